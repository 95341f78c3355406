/**
 * The run's precision as one policy (issue 35 item 1), chosen once from `--precision`: the
 * format of the matrix products' operands (compute), the storage format of each tensor role
 * (parameters' device copies, activations, the L2L stash, what stages send), the masters'
 * format and whether the loss is scaled. The backends, the wire, the stash, the parameter
 * server and the cost model ask it (or {@link devicePolicy} in backend/low-precision.ts, the
 * policy as this thread's backend holds it) instead of testing for a precision by name.
 * 'bf16' and 'f16' are two instances. Pure: no TF.js, no addon, so the parameter server's
 * optimizer threads and the page can take it.
 */
import { toBf16 } from '../util/bf16.js';
import type { Precision } from './names.js';

/** A number format: float32, or a 2-byte one. */
export type NumberFormat = 'float32' | 'bfloat16' | 'float16';

/**
 * The roles a tensor plays, each with its storage format: `params`, the copies of the
 * parameters that products read (beside the float32 masters; shipped instead of them by the
 * L2L relay); `activations`, block boundaries; `saved`, the activations a recorded forward
 * saves for its backward, which stay on the device (backend/low-precision.ts
 * keepSavedAtComputePrecision); `stash`, the L2L relay's stashed layer inputs; `wire`, what
 * stages send each other.
 */
export type TensorRole = 'params' | 'activations' | 'saved' | 'stash' | 'wire';

/** Plain-JavaScript rounding of float32 values into a 2-byte format (RangeError on a length mismatch). */
export type Narrowing = (src: Float32Array, dst: Uint16Array) => void;

/** One precision's formats. */
export interface PrecisionPolicy {
  readonly name: Precision;
  /** The products' operands (accumulation is float32 in every policy). */
  readonly compute: NumberFormat;
  /** Each role's storage format: float32, or 2-byte values that widen exactly to the float32 the tensors stand for. */
  readonly storage: Readonly<Record<TensorRole, NumberFormat>>;
  /** Master weights, optimizer state and gradient sums. */
  readonly master: 'float32';
  /** Dynamic loss scaling (optim/loss-scale.ts). */
  readonly lossScaling: boolean;
}

const FP32: PrecisionPolicy = {
  name: 'fp32',
  compute: 'float32',
  storage: {
    params: 'float32',
    activations: 'float32',
    saved: 'float32',
    stash: 'float32',
    wire: 'float32',
  },
  master: 'float32',
  lossScaling: false,
};

/** bf16 on the native backend: products, their parameters' copies and every block boundary in bfloat16. */
const BF16: PrecisionPolicy = {
  name: 'bf16',
  compute: 'bfloat16',
  storage: {
    params: 'bfloat16',
    activations: 'bfloat16',
    saved: 'bfloat16',
    stash: 'bfloat16',
    wire: 'bfloat16',
  },
  master: 'float32',
  lossScaling: false,
};

/**
 * f16 on webgpu: f16 numerics of the products (backend/webgpu-f16.ts), the activations a
 * recorded forward saves for its backward stored as f16 on the device (2 bytes an element,
 * widened for their op's gradient), everything that leaves the device or crosses a block in
 * float32; loss scaled.
 */
const F16: PrecisionPolicy = {
  name: 'f16',
  compute: 'float16',
  storage: { ...FP32.storage, saved: 'float16' },
  master: 'float32',
  lossScaling: true,
};

const POLICIES: Record<Precision, PrecisionPolicy> = {
  fp32: FP32,
  bf16: BF16,
  f16: F16,
};

/** The policy of `precision` (a member of backend/names.ts PRECISIONS; RangeError otherwise). */
export function policyOf(precision: string): PrecisionPolicy {
  const p = POLICIES[precision as Precision];
  if (!p) throw new RangeError(`unknown precision '${precision}'`);
  return p;
}

/** Bytes per element of `format`. */
export function bytesOfFormat(format: NumberFormat): number {
  return format === 'float32' ? 4 : 2;
}

/** Whether `role` is stored in a 2-byte format under `policy`. */
export function isNarrow(policy: PrecisionPolicy, role: TensorRole): boolean {
  return policy.storage[role] !== 'float32';
}

/** Bytes per element of a float32 tensor in `role` under `policy`. */
export function bytesPerElement(
  policy: PrecisionPolicy,
  role: TensorRole,
): number {
  return bytesOfFormat(policy.storage[role]);
}

