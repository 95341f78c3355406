/**
 * What the benchmarks share: the model they train, the timed training loop, rotated rounds, and
 * their output (results as JSON and as a Markdown table, written atomically under bench/results/).
 */
import { join } from 'node:path';
import { tf } from '../backend/tfjs.js';
import {
  modelConfigFor,
  optimizerConfigOf,
  type TrainConfig,
} from '../config/config.js';
import { type Batch, makeBatcher } from '../data/batcher.js';
import { type Dataset, loadDataset } from '../data/index.js';
import { type HostParams, initParams } from '../model/init.js';
import { buildModel, type Model } from '../model/model.js';
import { Stage } from '../pipeline/stage.js';
import type { StepReport, Strategy } from '../strategies/strategy.js';
import type { StepMetrics } from '../train/metrics.js';
import { writeFileAtomic } from '../util/fsx.js';

/** One table: column names and rows of cells. */
export interface Table {
  columns: string[];
  rows: Array<Array<string | number>>;
}

/** Renders a Markdown table; numbers are printed as given (format them before). */
export function markdownTable(t: Table): string {
  const line = (cells: Array<string | number>) =>
    `| ${cells.map(String).join(' | ')} |`;
  return `${[line(t.columns), line(t.columns.map(() => '---')), ...t.rows.map(line)].join('\n')}\n`;
}

/** Writes `<dir>/<name>.json` and `<dir>/<name>.md`. Returns their paths. */
export async function writeBenchResults(
  dir: string,
  name: string,
  json: unknown,
  markdown: string,
): Promise<string[]> {
  const j = join(dir, `${name}.json`);
  const m = join(dir, `${name}.md`);
  await writeFileAtomic(j, `${JSON.stringify(json, null, 2)}\n`);
  await writeFileAtomic(m, markdown);
  return [j, m];
}

/**
 * {@link writeBenchResults}, then logs `wrote <dir>/<name>.json, <dir>/<name>.md`.
 */
export async function reportBenchResults(
  dir: string,
  name: string,
  json: unknown,
  markdown: string,
  log: (s: string) => void,
): Promise<void> {
  const files = await writeBenchResults(dir, name, json, markdown);
  log(`wrote ${files.join(', ')}`);
}

/** A preset's model as a bench trains it (see {@link loadBenchModel}). */
export interface BenchModel {
  ds: Dataset;
  model: Model;
  /** Initial parameters, drawn from the config's seed. */
  params: HostParams;
  /** A charlm's context length (tokens per example); undefined for other architectures. */
  context: number | undefined;
}

/** What every configuration of a bench that trains in this process shares: its options `o`, the resolved base configuration, the model, the machine's cores and the log. */
export interface BenchRun<O> {
  o: O;
  base: TrainConfig;
  bench: BenchModel;
  cores: number;
  log: (s: string) => void;
}

/**
 * Loads `base`'s data set, builds its model and draws the initial parameters from `base.seed`.
 * Throws what loadDataset and modelConfigFor throw (an unknown data set, a model module).
 */
export async function loadBenchModel(base: TrainConfig): Promise<BenchModel> {
  const ds = await loadDataset(base.data);
  const model = buildModel(modelConfigFor(base, ds));
  const params = initParams(model.blocks, base.seed);
  const context =
    model.config.arch === 'charlm' ? model.config.context : undefined;
  return { ds, model, params, context };
}

/** A plain-backprop Stage over the whole of a bench's model, on this thread's backend. */
export interface InThreadStage {
  model: Model;
  /** The stage it trains (its parameters: `stage.getParams()`). */
  stage: Stage;
  /**
   * One synchronous training step at learning rate 1e-4 on the next batch (batches seeded 1):
   * forward with the labels, backward, optimizer step. Returns the batch.
   */
  step(): Batch;
  dispose(): void;
}

/**
 * {@link loadBenchModel}'s model for `cfg` on one Stage in this thread (no devices, no messages),
 * for benches that look inside a step (kernels, webgpu-host).
 */
