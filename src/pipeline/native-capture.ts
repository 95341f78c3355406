/**
 * A captured step on the native CPU device (issue 37; as webgpu's, pipeline/captured-step.ts,
 * and CUDA graphs): a backprop stage that holds the whole model, training one micro-batch a step,
 * records the native addon's calls of its forward and backward through TF.js, and once two steps
 * in a row made the same calls on the same arrays, and a replay of them has reproduced a third
 * step bit for bit, runs later steps' forward and backward as that list of calls alone: no
 * TF.js, no tape, no JS between the kernels. The step's tokens and labels are copied into the
 * arrays the recording read them from; the gradients are handed on as tensors on the recording's
 * arrays (not copied) and the loss is what the recorded loss call returns. The optimizer step,
 * the gradient norm and the reads still run through TF.js.
 *
 * Why it is exact: an addon call reads nothing but its arguments. With AdamW in place
 * (backend/native.ts adamwMultiKernel) and the pools handing out the first-made free buffer
 * (backend/free-list.ts), a step calls the addon on exactly the arrays of the step before:
 * the two recordings compared show it, call by call (arrays by identity, other arguments by
 * value, the tokens and labels by their place). What the step's JS computes outside the addon
 * (a kernel of TF.js's cpu backend, a zero fill, a constant) is not in the list; where a call
 * reads such a value, the third step shows it: before that step runs through TF.js it is
 * replayed with its batch, and the capture stands only where the replay's gradients and loss
 * equal TF.js's bit for bit (else it is never tried again by this stage). The arrays the
 * recording uses are then claimed from the pools (NativeBackend.claimArrays), so nothing else is
 * handed them between replays. The capture is dropped and recorded anew when a step differs:
 * the parameters' arrays or their bf16 copies (a checkpoint restored), the batch's shapes, the
 * loss seed (a new loss scale), the team's thread count, LayerDrop, a diagnosing step, several
 * micro-batches; or when a replay fails. A replayed step counts the bytes its recording reached
 * above the step's start as device bytes for the replay's span (backend/memory.ts), so its peak
 * and the `--device-memory` budget read as a recorded step's.
 *
 * On by default where the backend is native; LAYERWISE_NATIVE_CAPTURE=0 turns it off (the
 * kernels bench turns it off: it times TF.js's kernels).
 */

import {
  countPrivateBytes,
  deviceBytes,
  peakBytes,
} from '../backend/memory.js';
import {
  type AddonCall,
  type AddonRecording,
  nativeAddon,
  replayAddonCalls,
  startAddonRecording,
} from '../backend/native-addon.js';
import { tf } from '../backend/tfjs.js';
import { capturesStep } from './captured-step.js';
import type { StepIO } from './executor.js';

/** Forward-and-backwards this thread replayed from captured steps so far (the stage host reports each step's). */
export function nativeReplays(): number {
  return replaysHere;
}

let replaysHere = 0;

/** The environment variable that turns native captured steps off (value 0); on where unset. */
export const NATIVE_CAPTURE_ENV = 'LAYERWISE_NATIVE_CAPTURE';

/**
 * Recordings in a row that may fail to make a capture before a stage stops recording: a step
 * that calls the addon on new arrays every step (parameters updated out of place, a JS value
 * made anew each step) would otherwise pay for recording and comparing forever.
 */
const MAX_MISSES = 8;

/** The parts of backend/native.ts's NativeBackend used here. */
interface Backend {
  data: { get(dataId: object): { values?: unknown } | undefined };
  parameterCopyOf(t: tf.TensorInfo): Uint16Array | null;
  anyBf16Only(...ts: tf.TensorInfo[]): boolean;
  claimArrays(arrays: Iterable<ArrayBufferView>): void;
}

/** What the stage hands the capture: its parameters' variables (whose arrays a replay must find unchanged). */
export interface NativeCaptureHost {
  readonly paramVars: ReadonlyMap<string, tf.Variable>;
}

/** One recorded forward and backward. */
interface Captured {
  calls: AddonCall[];
  /** The arrays the recording read the tokens and the labels from (int32). */
  x: Int32Array;
  labels: Int32Array;
  xShape: number[];
  labelsShape: number[];
  /** The call whose result is the loss. */
  lossCall: number;
  /** The gradients' arrays and shapes by key. */
  grads: Map<string, { values: Float32Array; shape: number[] }>;
  /** The parameters' arrays and their bf16 copies (null: none), in the stage's key order. */
  params: unknown[];
  copies: Array<Uint16Array | null>;
  seed: number;
  threads: number;
  /** Bytes above the device's level at the recording's start that the recorded step reached (bytes). */
  transientBytes: number;
}

