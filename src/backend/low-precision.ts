/**
 * The seam between a backend's tensors and the run's precision policy (backend/precision.ts;
 * issue 23 item 4, issue 35 item 1): 2-byte values of the policy's storage format (parameters
 * shipped by the L2L relay, stashes, what stages send) become float32 tensors that the backend
 * keeps as those 2-byte values where it can (the native backend at --precision bf16:
 * NativeBackend.fromBf16, 2 bytes per element on the device, read directly as the products'
 * bf16 operands), or as their exact float32 widening elsewhere. Every helper asks the thread's
 * policy ({@link devicePolicy}); only {@link HOLDERS} names a format's backend methods.
 * Imports only TF.js, so the page's bundle can take it.
 */
import {
  isNarrow,
  knownPolicy,
  type Narrowing,
  type NumberFormat,
  narrowingTo,
  onlyNarrowPolicy,
  type PrecisionPolicy,
  policyOf,
  type TensorRole,
  type Widening,
  wideningFrom,
} from './precision.js';
import { tf } from './tfjs.js';

/**
 * A backend that holds float32 tensors as 2-byte values of its policy's storage format (the
 * native backend at bf16), in that format's terms: the seam the helpers below go through, so
 * none of them names a format.
 */
interface NarrowHolder {
  /** The 2-byte format it holds. */
  format: NumberFormat;
  /** A parameter's tensor held as `d` (taken over). */
  fromNarrow(d: Uint16Array, shape: number[]): tf.Tensor;
  /** An activation's tensor held as `d` (taken over). */
  activationFromNarrow(d: Uint16Array, shape: number[]): tf.Tensor;
  /** The backend's rounding loop into `format`. */
  round: Narrowing;
  /** The backend's widening loop from `format`. */
  widen: Widening;
  /** A saved activation's 2-byte-only copy, or null where it keeps t (see {@link keepSavedAtComputePrecision}). */
  narrowSaved(t: tf.Tensor): tf.Tensor | null;
}

/** The native backend's bfloat16 methods (backend/native.ts NativeBackend). */
interface Bf16Backend {
  fromBf16(bf: Uint16Array, shape: number[]): tf.Tensor;
  activationFromBf16(bf: Uint16Array, shape: number[]): tf.Tensor;
  roundToBf16(src: Float32Array, dst: Uint16Array): void;
  widenFromBf16(src: Uint16Array, dst: Float32Array): void;
  bf16Saved(t: tf.Tensor): tf.Tensor | null;
}

/**
 * Per 2-byte storage format, the {@link NarrowHolder} a backend offers in it, or null where it
 * has none: the one place that names a format's backend methods (a new 2-byte policy adds its
 * entry here, its conversions in backend/precision.ts).
 */
const HOLDERS: Partial<
  Record<NumberFormat, (b: object) => NarrowHolder | null>
> = {
  bfloat16: (b) => {
    if (typeof (b as Partial<Bf16Backend>).fromBf16 !== 'function') return null;
    const n = b as Bf16Backend;
    return {
      format: 'bfloat16',
      fromNarrow: (d, shape) => n.fromBf16(d, shape),
      activationFromNarrow: (d, shape) => n.activationFromBf16(d, shape),
      round: (src, dst) => n.roundToBf16(src, dst),
      widen: (src, dst) => n.widenFromBf16(src, dst),
      narrowSaved: (t) => n.bf16Saved(t),
    };
  },
};

/**
 * A backend that keeps the activations a recorded forward saves for its backward in its
 * policy's 2-byte `saved` format (backend/precision.ts): `narrowSaved` makes a saved
 * tensor's 2-byte copy (null where it keeps the tensor as it is); `widenSaved`, where the
 * backend's kernels cannot read such a copy as it is, gives the float32 tensor an op's gradient
 * reads (null for a tensor that is no such copy).
 */
