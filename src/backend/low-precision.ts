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
  /** Each saved activation's 2-byte-only copy, or null where it keeps the tensor (see {@link keepSavedAtComputePrecision}). */
  narrowSaved(ts: readonly tf.Tensor[]): (tf.Tensor | null)[];
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
      narrowSaved: (ts) => ts.map((t) => n.bf16Saved(t)),
    };
  },
};

/**
 * A backend that keeps the activations a recorded forward saves for its backward in its
 * policy's 2-byte `saved` format (backend/precision.ts): `narrowSaved` makes saved tensors'
 * 2-byte copies (null where it keeps a tensor as it is); `widenSaved`, where the backend's
 * kernels cannot read such copies as they are, gives the float32 tensors the ops' gradients read
 * (null for a tensor that is no such copy); each for `group` tensors at a time (one dispatch on
 * webgpu).
 */
interface SavedHolder {
  narrowSaved(ts: readonly tf.Tensor[]): (tf.Tensor | null)[];
  widenSaved?(ts: readonly tf.Tensor[]): (tf.Tensor | null)[];
  /** How many tensors one narrowSaved or widenSaved call converts together (1 if absent). */
  group?: number;
  /**
   * The copy for `t`, a saved tensor on the data `copy` was made from (a reshape of it, say):
   * a clone of `copy` standing for t's shape. tf.clone where absent (a copy of t's shape already).
   */
  sharedSaved?(copy: tf.Tensor, t: tf.Tensor): tf.Tensor;
}

