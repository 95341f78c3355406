/**
 * The native CPU device: a TF.js backend named 'native' whose kernels run in layerwise's N-API
 * addon (native/, C++ on oneDNN, built by `npm ci` where Debian's `libdnnl-dev` and a compiler
 * are present). Its storage is the cpu backend's: it extends `MathBackendCPU`, so tensors are
 * plain typed arrays on the host, and every kernel the addon does not provide is the cpu
 * backend's own kernel, never an error. Native so far: `BatchMatMul` and `_FusedMatMul`
 * (oneDNN sgemm with transposed operands read in place, batch broadcasting, batched products
 * spread over the device's threads); broadcasting binary ops (Add, Sub, Multiply, RealDiv,
 * Maximum, Minimum, SquaredDifference); unary ops (Exp, Log, Sqrt, Rsqrt, Square, Neg,
 * Sigmoid, Tanh, Relu, Abs, Reciprocal); reductions (Sum, Mean, Max, Min over any axes);
 * Transpose; Softmax (last axis); UnsortedSegmentSum; GatherV2 (float32; other dtypes and
 * cases go to the cpu kernels); Pack along axis 0 (a copy); Cast to float32 (a real copy);
 * convolution and pooling forward and backward (backend/native-conv.ts, oneDNN primitives); `_FusedMatMul`'s bias and
 * activation in place in the product's buffer; and layerwise's fused kernels
 * (backend/kernel-names.ts): GELU, layer norm, causal softmax, causal multi-head attention
 * (q, k, v read in place from the qkv projection), softmax cross-entropy and their gradients, and the
 * one-pass AdamW and SGD updates of the device optimizer. With `precision` 'bf16' the products,
 * attention and convolutions read bfloat16 copies of their operands (native/src/bf16.cc; a
 * parameter's copy made once per version and kept behind its tensor). Outputs come from a
 * {@link BufferPool} (backend/buffer-pool.ts). Each worker thread (device) loads the addon
 * itself and has its own OpenMP team (`threads`).
 *
 * Where the addon is missing, {@link nativeAddon} returns null and {@link nativeUnavailable}
 * says why; `initBackend('native')` then fails with that reason.
 */

import { MathBackendCPU } from '@tensorflow/tfjs-backend-cpu';
import * as tf from '@tensorflow/tfjs-core';
import { coversOwnBuffer } from '../util/buffers.js';
import { broadcastIndex } from './broadcast.js';
import { BufferPool } from './buffer-pool.js';
import { FreeList } from './free-list.js';
import {
  ADAMW_KERNEL,
  ADAMW_MULTI_KERNEL,
  adamwMultiCount,
  CAUSAL_ATTENTION_GRAD_KERNEL,
  CAUSAL_ATTENTION_KERNEL,
  CAUSAL_SOFTMAX_GRAD_KERNEL,
  CAUSAL_SOFTMAX_KERNEL,
  GELU_GRAD_KERNEL,
  GELU_KERNEL,
  LAYER_NORM_GRAD_KERNEL,
  LAYER_NORM_KERNEL,
  SGD_KERNEL,
  SOFTMAX_CROSS_ENTROPY_GRAD_KERNEL,
  SOFTMAX_CROSS_ENTROPY_KERNEL,
  SUM_SQUARES_KERNEL,
} from './kernel-names.js';
import { keepFloat32Saved, ROUND_BF16_KERNEL } from './low-precision.js';
import { countPrivateBytes } from './memory.js';
import type { Precision } from './names.js';
import { nativeAddon } from './native-addon.js';
import { NATIVE_CONV_KERNELS } from './native-conv.js';
import {
  type NumberFormat,
  type PrecisionPolicy,
  policyOf,
} from './precision.js';
import { WireBuffers } from './wire-buffers.js';

export {
  type NativeAddon,
  nativeAddon,
  nativeUnavailable,
} from './native-addon.js';

/**
 * The TF.js backend of the native device: the cpu backend's storage and kernels, with native
 * ones registered over them. Native kernels take their outputs from a {@link BufferPool}
 * ({@link alloc}); the overrides below tell the pool which arrays tensors hold, free and
 * hand out to callers, so a buffer is reused only when nothing can see it.
 */
export class NativeBackend extends MathBackendCPU {
  /**
   * Output buffers of the native kernels, reused across steps: of any size (a step is then
   * handed the very arrays of the step before, which a captured step needs,
   * pipeline/native-capture.ts).
   */
  readonly pool = new BufferPool();
  /** The arrays that carry this device's activations and gradients to and from other stages, recycled ({@link WireBuffers}). */
  readonly wire = new WireBuffers();
  private internalRead = false;
  /**
   * The compute precision of the products (BatchMatMul, _FusedMatMul, causal attention,
   * convolutions, and their gradients): 'fp32', or 'bf16' (bfloat16 operands on oneDNN's bf16
   * matmul and convolution, float32 accumulation and float32 outputs; the tensors stay
   * float32). Set through initBackend's `precision` (backend/index.ts).
   */
  precision: Precision = 'fp32';

  /** The run's precision policy (backend/precision.ts), the one {@link precision} names. */
  get policy(): PrecisionPolicy {
    return policyOf(this.precision);
  }

  /**
   * Whether the products read operands in the addon's 2-byte format ({@link NATIVE_NARROW}):
   * the policy's compute format is it (bf16).
   */
  computesNarrow(): boolean {
    return this.policy.compute === NATIVE_NARROW;
  }

  /**
   * Whether the policy stores activations in the addon's 2-byte format ({@link NATIVE_NARROW}),
   * so kernels write their outputs' 2-byte values ({@link shadowBuffer}, {@link bf16Product}).
   */
  holdsNarrow(): boolean {
    return this.policy.storage.activations === NATIVE_NARROW;
  }
  /**
   * bf16 copies of parameters (the data of registered tf.Variables), by data id: converted the
   * first time a product reads that data, reused by every later product (each micro-batch's
   * forward and backward) until the data is freed or updated. AdamW updates a parameter's data in
   * place where nothing else holds it ({@link adamwMultiKernel}) and rewrites its copy in the
   * same pass (or drops it, {@link dropParameterCopy}); any other update gives the variable new
   * data (Variable.assign), hence a new id and a new conversion: one per parameter version. Other
   * kernels write only their own new outputs, so an entry is otherwise stale only once its id is
   * freed, when {@link disposeData} and {@link move} drop it.
   */
  private readonly bf16Params = new Map<tf.DataId, Uint16Array>();
  /** Parameter conversions to bf16 so far (each a new parameter version, or one freed and read again). */
  bf16ParamConversions = 0;
  /**
   * bf16 copies of activations the products read, by data id (a "shadow" of the float32
   * values): made by the first product that reads the data, reused by every later one (a
   * gradient reads dy twice: dx = dy W^T, then dW = x^T dy), taken over by a recorded
   * forward's saved operand (bf16Saved), dropped when the data is freed. Counted as device bytes
   * while attached; their buffers then go back to {@link bf16Free} for the next conversion.
   */
  private readonly shadows = new Map<tf.DataId, Uint16Array>();
  /** Free bf16 buffers by length (elements), reused so a conversion does not zero-fill a new one. */
  private readonly bf16Free = new FreeList<Uint16Array>(BF16_FREE_BYTES);
  /** bf16 buffers a captured step claimed ({@link claimArrays}): never put back on {@link bf16Free}, even when a tensor that held one at the claim goes. */
  private readonly claimedBf16 = new WeakSet<ArrayBufferLike>();

  constructor() {
    super();
    // no "install our node backend" banner on the first tensor (see backend/tfjs.ts)
    (this as unknown as { firstUse: boolean }).firstUse = false;
  }

  /** A float32 output of `length` elements whose every element the kernel writes (contents undefined). */
  alloc(length: number): Float32Array {
    return this.pool.take(length);
  }

  override write(
    values: tf.backend_util.BackendValues,
    shape: number[],
    dtype: tf.DataType,
  ): tf.DataId {
    const id = super.write(values, shape, dtype);
    this.pool.hold(values);
    this.wire.hold(values);
    return id;
  }

  override move(
    dataId: tf.DataId,
    values: tf.backend_util.BackendValues,
    shape: number[],
    dtype: tf.DataType,
    refCount: number,
  ): void {
    super.move(dataId, values, shape, dtype, refCount);
    this.pool.hold(values);
    this.wire.hold(values);
    this.dropBf16Param(dataId); // new values under this id
    this.dropShadow(dataId);
  }

  override disposeData(dataId: tf.DataId, force = false): boolean {
    const entry = this.data.has(dataId) ? this.data.get(dataId) : undefined;
    const done = super.disposeData(dataId, force);
    if (entry !== undefined && !this.data.has(dataId)) {
      const lazy = this.bf16Only.get(dataId);
      // a bf16-only tensor's float32 values (if made) are its own, never the pool's (and reading
      // `values` would widen them)
      if (lazy === undefined) {
        this.pool.release(entry.values);
        this.wire.release(entry.values);
      }
      this.dropBf16Param(dataId);
      this.dropShadow(dataId);
    }
    return done;
  }

