/**
 * `npm run bench -- gpipe`: throughput of single and of gpipe (K = 2) for M = 1, 2, 4, 8 in
 * each re-materialization mode (and each schedule of `--schedules`: gpipe, 1f1b, zb-h1) on the
 * same model and mini-batch, with each stage's measured
 * bubble beside the ideal (K-1)/(M+K-1), beside the cost model's prediction for the stages'
 * profiled block times (cost/time.ts: free communication, one core per stage), and the peak
 * device bytes per stage. Measured above predicted is time the model leaves out: messages,
 * thread wake-ups, and stages sharing cores when K exceeds them.
 */

import type { Precision } from '../backend/names.js';
import {
  optimizerConfigOf,
  resolveConfig,
  type TrainConfig,
} from '../config/config.js';
import { costsAt, type ModelProfile } from '../cost/costs.js';
import { profileModel } from '../cost/profile.js';
import { predictStepTime } from '../cost/time.js';
import { makeBatcher } from '../data/batcher.js';
import { type Model, modelParamCount } from '../model/model.js';
import type { StageRange } from '../partition/balance.js';
import {
  idealBubble,
  REMAT_MODES,
  type RematMode,
  type ScheduleKind,
} from '../schedule/schedule.js';
import { createStrategy, planStages } from '../strategies/index.js';
import { threadsPerDevice } from '../strategies/spec.js';
import type { Strategy } from '../strategies/strategy.js';
import { median } from '../util/stats.js';
import {
  type BenchModel,
  inRotatedRounds,
  loadBenchModel,
  markdownTable,
  reportBenchResults,
  timeTrainSteps,
} from './report.js';

export interface GpipeBenchOptions {
  preset: string;
  batchSize: number;
  /** Measured steps per configuration (after one warm-up step). */
  steps: number;
  microBatches: number[];
  stages: number;
  /** Schedules to run (default gpipe's fill-drain only). */
  schedules?: ScheduleKind[];
  /** Re-materialization modes to run (default all). */
  remats?: RematMode[];
  /** Results file name (default 'gpipe'). */
  name?: string;
  /** Rounds: every configuration once per round, in a rotated order (default 1). */
  rounds?: number;
  backend: string;
  /** Compute precision (bf16: native only). Default fp32. */
  precision?: Precision;
  out: string;
}

interface Row {
  strategy: string;
  schedule: ScheduleKind | '-';
  stages: number;
  micro_batches: number;
  remat: RematMode | '-';
  tokens_per_s: number;
  speedup: number;
  bubble_measured: number[];
  bubble_ideal: number;
  /** The cost model's bubble per stage for this balance (empty for single). */
  bubble_predicted: number[];
  /** Blocks per stage. */
  balance: number[];
  peak_device_bytes: number[];
  step_s: number;
  /** tokens/s of each round, in round order. */
  tokens_per_s_rounds?: number[];
}

/** A row before the speed-ups against single are known. */
type Measured = Omit<Row, 'speedup'>;

/** One configuration of the bench. */
interface GpipeConfig {
  strategy: 'single' | 'gpipe';
  m: number;
  mode: RematMode;
  schedule: ScheduleKind;
}

/** What every configuration of the bench shares. */
interface GpipeRun {
  o: GpipeBenchOptions;
  base: TrainConfig;
  bench: BenchModel;
  /** Every block's measured costs at each micro-batch size of the bench. */
  profile: ModelProfile;
}