/** The webgpu backend's f16 copies of saved activations (backend/webgpu-f16.ts installF16Saved). */
interface F16SavedBackend {
  f16Saved(ts: readonly tf.Tensor[]): (tf.Tensor | null)[];
  widenF16Saved(ts: readonly tf.Tensor[]): (tf.Tensor | null)[];
  f16SavedGroup: number;
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
      narrowSaved: (ts) => f.f16Saved(ts),
      widenSaved: (ts) => f.widenF16Saved(ts),
      group: f.f16SavedGroup,
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

/**
 * `v` rounded to the 2-byte storage format of this thread's policy (see {@link storesNarrow}),
 * into `out` (of v's length; a new array where not given), which is returned.
 */
export function narrowValues(
  v: Float32Array,
  out: Uint16Array = new Uint16Array(v.length),
): Uint16Array {
  narrowing(narrowFormat())(v, out);
  return out;
}

/**
 * 2-byte values (of this thread's policy's storage format) widened to float32 (exact), into
 * `out` (of d's length; a new array where not given), which is returned.
 */
export function widenValues(
  d: Uint16Array,
  out: Float32Array = new Float32Array(d.length),
): Float32Array {
  widening(narrowFormat())(d, out);
  return out;
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

/** Data of kernel outputs that stay float32 when saved for a backward (see {@link keepFloat32Saved}). */
const statistics = new WeakSet<tf.DataId>();

/**
 * Marks a kernel's output as a statistic that stays float32 when a recorded forward saves it
 * for the backward, whatever the policy's `saved` format ({@link keepSavedAtComputePrecision}):
 * layer norm's rstd on native, attention's log-sum-exp on webgpu (its f16 rounding would move
 * every recomputed probability by up to 0.4%). Any backend's kernels; returns `out`.
 */
export function keepFloat32Saved<T extends tf.TensorInfo>(out: T): T {
  statistics.add(out.dataId);
  return out;
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
 * {@link widenSavedForGradient}). Kept float32: parameters, statistics a kernel marks so
 * ({@link keepFloat32Saved}), and data a tensor outside the tape holds too (the
 * stage's input). The holder converts its `group` tensors at a time (webgpu: 4 a dispatch), and
 * where copies are widened for the gradients, the backward widens them in groups of as many, in
 * the order it reaches them. Elsewhere does nothing.
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
  // one tensor per data, in tape order, converted `group` at a time as the walk below reaches
  // them (so that the float32 originals are freed as before, a few copies early at most)
  const firsts = new Map<tf.DataId, tf.Tensor>();
  for (const node of tape)
    for (const t of node.saved ?? [])
      if (
        t instanceof tf.Tensor &&
        !heldElsewhere.has(t.dataId) &&
        !statistics.has(t.dataId) &&
        t.dtype === 'float32' &&
        !firsts.has(t.dataId)
      )
        firsts.set(t.dataId, t);
  const order = [...firsts.values()];
  const size = h.group ?? 1;
  const copies = new Map<tf.DataId, tf.Tensor | null>();
  const copyOf = (t: tf.Tensor): tf.Tensor | null => {
    if (!firsts.has(t.dataId)) return null; // kept: held elsewhere, bf16 already
    if (!copies.has(t.dataId)) {
      const from = copies.size; // the tensors before it were converted: it is next in order
      const group = order.slice(from, from + size);
      h.narrowSaved(group).forEach((c, j) => copies.set(group[j]!.dataId, c));
    }
    return copies.get(t.dataId)!;
  };
  const slots: SavedSlot[][] = [];
  const given = new Set<tf.DataId>(); // data whose copy a slot took: later slots get their own
  for (const node of tape) {
    const saved = node.saved;
    const mine: SavedSlot[] = [];
    slots.push(mine);
    saved?.forEach((t, i) => {
      if (!(t instanceof tf.Tensor)) return;
      let copy = copyOf(t);
      if (copy === null) return; // kept: a parameter, a statistic, bf16 already, held elsewhere
      if (given.has(t.dataId))
        copy = h.sharedSaved ? h.sharedSaved(copy, t) : tf.clone(copy);
      given.add(t.dataId);
      // kept: made inside a recording's tidy scope, it must outlive that scope as saved tensors do
      saved[i] = tf.keep(copy); // in place: the node's gradient closure holds this array
      mine.push({ saved, i, copy: saved[i]! });
      t.dispose();
    });
  }
  if (h.widenSaved) groupForWidening(slots, size);
}

/** A saved tensor's 2-byte copy and where it sits: `saved[i]` of a tape node. */
interface SavedSlot {
  saved: tf.Tensor[];
  i: number;
  copy: tf.Tensor;
}

/** The copies widened together with each copy ({@link widenSavedForGradient}), and whether they were. */
const wideningGroups = new WeakMap<
  tf.Tensor,
  { slots: SavedSlot[]; done: boolean }
>();

/**
 * Groups the copies of a recorded forward (`slots`, by tape node in forward order) in the order
 * the backward reaches them (nodes last to first), `size` copies a group: the first of a group
 * an op's gradient needs widens the whole group, so `size` copies cost one conversion.
 */
function groupForWidening(slots: SavedSlot[][], size: number): void {
  let group = { slots: [] as SavedSlot[], done: false };
  for (let n = slots.length - 1; n >= 0; n--)
    for (const slot of slots[n]!) {
      if (group.slots.length === size) group = { slots: [], done: false };
      group.slots.push(slot);
      wideningGroups.set(slot.copy, group);
    }
}

/**
 * Before an op's gradient runs (pipeline/tape.ts gradientsOf): where this thread's backend
 * cannot read its 2-byte copies of saved activations as they are (webgpu's f16,
 * {@link keepSavedAtComputePrecision}), replaces each such copy in `saved` (in place: the
 * node's gradient closure holds the array) by its float32 widening, and frees the copy; the
 * widened tensors are freed with the node's saved tensors. A copy's whole widening group is
 * widened at once, in the saved arrays of the ops the backward reaches next, so that their
 * gradients find theirs made. Elsewhere does nothing.
 */
export function widenSavedForGradient(saved: tf.Tensor[] | undefined): void {
  const widen = saved?.length ? savedHolder()?.widenSaved : undefined;
  if (!widen || !saved) return;
  for (const t of saved) {
    const group = t instanceof tf.Tensor ? wideningGroups.get(t) : undefined;
    if (!group || group.done) continue;
    group.done = true;
    // the group's copies still waiting (a node released unrun has disposed its own)
    const live = group.slots.filter(
      (s) => !s.copy.isDisposed && s.saved[s.i] === s.copy,
    );
    const wide = widen(live.map((s) => s.copy));
    live.forEach((s, j) => {
      const w = wide[j];
      if (w == null) return;
      s.saved[s.i] = tf.keep(w);
      s.copy.dispose();
    });
  }
}