  /**
   * A product operand for the bf16 path: a parameter's cached bf16 copy (converted now if it
   * has none), else an activation's bf16 shadow (converted now if it has none).
   * Throws DeviceOutOfMemoryError where a new copy would take the device over its budget.
   */
  bf16Operand(t: tf.TensorInfo): Float32Array | Uint16Array {
    let bf = this.bf16Params.get(t.dataId); // a parameter's copy, or a bf16-only tensor's values
    if (bf !== undefined) return bf;
    const f32 = this.data.get(t.dataId).values as Float32Array;
    if (!isParameterData(t.dataId)) return this.shadowOf(t.dataId, f32);
    bf = this.parameterCopyBuffer(f32.length);
    nativeAddon()!.toBf16(f32, bf);
    this.bf16Params.set(t.dataId, bf);
    this.bf16ParamConversions++;
    return bf;
  }

  /**
   * A buffer for a parameter version's bf16 copy of `length` elements (a free one, else new;
   * contents undefined), counted now as device bytes: for {@link bf16Operand}, or for the
   * optimizer's update to fill and give to {@link keepParameterCopy}. Throws
   * DeviceOutOfMemoryError where it would take the device over its budget.
   */
  parameterCopyBuffer(length: number): Uint16Array {
    countPrivateBytes(2 * length); // device bytes, under the budget
    return this.takeBf16(length);
  }

  /**
   * Keeps `bf` (a {@link parameterCopyBuffer} holding the bf16 rounding of `t`'s values, taken
   * over) as the bf16 copy of t's data, which products then read instead of converting it: AdamW
   * writes each new matrix's copy in its update pass (adamwMultiKernel).
   */
  keepParameterCopy(t: tf.TensorInfo, bf: Uint16Array): void {
    this.bf16Params.set(t.dataId, bf);
  }

  /** The bf16 copy t's data has (a parameter's, {@link bf16Operand}), or null: for AdamW's update in place to rewrite. */
  parameterCopyOf(t: tf.TensorInfo): Uint16Array | null {
    return this.bf16Params.get(t.dataId) ?? null;
  }

  /** Drops the bf16 copy of t's data, if any: its values were updated in place without it. */
  dropParameterCopy(t: tf.TensorInfo): void {
    this.dropBf16Param(t.dataId);
  }

  private dropBf16Param(dataId: tf.DataId): void {
    const bf = this.bf16Params.get(dataId);
    if (bf === undefined) return;
    this.bf16Params.delete(dataId);
    const lazy = this.bf16Only.get(dataId);
    if (lazy === undefined) {
      // a parameter version's copy: only its products read it, each for its call
      countPrivateBytes(-bf.byteLength);
      this.giveBf16(bf);
      return;
    }
    // a bf16-only tensor: the engine uncounts its 4 bytes per element; 2 of them were never held
    this.bf16Only.delete(dataId);
    countPrivateBytes(bf.byteLength - (lazy.widened ? 4 * bf.length : 0));
    this.giveBf16(bf); // taken over by fromBf16: nothing else reads it
    if (lazy.f32 !== null) {
      // its widened values: a pool buffer unless a reader kept them (readSync disowns them)
      this.pool.hold(lazy.f32);
      this.pool.release(lazy.f32);
    }
  }

  /** dst[i] = src[i] rounded to bf16 (the addon's vectorised loop; see backend/low-precision.ts). */
  roundToBf16(src: Float32Array, dst: Uint16Array): void {
    nativeAddon()!.toBf16(src, dst);
  }

  /** dst[i] = the bf16 src[i] widened to float32 (exact; the addon's loop). */
  widenFromBf16(src: Uint16Array, dst: Float32Array): void {
    widenBf16(src, dst);
  }

  /**
   * A bf16-only copy ({@link activationFromBf16}) of `t`, an activation saved for a backward
   * (backend/low-precision.ts keepSavedAtComputePrecision): its bf16 values, its shadow taken
   * over where a product made one, else converted now. Null for a parameter (its bf16 copy is
   * cached per version) or a tensor already held as bf16 (statistics marked by
   * low-precision.ts keepFloat32Saved never come here).
   */
  bf16Saved(t: tf.Tensor): tf.Tensor | null {
    if (this.bf16Params.has(t.dataId) || isParameterData(t.dataId)) return null;
    let bf = this.shadows.get(t.dataId);
    if (bf !== undefined) {
      // taken over: counted from now on as the new tensor's bytes
      this.shadows.delete(t.dataId);
      countPrivateBytes(-bf.byteLength);
    } else {
      const f32 = this.data.get(t.dataId).values as Float32Array;
      bf = this.takeBf16(f32.length);
      nativeAddon()!.toBf16(f32, bf);
    }
    return this.activationFromBf16(bf, t.shape);
  }

  /** Parameters uploaded as bf16 values ({@link fromBf16}), by data id. */
  private readonly uploaded = new WeakSet<tf.DataId>();

  /**
   * bf16 mode: whether a product of `a` and `b` is held as its bf16 values, as autocast gives a
   * Linear layer's output: where an operand is a parameter (x W, and the input gradient
   * dy W^T); other products (a parameter's gradient x^T dy, accumulated in float32) stay
   * float32.
   */
  bf16Product(a: tf.TensorInfo, b: tf.TensorInfo): boolean {
    return this.holdsNarrow() && (this.isParameter(a) || this.isParameter(b));
  }

  private isParameter(t: tf.TensorInfo): boolean {
    return this.uploaded.has(t.dataId) || isParameterData(t.dataId);
  }

  /** bf16-only tensors ({@link fromBf16}) by data id: whether their float32 values were made since. */
  private readonly bf16Only = new Map<tf.DataId, Bf16OnlyState>();

  /**
   * A float32 tensor of `shape` held as its bf16 values `bf` (taken over, not copied): the
   * products, attention and convolutions read `bf` as their bf16 operand directly, and the
   * device holds 2 bytes per element (counted so by backend/memory.ts) until some other kernel
   * reads the float32 values, which are then widened from `bf` once (exact; 4 more bytes per
   * element from then on). Used by the L2L relay to upload a layer's weights in the compute
   * precision (issue 23 item 4). The values are those of `bf` widened, so a tensor read only by
   * products gives the same numbers as a float32 parameter in a bf16 run.
   */
  fromBf16(bf: Uint16Array, shape: number[]): tf.Tensor {
    const id = this.writeBf16(bf, shape);
    this.uploaded.add(id);
    return tf.engine().makeTensorFromDataId(id, shape, 'float32', this);
  }

  /** An activation held as its bf16 values `bf` (taken over), as {@link fromBf16} holds a parameter's (an L2L stash coming back to the device). */
  activationFromBf16(bf: Uint16Array, shape: number[]): tf.Tensor {
    const id = this.writeBf16(bf, shape);
    return tf.engine().makeTensorFromDataId(id, shape, 'float32', this);
  }

  /**
   * bf16 mode: a kernel's float32 output of `shape` held as its bf16 values `bf` only (a
   * {@link shadowBuffer} the kernel filled, taken over), as {@link fromBf16} holds them: the
   * outputs autocast holds in bf16 (a product with a parameter, layer norm's y, GELU and its
   * gradient, attention and its gradient, the boundary rounding); products read those bf16
   * values as they are, the element-wise kernels without widening them whole.
   */
  bf16Output(bf: Uint16Array, shape: number[]): tf.TensorInfo {
    countPrivateBytes(-bf.byteLength); // counted by shadowBuffer; from now on the tensor's bytes
    return { dataId: this.writeBf16(bf, shape), shape, dtype: 'float32' };
  }

  /**
   * Runs `f` with t's float32 values: a bf16-only tensor's widened into a scratch for the call
   * (counted as device bytes while it runs, then back to the pool: never kept), else its own.
   * For a kernel without a bf16 input of its own (a unary op after a product, as relu).
   */
  withFloat32<R>(t: tf.TensorInfo, f: (values: Float32Array) => R): R {
    const bf = this.bf16OnlyValues(t);
    if (bf === undefined)
      return f(this.data.get(t.dataId).values as Float32Array);
    const scratch = this.pool.take(bf.length);
    countPrivateBytes(scratch.byteLength);
    try {
      widenBf16(bf, scratch);
      return f(scratch);
    } finally {
      countPrivateBytes(-scratch.byteLength);
      this.pool.hold(scratch);
      this.pool.release(scratch);
    }
  }

  /** t's values as a kernel that reads float32 or bf16 takes them: a bf16-only tensor's bf16 values (not widened), else its float32 values. */
  f32OrBf16(t: tf.TensorInfo): Float32Array | Uint16Array {
    return (
      this.bf16OnlyValues(t) ?? (this.data.get(t.dataId).values as Float32Array)
    );
  }

  /** Whether any of `ts` is bf16-only data whose float32 values have not been made. */
  anyBf16Only(...ts: tf.TensorInfo[]): boolean {
    return ts.some((t) => this.bf16OnlyValues(t) !== undefined);
  }

  /** t's bf16 values if t is bf16-only data whose float32 values have not been made (read only), else undefined. */
  bf16OnlyValues(t: tf.TensorInfo): Uint16Array | undefined {
    const lazy = this.bf16Only.get(t.dataId);
    return lazy !== undefined && !lazy.widened
      ? this.bf16Params.get(t.dataId)
      : undefined;
  }

