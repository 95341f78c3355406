/**
 * Profiling: measures what each block of a model costs on a backend, in this thread, so that
 * stages can be balanced by time or memory (torchgpipe's balance_by_time / balance_by_size) and
 * so that `layerwise plan` can predict peak memory and throughput (see cost/memory.ts and cost/time.ts).
 *
 * For each block and micro-batch size: forward and backward seconds (median of a few runs after
 * a warm-up), and device bytes from the engine's exact byte counter (backend/memory.ts): the
 * forward's transient peak, the bytes its tape keeps (recordForward, as a stage that keeps its
 * activations does), the backward's transient peak, and the block's input and output sizes.
 * Per block, independent of the batch: parameter bytes, the largest parameter, and one
 * optimizer step's time and transient bytes.
 */

import { initBackend } from '../backend/index.js';
import { devicePolicy } from '../backend/low-precision.js';
import {
  backwardBytesProbe,
  deviceBytes,
  peakBytes,
  resetPeakBytes,
} from '../backend/memory.js';
import type { Precision } from '../backend/names.js';
import { nativeAddon } from '../backend/native-addon.js';
import { bytesPerElement, deviceCopyBytes } from '../backend/precision.js';
import { tf } from '../backend/tfjs.js';
import {
  type Block,
  paramKey,
  readByProducts,
  sizeOf,
} from '../model/block.js';
import { initParams } from '../model/init.js';
import type { Model } from '../model/model.js';
import { DeviceOptimizer, type OptimizerConfig } from '../optim/optimizer.js';
import { backwardRecorded, recordForward } from '../pipeline/rematerialize.js';
import { backwardInput, backwardWeight } from '../pipeline/split-backward.js';
import { LayerwiseError } from '../util/errors.js';
import { Rng } from '../util/rng.js';
import { median } from '../util/stats.js';
import {
  type BlockSizeCost,
  blockBalanceCosts,
  costsAt,
  type ModelProfile,
  optimizerSlots,
  type StepShape,
} from './costs.js';

/** What to profile. */
export interface ProfileOptions {
  /** Backend to measure on; initialised in this thread with initBackend. */
  backend: string;
  /** Micro-batch sizes (examples) to measure at; at least one. */
  microBatchSizes: number[];
  /** The optimizer whose step and slots to measure. */
  optimizer: OptimizerConfig;
  /** Timed runs per measurement, after `warmup` untimed ones (default 5 and 2). */
  repeats?: number;
  warmup?: number;
  /** Seed of the random parameters and inputs (default 1). */
  seed?: number;
  /**
   * native: the OpenMP team to measure with, as each device will run it (strategies/spec.ts
   * threadsPerDevice); restored afterwards. Other backends fix their thread count when they
   * start, so it is ignored there. Default: the backend's current.
   */
  threads?: number;
  /** Compute precision to measure at (see initBackend and backend/names.ts checkPrecision). Default fp32. */
  precision?: Precision;
}

function bytesOf(shape: number[]): number {
  return sizeOf(shape) * 4; // float32 and int32
}

/**
 * Bytes of a block boundary's activation (or its gradient) of `shape` and `dtype` as the device
 * holds it: a float32 activation in the precision policy's activation format (the boundary's
 * rounding, backend/low-precision.ts roundActivation: 2 bytes per element for a 2-byte
 * format); else 4.
 */
function boundaryBytes(shape: number[], dtype: string): number {
  return (
    sizeOf(shape) *
    (dtype === 'float32' ? bytesPerElement(devicePolicy(), 'activations') : 4)
  );
}

/** Waits for asynchronous backends (webgpu) to finish the work behind `t`; a no-op cost elsewhere. */
async function settle(t: tf.Tensor): Promise<void> {
  if (tf.getBackend() === 'webgpu') await t.data();
}

/**
 * Profiles every block of `model` on `opts.backend` at each micro-batch size, in this thread.
 * Parameters and inputs are random (costs do not depend on values). Returns a
 * {@link ModelProfile} (bytes, seconds). Throws {@link LayerwiseError} for an unknown or
 * unavailable backend or a non-positive micro-batch size.
 */
