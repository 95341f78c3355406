/**
 * `npm run bench -- balance`: on a model with deliberately uneven blocks (a character
 * Transformer with a wide vocabulary: the embedding holds many parameters but costs almost no
 * time, the head costs most of the time), gpipe throughput with `--balance time` against the
 * default balance by parameter count, for a few M; each stage's measured bubble beside
 * (K-1)/(M+K-1) and beside the cost model's prediction.
 */

import { resolveConfig, type TrainConfig } from '../config/config.js';
import {
  blockBalanceCosts,
  costsAt,
  type MicroBatchCosts,
  type ModelProfile,
  type StepShape,
} from '../cost/costs.js';
import { profileModel } from '../cost/profile.js';
import { predictStepTime } from '../cost/time.js';
import type { Batch } from '../data/batcher.js';
import { type HostParams, initParams } from '../model/init.js';
import {
  buildModel,
  type CharLmConfig,
  type Model,
  modelParamCount,
} from '../model/model.js';
import { defaultOptimizerConfig } from '../optim/optimizer.js';
import {
  balanceByCost,
  type StageRange,
  stageRanges,
} from '../partition/balance.js';
import { idealBubble } from '../schedule/schedule.js';
import { createStrategy, planStages } from '../strategies/index.js';
import type { Strategy } from '../strategies/strategy.js';
import { Rng } from '../util/rng.js';
import { markdownTable, reportBenchResults, timeTrainSteps } from './report.js';

export interface BalanceBenchOptions {
  layers: number;
  dModel: number;
  context: number;
  /** Vocabulary size: the width of the head (the uneven block). */
  vocab: number;
  batchSize: number;
  stages: number;
  microBatches: number[];
  /** Measured steps per configuration (after one warm-up step). */
  steps: number;
  backend: string;
  out: string;
}

interface Row {
  balance_by: 'params' | 'time';
  balance: number[];
  micro_batches: number;
  tokens_per_s: number;
  speedup_vs_params: number;
  step_s: number;
  predicted_step_s: number;
  bubble_measured: number[];
  bubble_predicted: number[];
  bubble_ideal: number;
  stage_busy_s: number[];
}

/** What every configuration of the bench shares. */
interface BalanceRun {
  o: BalanceBenchOptions;
  model: Model;
  /** Initial parameters (seed 1), the same for every configuration. */
  params: HostParams;
  /** The next mini-batch of uniformly random tokens, [batchSize, context] (one seeded stream). */
  batch: () => Batch;
  /** Every block's measured costs at each micro-batch size of the bench. */
  profile: ModelProfile;
  log: (s: string) => void;
}

/** What the cost model is given of a step: M, re-materialization and schedule. */
type Shape = Omit<StepShape, 'slots'>;

/** Runs the benchmark and writes balance.json and balance.md into o.out. */
export async function benchBalance(
  o: BalanceBenchOptions,
  log: (s: string) => void,
): Promise<void> {
  const model = buildModel(unevenModelConfig(o));
  const params = initParams(model.blocks, 1);
  const batch = randomBatches(o, new Rng(7));
  const profile = await profileBlocks(o, model, log);
  const run: BalanceRun = { o, model, params, batch, profile, log };
  const rows: Row[] = [];
  for (const m of o.microBatches) rows.push(...(await measureAtM(run, m)));
  await reportBenchResults(
    o.out,
    'balance',
    {
      bench: 'balance',
      options: o,
      params: modelParamCount(model),
      profile,
      rows,
    },
    await balanceMarkdown(o, model, rows),
    log,
  );
}

/** The uneven model: a charlm of `o.layers` decoders, 2 heads, and the wide vocabulary `o.vocab`. */
function unevenModelConfig(o: BalanceBenchOptions): CharLmConfig {
  return {
    arch: 'charlm',
    layers: o.layers,
    dModel: o.dModel,
    heads: 2,
    context: o.context,
    vocab: o.vocab,
  };
}

/** Mini-batches of `o.batchSize` x `o.context` tokens, inputs and targets drawn from `rng` below `o.vocab`. */
function randomBatches(o: BalanceBenchOptions, rng: Rng): () => Batch {
  return (): Batch => {
    const n = o.batchSize * o.context;
    return {
      x: new Int32Array(n).map(() => rng.int(o.vocab)),
      xShape: [o.batchSize, o.context],
      y: new Int32Array(n).map(() => rng.int(o.vocab)),
      yShape: [o.batchSize, o.context],
      examples: o.batchSize,
      tokens: n,
    };
  };
}

/** Profiles every block on `o.backend` (AdamW) at each micro-batch size of the bench; logs how long it took. */
async function profileBlocks(
  o: BalanceBenchOptions,
  model: Model,
  log: (s: string) => void,
): Promise<ModelProfile> {
  const t0 = performance.now();
  const profile = await profileModel(model, {
    backend: o.backend,
    microBatchSizes: o.microBatches.map((m) => o.batchSize / m),
    optimizer: defaultOptimizerConfig('adamw'),
  });
  log(
    `profiled ${model.blocks.length} blocks in ${((performance.now() - t0) / 1000).toFixed(1)} s`,
  );
  return profile;
}

/**
 * gpipe with M = `m` micro-batches, balanced by parameters (the default) and then by profiled
 * time: one row each, in that order; the time row's speed-up is against the params row.
 */