/** Runs the benchmark and writes gpipe.json and gpipe.md. */
export async function benchGpipe(
  o: GpipeBenchOptions,
  log: (s: string) => void,
): Promise<void> {
  const base = resolveConfig({
    preset: o.preset,
    batchSize: o.batchSize,
    backend: o.backend,
    precision: o.precision,
    steps: o.steps + 1,
  });
  const bench = await loadBenchModel(base);
  /** Throughput unit: a language model's batch counts tokens, an image classifier's examples (tokens_per_s holds either). */
  const unit = bench.context !== undefined ? 'tokens/s' : 'examples/s';
  const run: GpipeRun = {
    o,
    base,
    bench,
    profile: await profileForStages(o, base, bench.model),
  };
  // every configuration once per round, each round in a rotated order (single among them), so a
  // drift of the machine's speed spreads over all of them; a row is each figure's median over
  // the rounds, and speed-ups are against single's median
  const configs = gpipeConfigs(o);
  const rounds = Math.max(1, o.rounds ?? 1);
  const runs = await inRotatedRounds(
    configs.length,
    rounds,
    async (i, round) => {
      const c = configs[i]!;
      const r = await measure(run, c);
      log(
        `round ${round + 1}/${rounds}: ${c.strategy === 'single' ? 'single' : `gpipe ${c.schedule} K=${o.stages} M=${c.m} ${c.mode}`}: ${r.tokens_per_s.toFixed(0)} ${unit}, bubble ${r.bubble_measured.map((b) => b.toFixed(3)).join('/')} (cost model ${r.bubble_predicted.map((b) => b.toFixed(3)).join('/') || '-'}, ideal ${r.bubble_ideal.toFixed(3)})`,
      );
      return r;
    },
  );
  const rows = withSpeedups(runs.map(medianRow));
  await reportBenchResults(
    o.out,
    o.name ?? 'gpipe',
    { bench: 'gpipe', options: o, params: modelParamCount(bench.model), rows },
    await gpipeMarkdown(o, { model: bench.model, unit, rounds, rows }),
    log,
  );
}

/** Examples per micro-batch with `m` micro-batches of a `batchSize` mini-batch (at least 1). */
function microBatchSize(batchSize: number, m: number): number {
  return Math.max(1, Math.floor(batchSize / m));
}

/**
 * Profiles every block at each micro-batch size of the bench, each stage's kernels on the
 * threads its device gets (the cores divided among the stages).
 */
function profileForStages(
  o: GpipeBenchOptions,
  base: TrainConfig,
  model: Model,
): Promise<ModelProfile> {
  return profileModel(model, {
    backend: o.backend,
    precision: o.precision,
    microBatchSizes: o.microBatches.map((m) => microBatchSize(o.batchSize, m)),
    optimizer: optimizerConfigOf(base),
    threads: threadsPerDevice(base, o.stages),
  });
}

/** single first, then gpipe for each re-materialization mode, M and schedule (in that nesting). */
function gpipeConfigs(o: GpipeBenchOptions): GpipeConfig[] {
  const configs: GpipeConfig[] = [
    { strategy: 'single', m: 1, mode: 'never', schedule: 'gpipe' },
  ];
  for (const mode of o.remats ?? REMAT_MODES)
    for (const m of o.microBatches)
      for (const schedule of o.schedules ?? ['gpipe'])
        configs.push({ strategy: 'gpipe', m, mode, schedule });
  return configs;
}

/**
 * Trains configuration `c`: one warm-up step, then `o.steps` timed steps; the row holds the
 * median step (seconds) and its throughput, the mean bubble and the peak device bytes per stage,
 * and the cost model's bubble (none for single). Closes the strategy.
 */
async function measure(run: GpipeRun, c: GpipeConfig): Promise<Measured> {
  const { o, base, bench } = run;
  const { strategy, m, mode, schedule } = c;
  const cfg = resolveConfig({
    ...base,
    balance: undefined,
    strategy,
    stages: strategy === 'single' ? 1 : o.stages,
    microBatches: m,
    remat: mode,
    schedule,
  });
  const s = await createStrategy(cfg, bench.model, bench.params);
  try {
    const { secs, tokens, bubble, peak } = await timeSteps(run, s);
    const k = s.devices;
    const ranges = planStages(cfg, bench.model);
    const single = strategy === 'single';
    return {
      strategy,
      schedule: single ? '-' : schedule,
      stages: k,
      micro_batches: single ? 1 : m,
      remat: single ? '-' : mode,
      tokens_per_s: tokens / secs,
      bubble_measured: bubble,
      bubble_ideal: idealBubble(single ? 1 : m, k),
      bubble_predicted: single ? [] : predictedBubble(run, c, cfg, ranges),
      balance: ranges.map((r) => r.to - r.from),
      peak_device_bytes: peak,
      step_s: secs,
    };
  } finally {
    await s.close();
  }
}

/**
 * One warm-up step, then `o.steps` timed steps of `s` on batches from seed 1: the median step
 * seconds (this machine's speed drifts between runs, a mean would carry outliers), the tokens of
 * one step, and per stage the mean bubble and the peak device bytes.
 */
