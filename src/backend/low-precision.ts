/**
 * The seam between the L2L relay and a backend's compute precision (issue 23 item 4): a
 * parameter shipped as bfloat16 values becomes a float32 tensor that the backend keeps as those
 * bf16 values where it can (the native backend at --precision bf16: NativeBackend.fromBf16, 2
 * bytes per element on the device, read directly as the products' bf16 operands), or as their
 * exact float32 widening elsewhere. Imports only TF.js, so the page's bundle can take it.
 */
import { toBf16 } from '../util/bf16.js';
import {
  isNarrow,
  type PrecisionPolicy,
  policyOf,
  type TensorRole,
} from './precision.js';
import { tf } from './tfjs.js';

/** A backend that can hold a float32 tensor as bf16 values (backend/native.ts NativeBackend). */
interface Bf16Holder {
  precision: string;
  fromBf16(bf: Uint16Array, shape: number[]): tf.Tensor;
  activationFromBf16(bf: Uint16Array, shape: number[]): tf.Tensor;
  roundToBf16(src: Float32Array, dst: Uint16Array): void;
  widenFromBf16(src: Uint16Array, dst: Float32Array): void;
  bf16Saved(t: tf.Tensor): tf.Tensor | null;
}

function holder(): Bf16Holder | null {
  const b = tf.backend() as unknown as Partial<Bf16Holder>;
  return b.precision === 'bf16' && typeof b.fromBf16 === 'function'
    ? (b as Bf16Holder)
    : null;
}

/** Whether this thread's backend computes in bf16 and keeps bf16-only tensors (then {@link tensorFromBf16} halves their bytes). */
export function holdsBf16(): boolean {
  return holder() !== null;
}

/**
 * The precision policy (backend/precision.ts) as this thread's backend holds tensors: bf16's
 * where the backend keeps bf16-only tensors ({@link holdsBf16}), f16's on a backend computing
 * f16 products (float32 storage), else fp32's. Callers ask it, or {@link storesNarrow}, which
 * roles travel and wait in a 2-byte format; the helpers below convert to and from it.
 */
export function devicePolicy(): PrecisionPolicy {
  if (holder()) return policyOf('bf16');
  const p = (tf.backend() as unknown as { precision?: string }).precision;
  return policyOf(p === 'f16' ? 'f16' : 'fp32');
}

/** Whether this thread's backend keeps float32 tensors of `role` in a 2-byte format (see {@link devicePolicy}). */
export function storesNarrow(role: TensorRole): boolean {
  return isNarrow(devicePolicy(), role);
}

/**
 * `v` rounded to the 2-byte storage format (new array; see {@link storesNarrow}): bfloat16, the
 * only 2-byte storage of any policy today (f16 stores float32); a policy with another would
 * round here by its format.
 */
export function narrowValues(v: Float32Array): Uint16Array {
  const d = new Uint16Array(v.length);
  roundToBf16(v, d);
  return d;
}

/** 2-byte values widened to float32 (exact; a new array). */
export function widenValues(d: Uint16Array): Float32Array {
  const f32 = new Float32Array(d.length);
  widenBf16(d, f32);
  return f32;
}

/** A float32 tensor in the 2-byte wire format, as it crosses between stages. */
export interface NarrowWire {
  shape: number[];
  data: Uint16Array;
}

/** The message fields that carry a {@link NarrowWire} (the field keeps its first name, `bf16`). */
export interface NarrowWireFields {
  bf16?: NarrowWire;
}

/** The fields of a message carrying `data` (2-byte values of a tensor of `shape`). */
export function narrowWireFields(
  shape: number[],
  data: Uint16Array,
): NarrowWireFields {
  return { bf16: { shape, data } };
}

/** The {@link NarrowWire} a message carries, if any. */
export function narrowWireOf(m: NarrowWireFields): NarrowWire | undefined {
  return m.bf16;
}

/**
 * dst[i] = src[i] rounded to bfloat16 (nearest, ties to even), on this thread's backend where
 * it converts (the native addon's vectorised loop), else in JavaScript. RangeError on a length
 * mismatch.
 */
export function roundToBf16(src: Float32Array, dst: Uint16Array): void {
  const h = holder();
  if (h) h.roundToBf16(src, dst);
  else toBf16(src, dst);
}

/** dst[i] = the bf16 src[i] widened to float32 (exact): the backend's loop where it has one. */
export function widenBf16(src: Uint16Array, dst: Float32Array): void {
  const h = holder();
  if (h) {
    h.widenFromBf16(src, dst);
    return;
  }
  const u = new Uint32Array(dst.buffer, dst.byteOffset, dst.length);
  for (let i = 0; i < src.length; i++) u[i] = src[i]! << 16;
}

/**
 * A float32 tensor of `shape` whose values are the bf16 values `bf` widened (exact). `bf` is
 * taken over: the caller must not change it afterwards. On a bf16 native backend the device
 * holds `bf` itself (see NativeBackend.fromBf16); elsewhere a widened Float32Array.
 * RangeError if `bf`'s length is not the shape's size.
 */
export function tensorFromBf16(bf: Uint16Array, shape: number[]): tf.Tensor {
  const h = holder();
  if (h) return h.fromBf16(bf, shape);
  const n = tf.util.sizeFromShape(shape);
  if (bf.length !== n)
    throw new RangeError(
      `tensorFromBf16: ${bf.length} bf16 values for shape [${shape}] (${n} elements)`,
    );
  const f32 = new Float32Array(n);
  widenBf16(bf, f32);
  return tf.tensor(f32, shape, 'float32');
}

