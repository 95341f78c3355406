/**
 * A captured step on the native CPU device (issue 37; as webgpu's, pipeline/captured-step.ts,
 * and CUDA graphs): any backprop stage (single device, a pipeline's stage, a replica's), and a
 * local-parallelism stage without an overlapped tail (its step one local update), records
 * the native addon's calls of each compute action of its training step (forward, backward,
 * backward_input, backward_weight, for every micro-batch, in the schedule's order; or
 * local_update) through
 * TF.js, and once two steps in a row made the same calls on the same arrays, and a trial replay
 * of them has reproduced a third step bit for bit, runs later steps' actions as those lists of
 * calls alone: no TF.js, no tape, no JS between the kernels. Each action's inputs (tokens and
 * labels, a received activation or gradient) are copied into the arrays the recording read them
 * from; its outputs (an activation or gradient to send) are handed on as copies, a loss as what
 * the recorded loss call returns, and after the step's last action the accumulated gradients as
 * tensors on the recording's arrays (not copied). The optimizer step, the gradient norm, the
 * all-reduce and the sends still run through TF.js and the executor.
 *
 * Why it is exact: an addon call reads nothing but its arguments. With AdamW in place
 * (backend/native.ts adamwMultiKernel), the pools handing out the first-made free buffer
 * (backend/free-list.ts) and a sent tensor's array going back to the pool (runtime/serialize.ts
 * copyOfValues), a step calls the addon on exactly the arrays of the step before: the two
 * recordings compared show it, call by call (arrays by identity, other arguments by value, each
 * action's inputs by their place). What the step's JS computes outside the addon (a kernel of
 * TF.js's cpu backend, a zero fill, a constant, Dropout's noise) is not in the lists; where a
 * call reads such a value, the third step shows it: before each of its actions runs through
 * TF.js, the recorded action is replayed on that action's inputs, and every array it wrote is put
 * back afterwards; the capture stands only where every replayed action's outputs and loss, and
 * the step's gradients, equal TF.js's bit for bit (else it is never tried again by this stage).
 * The arrays the recording uses are then claimed from the pools (NativeBackend.claimArrays), so
 * nothing else is handed them between replays. The capture is dropped and recorded anew when a
 * step differs at its first action: the parameters' arrays or their bf16 copies (a checkpoint
 * restored), the inputs' shapes, the micro-batches, the loss seed (a new loss scale), the team's
 * thread count, LayerDrop, a diagnosing step; or when a replay fails. A replayed step counts the
 * bytes its recording reached above the step's start as device bytes at its first action
 * (backend/memory.ts), so its peak and the `--device-memory` budget read as a recorded step's.
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
  bf16OnlyValues(t: tf.TensorInfo): Uint16Array | undefined;
  bf16Output(bf: Uint16Array, shape: number[]): tf.TensorInfo;
  claimArrays(arrays: Iterable<ArrayBufferView>): void;
  keepRecordedInput(array: ArrayBufferView): void;
  alloc(length: number): Float32Array;
  shadowBuffer(length: number): Uint16Array | undefined;
}

/** What the stage hands the capture: its parameters' variables (whose arrays a replay must find unchanged). */
export interface NativeCaptureHost {
  readonly paramVars: ReadonlyMap<string, tf.Variable>;
}

/** A compute action of a stage's training step, as the capture keys its segments. */
export interface CaptureAction {
  /** forward, backward, backward_input or backward_weight; local_update (a local stage's step). */
  op: string;
  mb: number;
  /** Whether the forward kept its activations (no re-materialization). */
  keep: boolean;
}

/** What an action takes from the step (disposed by the capture where it replays the action). */
export interface ActionInputs {
  /** The stage's input: [B/M, T] int32 tokens, or float32 activations. */
  x?: tf.Tensor;
  /** The labels (last stage). */
  labels?: tf.Tensor;
  /** The gradient of the stage's output (not the last stage). */
  dy?: tf.Tensor;
}