interface SavedHolder {
  narrowSaved(t: tf.Tensor): tf.Tensor | null;
  widenSaved?(t: tf.Tensor): tf.Tensor | null;
  /**
   * The copy for `t`, a saved tensor on the data `copy` was made from (a reshape of it, say):
   * a clone of `copy` standing for t's shape. tf.clone where absent (a copy of t's shape already).
   */
  sharedSaved?(copy: tf.Tensor, t: tf.Tensor): tf.Tensor;
}

/** The webgpu backend's f16 copies of saved activations (backend/webgpu-f16.ts installF16Saved). */
interface F16SavedBackend {
  f16Saved(t: tf.Tensor): tf.Tensor | null;
  widenF16Saved(t: tf.Tensor): tf.Tensor | null;
  sharedF16Saved(copy: tf.Tensor, t: tf.Tensor): tf.Tensor;
}

/**
 * Per 2-byte format, the {@link SavedHolder} a backend offers for saved activations: the native
 * backend at bf16 (its kernels read bf16 copies as they are), webgpu at f16 (its copies are
 * widened for each op's gradient).
 */
const SAVED_HOLDERS: Partial<
  Record<NumberFormat, (b: object) => SavedHolder | null>
> = {
  bfloat16: (b) => HOLDERS.bfloat16?.(b) ?? null,
  float16: (b) => {
    const w = b as Partial<F16SavedBackend>;
    if (typeof w.f16Saved !== 'function') return null;
    const f = w as F16SavedBackend;
    return {
      narrowSaved: (t) => f.f16Saved(t),
      widenSaved: (t) => f.widenF16Saved(t),
      sharedSaved: (copy, t) => f.sharedF16Saved(copy, t),
    };
  },
};

/** This thread's backend's holder of its policy's 2-byte `saved` storage, or null (saved activations stay float32). */
function savedHolder(): SavedHolder | null {
  const b = tf.backend();
  const p = namedPolicy(b);
  if (!isNarrow(p, 'saved')) return null;
  return SAVED_HOLDERS[p.storage.saved]?.(b) ?? null;
}

/** The policy a backend names (its `precision`), fp32's for a backend naming none. */
function namedPolicy(b: object): PrecisionPolicy {
  return (
    knownPolicy((b as { precision?: unknown }).precision) ?? policyOf('fp32')
  );
}

/** `b`'s holder of `policy`'s 2-byte storage, or null where the policy stores float32 or `b` cannot hold it. */
function holderOf(b: object, policy: PrecisionPolicy): NarrowHolder | null {
  if (!isNarrow(policy, 'activations')) return null;
  return HOLDERS[policy.storage.activations]?.(b) ?? null;
}

/** This thread's backend's holder of its policy's 2-byte storage, or null (then tensors are float32 only). */
function holder(): NarrowHolder | null {
  const b = tf.backend();
  return holderOf(b, namedPolicy(b));
}

/**
 * The precision policy (backend/precision.ts) as this thread's backend holds tensors: the
 * policy its backend names (NativeBackend.precision, the webgpu backend's), where the backend
 * can hold that policy's 2-byte storage (a {@link NarrowHolder}); fp32's where it names none,
 * or names a 2-byte policy it cannot hold. Callers ask it, or {@link storesNarrow}, which
 * roles travel and wait in a 2-byte format; the helpers below convert to and from it.
 */
export function devicePolicy(): PrecisionPolicy {
  const b = tf.backend();
  const p = namedPolicy(b);
  return isNarrow(p, 'activations') && !holderOf(b, p) ? policyOf('fp32') : p;
}

/** Whether this thread's backend keeps float32 tensors of `role` in a 2-byte format (see {@link devicePolicy}). */
export function storesNarrow(role: TensorRole): boolean {
  return isNarrow(devicePolicy(), role);
}

/**
 * The 2-byte format of values that travel and wait here: the device policy's (its activations'
 * storage, which a policy's other 2-byte roles share); on a thread whose backend holds none,
 * that of the one policy storing 2-byte values (backend/precision.ts onlyNarrowPolicy).
 */