  /** A bf16-only tensor's data ({@link fromBf16}, {@link bf16Output}): `bf` taken over, float32 values widened on their first read. */
  private writeBf16(bf: Uint16Array, shape: number[]): tf.DataId {
    const n = tf.util.sizeFromShape(shape);
    if (bf.length !== n)
      throw new RangeError(
        `fromBf16: ${bf.length} bf16 values for shape [${shape}] (${n} elements)`,
      );
    countPrivateBytes(-2 * n); // the engine counts 4 bytes per element when it tracks the tensor
    const id = super.write(new Float32Array(0), shape, 'float32');
    const entry = this.data.get(id) as { values: unknown };
    const state: Bf16OnlyState = { widened: false, f32: null };
    Object.defineProperty(entry, 'values', {
      configurable: true,
      enumerable: true,
      get: () => {
        if (state.f32 === null) {
          countPrivateBytes(4 * n);
          state.f32 = this.pool.take(n); // back to the pool when the tensor goes (dropBf16Param)
          widenBf16(bf, state.f32);
          state.widened = true;
        }
        return state.f32;
      },
      set: (v: Float32Array) => {
        state.f32 = v;
      },
    });
    this.bf16Params.set(id, bf);
    this.bf16Only.set(id, state);
    return id;
  }

  /** An activation's bf16 shadow, converted into a free buffer now if it has none. */
  private shadowOf(id: tf.DataId, f32: Float32Array): Uint16Array {
    let bf = this.shadows.get(id);
    if (bf !== undefined) return bf;
    countPrivateBytes(2 * f32.length); // device bytes, under the budget
    bf = this.takeBf16(f32.length);
    nativeAddon()!.toBf16(f32, bf);
    this.shadows.set(id, bf);
    return bf;
  }

  /**
   * bf16 mode: a buffer for a kernel to write its output's bf16 values into (counted now, under
   * the budget), to become the output with {@link bf16Output}. Undefined at fp32.
   */
  shadowBuffer(length: number): Uint16Array | undefined {
    if (!this.holdsNarrow() || length === 0) return undefined;
    countPrivateBytes(2 * length);
    return this.takeBf16(length);
  }

  private dropShadow(id: tf.DataId): void {
    const bf = this.shadows.get(id);
    if (bf === undefined) return;
    this.shadows.delete(id);
    countPrivateBytes(-bf.byteLength);
    this.giveBf16(bf);
  }

  /** A bf16 buffer of `length` elements, contents undefined: a free one, else a new one. */
  private takeBf16(length: number): Uint16Array {
    return (
      this.bf16Free.take(length) ??
      this.bf16Free.madeNow(new Uint16Array(length))
    );
  }

  /** Returns a bf16 buffer nothing reads any more (a whole, unshared one, of any size, so that a step is handed the arrays of the step before; up to BF16_FREE_BYTES kept). */
  private giveBf16(bf: Uint16Array): void {
    if (coversOwnBuffer(bf) && !this.claimedBf16.has(bf.buffer))
      this.bf16Free.give(bf);
  }

  /**
   * Takes `arrays` (typed arrays, by their memory) out of this backend's pools for good: a
   * captured step's (pipeline/native-capture.ts), which its replays write, so no kernel is handed
   * them again; one a tensor still holds (the step's outputs, sent after it) does not come back
   * when the tensor goes (float32: the pool no longer owns it; bf16: {@link claimedBf16}).
   */
  claimArrays(arrays: Iterable<ArrayBufferView>): void {
    const buffers = new Set<ArrayBufferLike>();
    for (const a of arrays) {
      buffers.add(a.buffer);
      this.wire.disown(a);
      if (a instanceof Uint16Array) this.claimedBf16.add(a.buffer);
    }
    this.pool.claim(buffers);
    this.bf16Free.claim(buffers);
  }

  /**
   * An array a captured step's recording reads as an action's input (pipeline/native-capture.ts):
   * a received message's array is then never recycled to carry a send ({@link WireBuffers}),
   * which would transfer it away before the capture claims it.
   */
  keepRecordedInput(array: ArrayBufferView): void {
    this.wire.disown(array);
  }

  /** Bytes held in bf16 parameter copies (behind the tensors: counted by backend/memory.ts, not by tf.memory()). */
  bf16ParamBytes(): number {
    let n = 0;
    for (const a of this.bf16Params.values()) n += a.byteLength;
    return n;
  }

  /**
   * A tensor's values for a reader outside the kernels: its own array (disowned by the pool), or a
   * copy of a variable's (a parameter or an optimizer moment), which AdamW may update in place
   * after the read ({@link adamwMultiKernel}).
   */
  override readSync(dataId: tf.DataId): tf.backend_util.BackendValues {
    const values = super.readSync(dataId);
    if (this.internalRead) return values;
    if (isParameterData(dataId) && ArrayBuffer.isView(values))
      return (values as Float32Array).slice();
    this.pool.disown(values);
    this.wire.disown(values);
    return values;
  }

  /**
   * A copy of a tensor's values (float32 or int32), read without disowning its array: the array
   * goes back to the pool when the tensor is disposed, so a stage that sends an activation each
   * micro-batch (runtime/serialize.ts toWire) gets the same arrays every step rather than new
   * ones (which a captured step, pipeline/native-capture.ts, needs, and which would otherwise be
   * fresh pages each micro-batch). A float32 copy is one of {@link wire}'s arrays (a received
   * message's, free again), for the caller to transfer away; an int32 copy a new array.
   */
  copyValues(dataId: tf.DataId): Float32Array | Int32Array {
    this.internalRead = true;
    try {
      const values = this.readSync(dataId) as Float32Array | Int32Array;
      if (!(values instanceof Float32Array)) return values.slice();
      const copy = this.wire.takeF32(values.length);
      copy.set(values);
      return copy;
    } finally {
      this.internalRead = false;
    }
  }

  /** Kernels read their inputs through this for the duration of the kernel only: no need to disown. */
  override bufferSync<R extends tf.Rank, D extends tf.DataType>(
    t: tf.TensorInfo,
  ): tf.TensorBuffer<R, D> {
    this.internalRead = true;
    try {
      return super.bufferSync<R, D>(t);
    } finally {
      this.internalRead = false;
    }
  }

  override dispose(): void {
    this.pool.clear();
    this.wire.clear();
    for (const id of [...this.bf16Params.keys()]) this.dropBf16Param(id);
    for (const id of [...this.shadows.keys()]) this.dropShadow(id);
    this.bf16Free.clear();
    super.dispose();
  }
}

/** A bf16-only tensor's float32 values: whether made (widened from its bf16 values on a float32 read), and where. */
interface Bf16OnlyState {
  widened: boolean;
  f32: Float32Array | null;
}

/**
 * The one 2-byte format the addon's kernels read and write (native/src/bf16.cc): a policy
 * whose compute or activations' storage is this format runs them; any other stays float32.
 */
export const NATIVE_NARROW: NumberFormat = 'bfloat16';

/** The most bytes of free bf16 buffers a backend keeps for reuse (not device bytes: nothing holds them). */
const BF16_FREE_BYTES = 256 * 2 ** 20;

/** dst[i] = bf16 src[i] widened to float32 (exact): the addon's loop where built, else in JS. */
export function widenBf16(src: Uint16Array, dst: Float32Array): void {
  const lib = nativeAddon();
  if (lib) {
    lib.fromBf16(src, dst);
    return;
  }
  const u = new Uint32Array(dst.buffer, dst.byteOffset, dst.length);
  for (let i = 0; i < src.length; i++) u[i] = src[i]! << 16;
}

/** Whether `dataId` is the data of a registered tf.Variable (a parameter) in this thread's engine. */
function isParameterData(dataId: tf.DataId): boolean {
  // Object.values, not for...in: 4x faster over a stage's ~160 variables (parameters and
  // optimizer slots), asked for each product operand and each saved activation
  for (const v of Object.values(tf.engine().state.registeredVariables))
    if (v.dataId === dataId) return true;
  return false;
}

type Attrs = Record<string, unknown>;
type KernelArgs = Parameters<tf.KernelFunc>[0];

/** The sizes of a matMul: op(a) [...batchA, m, k] @ op(b) [...batchB, k, n] -> [...outBatch, m, n]. */
interface MatMulDims {
  m: number;
  n: number;
  k: number;
  tA: boolean;
  tB: boolean;
  batchShapeA: number[];
  batchShapeB: number[];
  /** The broadcast batch shape of the output. */
  outBatch: number[];
  /** Products in the output (the size of outBatch), and in a's and b's batches. */
  batch: number;
  batchA: number;
  batchB: number;
}

/**
 * The sizes of op(a) @ op(b) (op: transpose of the last two axes when `tA`/`tB`). Throws (as
 * the stock kernel) when the inner sizes differ or the batch shapes do not broadcast.
 */
function matMulDims(
  a: tf.TensorInfo,
  b: tf.TensorInfo,
  tA: boolean,
  tB: boolean,
): MatMulDims {
  const [a0, a1] = a.shape.slice(-2) as [number, number];
  const [b0, b1] = b.shape.slice(-2) as [number, number];
  const [m, k] = tA ? [a1, a0] : [a0, a1];
  const [kb, n] = tB ? [b1, b0] : [b0, b1];
  tf.util.assert(
    k === kb,
    () =>
      `Error in matMul: inner shapes (${k}) and (${kb}) of Tensors with shapes ${a.shape} and ` +
      `${b.shape} and transposeA=${tA} and transposeB=${tB} must match.`,
  );
  const batchShapeA = a.shape.slice(0, -2);
  const batchShapeB = b.shape.slice(0, -2);
  const outBatch = tf.broadcast_util.assertAndGetBroadcastShape(
    batchShapeA,
    batchShapeB,
  );
  return {
    m,
    n,
    k,
    tA,
    tB,
    batchShapeA,
    batchShapeB,
    outBatch,
    batch: tf.util.sizeFromShape(outBatch),
    batchA: tf.util.sizeFromShape(batchShapeA),
    batchB: tf.util.sizeFromShape(batchShapeB),
  };
}