/** A replay's gradients (copies) and loss, for the check against TF.js's. */
interface Trial {
  captured: Captured;
  grads: Map<string, Float32Array>;
  loss: number;
}

/**
 * The capture of one stage's forward and backward on native (see the module's comment). The
 * stage calls it around its forward and backward handlers, as webgpu's StepCapture.
 */
export class NativeStepCapture {
  private recording: {
    rec: AddonRecording;
    /** The batch's values, shapes as recorded (the tensors are disposed by the backward's end). */
    x: unknown;
    labels: unknown;
    xShape: number[];
    labelsShape: number[];
    loss?: number;
    base: number;
  } | null = null;
  /** The last step's recording, to compare the next with. */
  private last: Captured | null = null;
  /** Whether the step before the last recorded the same as {@link last}: the next step tries it. */
  private matched = false;
  /** Recordings in a row that did not make a capture: at {@link MAX_MISSES} this stage stops recording. */
  private misses = 0;
  /** A capture being checked: replayed before this step ran through TF.js. */
  private trial: Trial | null = null;
  /** The capture replayed. */
  private ready: Captured | null = null;
  /** Whether a replay of this stage once differed from TF.js, or its steps did not repeat: never captured again. */
  private refused = false;
  /** Whether this step's forward was replayed (the backward hands on the replay's results). */
  private pending: { grads: Map<string, tf.Tensor>; loss: tf.Tensor } | null =
    null;
  constructor(private readonly host: NativeCaptureHost) {}

  /** Whether native captured steps are on: this thread's backend is native (its addon loaded) and LAYERWISE_NATIVE_CAPTURE is not 0. */
  static wanted(): boolean {
    const env = (globalThis as { process?: { env?: Record<string, string> } })
      .process?.env;
    return (
      env?.[NATIVE_CAPTURE_ENV] !== '0' &&
      tf.getBackend() === 'native' &&
      nativeAddon() !== null
    );
  }

  private get backend(): Backend {
    return tf.backend() as unknown as Backend;
  }

  private valuesOf(t: tf.TensorInfo): unknown {
    return this.backend.data.get(t.dataId)?.values;
  }

  private paramState(): {
    params: unknown[];
    copies: Array<Uint16Array | null>;
  } {
    const vars = [...this.host.paramVars.values()];
    return {
      params: vars.map((v) => this.valuesOf(v)),
      copies: vars.map((v) => this.backend.parameterCopyOf(v)),
    };
  }

  /** Whether `c` replays this step: the same parameters' arrays, batch shapes, seed and team. */
  private fits(
    c: Captured,
    io: StepIO,
    x: tf.Tensor,
    labels: tf.Tensor,
  ): boolean {
    const { params, copies } = this.paramState();
    const xs = this.valuesOf(x);
    const ls = this.valuesOf(labels);
    return (
      xs instanceof Int32Array &&
      ls instanceof Int32Array &&
      sameList(x.shape, c.xShape) &&
      sameList(labels.shape, c.labelsShape) &&
      io.lossSeed === c.seed &&
      nativeAddon()!.threads() === c.threads &&
      sameList(params, c.params) &&
      sameList(copies, c.copies)
    );
  }

  /**
   * The training forward of a stage holding the whole model, before it runs: true where this
   * step is replayed (x and labels taken: their values copied into the recording's arrays and
   * the tensors disposed; the stage skips its forward and the backward hands on the replay's
   * results), false where the stage runs its forward (recorded where the step is one the
   * capture covers: call {@link afterForward} once it ran).
   */
  beforeForward(
    mb: number,
    io: StepIO,
    keep: boolean,
    x: tf.Tensor,
    labels: tf.Tensor,
  ): boolean {
    if (this.refused || !capturesStep(mb, io, keep)) {
      this.drop();
      return false;
    }
    const c = this.ready;
    if (c) {
      if (this.fits(c, io, x, labels)) {
        this.pending = this.replay(c, x, labels);
        x.dispose();
        labels.dispose();
        replaysHere++;
        return true;
      }
      this.drop();
    }
    // two steps recorded the same: replay that before this step runs through TF.js, to compare
    if (this.last && this.matched && this.fits(this.last, io, x, labels))
      this.trial = this.tryReplay(this.last, x, labels);
    this.recording = {
      rec: startAddonRecording(),
      x: this.valuesOf(x),
      labels: this.valuesOf(labels),
      xShape: [...x.shape],
      labelsShape: [...labels.shape],
      base: deviceBytes(),
    };
    return false;
  }