/** What an action gives the step. */
export interface ActionOutputs {
  /** The output to send on (a forward of a stage that is not the last). */
  y?: tf.Tensor | null;
  /** The input's gradient to send back (a backward of a stage that is not the first). */
  dx?: tf.Tensor | null;
  /** The micro-batch's loss (a forward of the last stage): a float32 scalar. */
  loss?: tf.Tensor | null;
}

/** A replayed action's results, for the stage to hand on as it would TF.js's. */
export interface ReplayedAction {
  y?: tf.Tensor;
  dx?: tf.Tensor;
  loss?: tf.Tensor;
  /** After the step's last action: the accumulated gradients by key (tensors on the capture's arrays). */
  grads?: Map<string, tf.Tensor>;
}

type InputName = keyof ActionInputs;
type OutputName = 'y' | 'dx';

/** One action's part of a recorded step. */
interface Segment {
  op: string;
  mb: number;
  keep: boolean;
  /** Its calls: [from, to) of the step's. */
  from: number;
  to: number;
  /** The arrays it read its inputs from (copied into on a replay), by name. */
  inputs: Array<{
    name: InputName;
    /** bf16 values (Uint16Array) where the tensor was bf16-only data (backend/native.ts bf16Output). */
    values: Float32Array | Int32Array | Uint16Array;
    shape: number[];
  }>;
  /** The arrays its outputs were on (copied out on a replay). */
  outputs: Array<{
    name: OutputName;
    /** bf16 values where the output was bf16-only data. */
    values: Float32Array | Uint16Array;
    shape: number[];
  }>;
  /** The call (of the step's) whose result is its loss; -1: none. */
  lossCall: number;
}

/** One recorded step of a stage: its compute actions' addon calls. */
interface Captured {
  calls: AddonCall[];
  segments: Segment[];
  /** The accumulated gradients' arrays and shapes by key, after the last action. */
  grads: Map<string, { values: Float32Array; shape: number[] }>;
  /** The parameters' arrays and their bf16 copies (null: none), in the stage's key order. */
  params: unknown[];
  copies: Array<Uint16Array | null>;
  seed: number;
  m: number;
  threads: number;
  /** Bytes above the device's level at the step's first action that the recorded step reached (bytes). */
  transientBytes: number;
}

/** A step being recorded. */
interface Recording {
  calls: AddonCall[];
  segments: Segment[];
  grads: Map<string, { values: Float32Array; shape: number[] }>;
  /** Whether some action could not be recorded (an input or output not on a plain array): never a capture. */
  broken: boolean;
  base: number;
  seed: number;
  m: number;
  /** The action being recorded. */
  open: {
    rec: AddonRecording;
    segment: Segment;
  } | null;
}

/** A replay of {@link Trial.captured}'s actions, each before TF.js runs it, to compare results. */
interface Trial {
  captured: Captured;
  /** Whether every action so far gave TF.js's results bit for bit. */
  ok: boolean;
  /** The current action's replayed outputs (copies) and loss. */
  outputs: Map<OutputName, Float32Array | Uint16Array>;
  loss: number | null;
  /** After the last action: the replayed gradients (copies). */
  grads: Map<string, Float32Array> | null;
  /** Actions compared so far. */
  done: number;
  /** The recording's input arrays to this step's, of the actions so far. */
  sub: Map<unknown, unknown>;
}

/**
 * The capture of one stage's training step on native (see the module's comment). The stage
 * calls it around each compute action of a training step ({@link replay}, else {@link begin}
 * and {@link end}), and at the step's end ({@link endStep}).
 */
export class NativeStepCapture {
  private recording: Recording | null = null;
  /** The last step's recording, to compare the next with. */
  private last: Captured | null = null;
  /** Whether the step before the last recorded the same as {@link last}: the next step tries it. */
  private matched = false;
  /** Recordings in a row that did not make a capture: at {@link MAX_MISSES} this stage stops recording. */
  private misses = 0;
  /** A capture being checked, action by action, in this step. */
  private trial: Trial | null = null;
  /** The capture replayed. */
  private ready: Captured | null = null;
  /** Whether this step is replayed (decided at its first action). */
  private replaying = false;
  /** Actions of this step so far. */
  private cursor = 0;
  /** Whether a replay of this stage once differed from TF.js, or its steps did not repeat: never captured again. */
  private refused = false;
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