/** Whether a and b each hold one product per output product or one shared by all (strided batches, no broadcast index). */
function denseBatches({ batch, batchA, batchB }: MatMulDims): boolean {
  return (
    (batchA === batch || batchA === 1) && (batchB === batch || batchB === 1)
  );
}

/**
 * A bf16 run's product with a parameter operand: written as its bf16 values (oneDNN's bf16
 * destination), the bias (float32 [n], if any) added before the rounding. Returns the
 * bf16-held tensor [...outBatch, m, n].
 */
function matMulToBf16(
  backend: NativeBackend,
  a: tf.TensorInfo,
  b: tf.TensorInfo,
  d: MatMulDims,
  bias: tf.TensorInfo | undefined,
): tf.TensorInfo {
  const { m, n, k } = d;
  const bf = backend.shadowBuffer(d.batch * m * n)!;
  nativeAddon()!.matmulBf16To(
    backend.bf16Operand(a),
    backend.bf16Operand(b),
    bf,
    bias === undefined ? undefined : values(backend, bias),
    d.batch,
    d.batchA === 1 ? 0 : m * k,
    d.batchB === 1 ? 0 : k * n,
    m,
    n,
    k,
    d.tA,
    d.tB,
  );
  return backend.bf16Output(bf, [...d.outBatch, m, n]);
}

/**
 * out (float32 [batch * m * n]) = op(a) @ op(b) on bf16 operands (a parameter's cached copy,
 * or converted per product) with float32 sums; the batches must be dense ({@link denseBatches}).
 */
function matMulBf16Operands(
  backend: NativeBackend,
  a: tf.TensorInfo,
  b: tf.TensorInfo,
  d: MatMulDims,
  out: Float32Array,
): void {
  const lib = nativeAddon()!;
  const { m, n, k, batch, batchA, batchB, tA, tB } = d;
  const [ab, bb] = [backend.bf16Operand(a), backend.bf16Operand(b)];
  if (batchB === 1 && !tA)
    lib.matmulBf16(ab, bb, out, 1, 0, 0, batch * m, n, k, false, tB);
  else
    lib.matmulBf16(
      ab,
      bb,
      out,
      batch,
      batchA === 1 ? 0 : m * k,
      batchB === 1 ? 0 : k * n,
      m,
      n,
      k,
      tA,
      tB,
    );
}

/**
 * out (float32 [batch * m * n]) = op(a) @ op(b) in float32: one product when b is shared and a
 * not transposed, strided batches when dense, else one product per output batch index
 * (broadcast).
 */
function matMulFloat32(
  backend: NativeBackend,
  a: tf.TensorInfo,
  b: tf.TensorInfo,
  d: MatMulDims,
  out: Float32Array,
): void {
  const lib = nativeAddon()!;
  const { m, n, k, batch, batchA, batchB, tA, tB } = d;
  // read here, not before: a bf16-only tensor (NativeBackend.fromBf16) widens on its first float32 read
  const av = backend.data.get(a.dataId).values as Float32Array;
  const bv = backend.data.get(b.dataId).values as Float32Array;
  if (batchB === 1 && !tA) {
    // a's batch folds into the rows of one product with the shared b
    lib.matmul(av, bv, out, 1, 0, 0, batch * m, n, k, false, tB);
  } else if (denseBatches(d)) {
    lib.matmul(
      av,
      bv,
      out,
      batch,
      batchA === 1 ? 0 : m * k,
      batchB === 1 ? 0 : k * n,
      m,
      n,
      k,
      tA,
      tB,
    );
  } else {
    const ia = broadcastIndex(d.outBatch, d.batchShapeA);
    const ib = broadcastIndex(d.outBatch, d.batchShapeB);
    for (let i = 0; i < batch; i++) {
      lib.matmul(
        av.subarray(ia[i]! * m * k, (ia[i]! + 1) * m * k),
        bv.subarray(ib[i]! * k * n, (ib[i]! + 1) * k * n),
        out.subarray(i * m * n, (i + 1) * m * n),
        1,
        0,
        0,
        m,
        n,
        k,
        tA,
        tB,
      );
    }
  }
}

/** Adds bias (float32 [n]) to every row of out ([...outBatch, m, n]) in place: out is the kernel's own new buffer. */
function addBiasRows(
  backend: NativeBackend,
  out: Float32Array,
  d: MatMulDims,
  bias: tf.TensorInfo,
): void {
  const shape = [...d.outBatch, d.m, d.n];
  nativeAddon()!.binary(
    BINARY.Add!,
    out,
    shape,
    values(backend, bias),
    [d.n],
    out,
    shape,
  );
}

/**
 * op(a) @ op(b) (+ bias, float32 [N], on every row) for float32 a [...batchA, M, K] and b
 * [...batchB, K, N] (op: transpose of the last two axes when asked), batch axes broadcast: a
 * new float32 tensor [...batch, M, N]; in a bf16 run a product with a parameter operand is held
 * as its bf16 values (NativeBackend.bf16Product, the bias added before the rounding). Throws (as
 * the stock kernel) when the inner sizes differ or the batches do not broadcast.
 */
function nativeMatMul(
  backend: NativeBackend,
  a: tf.TensorInfo,
  b: tf.TensorInfo,
  tA: boolean,
  tB: boolean,
  bias?: tf.TensorInfo,
): tf.TensorInfo {
  const d = matMulDims(a, b, tA, tB);
  const { m, n, k, batch } = d;
  if (k > 0 && m * n > 0 && denseBatches(d) && backend.bf16Product(a, b))
    return matMulToBf16(backend, a, b, d, bias);
  // no products to sum (k = 0): zeros
  const out =
    k === 0
      ? backend.pool.takeZeroed(batch * m * n)
      : backend.alloc(batch * m * n);
  if (out.length > 0 && k > 0 && backend.computesNarrow() && denseBatches(d))
    matMulBf16Operands(backend, a, b, d, out);
  else if (out.length > 0) matMulFloat32(backend, a, b, d, out);
  if (bias !== undefined && out.length > 0) addBiasRows(backend, out, d, bias);
  return backend.makeTensorInfo([...d.outBatch, m, n], 'float32', out);
}

/** Runs the cpu backend's kernel `name` on the native backend (same storage). */
function cpuKernel(name: string, args: KernelArgs): tf.TensorInfo {
  const k = tf.getKernel(name, 'cpu');
  if (!k) throw new Error(`the cpu backend has no ${name} kernel`);
  return k.kernelFunc(args) as tf.TensorInfo;
}

const ACTIVATION_KERNEL: Record<string, string> = {
  relu: 'Relu',
  relu6: 'Relu6',
  elu: 'Elu',
  sigmoid: 'Sigmoid',
  leakyrelu: 'LeakyRelu',
  prelu: 'Prelu',
};

function batchMatMulKernel(args: KernelArgs): tf.TensorInfo {
  const { a, b } = args.inputs as { a: tf.TensorInfo; b: tf.TensorInfo };
  if (a.dtype !== 'float32' || b.dtype !== 'float32')
    return cpuKernel('BatchMatMul', args);
  const attrs = args.attrs as Attrs;
  const backend = args.backend as NativeBackend;
  return nativeMatMul(
    backend,
    a,
    b,
    attrs.transposeA === true,
    attrs.transposeB === true,
  );
}

/** `_FusedMatMul`: the native product, then the cpu backend's bias add and activation. */
function fusedMatMulKernel(args: KernelArgs): tf.TensorInfo {
  const {
    a,
    b,
    bias,
    preluActivationWeights: prelu,
  } = args.inputs as Record<string, tf.TensorInfo | undefined>;
  if (a!.dtype !== 'float32' || b!.dtype !== 'float32')
    return cpuKernel('_FusedMatMul', args);
  const backend = args.backend as NativeBackend;
  const attrs = args.attrs as Attrs;
  const [tA, tB] = [attrs.transposeA === true, attrs.transposeB === true];
  const activation = String(attrs.activation ?? 'linear');
  const n = b!.shape[b!.shape.length - (tB ? 2 : 1)]!;
  if (
    activation === 'linear' &&
    backend.bf16Product(a!, b!) &&
    (bias === undefined ||
      (bias.dtype === 'float32' &&
        tf.util.sizeFromShape(bias.shape) === n &&
        bias.shape[bias.shape.length - 1] === n))
  )
    // bf16 run, a dense layer: its bias added in the product, the output held as bf16 values
    return nativeMatMul(backend, a!, b!, tA, tB, bias);
  let out = nativeMatMul(backend, a!, b!, tA, tB);
  // a bf16-only product's values are not changed in place (a float32 read would be a copy)
  const inPlace = !backend.anyBf16Only(out);
  if (bias !== undefined) {
    if (
      inPlace &&
      bias.dtype === 'float32' &&
      tf.util.arraysEqual(
        tf.backend_util.assertAndGetBroadcastShape(out.shape, bias.shape),
        out.shape,
      )
    ) {
      // in place: the product's output is this kernel's own new buffer
      const o = values(backend, out);
      nativeAddon()!.binary(
        BINARY.Add!,
        o,
        out.shape,
        values(backend, bias),
        bias.shape,
        o,
        out.shape,
      );
    } else {
      const sum = cpuKernel('Add', {
        inputs: { a: out, b: bias },
        backend,
        attrs: {},
      });
      backend.disposeIntermediateTensorInfo(out);
      out = sum;
    }
  }
  if (activation !== 'linear') {
    const kernel = ACTIVATION_KERNEL[activation];
    if (kernel === undefined)
      throw new Error(
        `_FusedMatMul: activation ${activation} is not supported`,
      );
    if (inPlace && UNARY[kernel] !== undefined) {
      const o = values(backend, out);
      nativeAddon()!.unary(UNARY[kernel]!, o, o); // in place, as the bias
      return out;
    }
    const inputs: Record<string, tf.TensorInfo> =
      kernel === 'Prelu' ? { x: out, alpha: prelu! } : { x: out };
    const act = cpuKernel(kernel, {
      inputs,
      backend,
      attrs: { alpha: attrs.leakyreluAlpha as number },
    });
    backend.disposeIntermediateTensorInfo(out);
    out = act;
  }
  return out;
}

