/**
 * Test helpers: small, seeded data shared by the tests (never used by the library itself).
 */

import assert from 'node:assert/strict';
import { tf } from '../backend/tfjs.js';
import { resolveConfig, type TrainConfig } from '../config/config.js';
import { type Batch, makeBatcher } from '../data/batcher.js';
import { type Dataset, loadDataset } from '../data/index.js';
import { type TextDataset, textDatasetFromString } from '../data/text.js';
import { type HostParams, initParams } from '../model/init.js';
import type { Model } from '../model/model.js';
import { buildModel } from '../model/model.js';
import { getPreset } from '../model/presets.js';
import { defaultOptimizerConfig } from '../optim/optimizer.js';
import { Stage } from '../pipeline/stage.js';
import { createStrategy } from '../strategies/index.js';
import type { StepReport, Strategy } from '../strategies/strategy.js';
import { Rng } from '../util/rng.js';

const WORDS = [
  'the',
  'whale',
  'sea',
  'ship',
  'captain',
  'ahab',
  'white',
  'call',
  'me',
  'ishmael',
  'and',
  'of',
  'a',
];

/**
 * A ~4000-character text of whale words (seed 5), as the data set 'tiny-whale': the same
 * characters on every call, so strategies compared in one test see the same data.
 */
export function tinyWhaleDataset(): TextDataset {
  const rng = new Rng(5);
  let text = '';
  while (text.length < 4000)
    text += WORDS[rng.int(WORDS.length)] + (rng.int(8) === 0 ? '.\n' : ' ');
  return textDatasetFromString('tiny-whale', text);
}

/**
 * Random inputs and labels of n examples for `model`: token ids in [0, vocab) for a character
 * model (labels of the same shape), uniform [0, 1) images with class labels otherwise.
 */
export function randomBatch(model: Model, n: number, rng: Rng): Batch {
  const xShape = model.inputShape(n);
  const size = xShape.reduce((a, b) => a * b, 1);
  const cfg = model.config;
  if (cfg.arch === 'charlm') {
    const x = new Int32Array(size).map(() => rng.int(cfg.vocab));
    const y = new Int32Array(size).map(() => rng.int(cfg.vocab));
    return { x, xShape, y, yShape: xShape, examples: n, tokens: size };
  }
  const out = model.blocks.reduce((sh, b) => b.outputShape(sh), xShape);
  if (cfg.arch === 'module' && cfg.loss === 'mse') {
    const y = new Float32Array(out.reduce((a, b) => a * b, 1)).map(() =>
      rng.normal(),
    );
    return {
      x: new Float32Array(size).map(() => rng.next()),
      xShape,
      y,
      yShape: out,
      examples: n,
      tokens: n,
    };
  }
  const classes =
    cfg.arch === 'mlp' || cfg.arch === 'cnn'
      ? cfg.classes
      : cfg.arch === 'module'
        ? out[out.length - 1]!
        : 2;
  return {
    x: new Float32Array(size).map(() => rng.next()),
    xShape,
    y: new Int32Array(n).map(() => rng.int(classes)),
    yShape: [n],
    examples: n,
    tokens: n,
  };
}

/**
 * Peak device bytes per stage of the second of two training steps on random batches of n
 * examples (the first creates the optimizer slots, so the second is the steady state the
 * memory model predicts). Closes the strategy, also when a step throws.
 */
export async function steadyPeakBytes(
  s: Strategy,
  model: Model,
  n: number,
  rng: Rng,
): Promise<number[]> {
  try {
    await s.trainStep(randomBatch(model, n, rng), 1e-3);
    return (await s.trainStep(randomBatch(model, n, rng), 1e-3)).peakBytes;
  } finally {
    await s.close();
  }
}

/** What {@link trainTinyLm} runs: a charlm-tiny of `shape` on {@link tinyWhaleDataset}. */
export interface TinyLmRun {
  shape: { layers: number; dModel: number; heads: number; context: number };
  batchSize: number;
  /** One step per learning rate. */
  lrs: number[];
  /** Called before each step (e.g. to hurt a device mid-run). */
  during?: (step: number) => void;
}

/**
 * Trains a charlm-tiny of `run.shape` (parameters seeded 5, batches seeded 2, threads 1) with
 * the configuration `o` (strategy, backend, devices, ...), one step per learning rate, and
 * returns the losses, the final parameters and each step's report; closes the strategy, also
 * when a step throws.
 * The strategy comparisons (native, devices, hosts, webgpu) all train through this.
 */