  /** Replays `c` with x and labels: the gradients as tensors on its arrays and the loss. */
  private replay(
    c: Captured,
    x: tf.Tensor,
    labels: tf.Tensor,
  ): { grads: Map<string, tf.Tensor>; loss: tf.Tensor } {
    const loss = this.run(c, x, labels);
    return {
      grads: new Map(
        [...c.grads].map(([k, g]) => [k, tf.tensor(g.values, g.shape)]),
      ),
      loss: tf.scalar(loss),
    };
  }

  /** Copies the batch into c's arrays and runs c's calls; returns the loss. */
  private run(c: Captured, x: tf.Tensor, labels: tf.Tensor): number {
    c.x.set(this.valuesOf(x) as Int32Array);
    c.labels.set(this.valuesOf(labels) as Int32Array);
    // the device holds the recorded step's activations while the replay runs: counted as the
    // recorded step counted its tensors (its peak, checked against --device-memory)
    countPrivateBytes(c.transientBytes);
    countPrivateBytes(-c.transientBytes);
    let results: unknown[];
    try {
      results = replayAddonCalls(c.calls);
    } catch (e) {
      this.drop(); // the next step runs through TF.js, and records anew
      throw e;
    }
    return results[c.lossCall] as number;
  }

  /** Replays `c` with this step's batch before TF.js runs it, keeping copies of what it gave. */
  private tryReplay(c: Captured, x: tf.Tensor, labels: tf.Tensor): Trial {
    const loss = this.run(c, x, labels);
    return {
      captured: c,
      grads: new Map([...c.grads].map(([k, g]) => [k, g.values.slice()])),
      loss,
    };
  }

  /** After a recorded forward: `loss` the forward's loss tensor. */
  afterForward(_x: tf.Tensor, _labels: tf.Tensor, loss: tf.Tensor): void {
    const r = this.recording;
    if (!r) return;
    const v = this.valuesOf(loss);
    if (v instanceof Float32Array && v.length === 1) r.loss = v[0];
  }

  /**
   * The backward of micro-batch 0: where its forward was replayed, the gradients by key (tensors
   * on the recording's arrays: the stage accumulates and the optimizer reads them as any) and the
   * loss tensor; null where the stage runs its backward.
   */
  replayBackward(): { grads: Map<string, tf.Tensor>; loss: tf.Tensor } | null {
    const p = this.pending;
    this.pending = null;
    return p;
  }

  /**
   * After a recorded backward: `grads` the stage's accumulated gradients by key. Ends the
   * recording; where it repeats the last step's and this step's trial replay gave TF.js's
   * results, the capture is ready and the next step is replayed.
   */
  afterBackward(grads: ReadonlyMap<string, tf.Tensor>, lossSeed: number): void {
    const r = this.recording;
    if (!r) return;
    this.recording = null;
    r.rec.stop();
    const c = this.captured(r, r.rec.calls, grads, lossSeed);
    const trial = this.trial;
    this.trial = null;
    if (c && trial && sameCapture(trial.captured, c)) {
      if (!sameResults(trial, c)) {
        this.refuse(); // a value the calls read came from outside them
        return;
      }
      this.backend.claimArrays(arraysOf(c));
      this.ready = c;
      this.last = null;
      this.matched = false;
      this.misses = 0;
      return;
    }
    if (c && this.last && !this.matched && sameCapture(this.last, c)) {
      this.matched = true; // the next step tries it
      return;
    }
    this.last = c;
    this.matched = false;
    if (++this.misses >= MAX_MISSES) this.refuse();
  }

  /** Stops capturing for good (this stage's steps run through TF.js). */
  private refuse(): void {
    this.drop();
    this.refused = true;
  }