export async function profileModel(
  model: Model,
  opts: ProfileOptions,
): Promise<ModelProfile> {
  const sizes = [...new Set(opts.microBatchSizes)].sort((a, b) => a - b);
  if (sizes.length === 0)
    throw new LayerwiseError('profiling needs at least one micro-batch size');
  for (const b of sizes) {
    if (!Number.isInteger(b) || b < 1)
      throw new LayerwiseError(
        `micro-batch size must be a positive integer, got ${b}; check --batch-size and --micro-batches`,
      );
  }
  const repeats = opts.repeats ?? 5;
  const warmup = opts.warmup ?? 2;
  const team = opts.backend === 'native' ? opts.threads : undefined;
  const before = team !== undefined ? nativeAddon()?.threads() : undefined;
  await initBackend(opts.backend, {
    ...(team !== undefined ? { threads: team } : {}),
    precision: opts.precision ?? 'fp32',
  });
  try {
    return await profileWithBackend(model, opts, sizes, repeats, warmup);
  } finally {
    if (before !== undefined) nativeAddon()!.setThreads(before);
  }
}

async function profileWithBackend(
  model: Model,
  opts: ProfileOptions,
  sizes: number[],
  repeats: number,
  warmup: number,
): Promise<ModelProfile> {
  const rng = new Rng(opts.seed ?? 1);
  const host = initParams(model.blocks, opts.seed ?? 1);
  const params = model.blocks.map((blk, i) =>
    Object.fromEntries(
      blk.params.map((s) => {
        const init = tf.tensor(
          host.get(paramKey(i, s.name))!.slice(),
          s.shape,
          'float32',
        );
        const v = tf.variable(init, false);
        init.dispose();
        return [s.name, v] as const;
      }),
    ),
  );
  try {
    const blocks = model.blocks.map((blk, i) => {
      const paramBytes = blk.params.reduce((s, p) => s + bytesOf(p.shape), 0);
      // the copies the products read (parameters' cached copies, or the relay's upload)
      const policy = devicePolicy();
      const copyBytes = blk.params
        .filter(readByProducts)
        .reduce((s, p) => s + deviceCopyBytes(policy, sizeOf(p.shape)), 0);
      const maxParamBytes = Math.max(
        0,
        ...blk.params.map((p) => bytesOf(p.shape)),
      );
      const { seconds, transient } = profileOptimizer(
        params[i],
        opts.optimizer,
        repeats,
        warmup,
      );
      return {
        name: blk.name,
        paramBytes,
        ...(copyBytes > 0 ? { deviceCopyBytes: copyBytes } : {}),
        maxParamBytes,
        optTransientBytes: transient,
        optSeconds: seconds,
      };
    });
    const out: ModelProfile = { backend: opts.backend, blocks, sizes: [] };
    // a whole untimed pass at the smallest size first: the first pass of a process runs
    // noticeably slower (JIT compilation of the JavaScript around the kernels)
    if (warmup > 0) await profileAt(model, params, sizes[0], rng, 1, 0);
    for (const n of sizes)
      out.sizes.push(await profileAt(model, params, n, rng, repeats, warmup));
    return out;
  } finally {
    for (const p of params) for (const v of Object.values(p)) v.dispose();
  }
}

/** One optimizer step over a block's parameters: median seconds and peak bytes above params, slots and grads. */
function profileOptimizer(
  params: Record<string, tf.Variable>,
  cfg: OptimizerConfig,
  repeats: number,
  warmup: number,
): { seconds: number; transient: number } {
  const map = new Map(Object.entries(params));
  if (map.size === 0) return { seconds: 0, transient: 0 };
  // a copy of the parameters, so that the steps do not change the values used for the blocks
  const copy = new Map(
    [...map].map(([k, v]) => [k, tf.variable(v, false)] as const),
  );
  const grads = new Map(
    [...map].map(([k, v]) => [k, tf.randomNormal(v.shape, 0, 1e-3)] as const),
  );
  const opt = new DeviceOptimizer(cfg);
  try {
    opt.apply(copy, grads, 1e-3, 0.5); // creates the slots
    const times: number[] = [];
    let transient = 0;
    for (let r = 0; r < warmup + repeats; r++) {
      const before = deviceBytes();
      resetPeakBytes();
      const t0 = performance.now();
      opt.apply(copy, grads, 1e-3, 0.5); // a clipping scale != 1, as when clipping is active
      if (r >= warmup) times.push((performance.now() - t0) / 1000);
      transient = Math.max(transient, peakBytes() - before);
    }
    return { seconds: median(times), transient };
  } finally {
    opt.dispose();
    for (const t of [...copy.values(), ...grads.values()]) t.dispose();
  }
}