function narrowFormat(): NumberFormat {
  const p = devicePolicy();
  return isNarrow(p, 'activations')
    ? p.storage.activations
    : onlyNarrowPolicy().storage.activations;
}

/** The rounding into `format`: this thread's backend's loop where it holds `format`, else plain JavaScript. */
function narrowing(format: NumberFormat): Narrowing {
  const h = holder();
  return h?.format === format ? h.round : narrowingTo(format);
}

/** The widening from `format`: this thread's backend's loop where it holds `format`, else plain JavaScript. */
function widening(format: NumberFormat): Widening {
  const h = holder();
  return h?.format === format ? h.widen : wideningFrom(format);
}

/** `v` rounded to the 2-byte storage format of this thread's policy (a new array; see {@link storesNarrow}). */
export function narrowValues(v: Float32Array): Uint16Array {
  const d = new Uint16Array(v.length);
  narrowing(narrowFormat())(v, d);
  return d;
}

/** 2-byte values (of this thread's policy's storage format) widened to float32 (exact; a new array). */
export function widenValues(d: Uint16Array): Float32Array {
  const f32 = new Float32Array(d.length);
  widening(narrowFormat())(d, f32);
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
 * it holds bfloat16 (the native addon's vectorised loop), else in JavaScript. RangeError on a
 * length mismatch.
 */
export function roundToBf16(src: Float32Array, dst: Uint16Array): void {
  narrowing('bfloat16')(src, dst);
}

/** dst[i] = the bf16 src[i] widened to float32 (exact): the backend's loop where it has one. */
export function widenBf16(src: Uint16Array, dst: Float32Array): void {
  widening('bfloat16')(src, dst);
}

/**
 * A float32 tensor of `shape` whose values are the 2-byte values `d` (this thread's policy's
 * storage format, see {@link narrowValues}) widened (exact): a parameter's 2-byte copy on the
 * device. `d` is taken over: the caller must not change it afterwards. On a backend holding
 * that format (the native backend at bf16) the device holds `d` itself (NativeBackend.fromBf16);
 * elsewhere a widened Float32Array. RangeError if `d`'s length is not the shape's size.
 */
export function tensorFromNarrow(d: Uint16Array, shape: number[]): tf.Tensor {
  const h = holder();
  if (h) return h.fromNarrow(d, shape);
  const n = tf.util.sizeFromShape(shape);
  if (d.length !== n)
    throw new RangeError(
      `tensorFromNarrow: ${d.length} 2-byte values for shape [${shape}] (${n} elements)`,
    );
  return tf.tensor(widenValues(d), shape, 'float32');
}

/**
 * An activation (an L2L stash coming back to the device) of `shape` whose values are the
 * 2-byte values `d` widened: as {@link tensorFromNarrow}, but not taken for a parameter (so
 * the products that read it keep their kind of output: backend/native.ts bf16Product). `d` is
 * taken over.
 */
export function activationFromNarrow(
  d: Uint16Array,
  shape: number[],
): tf.Tensor {
  const h = holder();
  if (h) return h.activationFromNarrow(d, shape);
  return tensorFromNarrow(d, shape);
}

/**
 * The kernel that rounds a float32 tensor to bf16 and widens it back in one pass (the native
 * backend's, backend/native.ts); {@link roundTensor} composes it where a backend has none.
 */
export const ROUND_BF16_KERNEL = 'LayerwiseRoundBf16';

/** Per 2-byte format, the name of a kernel that rounds a float32 tensor to it and widens it back in one pass. */
const ROUND_KERNELS: Partial<Record<NumberFormat, string>> = {
  bfloat16: ROUND_BF16_KERNEL,
};

/**
 * t's values rounded to this thread's 2-byte storage format (bf16 today, see {@link
 * narrowValues}) and widened back: a new float32 tensor of t's shape (t is kept). The
 * backend's one-pass kernel where it has one, else rounded and widened on the host.
 */
export function roundTensor(t: tf.Tensor): tf.Tensor {
  const format = narrowFormat();
  const kernel = ROUND_KERNELS[format];
  if (kernel && tf.getKernel(kernel, tf.getBackend()))
    return tf.engine().runKernel(kernel, { x: t }) as tf.Tensor;
  const v = t.dataSync() as Float32Array;
  const d = new Uint16Array(v.length);
  narrowing(format)(v, d);
  const f32 = new Float32Array(v.length);
  widening(format)(d, f32);
  return tf.tensor(f32, t.shape, 'float32');
}

/**
 * A layer-boundary activation at the run's precision: where this thread's policy stores
 * activations in a 2-byte format ({@link storesNarrow}; bf16 on the native backend) x's
 * float32 values rounded to it (a float32 tensor of x's shape), and in backward its gradient
 * rounded likewise; elsewhere x itself. Every strategy rounds at each block boundary
 * (pipeline/stage-params.ts applyBlocks; the L2L relay's stash and incoming gradients), so the
 * activations and gradients that stages send, and the stashes they keep, travel in the 2-byte
 * format without any strategy computing other numbers than a single device (issue 23 items 4
 * and 5).
 */
export function roundActivation(x: tf.Tensor): tf.Tensor {
  if (x.dtype !== 'float32' || !storesNarrow('activations')) return x;
  const round = tf.customGrad(((t: tf.Tensor) => ({
    value: roundTensor(t),
    gradFunc: (dy: tf.Tensor) => roundTensor(dy),
  })) as unknown as Parameters<typeof tf.customGrad>[0]);
  return round(x);
}

/**
 * Where this thread's policy stores saved activations in 2 bytes and its backend holds that
 * format (a {@link SavedHolder}: the native backend at bf16, webgpu at f16), replaces the
 * activations a recorded forward saved for its backward (`tape`: tfjs tape nodes,
 * pipeline/tape.ts) by 2-byte-only copies of them (NativeBackend.bf16Saved,
 * backend/webgpu-f16.ts f16Saved: 2 bytes per element instead of 4, the float32 values freed
 * unless something else holds them), as autocast keeps them (issue 23 item 4): the products'
 * operands (their gradients read them only as bf16 or f16 operands anyway: the same
 * gradients), GELU's input, attention's qkv and probabilities, layer norm's xhat (native's
 * gradients read bf16 inputs as they are; webgpu's copies are widened first,
 * {@link widenSavedForGradient}). Kept float32: parameters, statistics the backend marks so
 * (layer norm's rstd), and data a tensor outside the tape holds too (the stage's input).
 * Elsewhere does nothing.
 */
export function keepSavedAtComputePrecision(
  tape: ReadonlyArray<{ saved?: tf.Tensor[] }>,
): void {
  const h = savedHolder();
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
        copy = h.narrowSaved(t);
        copies.set(t.dataId, copy);
      } else if (copy !== null)
        copy = h.sharedSaved ? h.sharedSaved(copy, t) : tf.clone(copy);
      if (copy === null) return; // a parameter, or bf16 already
      // kept: made inside a recording's tidy scope, it must outlive that scope as saved tensors do
      saved[i] = tf.keep(copy); // in place: the node's gradient closure holds this array
      t.dispose();
    });
  }
}

/**
 * Before an op's gradient runs (pipeline/tape.ts gradientsOf): where this thread's backend
 * cannot read its 2-byte copies of saved activations as they are (webgpu's f16,
 * {@link keepSavedAtComputePrecision}), replaces each such copy in `saved` (in place: the
 * node's gradient closure holds the array) by its float32 widening, and frees the copy; the
 * widened tensors are freed with the node's saved tensors. Elsewhere does nothing.
 */
export function widenSavedForGradient(saved: tf.Tensor[] | undefined): void {
  const widen = saved?.length ? savedHolder()?.widenSaved : undefined;
  if (!widen || !saved) return;
  saved.forEach((t, i) => {
    if (!(t instanceof tf.Tensor)) return; // a shape kept in place of a tensor
    const wide = widen(t);
    if (wide === null) return;
    saved[i] = tf.keep(wide);
    t.dispose();
  });
}