/** Binary kernels and their op codes in native/src/kernels.h. */
const BINARY: Record<string, number> = {
  Add: 0,
  Sub: 1,
  Multiply: 2,
  RealDiv: 3,
  Maximum: 4,
  Minimum: 5,
  SquaredDifference: 6,
};
/** Unary kernels and their op codes. */
const UNARY: Record<string, number> = {
  Exp: 0,
  Log: 1,
  Sqrt: 2,
  Rsqrt: 3,
  Square: 4,
  Neg: 5,
  Sigmoid: 6,
  Tanh: 7,
  Relu: 8,
  Abs: 9,
  Reciprocal: 10,
  Step: 11,
};
/** Reduction kernels and their op codes. */
const REDUCE: Record<string, number> = { Sum: 0, Mean: 1, Max: 2, Min: 3 };

const values = (backend: NativeBackend, t: tf.TensorInfo) =>
  backend.data.get(t.dataId).values as Float32Array;
const isF32 = (...ts: tf.TensorInfo[]) =>
  ts.every((t) => t.dtype === 'float32');

function binaryKernel(name: string): tf.KernelFunc {
  const op = BINARY[name]!;
  return ((args: KernelArgs) => {
    const { a, b } = args.inputs as { a: tf.TensorInfo; b: tf.TensorInfo };
    if (!isF32(a, b)) return cpuKernel(name, args);
    const backend = args.backend as NativeBackend;
    const shape = tf.backend_util.assertAndGetBroadcastShape(a.shape, b.shape);
    const out = backend.alloc(tf.util.sizeFromShape(shape));
    if (tf.util.arraysEqual(a.shape, b.shape) && backend.anyBf16Only(a, b)) {
      // a bf16-only operand (a layer boundary's activation or gradient): read as it is held
      nativeAddon()!.binarySameShape(
        op,
        backend.f32OrBf16(a),
        backend.f32OrBf16(b),
        out,
      );
      return backend.makeTensorInfo(shape, 'float32', out);
    }
    nativeAddon()!.binary(
      op,
      values(backend, a),
      a.shape,
      values(backend, b),
      b.shape,
      out,
      shape,
    );
    return backend.makeTensorInfo(shape, 'float32', out);
  }) as tf.KernelFunc;
}

/**
 * bf16 rounding of a float32 tensor, widened back (backend/low-precision.ts ROUND_BF16_KERNEL):
 * one pass. In bf16 mode the output is held as its bf16 values; where x already is held so (all
 * 10 block-boundary roundings of a charlm-small bf16 step), the rounding changes nothing and
 * the output is x's own data (as the cpu backend's Reshape shares its input's): no copy, no new
 * bytes. Copying them (2 MiB each, [32, 128, 256]) on the JS thread took about 0.4 ms a call at
 * 1 thread and 0.3 at 2, 1.1-1.7% of the step.
 */
function roundBf16Kernel(args: KernelArgs): tf.TensorInfo {
  const { x } = args.inputs as { x: tf.TensorInfo };
  const backend = args.backend as NativeBackend;
  if (backend.holdsNarrow() && backend.bf16OnlyValues(x) !== undefined) {
    backend.incRef(x.dataId);
    return { dataId: x.dataId, shape: x.shape, dtype: 'float32' };
  }
  const n = tf.util.sizeFromShape(x.shape);
  const bf = backend.shadowBuffer(n);
  if (bf !== undefined) {
    // bf16: its values are bf16 values, held as such (2 bytes per element, nothing lost)
    nativeAddon()!.toBf16(values(backend, x), bf);
    return backend.bf16Output(bf, x.shape);
  }
  const out = backend.alloc(n);
  nativeAddon()!.unary(12, values(backend, x), out); // UnaryOp::RoundBf16
  return backend.makeTensorInfo(x.shape, 'float32', out);
}

function unaryKernel(name: string): tf.KernelFunc {
  const op = UNARY[name]!;
  return ((args: KernelArgs) => {
    const { x } = args.inputs as { x: tf.TensorInfo };
    if (!isF32(x)) return cpuKernel(name, args);
    const backend = args.backend as NativeBackend;
    const out = backend.alloc(tf.util.sizeFromShape(x.shape));
    const alpha =
      name === 'Step' ? Number((args.attrs as Attrs).alpha ?? 0) : 0; // Relu's gradient: dy * step(x)
    // a bf16-only input (a product's output) is widened for the call, not kept widened
    backend.withFloat32(x, (xv) => nativeAddon()!.unary(op, xv, out, alpha));
    return backend.makeTensorInfo(x.shape, 'float32', out);
  }) as tf.KernelFunc;
}

/** x with its axes permuted, as new values (float32). */
function transposed(
  backend: NativeBackend,
  x: tf.TensorInfo,
  perm: number[],
): Float32Array {
  const out = backend.alloc(tf.util.sizeFromShape(x.shape));
  if (out.length > 0)
    nativeAddon()!.transpose(values(backend, x), x.shape, perm, out);
  return out;
}

function reduceKernel(name: string): tf.KernelFunc {
  const op = REDUCE[name]!;
  return ((args: KernelArgs) => {
    const { x } = args.inputs as { x: tf.TensorInfo };
    const attrs = args.attrs as Attrs;
    if (!isF32(x) || x.shape.length === 0) return cpuKernel(name, args);
    const backend = args.backend as NativeBackend;
    const axes = tf.util
      .parseAxisParam(
        (attrs.axis ?? attrs.reductionIndices) as number | number[],
        x.shape,
      )
      .sort((p, q) => p - q);
    const reduced = axes.reduce((p, a) => p * x.shape[a]!, 1);
    const [outShape] = tf.backend_util.computeOutAndReduceShapes(x.shape, axes);
    const kept = tf.util.sizeFromShape(outShape);
    if (reduced === 0 && op >= 2) return cpuKernel(name, args); // max/min of nothing: the cpu backend's semantics
    const out = backend.alloc(kept);
    if (kept === 1) {
      // every element into one (a loss's mean, a gradient's sum of squares): one vectorised
      // pass over the buffer as it lies; column-wise it would be one dependent add per element
      nativeAddon()!.reduce(op, values(backend, x), out, 1, reduced);
    } else if (axes.every((a, i) => a === i)) {
      // the leading axes (a bias gradient's batch and time): column-wise, no transpose
      nativeAddon()!.reduceOuter(op, backend.f32OrBf16(x), out, reduced, kept);
    } else {
      // the reduced axes innermost: as they are, or after a transpose
      const perm = tf.backend_util.getAxesPermutation(axes, x.shape.length);
      const input =
        perm === null ? values(backend, x) : transposed(backend, x, perm);
      nativeAddon()!.reduce(op, input, out, kept, reduced);
    }
    const shape =
      attrs.keepDims === true
        ? tf.backend_util.expandShapeToKeepDim(outShape, axes)
        : outShape;
    return backend.makeTensorInfo(shape, 'float32', out);
  }) as tf.KernelFunc;
}

function transposeKernel(args: KernelArgs): tf.TensorInfo {
  const { x } = args.inputs as { x: tf.TensorInfo };
  const perm = (args.attrs as Attrs).perm as number[];
  if (!isF32(x) || x.shape.length === 0) return cpuKernel('Transpose', args);
  const backend = args.backend as NativeBackend;
  return backend.makeTensorInfo(
    perm.map((p) => x.shape[p]!),
    'float32',
    transposed(backend, x, perm),
  );
}

function softmaxKernel(args: KernelArgs): tf.TensorInfo {
  const { logits } = args.inputs as { logits: tf.TensorInfo };
  const dim = (args.attrs as Attrs).dim as number;
  const rank = logits.shape.length;
  if (!isF32(logits) || rank === 0 || (dim !== -1 && dim !== rank - 1))
    return cpuKernel('Softmax', args);
  const backend = args.backend as NativeBackend;
  const cols = logits.shape[rank - 1]!;
  const out = backend.alloc(tf.util.sizeFromShape(logits.shape));
  if (out.length > 0)
    nativeAddon()!.softmax(
      values(backend, logits),
      out,
      out.length / cols,
      cols,
    );
  return backend.makeTensorInfo(logits.shape, 'float32', out);
}