/**
 * Bytes of the device copy of a product-read parameter of `elements` values (0 where the
 * policy keeps no copy: the parameter is read as its float32 master).
 */
export function deviceCopyBytes(
  policy: PrecisionPolicy,
  elements: number,
): number {
  return isNarrow(policy, 'params')
    ? bytesPerElement(policy, 'params') * elements
    : 0;
}

/** Exact widening of 2-byte values into float32 (no length check: dst must be as long as src). */
export type Widening = (src: Uint16Array, dst: Float32Array) => void;

/** A native addon's vectorised rounding loops (backend/native-addon.ts). */
interface NarrowingAddon {
  toBf16(src: Float32Array, dst: Uint16Array): void;
}

/** A native addon's vectorised widening loops (backend/native-addon.ts). */
interface WideningAddon {
  fromBf16(src: Uint16Array, dst: Float32Array): void;
}

/**
 * The rounding of float32 values into `format`: the addon's vectorised loop where `lib` is
 * given, else plain JavaScript. RangeError for a format without a rounding here (float32, and
 * float16, which webgpu's shader rounds on the device).
 */
export function narrowingTo(
  format: NumberFormat,
  lib?: NarrowingAddon,
): Narrowing {
  if (format !== 'bfloat16')
    throw new RangeError(`no host rounding to ${format}`);
  return lib ? (src, dst) => lib.toBf16(src, dst) : toBf16;
}

/** bfloat16 values widened to float32 in plain JavaScript: the bits shifted into the high half. */
function widenBf16Js(src: Uint16Array, dst: Float32Array): void {
  const u = new Uint32Array(dst.buffer, dst.byteOffset, dst.length);
  for (let i = 0; i < src.length; i++) u[i] = src[i]! << 16;
}

/**
 * The exact widening of `format`'s values into float32: the addon's vectorised loop where
 * `lib` is given, else plain JavaScript. RangeError for a format without a widening here
 * (float32, float16).
 */
export function wideningFrom(
  format: NumberFormat,
  lib?: WideningAddon,
): Widening {
  if (format !== 'bfloat16')
    throw new RangeError(`no host widening from ${format}`);
  return lib ? (src, dst) => lib.fromBf16(src, dst) : widenBf16Js;
}

/**
 * The format of the 2-byte parameter copies that the parameter server keeps beside its float32
 * masters under `policy` (its storage.params; param-server/store.ts). RangeError naming the
 * fix where the policy stores parameters as float32 (it keeps no copies).
 */
export function paramCopyFormat(policy: PrecisionPolicy): NumberFormat {
  if (!isNarrow(policy, 'params'))
    throw new RangeError(
      `precision '${policy.name}' keeps no 2-byte parameter copies (its parameters are stored as float32): ask for copies only under a policy whose storage.params is a 2-byte format`,
    );
  return policy.storage.params;
}

/**
 * The one policy that stores some host-visible role ({@link ROLES}) in a 2-byte format (bf16
 * today; f16 stores only `saved` so): the policy of a caller
 * that asks for 2-byte values without naming its precision (the parameter server's copies
 * where strategies/l2l.ts passes no precision; 2-byte values reaching a thread whose backend
 * holds none, backend/low-precision.ts). RangeError once several policies do (then the caller
 * must name its precision).
 */
export function onlyNarrowPolicy(): PrecisionPolicy {
  const narrow = Object.values(POLICIES).filter((p) =>
    ROLES.some((r) => isNarrow(p, r)),
  );
  if (narrow.length !== 1)
    throw new RangeError(
      `${narrow.length} precisions store 2-byte values (${narrow.map((p) => p.name)}): name the run's precision where 2-byte values are asked for`,
    );
  return narrow[0]!;
}

/**
 * The roles whose values leave the device or wait on the host (`saved` stays on the device, in
 * its backend's own representation): those {@link onlyNarrowPolicy} asks about.
 */
const ROLES: readonly TensorRole[] = ['params', 'activations', 'stash', 'wire'];

/** The policy named `name`, or undefined where `name` names none (a backend without a precision). */
export function knownPolicy(name: unknown): PrecisionPolicy | undefined {
  return typeof name === 'string' && Object.hasOwn(POLICIES, name)
    ? POLICIES[name as Precision]
    : undefined;
}