  /** What a recording shows, or null where it cannot be replayed (no loss call, a gradient not from the pool's float32 arrays). */
  private captured(
    r: NonNullable<NativeStepCapture['recording']>,
    calls: AddonCall[],
    grads: ReadonlyMap<string, tf.Tensor>,
    seed: number,
  ): Captured | null {
    const { x, labels } = r;
    if (!(x instanceof Int32Array) || !(labels instanceof Int32Array))
      return null;
    // the last call that returned the loss (a double the kernel rounds to float32)
    const isLoss = (v: unknown) =>
      typeof v === 'number' && Math.fround(v) === r.loss;
    let lossCall = calls.length - 1;
    while (lossCall >= 0 && !isLoss(calls[lossCall]!.result)) lossCall--;
    if (lossCall < 0 || typeof r.loss !== 'number') return null;
    const byKey = new Map<string, { values: Float32Array; shape: number[] }>();
    for (const [k, g] of grads) {
      const values = this.valuesOf(g);
      if (!(values instanceof Float32Array) || this.backend.anyBf16Only(g))
        return null;
      byKey.set(k, { values, shape: [...g.shape] });
    }
    return {
      calls,
      x,
      labels,
      xShape: r.xShape,
      labelsShape: r.labelsShape,
      lossCall,
      grads: byKey,
      ...this.paramState(),
      seed,
      threads: nativeAddon()!.threads(),
      transientBytes: Math.max(0, peakBytes() - r.base),
    };
  }

  /** Drops a replayed step's results (a failed step); the capture stays. */
  resetStep(): void {
    this.pending = null;
    this.trial = null;
    if (this.recording) {
      this.recording.rec.stop();
      this.recording = null;
    }
  }

  /** Drops the capture and any recording: the next covered step records anew. */
  drop(): void {
    this.resetStep();
    this.last = null;
    this.matched = false;
    this.ready = null;
  }

  /** Drops the capture. */
  dispose(): void {
    this.drop();
  }
}

const sameList = (a: readonly unknown[], b: readonly unknown[]) =>
  a.length === b.length && a.every((v, i) => v === b[i]);

/** Whether two arguments are the same: arrays by identity, lists item by item, the rest by value. */
function sameArg(a: unknown, b: unknown): boolean {
  if (Array.isArray(a))
    return (
      Array.isArray(b) &&
      a.length === b.length &&
      a.every((v, i) => sameArg(v, b[i]))
    );
  return a === b || (Number.isNaN(a) && Number.isNaN(b));
}

/** Whether two recordings are the same step: the same calls on the same arrays, the batch's arrays in the same places. */
function sameCapture(a: Captured, b: Captured): boolean {
  if (
    a.calls.length !== b.calls.length ||
    a.lossCall !== b.lossCall ||
    a.seed !== b.seed ||
    a.threads !== b.threads ||
    !sameList(a.params, b.params) ||
    !sameList(a.copies, b.copies) ||
    !sameList(a.xShape, b.xShape) ||
    !sameList(a.labelsShape, b.labelsShape) ||
    a.grads.size !== b.grads.size
  )
    return false;
  for (const [k, g] of a.grads) {
    const h = b.grads.get(k);
    if (!h || h.values !== g.values || !sameList(h.shape, g.shape))
      return false;
  }
  const place = (c: Captured, v: unknown) =>
    v === c.x ? 'x' : v === c.labels ? 'labels' : v;
  return a.calls.every((c, i) => {
    const d = b.calls[i]!;
    return (
      c.name === d.name &&
      c.args.length === d.args.length &&
      c.args.every((v, k) => sameArg(place(a, v), place(b, d.args[k])))
    );
  });
}

/** Whether a trial replay gave the recorded step's gradients and loss, bit for bit. */
function sameResults(t: Trial, c: Captured): boolean {
  if (!Object.is(t.loss, c.calls[c.lossCall]!.result)) return false;
  for (const [k, g] of c.grads) {
    const tried = t.grads.get(k);
    if (!tried || !sameBits(tried, g.values)) return false;
  }
  return true;
}

function sameBits(a: Float32Array, b: Float32Array): boolean {
  if (a.length !== b.length) return false;
  const x = new Uint32Array(a.buffer, a.byteOffset, a.length);
  const y = new Uint32Array(b.buffer, b.byteOffset, b.length);
  for (let i = 0; i < x.length; i++) if (x[i] !== y[i]) return false;
  return true;
}

/** Every typed array a capture's calls take (lists' items too), and its gradients'. */
function arraysOf(c: Captured): Set<ArrayBufferView> {
  const out = new Set<ArrayBufferView>();
  const add = (v: unknown) => {
    if (ArrayBuffer.isView(v)) out.add(v);
    else if (Array.isArray(v)) v.forEach(add);
  };
  for (const call of c.calls) call.args.forEach(add);
  for (const g of c.grads.values()) out.add(g.values);
  return out;
}