function segmentSumKernel(args: KernelArgs): tf.TensorInfo {
  const { x, segmentIds } = args.inputs as {
    x: tf.TensorInfo;
    segmentIds: tf.TensorInfo;
  };
  const segments = (args.attrs as Attrs).numSegments as number;
  if (
    !isF32(x) ||
    segmentIds.dtype !== 'int32' ||
    segmentIds.shape.length !== 1 ||
    x.shape[0] !== segmentIds.shape[0]
  ) {
    return cpuKernel('UnsortedSegmentSum', args);
  }
  const backend = args.backend as NativeBackend;
  const n = x.shape[0]!;
  const inner = tf.util.sizeFromShape(x.shape.slice(1));
  const out = backend.alloc(segments * inner);
  const ids = backend.data.get(segmentIds.dataId).values as Int32Array;
  if (out.length > 0)
    nativeAddon()!.segmentSum(values(backend, x), ids, out, n, inner, segments);
  return backend.makeTensorInfo(
    [segments, ...x.shape.slice(1)],
    'float32',
    out,
  );
}

function gatherKernel(args: KernelArgs): tf.TensorInfo {
  const { x, indices } = args.inputs as {
    x: tf.TensorInfo;
    indices: tf.TensorInfo;
  };
  const attrs = args.attrs as Attrs;
  const batchDims = (attrs.batchDims as number | undefined) ?? 0;
  if (!isF32(x) || indices.dtype !== 'int32' || batchDims !== 0)
    return cpuKernel('GatherV2', args);
  const backend = args.backend as NativeBackend;
  const axis = tf.util.parseAxisParam(attrs.axis as number, x.shape)[0]!;
  const idx = backend.data.get(indices.dataId).values as Int32Array;
  const axisSize = x.shape[axis]!;
  for (const i of idx)
    tf.util.assert(
      i <= axisSize - 1 && i >= 0,
      () => `GatherV2: the index value ${i} is not in [0, ${axisSize - 1}]`,
    );
  const outer = tf.util.sizeFromShape(x.shape.slice(0, axis));
  const inner = tf.util.sizeFromShape(x.shape.slice(axis + 1));
  const shape = [
    ...x.shape.slice(0, axis),
    ...indices.shape,
    ...x.shape.slice(axis + 1),
  ];
  const out = backend.alloc(tf.util.sizeFromShape(shape));
  if (out.length > 0)
    nativeAddon()!.gather(values(backend, x), idx, out, outer, axisSize, inner);
  return backend.makeTensorInfo(shape, 'float32', out);
}

/** `Pack` (tf.stack) along axis 0 of float32 tensors: their values one after another. */
function packKernel(args: KernelArgs): tf.TensorInfo {
  const inputs = args.inputs as unknown as tf.TensorInfo[];
  const axis = (args.attrs as Attrs).axis as number;
  const first = inputs[0];
  if (
    !first ||
    axis !== 0 ||
    !isF32(...inputs) ||
    inputs.some((t) => !tf.util.arraysEqual(t.shape, first.shape))
  )
    return cpuKernel('Pack', args);
  const backend = args.backend as NativeBackend;
  const size = tf.util.sizeFromShape(first.shape);
  const out = backend.alloc(size * inputs.length);
  inputs.forEach((t, i) => out.set(values(backend, t), i * size));
  return backend.makeTensorInfo(
    [inputs.length, ...first.shape],
    'float32',
    out,
  );
}

function layerNormKernel(args: KernelArgs): tf.TensorInfo[] {
  const { x, g, b } = args.inputs as {
    x: tf.TensorInfo;
    g: tf.TensorInfo;
    b: tf.TensorInfo;
  };
  const backend = args.backend as NativeBackend;
  const cols = x.shape[x.shape.length - 1]!;
  tf.util.assert(
    g.shape.length === 1 &&
      g.shape[0] === cols &&
      b.shape.length === 1 &&
      b.shape[0] === cols,
    () =>
      `${LAYER_NORM_KERNEL}: g ${g.shape} and b ${b.shape} must be [${cols}]`,
  );
  const size = tf.util.sizeFromShape(x.shape);
  const rows = cols > 0 ? size / cols : 0;
  const rstd = backend.alloc(rows);
  const bf = backend.shadowBuffer(size); // bf16: y's product operand, made in the same pass
  const epsilon = (args.attrs as Attrs).epsilon as number;
  let y: tf.TensorInfo;
  let xhat: tf.TensorInfo;
  if (bf !== undefined) {
    // bf16: y held as its bf16 values only (its readers are products), xhat too (saved for the
    // gradient, which reads it as bf16: what keepSavedAtComputePrecision would convert it to)
    const xhatBf = backend.shadowBuffer(size)!;
    if (size > 0)
      nativeAddon()!.layerNormToBf16(
        backend.f32OrBf16(x),
        values(backend, g),
        values(backend, b),
        bf,
        xhatBf,
        rstd,
        rows,
        cols,
        epsilon,
      );
    y = backend.bf16Output(bf, x.shape);
    xhat = backend.bf16Output(xhatBf, x.shape);
  } else {
    const xv = backend.alloc(size);
    const yv = backend.alloc(size);
    if (size > 0)
      nativeAddon()!.layerNorm(
        values(backend, x),
        values(backend, g),
        values(backend, b),
        yv,
        xv,
        rstd,
        rows,
        cols,
        epsilon,
      );
    y = backend.makeTensorInfo(x.shape, 'float32', yv);
    xhat = backend.makeTensorInfo(x.shape, 'float32', xv);
  }
  return [
    y,
    xhat,
    keepFloat32Saved(
      backend.makeTensorInfo([...x.shape.slice(0, -1), 1], 'float32', rstd),
    ),
  ];
}

function layerNormGradKernel(args: KernelArgs): tf.TensorInfo[] {
  const { dy, xhat, rstd, g } = args.inputs as {
    dy: tf.TensorInfo;
    xhat: tf.TensorInfo;
    rstd: tf.TensorInfo;
    g: tf.TensorInfo;
  };
  const backend = args.backend as NativeBackend;
  const cols = dy.shape[dy.shape.length - 1]!;
  const size = tf.util.sizeFromShape(dy.shape);
  const dx = backend.alloc(size);
  const dg = backend.alloc(cols);
  const db = backend.alloc(cols);
  if (size > 0)
    nativeAddon()!.layerNormGradAny(
      backend.f32OrBf16(dy), // bf16 run: a product's input gradient, held as bf16
      backend.f32OrBf16(xhat), // bf16 run: saved as bf16 (backend/low-precision.ts)
      values(backend, rstd),
      values(backend, g),
      dx,
      dg,
      db,
      size / cols,
      cols,
    );
  return [
    backend.makeTensorInfo(dy.shape, 'float32', dx),
    backend.makeTensorInfo(g.shape, 'float32', dg),
    backend.makeTensorInfo(g.shape, 'float32', db),
  ];
}

/**
 * T of a causal softmax's scores or probabilities `x` [..., T, T] (the addon reads them as
 * [batch, T, T]). Throws naming `kernel` and `what` where the last two axes differ.
 */
function causalRows(x: tf.TensorInfo, kernel: string, what: string): number {
  const t = x.shape[x.shape.length - 1]!;
  tf.util.assert(
    x.shape.length >= 2 && x.shape[x.shape.length - 2] === t,
    () => `${kernel}: ${what} ${x.shape} must be [..., T, T]`,
  );
  return t;
}

function causalSoftmaxKernel(args: KernelArgs): tf.TensorInfo {
  const { x } = args.inputs as { x: tf.TensorInfo };
  const backend = args.backend as NativeBackend;
  const t = causalRows(x, CAUSAL_SOFTMAX_KERNEL, 'scores');
  const out = backend.alloc(tf.util.sizeFromShape(x.shape));
  if (out.length > 0)
    nativeAddon()!.causalSoftmax(
      values(backend, x),
      out,
      out.length / (t * t),
      t,
      (args.attrs as Attrs).scale as number,
    );
  return backend.makeTensorInfo(x.shape, 'float32', out);
}

function causalSoftmaxGradKernel(args: KernelArgs): tf.TensorInfo {
  const { y, dy } = args.inputs as { y: tf.TensorInfo; dy: tf.TensorInfo };
  const backend = args.backend as NativeBackend;
  const t = causalRows(y, CAUSAL_SOFTMAX_GRAD_KERNEL, 'probabilities');
  const out = backend.alloc(tf.util.sizeFromShape(y.shape));
  if (out.length > 0)
    nativeAddon()!.causalSoftmaxGrad(
      values(backend, y),
      values(backend, dy),
      out,
      out.length / (t * t),
      t,
      (args.attrs as Attrs).scale as number,
    );
  return backend.makeTensorInfo(y.shape, 'float32', out);
}

/** Attention's [B, T, 3D] input as (batch, t, heads, dh), checked. */
function attentionDims(
  qkv: tf.TensorInfo,
  heads: number,
  name: string,
): [number, number, number, number] {
  const [b, t, d3] = qkv.shape as [number, number, number];
  tf.util.assert(
    qkv.shape.length === 3 &&
      d3 % 3 === 0 &&
      Number.isInteger(heads) &&
      heads > 0 &&
      (d3 / 3) % heads === 0,
    () =>
      `${name}: qkv ${qkv.shape} must be [B, T, 3D] with D divisible by heads (${heads})`,
  );
  return [b, t, heads, d3 / 3 / heads];
}