async function measureAtM(run: BalanceRun, m: number): Promise<Row[]> {
  const { o } = run;
  const cfg = resolveConfig({
    preset: 'charlm-tiny',
    strategy: 'gpipe',
    stages: o.stages,
    microBatches: m,
    batchSize: o.batchSize,
    remat: 'except_last',
    backend: o.backend,
    steps: o.steps + 1,
  });
  const costs = costsAt(run.profile, o.batchSize / m);
  const shape: Shape = { m, remat: cfg.remat, schedule: cfg.schedule };
  const byTime = stageRanges(
    balanceByCost(
      blockBalanceCosts(costs, 'time', { ...shape, slots: 2 }, o.stages),
      o.stages,
    ),
  );
  const byParams = planStages(cfg, run.model);
  const rows: Row[] = [];
  let paramsRate = NaN;
  for (const [by, ranges] of [
    ['params', byParams],
    ['time', byTime],
  ] as Array<[Row['balance_by'], StageRange[]]>) {
    const row = await measureBalance(
      run,
      cfg,
      by,
      ranges,
      costs,
      shape,
      paramsRate,
    );
    if (by === 'params') paramsRate = row.tokens_per_s;
    rows.push(row);
  }
  return rows;
}

/**
 * Trains `cfg` on the stages `ranges`: one warm-up step, then `o.steps` timed steps; the row
 * holds tokens/s over them (speed-up against `paramsRate`, itself for the params balance), the
 * mean step seconds, the mean measured bubble and busy seconds per stage, and the cost model's
 * prediction. Logs the row. Closes the strategy.
 */
async function measureBalance(
  run: BalanceRun,
  cfg: TrainConfig,
  by: Row['balance_by'],
  ranges: StageRange[],
  costs: MicroBatchCosts,
  shape: Shape,
  paramsRate: number,
): Promise<Row> {
  const { o } = run;
  const s = await createStrategy(cfg, run.model, run.params, ranges);
  try {
    const { secs, tokens, bubble, busy } = await timeSteps(run, s);
    const pred = predictStepTime(costs, ranges, shape);
    const rate = tokens / secs;
    const row: Row = {
      balance_by: by,
      balance: ranges.map((r) => r.to - r.from),
      micro_batches: shape.m,
      tokens_per_s: rate,
      speedup_vs_params: rate / (by === 'params' ? rate : paramsRate),
      step_s: secs / o.steps,
      predicted_step_s: pred.seconds,
      bubble_measured: bubble,
      bubble_predicted: pred.bubble,
      bubble_ideal: idealBubble(shape.m, o.stages),
      stage_busy_s: busy,
    };
    run.log(
      `M=${shape.m} balance by ${by} ${row.balance.join(',')}: ${rate.toFixed(0)} tokens/s (${row.speedup_vs_params.toFixed(2)}x), bubble ${bubble.map((b) => b.toFixed(3)).join('/')} vs ideal ${row.bubble_ideal.toFixed(3)}`,
    );
    return row;
  } finally {
    await s.close();
  }
}

/**
 * One warm-up step, then `o.steps` timed steps of `s`: their total seconds and tokens, and per
 * stage the mean bubble (fraction of the step) and mean busy seconds (step seconds not waiting).
 */
async function timeSteps(
  run: BalanceRun,
  s: Strategy,
): Promise<{ secs: number; tokens: number; bubble: number[]; busy: number[] }> {
  const steps = run.o.steps;
  let tokens = 0;
  const bubble = new Array<number>(s.devices).fill(0);
  const busy = new Array<number>(s.devices).fill(0);
  const times = await timeTrainSteps(s, run.batch, steps, (r, b) => {
    tokens += b.tokens;
    r.bubble.forEach((x, j) => (bubble[j] += x / steps));
    r.stageSeconds.forEach(
      (x, j) => (busy[j] += (x * (1 - r.bubble[j])) / steps),
    );
  });
  const secs = times.reduce((a, t) => a + t, 0);
  return { secs, tokens, bubble, busy };
}

/** balance.md: the model and setting, then one table row per (M, balance). */
async function balanceMarkdown(
  o: BalanceBenchOptions,
  model: Model,
  rows: Row[],
): Promise<string> {
  const f3 = (x: number) => x.toFixed(3);
  return [
    `# balance benchmark\n`,
    `Uneven model: charlm, ${o.layers} decoder layers of d_model ${o.dModel}, context ${o.context}, vocabulary ${o.vocab} ` +
      `(${modelParamCount(model).toLocaleString('en-US')} parameters; the embedding and the head each hold about as many parameters as all decoders, ` +
      `but the embedding costs almost no time and the head most of it). gpipe, K = ${o.stages}, mini-batch ${o.batchSize}, checkpoint except_last, ` +
      `backend ${o.backend}, ${o.steps} measured steps after one warm-up step, on this machine (${(await import('node:os')).cpus().length} cores).\n`,
    markdownTable({
      columns: [
        'M',
        'balance by',
        'blocks per stage',
        'tokens/s',
        'vs params',
        'step s (measured / predicted)',
        'bubble per stage (measured)',
        'bubble per stage (predicted)',
        '(K-1)/(M+K-1)',
        'busy s per stage',
      ],
      rows: rows.map((r) => [
        r.micro_batches,
        r.balance_by,
        r.balance.join(','),
        r.tokens_per_s.toFixed(0),
        `${r.speedup_vs_params.toFixed(2)}x`,
        `${f3(r.step_s)} / ${f3(r.predicted_step_s)}`,
        r.bubble_measured.map(f3).join(' / '),
        r.bubble_predicted.map(f3).join(' / '),
        f3(r.bubble_ideal),
        r.stage_busy_s.map(f3).join(' / '),
      ]),
    }),
  ].join('\n');
}