export async function trainTinyLm(
  o: Partial<TrainConfig>,
  run: TinyLmRun,
): Promise<{ losses: number[]; params: HostParams; reports: StepReport[] }> {
  const ds = tinyWhaleDataset();
  const cfg = resolveConfig({
    preset: 'charlm-tiny',
    batchSize: run.batchSize,
    threads: 1,
    ...run.shape,
    ...o,
  } as Parameters<typeof resolveConfig>[0]);
  const model = buildModel(
    getPreset('charlm-tiny').make({ vocab: ds.vocab.size }, cfg),
  );
  const batcher = makeBatcher(ds, {
    batchSize: run.batchSize,
    context: run.shape.context,
    seed: 2,
  });
  const s = await createStrategy(cfg, model, initParams(model.blocks, 5));
  try {
    const reports: StepReport[] = [];
    for (const [i, lr] of run.lrs.entries()) {
      run.during?.(i);
      reports.push(await s.trainStep(batcher.next(), lr));
    }
    return {
      losses: reports.map((r) => r.loss),
      params: await s.getParams(),
      reports,
    };
  } finally {
    await s.close();
  }
}

/**
 * Asserts that device 0's peak bytes in every step from the fourth on are the third step's (a
 * recorded step's) less at most `batchBytes` (the batch a replay takes as host values): a
 * captured step's replays count the bytes its recording held (pipeline/captured-step.ts,
 * pipeline/native-capture.ts).
 */
export function assertPeaksAsRecorded(
  reports: readonly StepReport[],
  batchBytes: number,
): void {
  const peak = (r: StepReport) => r.peakBytes[0]!;
  const recorded = peak(reports[2]!);
  for (const r of reports.slice(3))
    assert.ok(
      peak(r) <= recorded && peak(r) >= recorded - batchBytes,
      `replayed step's peak ${peak(r)} B against the recorded step's ${recorded} B`,
    );
}

const presetData = new Map<string, Promise<Dataset>>();

/**
 * One plain-backprop SGD step (lr 0.05, no momentum, no clipping) of preset `name` on a
 * whole-model Stage in this thread, on the current backend, over one batch of `batchSize`
 * examples of the preset's default data set (seed 3; each data set loaded once per process).
 * Returns the loss on that batch before and after the step. `afterBackward` sees the stage
 * holding its gradients, before the update. Leaves no tensor behind.
 */
export async function presetSgdStep(
  name: string,
  batchSize: number,
  afterBackward?: (stage: Stage) => void,
): Promise<{ loss0: number; loss1: number }> {
  const preset = getPreset(name);
  if (!presetData.has(preset.defaultData))
    presetData.set(preset.defaultData, loadDataset(preset.defaultData));
  const ds = await presetData.get(preset.defaultData)!;
  if (ds.kind === 'tensor')
    throw new Error(
      `preset ${name} trains on text or image data, not ${ds.name}`,
    );
  const config = preset.make(
    ds.kind === 'text'
      ? { vocab: ds.vocab.size }
      : { inputShape: ds.shape, classes: ds.classes },
    {},
  );
  const model = buildModel(config);
  const context = config.arch === 'charlm' ? config.context : undefined;
  const batch = makeBatcher(ds, { batchSize, context, seed: 3 }).next();
  const stage = new Stage(
    model,
    { from: 0, to: model.blocks.length },
    initParams(model.blocks, 7),
    { ...defaultOptimizerConfig('sgd'), momentum: 0, clipNorm: 0 },
  );
  try {
    const x = () => tf.tensor(batch.x, batch.xShape, model.inputDtype);
    const y = () => tf.tensor(batch.y, batch.yShape, 'int32');
    stage.forward(0, x(), { keep: true, grad: true, labels: y() });
    await stage.flush(); // the loss is read at the step's end
    const loss0 = stage.losses.get(0)!;
    stage.backward(0, null, 1);
    afterBackward?.(stage);
    stage.step(0.05, 1);
    stage.forward(0, x(), { keep: false, grad: false, labels: y() });
    await stage.flush();
    return { loss0, loss1: stage.losses.get(0)! };
  } finally {
    stage.dispose();
  }
}