function causalAttentionKernel(args: KernelArgs): tf.TensorInfo[] {
  const { qkv } = args.inputs as { qkv: tf.TensorInfo };
  const backend = args.backend as NativeBackend;
  const [b, t, h, dh] = attentionDims(
    qkv,
    (args.attrs as Attrs).heads as number,
    CAUSAL_ATTENTION_KERNEL,
  );
  const bf = backend.shadowBuffer(b * t * h * dh); // bf16: the next product's operand, written with ctx
  if (bf !== undefined) {
    // bf16: the context held as its bf16 values only (its reader is the output projection), the
    // probabilities too (saved for the gradient, which reads them as bf16, as autocast keeps them)
    const pBf = backend.shadowBuffer(b * h * t * t)!;
    if (bf.length > 0)
      nativeAddon()!.causalAttentionToBf16(
        backend.f32OrBf16(qkv),
        pBf,
        b,
        t,
        h,
        dh,
        1 / Math.sqrt(dh),
        bf,
      );
    return [
      backend.bf16Output(bf, [b, t, h * dh]),
      backend.bf16Output(pBf, [b, h, t, t]),
    ];
  }
  const p = backend.alloc(b * h * t * t);
  const ctx = backend.alloc(b * t * h * dh);
  if (ctx.length > 0)
    nativeAddon()!.causalAttention(
      values(backend, qkv),
      ctx,
      p,
      b,
      t,
      h,
      dh,
      1 / Math.sqrt(dh),
    );
  return [
    backend.makeTensorInfo([b, t, h * dh], 'float32', ctx),
    backend.makeTensorInfo([b, h, t, t], 'float32', p),
  ];
}

function causalAttentionGradKernel(args: KernelArgs): tf.TensorInfo {
  const { dy, qkv, p } = args.inputs as {
    dy: tf.TensorInfo;
    qkv: tf.TensorInfo;
    p: tf.TensorInfo;
  };
  const backend = args.backend as NativeBackend;
  const [b, t, h, dh] = attentionDims(
    qkv,
    (args.attrs as Attrs).heads as number,
    CAUSAL_ATTENTION_GRAD_KERNEL,
  );
  const bf = backend.shadowBuffer(b * t * 3 * h * dh); // bf16: the products' dy, written with dqkv
  if (bf !== undefined) {
    // bf16: dqkv held as its bf16 values only (its readers are the qkv product's gradients)
    if (bf.length > 0)
      nativeAddon()!.causalAttentionGradToBf16(
        backend.f32OrBf16(dy),
        backend.f32OrBf16(qkv),
        backend.f32OrBf16(p),
        b,
        t,
        h,
        dh,
        1 / Math.sqrt(dh),
        bf,
      );
    return backend.bf16Output(bf, qkv.shape);
  }
  const dqkv = backend.alloc(b * t * 3 * h * dh);
  if (dqkv.length > 0)
    nativeAddon()!.causalAttentionGrad(
      values(backend, dy),
      values(backend, qkv),
      values(backend, p),
      dqkv,
      b,
      t,
      h,
      dh,
      1 / Math.sqrt(dh),
    );
  return backend.makeTensorInfo(qkv.shape, 'float32', dqkv);
}

/** Labels as the Int32Array the addon reads (float labels are converted). */
function labelValues(
  backend: NativeBackend,
  labels: tf.TensorInfo,
): Int32Array {
  const v = backend.data.get(labels.dataId).values;
  return v instanceof Int32Array ? v : Int32Array.from(v as Float32Array);
}

function softmaxCrossEntropyKernel(args: KernelArgs): tf.TensorInfo[] {
  const { logits, labels } = args.inputs as {
    logits: tf.TensorInfo;
    labels: tf.TensorInfo;
  };
  const backend = args.backend as NativeBackend;
  const [n, c] = logits.shape as [number, number];
  tf.util.assert(
    logits.shape.length === 2 &&
      labels.shape.length === 1 &&
      labels.shape[0] === n,
    () =>
      `${SOFTMAX_CROSS_ENTROPY_KERNEL}: logits ${logits.shape} must be [N, C] and labels ${labels.shape} [N]`,
  );
  const probs = backend.alloc(n * c);
  // bf16 logits (the head's product with its parameters) read as held: no separate pass widening
  // a float32 copy first (about 15% of the kernel's time at 1 thread)
  const loss = nativeAddon()!.softmaxCrossEntropy(
    backend.f32OrBf16(logits),
    labelValues(backend, labels),
    probs,
    n,
    c,
  );
  return [
    backend.makeTensorInfo([], 'float32', new Float32Array([loss])),
    backend.makeTensorInfo([n, c], 'float32', probs),
  ];
}

function softmaxCrossEntropyGradKernel(args: KernelArgs): tf.TensorInfo {
  const { probs, labels, dy } = args.inputs as {
    probs: tf.TensorInfo;
    labels: tf.TensorInfo;
    dy: tf.TensorInfo;
  };
  const backend = args.backend as NativeBackend;
  const [n, c] = probs.shape as [number, number];
  const out = backend.alloc(n * c);
  const d = values(backend, dy)[0]!;
  if (out.length > 0)
    nativeAddon()!.softmaxCrossEntropyGrad(
      values(backend, probs),
      labelValues(backend, labels),
      out,
      n,
      c,
      d / n,
    );
  return backend.makeTensorInfo([n, c], 'float32', out);
}

function geluKernel(args: KernelArgs): tf.TensorInfo {
  const { x } = args.inputs as { x: tf.TensorInfo };
  const backend = args.backend as NativeBackend;
  const n = tf.util.sizeFromShape(x.shape);
  const bf = backend.shadowBuffer(n); // bf16: its product operand, made in the same pass
  if (bf !== undefined) {
    // bf16: held as the bf16 values only (its readers are products)
    nativeAddon()!.geluToBf16(backend.f32OrBf16(x), bf);
    return backend.bf16Output(bf, x.shape);
  }
  const out = backend.alloc(n);
  nativeAddon()!.gelu(values(backend, x), out);
  return backend.makeTensorInfo(x.shape, 'float32', out);
}

function geluGradKernel(args: KernelArgs): tf.TensorInfo {
  const { x, dy } = args.inputs as { x: tf.TensorInfo; dy: tf.TensorInfo };
  const backend = args.backend as NativeBackend;
  tf.util.assert(
    tf.util.arraysEqual(x.shape, dy.shape),
    () => `${GELU_GRAD_KERNEL}: x ${x.shape} and dy ${dy.shape} differ`,
  );
  const n = tf.util.sizeFromShape(x.shape);
  const bf = backend.shadowBuffer(n); // bf16: the products' dy, made in the same pass
  if (bf !== undefined) {
    // bf16: held as the bf16 values only (its readers are the products' gradients)
    nativeAddon()!.geluGradToBf16(
      backend.f32OrBf16(x),
      backend.f32OrBf16(dy),
      bf,
    );
    return backend.bf16Output(bf, x.shape);
  }
  const out = backend.alloc(n);
  nativeAddon()!.geluGrad(values(backend, x), values(backend, dy), out);
  return backend.makeTensorInfo(x.shape, 'float32', out);
}

function adamwKernel(args: KernelArgs): tf.TensorInfo[] {
  const { p, g, m, v } = args.inputs as Record<string, tf.TensorInfo>;
  const a = args.attrs as Record<string, number>;
  const backend = args.backend as NativeBackend;
  const n = tf.util.sizeFromShape(p!.shape);
  const [pOut, mOut, vOut] = [
    backend.alloc(n),
    backend.alloc(n),
    backend.alloc(n),
  ];
  nativeAddon()!.adamw(
    values(backend, p!),
    values(backend, g!),
    values(backend, m!),
    values(backend, v!),
    a.lr!,
    a.beta1!,
    a.beta2!,
    a.epsilon!,
    a.weightDecay!,
    a.step!,
    a.scale!,
    pOut,
    mOut,
    vOut,
  );
  return [pOut, mOut, vOut].map((out) =>
    backend.makeTensorInfo(p!.shape, 'float32', out),
  );
}

/**
 * LayerwiseAdamWMulti (kernel-names.ts ADAMW_MULTI_KERNEL): inputs [p_0..p_n-1, g_0..g_n-1, m,
 * v] float32 (g_i of p_i's shape; m and v flat [total], p_0's elements first); outputs
 * [p'_0..p'_n-1, m', v'], as {@link adamwKernel} on each (the same bits) in one addon call, the
 * flat moments handed to it as per-parameter views: one OpenMP region over all of a stage's
 * parameters instead of one per parameter. Each output is its input's own data, updated in place
 * (with its bf16 copy, where products read one), where nothing but the input holds that data
 * (TF.js's refCount 1: the variable alone), else a new array from the pool (a kept clone sees the
 * old values), as webgpu's (backend/webgpu-multi.ts): a step then reads its parameters and
 * moments from the arrays of the step before, which a captured step needs
 * (pipeline/native-capture.ts), and the update needs no new arrays. Throws where the inputs are
 * not so laid out (kernel-names.ts adamwMultiCount).
 */