/** Random model input and labels for `n` examples. */
function randomBatch(
  model: Model,
  n: number,
  rng: Rng,
): { x: tf.Tensor; labels: tf.Tensor; labelBytes: number } {
  const shape = model.inputShape(n);
  let x: tf.Tensor;
  if (model.inputDtype === 'int32') {
    const vocab = model.config.arch === 'charlm' ? model.config.vocab : 2;
    x = tf.tensor(
      new Int32Array(sizeOf(shape)).map(() => rng.int(vocab)),
      shape,
      'int32',
    );
  } else {
    x = tf.tensor(
      new Float32Array(sizeOf(shape)).map(() => rng.next()),
      shape,
      'float32',
    );
  }
  let outShape = shape;
  for (const b of model.blocks) outShape = b.outputShape(outShape);
  const classes = outShape[outShape.length - 1];
  const lShape = outShape.slice(0, -1);
  const labels = tf.tensor(
    new Int32Array(sizeOf(lShape)).map(() => rng.int(classes)),
    lShape,
    'int32',
  );
  return { x, labels, labelBytes: bytesOf(lShape) };
}

/**
 * One untimed forward and backward of the whole model on input `x` and `labels`: kernels
 * compile and allocators grow here rather than inside the first block's measurement.
 */
async function warmUpModel(
  model: Model,
  params: Array<Record<string, tf.Variable>>,
  x: tf.Tensor,
  labels: tf.Tensor,
): Promise<void> {
  const all = model.blocks.flatMap((_, i) => Object.values(params[i]));
  const g = tf.grads((...ps: tf.Tensor[]) => {
    let h = x;
    let j = 0;
    model.blocks.forEach((b, i) => {
      const p: Record<string, tf.Tensor> = {};
      for (const name of Object.keys(params[i])) p[name] = ps[j++];
      h = b.forward(p, h);
    });
    return model.loss(h, labels);
  })(all);
  await settle(g[g.length - 1]);
  g.forEach((t) => t.dispose());
}

/** What {@link profileAt} measures every block with. */
interface BlockProfiling {
  model: Model;
  params: Array<Record<string, tf.Variable>>;
  labels: tf.Tensor;
  /** backwardBytesProbe's probe and the device bytes it noted. */
  probe: (x: tf.Tensor) => tf.Tensor;
  probedBytes: () => number;
  repeats: number;
  warmup: number;
}

/** A block under measurement: its forward `f` (with the loss for the last block) and what its backward differentiates. */
interface BlockRun {
  i: number;
  isLast: boolean;
  blk: Block;
  /** The block's input. */
  xi: tf.Tensor;
  /** The forward: the block on its input (through the probe after the first block), with the loss for the last. */
  f: () => tf.Tensor;
  /** Its parameters, then its input after the first block. */
  xs: tf.Tensor[];
}

/** One forward and backward of a block: seconds, and device bytes above the level before each. */
interface OneRun {
  fwdSeconds: number;
  bwdSeconds: number;
  fwdPeak: number;
  /** Bytes the forward's tape keeps. */
  kept: number;
  bwdPeak: number;
  /** Bytes the backward holds when it reaches the block's input (blocks after the first). */
  held: number | undefined;
  /** Bytes of the block's output at a stage boundary. */
  outBytes: number;
}