  /**
   * The array an action's input or output is on: a bf16-only tensor's bf16 values (its float32
   * values not made: reading them would widen them outside the recorded calls), else its values.
   */
  private dataOf(t: tf.TensorInfo): unknown {
    return this.backend.bf16OnlyValues(t) ?? this.valuesOf(t);
  }

  /**
   * A tensor of `shape` on a copy of `values`: float32 (on an array from the backend's pool, back
   * to it when the tensor goes: a sent activation is copied out and disposed every micro-batch,
   * and new arrays each time would be garbage to collect), or bf16-only where `values` are bf16
   * (alike, from the backend's free bf16 buffers).
   */
  private tensorOfCopy(
    values: Float32Array | Uint16Array,
    shape: number[],
  ): tf.Tensor {
    if (values instanceof Float32Array) {
      const copy = this.backend.alloc(values.length);
      copy.set(values);
      return tf.tensor(copy, shape);
    }
    // a free bf16 buffer (counted as a shadow's bytes, which bf16Output takes over, and given
    // back when the tensor goes), else a copy counted so
    let bf = this.backend.shadowBuffer(values.length);
    if (bf) bf.set(values);
    else {
      bf = values.slice();
      countPrivateBytes(bf.byteLength);
    }
    const info = this.backend.bf16Output(bf, shape);
    return tf
      .engine()
      .makeTensorFromDataId(
        info.dataId,
        shape,
        'float32',
        this.backend as unknown as tf.KernelBackend,
      );
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

  /** Whether `c` replays a step starting with `io`: the same parameters' arrays, seed, micro-batches and team, no block skipped, no diagnosis. */
  private fitsStep(c: Captured, io: StepIO): boolean {
    const { params, copies } = this.paramState();
    return (
      io.lossSeed === c.seed &&
      io.m === c.m &&
      nativeAddon()!.threads() === c.threads &&
      sameList(params, c.params) &&
      sameList(copies, c.copies)
    );
  }

  /**
   * Whether segment `s` is action `a` with these inputs (names, shapes and arrays' kinds; with
   * `anyFloat`, a float input may be float32 where the recording's was bf16 or back: a replay
   * converts it, exactly, as block boundaries hold bf16 values).
   */
  private fitsAction(
    s: Segment | undefined,
    a: CaptureAction,
    inputs: ActionInputs,
    anyFloat = false,
  ): s is Segment {
    if (!s || s.op !== a.op || s.mb !== a.mb || s.keep !== a.keep) return false;
    const given = inputNames(inputs);
    if (given.length !== s.inputs.length) return false;
    return s.inputs.every((r, i) => {
      const t = inputs[r.name];
      const v = t ? this.dataOf(t) : undefined;
      return (
        given[i] === r.name &&
        (v?.constructor === r.values.constructor ||
          (anyFloat && isFloat(v) && isFloat(r.values))) &&
        sameList(t!.shape, r.shape)
      );
    });
  }

  /**
   * A compute action of a training step, before it runs: where this step is replayed, copies
   * its inputs into the recording's arrays (disposing them), replays its calls and returns its
   * results (the stage hands them on and skips the action); else null (the stage runs it through
   * TF.js, between {@link begin} and {@link end}).
   * @throws Error where a replayed step's action is not the recording's (a schedule that changed
   * within a step): the step fails, and the capture is dropped.
   */
  replay(
    a: CaptureAction,
    io: StepIO,
    inputs: ActionInputs,
  ): ReplayedAction | null {
    if (this.cursor === 0) {
      this.replaying = false;
      const c = this.ready;
      if (this.refused || !coverable(io) || (c && !this.fitsStep(c, io))) {
        this.drop();
      } else if (c && this.fitsAction(c.segments[0], a, inputs)) {
        this.replaying = true;
        // the device holds the recorded step's activations while the replay runs: counted as
        // the recorded step counted its tensors (its peak, checked against --device-memory)
        countPrivateBytes(c.transientBytes);
        countPrivateBytes(-c.transientBytes);
      } else if (c) this.drop();
    }
    if (!this.replaying) return null;
    const c = this.ready!;
    const s = c.segments[this.cursor];
    if (!this.fitsAction(s, a, inputs, true)) {
      this.drop();
      throw new Error(
        `a captured step's action ${this.cursor} is ${a.op} of micro-batch ${a.mb}, not the recording's; ` +
          `set ${NATIVE_CAPTURE_ENV}=0 to train without captured steps`,
      );
    }
    const loss = this.runSegment(c, s, inputs);
    for (const t of Object.values(inputs)) t?.dispose();
    this.cursor++;
    const out: ReplayedAction = {};
    for (const o of s.outputs)
      out[o.name] = this.tensorOfCopy(o.values, o.shape);
    if (loss !== null) out.loss = tf.scalar(loss);
    if (this.cursor === c.segments.length) {
      out.grads = new Map(
        [...c.grads].map(([k, g]) => [k, tf.tensor(g.values, g.shape)]),
      );
      replaysHere++;
    }
    return out;
  }

  /**
   * Runs segment s's calls with `inputs`; returns its loss (null: none). A replay copies the
   * inputs into the recording's arrays; a trial (`sub`: the recording's input arrays to this
   * step's, of the actions so far and this one's) runs the calls on this step's input arrays
   * instead, writing nothing TF.js's run of the step might still read.
   */
  private runSegment(
    c: Captured,
    s: Segment,
    inputs: ActionInputs,
    sub?: Map<unknown, unknown>,
  ): number | null {
    let calls = c.calls.slice(s.from, s.to);
    if (sub) calls = substituted(calls, sub);
    else
      for (const r of s.inputs)
        copyInto(r.values, this.dataOf(inputs[r.name]!));
    let results: unknown[];
    try {
      results = replayAddonCalls(calls);
    } catch (e) {
      this.drop(); // the next step runs through TF.js, and records anew
      throw e;
    }
    return s.lossCall < 0 ? null : (results[s.lossCall - s.from] as number);
  }

  /**
   * A compute action about to run through TF.js in a training step: records its addon calls
   * (until {@link end}); where a capture is being tried, first replays the recorded action with
   * these inputs, keeping what it gave for {@link end} to compare, and puts back every array it
   * wrote (so TF.js's run is as if it had not happened).
   */
  begin(a: CaptureAction, io: StepIO, inputs: ActionInputs): void {
    if (this.refused || this.replaying) return;
    if (this.cursor === 0) {
      this.recording = null;
      this.trial = null;
      if (!coverable(io)) return;
      if (this.last && this.matched && this.fitsStep(this.last, io))
        this.trial = {
          captured: this.last,
          ok: true,
          outputs: new Map(),
          loss: null,
          grads: null,
          done: 0,
          sub: new Map(),
        };
      this.recording = {
        calls: [],
        segments: [],
        grads: new Map(),
        broken: false,
        base: deviceBytes(),
        seed: io.lossSeed,
        m: io.m,
        open: null,
      };
    }
    this.cursor++;
    const r = this.recording;
    if (!r) return;
    this.tryAction(a, inputs);
    const segment: Segment = {
      op: a.op,
      mb: a.mb,
      keep: a.keep,
      from: r.calls.length,
      to: r.calls.length,
      inputs: [],
      outputs: [],
      lossCall: -1,
    };
    for (const name of inputNames(inputs)) {
      const t = inputs[name]!;
      const values = this.dataOf(t);
      if (
        values instanceof Float32Array ||
        values instanceof Int32Array ||
        values instanceof Uint16Array
      ) {
        segment.inputs.push({ name, values, shape: [...t.shape] });
        this.backend.keepRecordedInput(values);
      } else r.broken = true;
    }
    r.open = { rec: startAddonRecording(), segment };
  }

  /** The trial's replay of action `a` (its next), before TF.js runs it: results kept, arrays put back. */
  private tryAction(a: CaptureAction, inputs: ActionInputs): void {
    const t = this.trial;
    if (!t?.ok) return;
    const c = t.captured;
    const s = c.segments[t.done];
    if (!this.fitsAction(s, a, inputs)) {
      t.ok = false;
      return;
    }
    for (const r of s.inputs) t.sub.set(r.values, this.dataOf(inputs[r.name]!));
    const saved = this.snapshot(c, s, t.sub);
    try {
      const loss = this.runSegment(c, s, inputs, t.sub);
      t.loss = loss;
      t.outputs = new Map(s.outputs.map((o) => [o.name, o.values.slice()]));
      if (t.done === c.segments.length - 1)
        t.grads = new Map([...c.grads].map(([k, g]) => [k, g.values.slice()]));
    } finally {
      for (const [a, copy] of saved) a.set(copy);
    }
  }

  /** Copies of every array segment s's calls take (with `sub`'s arrays for the recording's) but the parameters' (and their bf16 copies'). */
  private snapshot(
    c: Captured,
    s: Segment,
    sub: Map<unknown, unknown>,
  ): Map<TypedArray, TypedArray> {
    const fixed = new Set<unknown>([...c.params, ...c.copies]);
    const out = new Map<TypedArray, TypedArray>();
    for (const a of arraysOfCalls(
      substituted(c.calls.slice(s.from, s.to), sub),
    ))
      if (!fixed.has(a) && !out.has(a)) out.set(a, a.slice());
    return out;
  }

  /**
   * After an action ran through TF.js: its outputs, and the stage's accumulated gradients now.
   * Ends the action's recording; where a capture is being tried, compares its replay's results
   * with these.
   */
  end(outputs: ActionOutputs, grads: ReadonlyMap<string, tf.Tensor>): void {
    const r = this.recording;
    if (!r?.open) return;
    const { rec, segment } = r.open;
    r.open = null;
    rec.stop();
    for (const call of rec.calls) r.calls.push(call);
    segment.to = r.calls.length;
    for (const name of ['y', 'dx'] as const) {
      const t = outputs[name];
      if (!t) continue;
      const values = this.dataOf(t);
      if (values instanceof Float32Array || values instanceof Uint16Array)
        segment.outputs.push({ name, values, shape: [...t.shape] });
      else r.broken = true;
    }
    let loss: number | null = null;
    if (outputs.loss) {
      const v = this.valuesOf(outputs.loss);
      if (!(v instanceof Float32Array) || v.length !== 1) r.broken = true;
      else {
        loss = v[0]!;
        // the last call that returned the loss (a double the kernel rounds to float32)
        let k = segment.to - 1;
        while (k >= segment.from && !isLoss(r.calls[k]!.result, loss)) k--;
        if (k < segment.from) r.broken = true;
        segment.lossCall = k;
      }
    }
    r.segments.push(segment);
    r.grads = new Map();
    for (const [k, g] of grads) {
      const values = this.backend.anyBf16Only(g) ? null : this.valuesOf(g);
      if (values instanceof Float32Array)
        r.grads.set(k, { values, shape: [...g.shape] });
      else r.broken = true;
    }
    this.compareAction(segment, loss, r.grads);
  }

  /** Whether the trial's replay of this action gave TF.js's outputs, loss and (after the last) gradients bit for bit. */
  private compareAction(
    s: Segment,
    loss: number | null,
    grads: Map<string, { values: Float32Array }>,
  ): void {
    const t = this.trial;
    if (!t?.ok) return;
    t.done++;
    const same =
      s.outputs.length === t.outputs.size &&
      s.outputs.every((o) => {
        const tried = t.outputs.get(o.name);
        return tried !== undefined && sameBits(tried, o.values);
      }) &&
      (loss === null
        ? t.loss === null
        : t.loss !== null && Object.is(Math.fround(t.loss), loss)) &&
      (t.grads === null ||
        (t.grads.size === grads.size &&
          [...grads].every(([k, g]) => {
            const tried = t.grads!.get(k);
            return tried !== undefined && sameBits(tried, g.values);
          })));
    if (!same) t.ok = false;
  }

  /**
   * The step's compute actions are done (before its optimizer step): ends its recording. Where
   * it repeats the last step's and this step's trial replays gave TF.js's results, the capture is
   * ready and the next step is replayed.
   */
  endStep(): void {
    const r = this.recording;
    const trial = this.trial;
    const replayed = this.replaying;
    this.recording = null;
    this.trial = null;
    this.cursor = 0;
    this.replaying = false;
    if (replayed || !r || this.refused) return;
    const c = this.captured(r);
    if (c && trial && sameCapture(trial.captured, c)) {
      if (!trial.ok || trial.done !== c.segments.length) {
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

  /** What a recorded step shows, or null where it cannot be replayed. */
  private captured(r: Recording): Captured | null {
    if (r.broken || r.open || r.segments.length === 0) return null;
    return {
      calls: r.calls,
      segments: r.segments,
      grads: r.grads,
      ...this.paramState(),
      seed: r.seed,
      m: r.m,
      threads: nativeAddon()!.threads(),
      transientBytes: Math.max(0, peakBytes() - r.base),
    };
  }

  /** Drops a step's recording, trial or replay (a failed step); the capture stays. */
  resetStep(): void {
    this.trial = null;
    this.cursor = 0;
    this.replaying = false;
    if (this.recording?.open) this.recording.open.rec.stop();
    this.recording = null;
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

type TypedArray = Float32Array | Int32Array | Uint16Array | Uint8Array;

/**
 * Copies an input's values into a recording's array of the same length: as they are where both
 * are of a kind, else converted between float32 and bf16 by the addon (exact for block
 * boundaries' values, which are bf16 values).
 */
function copyInto(to: TypedArray, from: unknown): void {
  if (from instanceof Float32Array && to instanceof Uint16Array)
    nativeAddon()!.toBf16(from, to);
  else if (from instanceof Uint16Array && to instanceof Float32Array)
    nativeAddon()!.fromBf16(from, to);
  else to.set(from as Float32Array);
}

/** Whether `x` holds float values: float32, or bf16 (Uint16Array). */
const isFloat = (x: unknown) =>
  x instanceof Float32Array || x instanceof Uint16Array;

/** Whether a step with `io` may be captured: it skips no block and diagnoses nothing. */
function coverable(io: StepIO): boolean {
  return io.dropped.size === 0 && !io.diagnose;
}

/** The names of the inputs given, in a fixed order. */
function inputNames(inputs: ActionInputs): InputName[] {
  return (['x', 'labels', 'dy'] as const).filter((n) => inputs[n]);
}

/** Whether a call's result is `loss` (a double the kernel rounds to float32). */
const isLoss = (v: unknown, loss: number) =>
  typeof v === 'number' && Math.fround(v) === loss;

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

/** Whether two segments are the same action: op, micro-batch, calls' span, loss call, inputs' names and shapes, outputs' arrays. */
function sameSegment(a: Segment, b: Segment): boolean {
  return (
    a.op === b.op &&
    a.mb === b.mb &&
    a.keep === b.keep &&
    a.from === b.from &&
    a.to === b.to &&
    a.lossCall === b.lossCall &&
    a.inputs.length === b.inputs.length &&
    a.inputs.every(
      (r, i) =>
        r.name === b.inputs[i]!.name &&
        r.values.constructor === b.inputs[i]!.values.constructor &&
        sameList(r.shape, b.inputs[i]!.shape),
    ) &&
    a.outputs.length === b.outputs.length &&
    a.outputs.every(
      (o, i) =>
        o.name === b.outputs[i]!.name &&
        o.values === b.outputs[i]!.values &&
        sameList(o.shape, b.outputs[i]!.shape),
    )
  );
}

/**
 * Whether two recordings are the same step: the same actions making the same calls on the same
 * arrays, each action's inputs' arrays in the same places.
 */
function sameCapture(a: Captured, b: Captured): boolean {
  if (
    a.calls.length !== b.calls.length ||
    a.segments.length !== b.segments.length ||
    a.seed !== b.seed ||
    a.m !== b.m ||
    a.threads !== b.threads ||
    !sameList(a.params, b.params) ||
    !sameList(a.copies, b.copies) ||
    a.grads.size !== b.grads.size ||
    !a.segments.every((s, i) => sameSegment(s, b.segments[i]!))
  )
    return false;
  for (const [k, g] of a.grads) {
    const h = b.grads.get(k);
    if (!h || h.values !== g.values || !sameList(h.shape, g.shape))
      return false;
  }
  const places = (c: Captured) => {
    const m = new Map<unknown, string>();
    c.segments.forEach((s, i) => {
      for (const r of s.inputs)
        if (!m.has(r.values)) m.set(r.values, `${i}:${r.name}`);
    });
    return m;
  };
  const pa = places(a);
  const pb = places(b);
  const place = (p: Map<unknown, string>, v: unknown) => p.get(v) ?? v;
  const samePlaced = (x: unknown, y: unknown): boolean =>
    Array.isArray(x)
      ? Array.isArray(y) &&
        x.length === y.length &&
        x.every((v, i) => samePlaced(v, y[i]))
      : sameArg(place(pa, x), place(pb, y));
  return a.calls.every((c, i) => {
    const d = b.calls[i]!;
    return (
      c.name === d.name &&
      c.args.length === d.args.length &&
      c.args.every((v, k) => samePlaced(v, d.args[k]))
    );
  });
}

/** Whether two arrays hold the same bits: float32 (as 32-bit words), or bf16 (16-bit). */
function sameBits(
  a: Float32Array | Uint16Array,
  b: Float32Array | Uint16Array,
): boolean {
  if (a.length !== b.length || a.constructor !== b.constructor) return false;
  if (a instanceof Uint16Array) return a.every((v, i) => v === b[i]);
  const x = new Uint32Array(a.buffer, a.byteOffset, a.length);
  const y = new Uint32Array(b.buffer, b.byteOffset, b.length);
  for (let i = 0; i < x.length; i++) if (x[i] !== y[i]) return false;
  return true;
}

/** `calls` with every array that is a key of `sub` (lists' items too) replaced by its value. */
function substituted(
  calls: readonly AddonCall[],
  sub: ReadonlyMap<unknown, unknown>,
): AddonCall[] {
  const map = (v: unknown): unknown =>
    Array.isArray(v) ? v.map(map) : sub.has(v) ? sub.get(v) : v;
  return calls.map((c) => ({ ...c, args: c.args.map(map) }));
}

/** Every typed array that `calls` take (lists' items too), each once. */
function arraysOfCalls(calls: readonly AddonCall[]): Set<TypedArray> {
  const out = new Set<TypedArray>();
  const add = (v: unknown) => {
    if (ArrayBuffer.isView(v) && !(v instanceof DataView))
      out.add(v as TypedArray);
    else if (Array.isArray(v)) v.forEach(add);
  };
  for (const call of calls) call.args.forEach(add);
  return out;
}

/** Every typed array a capture's calls take, its inputs' and outputs', and its gradients'. */
function arraysOf(c: Captured): Set<ArrayBufferView> {
  const out = new Set<ArrayBufferView>(arraysOfCalls(c.calls));
  for (const s of c.segments) {
    for (const r of s.inputs) out.add(r.values);
    for (const o of s.outputs) out.add(o.values);
  }
  for (const g of c.grads.values()) out.add(g.values);
  return out;
}