function adamwMultiKernel(args: KernelArgs): tf.TensorInfo[] {
  const inputs = Object.values(args.inputs) as tf.TensorInfo[];
  const a = args.attrs as Record<string, number>;
  const backend = args.backend as NativeBackend;
  const n = adamwMultiCount(inputs);
  const arrays = inputs.map((t) => values(backend, t));
  const ps = arrays.slice(0, n);
  // the flat moments seen per parameter (views, no copies), in and out
  const views = (flat: Float32Array) => {
    let at = 0;
    return ps.map((p) => flat.subarray(at, (at += p.length)));
  };
  // each output is its input's own data where nothing else holds it (updated in place), else new
  const place = [...inputs.slice(0, n), inputs[2 * n]!, inputs[2 * n + 1]!].map(
    (t) => backend.refCount(t.dataId) === 1,
  );
  const outOf = (i: number, input: Float32Array) =>
    place[i] ? input : backend.alloc(input.length);
  const pOut = ps.map((p, i) => outOf(i, p));
  const [mOut, vOut] = [
    outOf(n, arrays[2 * n]!),
    outOf(n + 1, arrays[2 * n + 1]!),
  ];
  // bf16 products: each new matrix's bf16 copy made in the same pass (products read matrices),
  // into the copy it has where it is updated in place
  const copies = inputs
    .slice(0, n)
    .map((p, i) =>
      backend.computesNarrow() && p.shape.length >= 2
        ? ((place[i] ? backend.parameterCopyOf(p) : null) ??
          backend.parameterCopyBuffer(arrays[i]!.length))
        : null,
    );
  nativeAddon()!.adamwMulti(
    ps,
    arrays.slice(n, 2 * n),
    views(arrays[2 * n]!),
    views(arrays[2 * n + 1]!),
    pOut,
    views(mOut),
    views(vOut),
    a.lr!,
    a.beta1!,
    a.beta2!,
    a.epsilon!,
    a.weightDecay!,
    a.decayed!,
    a.step!,
    a.scale!,
    copies,
  );
  const outputs = [...pOut, mOut, vOut];
  const infos = [...inputs.slice(0, n), inputs[2 * n]!, inputs[2 * n + 1]!].map(
    (t, i) => {
      if (!place[i])
        return backend.makeTensorInfo(t.shape, 'float32', outputs[i]!);
      backend.incRef(t.dataId); // the output is the input's data, as Reshape's
      return { dataId: t.dataId, shape: t.shape, dtype: t.dtype };
    },
  );
  copies.forEach((bf, i) => {
    if (bf !== null) backend.keepParameterCopy(infos[i]!, bf);
    else if (place[i]) backend.dropParameterCopy(infos[i]!);
  });
  return infos;
}

/**
 * LayerwiseSumSquares (kernel-names.ts SUM_SQUARES_KERNEL): inputs [x_0..x_n-1] float32; output
 * [n] float32, sum(x_i^2) each (squares in float32, sums in double, as Square then Sum here), in
 * one addon call over all of them.
 */
function sumSquaresKernel(args: KernelArgs): tf.TensorInfo {
  const inputs = Object.values(args.inputs) as tf.TensorInfo[];
  const backend = args.backend as NativeBackend;
  const out = new Float32Array(inputs.length);
  nativeAddon()!.sumSquaresMulti(
    inputs.map((t) => values(backend, t)),
    out,
  );
  return backend.makeTensorInfo([inputs.length], 'float32', out);
}

function sgdKernel(args: KernelArgs): tf.TensorInfo[] {
  const { p, g, velocity } = args.inputs as Record<
    string,
    tf.TensorInfo | undefined
  >;
  const a = args.attrs as Record<string, number>;
  const backend = args.backend as NativeBackend;
  const n = tf.util.sizeFromShape(p!.shape);
  const pOut = backend.alloc(n);
  const velOut = velocity ? backend.alloc(n) : null;
  nativeAddon()!.sgd(
    values(backend, p!),
    values(backend, g!),
    velocity ? values(backend, velocity) : null,
    a.lr!,
    a.momentum!,
    a.weightDecay!,
    a.scale!,
    pOut,
    velOut,
  );
  return (velOut ? [pOut, velOut] : [pOut]).map((out) =>
    backend.makeTensorInfo(p!.shape, 'float32', out),
  );
}

/**
 * `Cast` to float32 as a real Float32Array copy. The cpu kernel casts int32 and bool to float32
 * without a copy (the new tensor shares the Int32Array or Uint8Array), which the native kernels,
 * reading float32 tensors as Float32Array, must never see. Every other cast is the cpu kernel's.
 */
function castKernel(args: KernelArgs): tf.TensorInfo {
  const { x } = args.inputs as { x: tf.TensorInfo };
  const dtype = (args.attrs as Attrs).dtype as tf.DataType;
  if (
    dtype !== 'float32' ||
    x.dtype === 'float32' ||
    x.dtype === 'complex64' ||
    x.dtype === 'string'
  )
    return cpuKernel('Cast', args);
  const backend = args.backend as NativeBackend;
  const src = backend.data.get(x.dataId).values as Int32Array | Uint8Array;
  const out = backend.alloc(src.length);
  for (let i = 0; i < src.length; i++) out[i] = src[i]!;
  return backend.makeTensorInfo(x.shape, 'float32', out);
}

/** The kernels the addon provides, by kernel name. */
const NATIVE_KERNELS: Record<string, tf.KernelFunc> = {
  BatchMatMul: batchMatMulKernel as tf.KernelFunc,
  _FusedMatMul: fusedMatMulKernel as tf.KernelFunc,
  ...Object.fromEntries(Object.keys(BINARY).map((k) => [k, binaryKernel(k)])),
  ...Object.fromEntries(Object.keys(UNARY).map((k) => [k, unaryKernel(k)])),
  ...Object.fromEntries(Object.keys(REDUCE).map((k) => [k, reduceKernel(k)])),
  Transpose: transposeKernel as tf.KernelFunc,
  Softmax: softmaxKernel as tf.KernelFunc,
  UnsortedSegmentSum: segmentSumKernel as tf.KernelFunc,
  GatherV2: gatherKernel as tf.KernelFunc,
  Pack: packKernel as tf.KernelFunc,
  Cast: castKernel as tf.KernelFunc,
  [GELU_KERNEL]: geluKernel as tf.KernelFunc,
  [CAUSAL_SOFTMAX_KERNEL]: causalSoftmaxKernel as tf.KernelFunc,
  [CAUSAL_SOFTMAX_GRAD_KERNEL]: causalSoftmaxGradKernel as tf.KernelFunc,
  [LAYER_NORM_KERNEL]: layerNormKernel as unknown as tf.KernelFunc,
  [LAYER_NORM_GRAD_KERNEL]: layerNormGradKernel as unknown as tf.KernelFunc,
  [GELU_GRAD_KERNEL]: geluGradKernel as tf.KernelFunc,
  [CAUSAL_ATTENTION_KERNEL]: causalAttentionKernel as unknown as tf.KernelFunc,
  [CAUSAL_ATTENTION_GRAD_KERNEL]: causalAttentionGradKernel as tf.KernelFunc,
  [SOFTMAX_CROSS_ENTROPY_KERNEL]:
    softmaxCrossEntropyKernel as unknown as tf.KernelFunc,
  [SOFTMAX_CROSS_ENTROPY_GRAD_KERNEL]:
    softmaxCrossEntropyGradKernel as tf.KernelFunc,
  [ADAMW_KERNEL]: adamwKernel as unknown as tf.KernelFunc,
  [SGD_KERNEL]: sgdKernel as unknown as tf.KernelFunc,
  [ADAMW_MULTI_KERNEL]: adamwMultiKernel as unknown as tf.KernelFunc,
  [SUM_SQUARES_KERNEL]: sumSquaresKernel as tf.KernelFunc,
  [ROUND_BF16_KERNEL]: roundBf16Kernel as unknown as tf.KernelFunc,
  ...NATIVE_CONV_KERNELS, // convolution and pooling (backend/native-conv.ts)
};

/**
 * Options registered with a kernel's config, read by its callers. AdamW over many parameters
 * (kernel-names.ts ADAMW_MULTI_KERNEL): at most 2^22 elements a call (the optimizer assigning
 * each call's outputs before the next), which bounds the new p, m and v a call holds beside the
 * old ones to 48 MiB. It was 2^20, so that a call's outputs were the buffers the call before had
 * just freed, still in the caches; the kernel now writes its outputs with streaming stores
 * (native/src/adamw.cc), which skip the caches, and one region over charlm-small's 3.24M
 * parameters took 5.1-5.3 ms at 1 thread and 2.8-3.1 ms at 2 where four took 6.0 and 3.5 (fp32;
 * bf16 6.4 and 3.4-3.8 against 6.9 and 4.1: `npm run bench -- kernels --threads 1,2`).
 */
const NATIVE_KERNEL_OPTIONS: Record<string, { elementsPerCall?: number }> = {
  [ADAMW_MULTI_KERNEL]: { elementsPerCall: 2 ** 22 },
};

let registered = false;

/**
 * Registers the 'native' backend and its kernels (the native ones above, the cpu backend's for
 * everything else) in this thread's tfjs-core, once. Returns false, registering nothing, when
 * the addon is unavailable.
 */
export function registerNativeBackend(): boolean {
  if (registered) return true;
  if (!nativeAddon()) return false;
  tf.registerBackend('native', () => new NativeBackend(), 0);
  for (const [kernelName, kernelFunc] of Object.entries(NATIVE_KERNELS))
    tf.registerKernel({
      kernelName,
      backendName: 'native',
      kernelFunc,
      ...NATIVE_KERNEL_OPTIONS[kernelName],
    });
  for (const k of tf.getKernelsForBackend('cpu')) {
    if (!(k.kernelName in NATIVE_KERNELS))
      tf.registerKernel({ ...k, backendName: 'native' });
  }
  registered = true;
  return true;
}

/** Names of the kernels that run natively on the 'native' backend (the rest are the cpu backend's). */
export function nativeKernelNames(): string[] {
  return Object.keys(NATIVE_KERNELS);
}
