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
  modelConfigFor,
  optimizerConfigOf,
  resolveConfig,
} from '../config/config.js';
import { costsAt } from '../cost/costs.js';
import { profileModel } from '../cost/profile.js';
import { predictStepTime } from '../cost/time.js';
import { makeBatcher } from '../data/batcher.js';
import { loadDataset } from '../data/index.js';
import { initParams } from '../model/init.js';
import { buildModel, modelParamCount } from '../model/model.js';
import {
  idealBubble,
  REMAT_MODES,
  type RematMode,
  type ScheduleKind,
} from '../schedule/schedule.js';
import { createStrategy, planStages } from '../strategies/index.js';
import { threadsPerDevice } from '../strategies/spec.js';
import { median } from '../util/stats.js';
import { markdownTable, writeBenchResults } from './report.js';

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
  const ds = await loadDataset(base.data);
  const model = buildModel(modelConfigFor(base, ds));
  const params = initParams(model.blocks, base.seed);
  const context =
    model.config.arch === 'charlm' ? model.config.context : undefined;
  /** Throughput unit: a language model's batch counts tokens, an image classifier's examples (tokens_per_s holds either). */
  const unit = context !== undefined ? 'tokens/s' : 'examples/s';
  /** Examples per micro-batch with m micro-batches. */
  const microBatchSize = (m: number) =>
    Math.max(1, Math.floor(o.batchSize / m));
  const sizes = o.microBatches.map(microBatchSize);
  // each stage's kernels on the threads its device gets (the cores divided among the stages)
  const profile = await profileModel(model, {
    backend: o.backend,
    precision: o.precision,
    microBatchSizes: sizes,
    optimizer: optimizerConfigOf(base),
    threads: threadsPerDevice(base, o.stages),
  });

  async function measure(
    strategy: 'single' | 'gpipe',
    m: number,
    mode: RematMode,
    schedule: ScheduleKind = 'gpipe',
  ): Promise<Omit<Row, 'speedup'>> {
    const cfg = resolveConfig({
      ...base,
      balance: undefined,
      strategy,
      stages: strategy === 'single' ? 1 : o.stages,
      microBatches: m,
      remat: mode,
      schedule,
    });
    const s = await createStrategy(cfg, model, params);
    try {
      const batcher = makeBatcher(ds, {
        batchSize: o.batchSize,
        context,
        seed: 1,
      });
      await s.trainStep(batcher.next(), 1e-4); // warm-up: kernels, XNNPACK packing
      const times: number[] = [];
      let tokens = 0;
      const bubble = new Array<number>(s.devices).fill(0);
      const peak = new Array<number>(s.devices).fill(0);
      for (let i = 0; i < o.steps; i++) {
        const b = batcher.next();
        const t0 = performance.now();
        const r = await s.trainStep(b, 1e-4);
        times.push((performance.now() - t0) / 1000);
        tokens = b.tokens;
        r.bubble.forEach((x, j) => (bubble[j] += x / o.steps));
        r.peakBytes.forEach((x, j) => (peak[j] = Math.max(peak[j], x)));
      }
      // the median step: this machine's speed drifts between runs, a mean would carry outliers
      const secs = median(times);
      const k = s.devices;
      const ranges = planStages(cfg, model);
      const predicted =
        strategy === 'single'
          ? []
          : predictStepTime(costsAt(profile, microBatchSize(m)), ranges, {
              m,
              remat: mode,
              schedule: cfg.schedule,
              virtualStages: cfg.virtualStages,
            }).bubble;
      return {
        strategy,
        schedule: strategy === 'single' ? '-' : schedule,
        stages: k,
        micro_batches: strategy === 'single' ? 1 : m,
        remat: strategy === 'single' ? '-' : mode,
        tokens_per_s: tokens / secs,
        bubble_measured: bubble,
        bubble_ideal: idealBubble(strategy === 'single' ? 1 : m, k),
        bubble_predicted: predicted,
        balance: ranges.map((r) => r.to - r.from),
        peak_device_bytes: peak,
        step_s: secs,
      };
    } finally {
      await s.close();
    }
  }

  // every configuration once per round, each round in a rotated order (single among them), so a
  // drift of the machine's speed spreads over all of them; a row is each figure's median over
  // the rounds, and speed-ups are against single's median
  const configs: Array<{
    strategy: 'single' | 'gpipe';
    m: number;
    mode: RematMode;
    schedule: ScheduleKind;
  }> = [{ strategy: 'single', m: 1, mode: 'never', schedule: 'gpipe' }];
  for (const mode of o.remats ?? REMAT_MODES)
    for (const m of o.microBatches)
      for (const schedule of o.schedules ?? ['gpipe'])
        configs.push({ strategy: 'gpipe', m, mode, schedule });
  const rounds = Math.max(1, o.rounds ?? 1);
  const runs: Array<Array<Omit<Row, 'speedup'>>> = configs.map(() => []);
  for (let round = 0; round < rounds; round++)
    for (let j = 0; j < configs.length; j++) {
      const i = (j + round) % configs.length;
      const c = configs[i]!;
      const r = await measure(c.strategy, c.m, c.mode, c.schedule);
      runs[i]!.push(r);
      log(
        `round ${round + 1}/${rounds}: ${c.strategy === 'single' ? 'single' : `gpipe ${c.schedule} K=${o.stages} M=${c.m} ${c.mode}`}: ${r.tokens_per_s.toFixed(0)} ${unit}, bubble ${r.bubble_measured.map((b) => b.toFixed(3)).join('/')} (cost model ${r.bubble_predicted.map((b) => b.toFixed(3)).join('/') || '-'}, ideal ${r.bubble_ideal.toFixed(3)})`,
      );
    }
  const medianRow = (
    rs: Array<Omit<Row, 'speedup'>>,
  ): Omit<Row, 'speedup'> => ({
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
  });
  const merged = runs.map(medianRow);
  const ref = merged[0]!.tokens_per_s;
  const rows: Row[] = merged.map((r) => ({
    ...r,
    speedup: r.tokens_per_s / ref,
  }));
  const mib = (b: number) => (b / 2 ** 20).toFixed(1);
  const md = [
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
  const files = await writeBenchResults(
    o.out,
    o.name ?? 'gpipe',
    { bench: 'gpipe', options: o, params: modelParamCount(model), rows },
    md,
  );
  log(`wrote ${files.join(', ')}`);
}