async function timeSteps(
  run: GpipeRun,
  s: Strategy,
): Promise<{ secs: number; tokens: number; bubble: number[]; peak: number[] }> {
  const { o, bench } = run;
  const batcher = makeBatcher(bench.ds, {
    batchSize: o.batchSize,
    context: bench.context,
    seed: 1,
  });
  let tokens = 0;
  const bubble = new Array<number>(s.devices).fill(0);
  const peak = new Array<number>(s.devices).fill(0);
  const times = await timeTrainSteps(
    s,
    () => batcher.next(),
    o.steps,
    (r, b) => {
      tokens = b.tokens;
      r.bubble.forEach((x, j) => (bubble[j] += x / o.steps));
      r.peakBytes.forEach((x, j) => (peak[j] = Math.max(peak[j], x)));
    },
  );
  return { secs: median(times), tokens, bubble, peak };
}

/**
 * The cost model's bubble per stage for configuration `c` (run as `cfg`: its schedule and
 * virtual stages) on the stages `ranges`, from the profiled block times.
 */
function predictedBubble(
  run: GpipeRun,
  c: GpipeConfig,
  cfg: TrainConfig,
  ranges: StageRange[],
): number[] {
  return predictStepTime(
    costsAt(run.profile, microBatchSize(run.o.batchSize, c.m)),
    ranges,
    {
      m: c.m,
      remat: c.mode,
      schedule: cfg.schedule,
      virtualStages: cfg.virtualStages,
    },
  ).bubble;
}

/** One configuration's rows over the rounds as one: medians (peaks: the largest), with each round's tokens/s. */
function medianRow(rs: Measured[]): Measured {
  return {
    ...rs[0]!,
    tokens_per_s: median(rs.map((r) => r.tokens_per_s)),
    tokens_per_s_rounds: rs.map((r) => r.tokens_per_s),
    bubble_measured: rs[0]!.bubble_measured.map((_, d) =>
      median(rs.map((r) => r.bubble_measured[d]!)),
    ),
    peak_device_bytes: rs[0]!.peak_device_bytes.map((_, d) =>
      Math.max(...rs.map((r) => r.peak_device_bytes[d]!)),
    ),
    step_s: median(rs.map((r) => r.step_s)),
  };
}

/** The rows with their throughput over the first's (single's). */
function withSpeedups(merged: Measured[]): Row[] {
  const ref = merged[0]!.tokens_per_s;
  return merged.map((r) => ({
    ...r,
    speedup: r.tokens_per_s / ref,
  }));
}

/** gpipe.md (or `<name>.md`): the setting, then one table row per configuration. */
async function gpipeMarkdown(
  o: GpipeBenchOptions,
  results: { model: Model; unit: string; rounds: number; rows: Row[] },
): Promise<string> {
  const { model, unit, rounds, rows } = results;
  const mib = (b: number) => (b / 2 ** 20).toFixed(1);
  return [
    `# ${o.name ?? 'gpipe'} benchmark\n`,
    `Model ${o.preset} (${modelParamCount(model).toLocaleString('en-US')} parameters), mini-batch ${o.batchSize}, backend ${o.backend} (${o.precision ?? 'fp32'}), median of ${o.steps} measured steps after one warm-up step, on this machine (${(await import('node:os')).cpus().length} cores); ${rounds} round${rounds > 1 ? 's' : ''}, every configuration (single too) once per round in a rotated order, each figure the median over the rounds (peaks: the largest); speed-ups are against single's median.\n`,
    markdownTable({
      columns: [
        'strategy',
        'schedule',
        'K',
        'M',
        'checkpoint',
        'blocks per stage',
        unit,
        'speed-up vs single',
        'bubble per stage (measured)',
        'bubble per stage (cost model)',
        'bubble (K-1)/(M+K-1) (gpipe, 1F1B)',
        'peak device MiB per stage',
      ],
      rows: rows.map((r) => [
        r.strategy,
        r.schedule,
        r.stages,
        r.micro_batches,
        r.remat,
        r.balance.join(','),
        r.tokens_per_s.toFixed(0),
        `${r.speedup.toFixed(2)}x`,
        r.bubble_measured.map((b) => b.toFixed(3)).join(' / '),
        r.bubble_predicted.map((b) => b.toFixed(3)).join(' / ') || '-',
        r.bubble_ideal.toFixed(3),
        r.peak_device_bytes.map(mib).join(' / '),
      ]),
    }),
  ].join('\n');
}