/**
 * An activation (an L2L stash coming back to the device) of `shape` whose values are the bf16
 * values `bf` widened: as {@link tensorFromBf16}, but not taken for a parameter (so the products
 * that read it keep their kind of output: backend/native.ts bf16Product). `bf` is taken over.
 */
export function activationFromBf16(
  bf: Uint16Array,
  shape: number[],
): tf.Tensor {
  const h = holder();
  if (h) return h.activationFromBf16(bf, shape);
  return tensorFromBf16(bf, shape);
}

/** {@link tensorFromBf16} in the storage format's name: a parameter's 2-byte copy on the device. */
export const tensorFromNarrow = tensorFromBf16;

/** {@link activationFromBf16} in the storage format's name: a stashed activation back on the device. */
export const activationFromNarrow = activationFromBf16;

/**
 * The kernel that rounds a float32 tensor to bf16 and widens it back in one pass (the native
 * backend's, backend/native.ts); {@link roundTensor} composes it where a backend has none.
 */
export const ROUND_BF16_KERNEL = 'LayerwiseRoundBf16';

/** t's values rounded to bf16 and widened back: a new float32 tensor of t's shape (t is kept). */
export function roundTensor(t: tf.Tensor): tf.Tensor {
  if (tf.getKernel(ROUND_BF16_KERNEL, tf.getBackend()))
    return tf.engine().runKernel(ROUND_BF16_KERNEL, { x: t }) as tf.Tensor;
  const v = t.dataSync() as Float32Array;
  const bf = new Uint16Array(v.length);
  roundToBf16(v, bf);
  const f32 = new Float32Array(v.length);
  widenBf16(bf, f32);
  return tf.tensor(f32, t.shape, 'float32');
}

/**
 * A layer-boundary activation at the run's compute precision: on a bf16 backend ({@link
 * holdsBf16}) x's float32 values rounded to bf16 (a float32 tensor of x's shape), and in
 * backward its gradient rounded to bf16 likewise; elsewhere x itself. Every strategy rounds at
 * each block boundary (pipeline/stage-params.ts applyBlocks; the L2L relay's stash and incoming
 * gradients), so the activations and gradients that stages send, and the stashes they keep,
 * travel in bf16 without any strategy computing other numbers than single-device bf16 (issue
 * 23 items 4 and 5).
 */
export function roundActivation(x: tf.Tensor): tf.Tensor {
  if (x.dtype !== 'float32' || !holdsBf16()) return x;
  const round = tf.customGrad(((t: tf.Tensor) => ({
    value: roundTensor(t),
    gradFunc: (dy: tf.Tensor) => roundTensor(dy),
  })) as unknown as Parameters<typeof tf.customGrad>[0]);
  return round(x);
}

/**
 * On a bf16 backend ({@link holdsBf16}), replaces the activations a recorded forward saved for
 * its backward (`tape`: tfjs tape nodes, pipeline/tape.ts) by bf16-only copies of them
 * (NativeBackend.bf16Saved: 2 bytes per element instead of 4, the float32 values freed unless
 * something else holds them), as autocast keeps them (issue 23 item 4): the products' operands
 * (their gradients read them only as bf16 operands anyway: the same gradients), GELU's input,
 * attention's qkv and probabilities, layer norm's xhat (their gradients read bf16 inputs as
 * they are). Kept float32: parameters, statistics the backend marks so (layer
 * norm's rstd), and data a tensor outside the tape holds too (the stage's input). Elsewhere
 * does nothing.
 */
export function keepSavedAtComputePrecision(
  tape: ReadonlyArray<{ saved?: tf.Tensor[] }>,
): void {
  const h = holder();
  if (!h) return;
  const heldElsewhere = new Set<tf.DataId>();
  const savedRefs = new Map<tf.DataId, number>();
  for (const node of tape)
    for (const t of node.saved ?? []) {
      if (!(t instanceof tf.Tensor)) continue; // a shape kept in place of a tensor
      savedRefs.set(t.dataId, (savedRefs.get(t.dataId) ?? 0) + 1);
    }
  // data a tensor outside the tape holds too (the stage's input, say) stays float32 for it
  const backend = tf.backend();
  for (const [id, n] of savedRefs)
    if (backend.refCount(id) > n) heldElsewhere.add(id);
  const copies = new Map<tf.DataId, tf.Tensor | null>();
  for (const node of tape) {
    const saved = node.saved;
    if (!saved) continue;
    saved.forEach((t, i) => {
      if (!(t instanceof tf.Tensor)) return;
      if (heldElsewhere.has(t.dataId) || t.dtype !== 'float32') return;
      let copy = copies.get(t.dataId);
      if (copy === undefined) {
        copy = h.bf16Saved(t);
        copies.set(t.dataId, copy);
      } else if (copy !== null) copy = tf.clone(copy);
      if (copy === null) return; // a parameter, or bf16 already
      // kept: made inside a recording's tidy scope, it must outlive that scope as saved tensors do
      saved[i] = tf.keep(copy); // in place: the node's gradient closure holds this array
      t.dispose();
    });
  }
}