export async function inThreadStage(cfg: TrainConfig): Promise<InThreadStage> {
  const { ds, model, params, context } = await loadBenchModel(cfg);
  const stage = new Stage(
    model,
    { from: 0, to: model.blocks.length },
    params,
    optimizerConfigOf(cfg),
  );
  const batcher = makeBatcher(ds, {
    batchSize: cfg.batchSize,
    context,
    seed: 1,
  });
  return {
    model,
    stage,
    step: () => {
      const b = batcher.next();
      stage.forward(0, tf.tensor(b.x, b.xShape, model.inputDtype), {
        keep: true,
        grad: true,
        labels: tf.tensor(b.y, b.yShape, 'int32'),
      });
      stage.backward(0, null, 1);
      stage.step(1e-4, 1);
      // the loss the step left to read at its end, unread: a bench has no use for it, and kept
      // it would hold a tensor (and its buffer) a step
      stage.discard();
      return b;
    },
    dispose: () => stage.dispose(),
  };
}

/** How a bench's setting line names `n` warm-up steps: "no warm-up step", "one warm-up step", "30 warm-up steps". */
export function warmUpSteps(n: number): string {
  return n === 0
    ? 'no warm-up step'
    : n === 1
      ? 'one warm-up step'
      : `${n} warm-up steps`;
}

/**
 * `warmup` (default 1) untimed warm-up steps (kernels, XNNPACK packing, V8 optimizing the JS) on
 * `next()`'s batches, then `steps` timed steps, all at learning rate 1e-4. Returns each timed
 * step's wall seconds, in order: the time of `trainStep` alone, not of making its batch. `onStep`
 * hears each timed step's report and batch (after its time is taken). Rejects as the strategy's
 * `trainStep` does.
 */
export async function timeTrainSteps(
  s: Pick<Strategy, 'trainStep'>,
  next: () => Batch,
  steps: number,
  onStep: (r: StepReport, b: Batch) => void,
  warmup = 1,
): Promise<number[]> {
  for (let w = 0; w < warmup; w++) await s.trainStep(next(), 1e-4);
  const times: number[] = [];
  for (let i = 0; i < steps; i++) {
    const b = next();
    const t0 = performance.now();
    const r = await s.trainStep(b, 1e-4);
    times.push((performance.now() - t0) / 1000);
    onStep(r, b);
  }
  return times;
}

/**
 * Runs `run(i, round)` for each of `n` configurations once per round, one after the other; round
 * r goes in the order r, r+1, ... (mod n), so a drift of the machine's speed spreads over all of
 * them. Returns, per configuration, its results in round order. Rejects with `run`'s first
 * rejection (nothing after it runs).
 */
export async function inRotatedRounds<T>(
  n: number,
  rounds: number,
  run: (i: number, round: number) => Promise<T>,
): Promise<T[][]> {
  const out: T[][] = Array.from({ length: n }, () => []);
  for (let round = 0; round < rounds; round++)
    for (let j = 0; j < n; j++) {
      const i = (j + round) % n;
      out[i]!.push(await run(i, round));
    }
  return out;
}

/**
 * What the benchmarks read off a run's steps after the first (which warms kernels up): the
 * mean host-to-device bytes per step, summed over devices, and the median step seconds (the
 * lower middle value for an even count).
 */
export function stepFigures(ms: readonly StepMetrics[]): {
  steps: StepMetrics[];
  hostToDeviceBytes: number;
  stepSeconds: number;
} {
  const steps = ms.slice(1);
  const h2d = steps.map((m) =>
    (m.host_to_device_bytes ?? []).reduce((x, y) => x + y, 0),
  );
  const s = steps.map((m) => m.step_s).sort((x, y) => x - y);
  return {
    steps,
    hostToDeviceBytes: h2d.reduce((a, b) => a + b, 0) / h2d.length,
    stepSeconds: s[Math.floor((s.length - 1) / 2)]!,
  };
}