/** Runs a block's recorded forward, then its backward from a seed of ones, timing and counting bytes. */
async function forwardBackwardOnce(
  b: BlockRun,
  probedBytes: () => number,
): Promise<OneRun> {
  const b0 = deviceBytes();
  resetPeakBytes();
  const t0 = performance.now();
  const rec = recordForward(b.f);
  await settle(rec.y);
  const t1 = performance.now();
  const fwdPeak = peakBytes() - b0;
  const kept = deviceBytes() - b0;
  const outBytes = b.isLast
    ? boundaryBytes(b.blk.outputShape(b.xi.shape), 'float32')
    : boundaryBytes(rec.y.shape, rec.y.dtype);
  const dy = b.isLast ? tf.scalar(1) : tf.onesLike(rec.y);
  const b1 = deviceBytes();
  resetPeakBytes();
  let held: number | undefined;
  const t2 = performance.now();
  if (b.xs.length === 0) {
    // a block without parameters on the model's input: nothing to differentiate
    rec.y.dispose();
  } else {
    const yBytes = bytesOf(rec.y.shape);
    const g = backwardRecorded(rec, b.xs, dy);
    await settle(g[g.length - 1]);
    // above the level before the forward (b1 is that level plus the tape and the seed
    // dy), less the output: held here by the recorded forward, in a stage by the next
    // block's tape, freed by then
    if (b.i > 0) held = Math.max(0, probedBytes() - b1 + kept - yBytes);
    g.forEach((t) => t.dispose());
  }
  const t3 = performance.now();
  const bwdPeak = peakBytes() - b1;
  dy.dispose();
  return {
    fwdSeconds: (t1 - t0) / 1000,
    bwdSeconds: (t3 - t2) / 1000,
    fwdPeak,
    kept,
    bwdPeak,
    held,
    outBytes,
  };
}

/**
 * Block `i`'s size-dependent costs on input `xi`: `warmup` untimed then `repeats` timed forward
 * and backward runs (medians of the timed ones; the largest bytes of all), with the input
 * part's share of a split backward for a block with parameters.
 */
async function profileBlock(
  p: BlockProfiling,
  i: number,
  xi: tf.Tensor,
): Promise<BlockSizeCost> {
  const { model, params, labels, probe } = p;
  const last = model.blocks.length - 1;
  const blk = model.blocks[i];
  const ps = Object.values(params[i]);
  // blocks after the first see their input through a probe that notes the device's bytes
  // when the backward reaches it (its last step): what the block's backward holds then
  const input = () => (i > 0 ? probe(xi) : xi);
  const f =
    i === last
      ? () => model.loss(blk.forward(params[i], input()), labels)
      : () => blk.forward(params[i], input());
  const xs = i > 0 ? [...ps, xi] : ps;
  const run: BlockRun = { i, isLast: i === last, blk, xi, f, xs };
  const fwd: number[] = [];
  const bwd: number[] = [];
  /** The input part's share of a split backward (I over I + W; zero-bubble schedules). */
  const inputShare: number[] = [];
  let weightHeld: number | undefined;
  let inputPeak: number | undefined;
  const mem: {
    fwdPeakBytes: number;
    keptBytes: number;
    bwdPeakBytes: number;
    bwdHeldBytes?: number;
    outBytes: number;
  } = { fwdPeakBytes: 0, keptBytes: 0, bwdPeakBytes: 0, outBytes: 0 };
  for (let r = 0; r < p.warmup + p.repeats; r++) {
    const one = await forwardBackwardOnce(run, p.probedBytes);
    if (r >= p.warmup) {
      fwd.push(one.fwdSeconds);
      bwd.push(one.bwdSeconds);
      if (ps.length > 0) {
        const sp = await splitShare(f, xi, ps, i > 0, i === last);
        inputShare.push(sp.share);
        weightHeld = Math.max(weightHeld ?? 0, sp.heldBytes);
        inputPeak = Math.max(inputPeak ?? 0, sp.peakBytes);
      }
    }
    mem.fwdPeakBytes = Math.max(mem.fwdPeakBytes, one.fwdPeak);
    mem.keptBytes = Math.max(mem.keptBytes, one.kept);
    mem.bwdPeakBytes = Math.max(mem.bwdPeakBytes, one.bwdPeak);
    if (one.held !== undefined)
      mem.bwdHeldBytes = Math.max(mem.bwdHeldBytes ?? 0, one.held);
    mem.outBytes = one.outBytes;
  }
  return {
    inBytes: boundaryBytes(xi.shape, xi.dtype),
    ...mem,
    fwdSeconds: median(fwd),
    bwdSeconds: median(bwd),
    ...(inputShare.length > 0
      ? { bwdInputSeconds: median(inputShare) * median(bwd) }
      : {}),
    ...(weightHeld !== undefined ? { weightHeldBytes: weightHeld } : {}),
    ...(inputPeak !== undefined ? { bwdInputPeakBytes: inputPeak } : {}),
  };
}

/** Every block's size-dependent costs at micro-batch size `n`. */
async function profileAt(
  model: Model,
  params: Array<Record<string, tf.Variable>>,
  n: number,
  rng: Rng,
  repeats: number,
  warmup: number,
): Promise<ModelProfile['sizes'][number]> {
  const { x, labels, labelBytes } = randomBatch(model, n, rng);
  const last = model.blocks.length - 1;
  const inputs: tf.Tensor[] = [x];
  try {
    for (let i = 0; i < last; i++)
      inputs.push(tf.tidy(() => model.blocks[i].forward(params[i], inputs[i])));
    if (warmup > 0) await warmUpModel(model, params, x, labels);
    const blocks: BlockSizeCost[] = [];
    const { probe, bytes: probedBytes } = backwardBytesProbe();
    const p: BlockProfiling = {
      model,
      params,
      labels,
      probe,
      probedBytes,
      repeats,
      warmup,
    };
    for (let i = 0; i <= last; i++)
      blocks.push(await profileBlock(p, i, inputs[i]));
    return { batch: n, labelBytes, blocks };
  } finally {
    for (const t of inputs) t.dispose();
    labels.dispose();
  }
}

/**
 * Per-block costs for `--balance time|memory`: profiles the model at one micro-batch size on a
 * backend and returns {@link blockBalanceCosts} (seconds, or bytes, per block) for the given
 * step shape. Throws {@link LayerwiseError} for an unavailable backend or a bad size.
 */
export async function profiledBalanceCosts(
  model: Model,
  o: {
    kind: 'time' | 'memory';
    backend: string;
    /** Examples per micro-batch. */
    microBatch: number;
    stages: number;
    shape: Omit<StepShape, 'slots'>;
    optimizer: OptimizerConfig;
    /** Kernel threads of each device (see ProfileOptions.threads). */
    threads?: number;
    /** Compute precision of the devices (see ProfileOptions.precision). */
    precision?: Precision;
  },
): Promise<number[]> {
  const profile = await profileModel(model, {
    backend: o.backend,
    microBatchSizes: [o.microBatch],
    optimizer: o.optimizer,
    threads: o.threads,
    precision: o.precision,
  });
  return blockBalanceCosts(
    costsAt(profile, o.microBatch),
    o.kind,
    { ...o.shape, slots: optimizerSlots(o.optimizer) },
    o.stages,
  );
}

/**
 * One split backward of `f` (a block's forward, on parameters `ps` and input `x`; `wantInput`
 * false for the model's first block, whose input is data): `share`, the seconds of its input
 * part I (pipeline/split-backward.ts) over those of I and W together, in [0, 1]; `heldBytes`,
 * the device bytes I leaves for W (beside its input gradient); `peakBytes`, I's peak above the
 * bytes held when it starts (the tape and the output gradient).
 */
async function splitShare(
  f: () => tf.Tensor,
  x: tf.Tensor,
  ps: tf.Tensor[],
  wantInput: boolean,
  isLoss: boolean,
): Promise<{ share: number; heldBytes: number; peakBytes: number }> {
  const b0 = deviceBytes();
  const rec = recordForward(f);
  const dy = isLoss ? tf.scalar(1) : tf.onesLike(rec.y);
  const b1 = deviceBytes();
  resetPeakBytes();
  const t0 = performance.now();
  const { dx, pending } = backwardInput(rec, x, ps, dy, wantInput);
  if (dx) await dx.data();
  const t1 = performance.now();
  const peak = Math.max(0, peakBytes() - b1);
  const heldBytes = Math.max(
    0,
    deviceBytes() - b0 - dy.size * 4 - (dx ? dx.size * 4 : 0),
  );
  const grads = backwardWeight(pending, ps);
  await grads[grads.length - 1]!.data();
  const t2 = performance.now();
  dx?.dispose();
  dy.dispose();
  for (const g of grads) g.dispose();
  const total = t2 - t0;
  return {
    share: total > 0 ? (t1 - t0) / total : 0.5,
    heldBytes,
    peakBytes: peak,
  };
}
