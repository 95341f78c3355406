/**
 * `--precision f16` on the webgpu backend (issue 23 item 6): the matrix products take their
 * operands rounded to IEEE half precision (f16) and accumulate in float32, the numerics of
 * f16 products on GPUs (Micikevicius et al., ICLR 2018); everything else (norms, softmax, the
 * loss, gradient sums, master weights, optimizer state) stays float32. layerwise's own products
 * (backend/webgpu-matmul.ts) round the operands as their tiles are loaded, in their one
 * dispatch; TF.js 4.22's stock kernels (LAYERWISE_WEBGPU_KERNELS=tfjs) are float32 only, so
 * there the operands are rounded by a shader of ours first ({@link ROUND_F16_PROGRAM_WGSL}:
 * nearest-even on the bits, f16's subnormals, values past f16's range made infinite so that
 * loss scaling sees the overflow). f16 numerics in float32 storage (documented as such in
 * README), except the activations saved for the backward, which wait packed as f16
 * ({@link installF16Saved}). The adapter must
 * have `shader-f16` (backend/index.ts checks); the device is made with it (backend/webgpu.ts
 * requestShaderF16) and GELU and its gradient then compute in f16 arithmetic
 * (backend/webgpu-kernels.ts useF16Arithmetic).
 */
import type { PrecisionPolicy } from './precision.js';
import { tf, wrapStockKernel } from './tfjs.js';
import {
  LayerwiseProgram,
  run,
  type Uniform,
  useF16Arithmetic,
  type WebGPUBackendish,
} from './webgpu-kernels.js';
import { ownsWebGPUProducts, setProductOperands } from './webgpu-matmul.js';
import { ROUND_F16_WGSL } from './wgsl/matmul.js';

/** Rounds every element of a float32 tensor to the nearest f16 value and back (overflow: +-Infinity). */
const ROUND_F16_PROGRAM_WGSL = `
  ${ROUND_F16_WGSL}
  fn main(index : i32) {
    if (index < uniforms.size) {
      setOutputAtIndex(index, roundF16(A[index]));
    }
  }
`;

/**
 * WGSL: the IEEE binary16 bits of `v`, a float32 value that f16 represents exactly (what
 * roundF16 returns: infinities and NaN included), and the float32 value of binary16 bits `h`
 * (exact). Plain u32 arithmetic, so that no f16 type (shader-f16) and no pack2x16float (whose
 * result past f16's range WGSL leaves indeterminate) is needed.
 */
const F16_BITS_WGSL = `
  fn f16Bits(v : f32) -> u32 {
    let b = bitcast<u32>(v);
    let sign = (b >> 16u) & 0x8000u;
    let mag = b & 0x7fffffffu;
    if (mag > 0x7f800000u) {
      return sign | 0x7e00u;
    }
    if (mag == 0x7f800000u) {
      return sign | 0x7c00u;
    }
    if (mag < 0x38800000u) {
      return sign | u32(abs(v) * 16777216.0);
    }
    return sign | (((mag >> 23u) - 112u) << 10u) | ((mag >> 13u) & 0x3ffu);
  }
  fn f16Value(h : u32) -> f32 {
    let sign = (h & 0x8000u) << 16u;
    let e = (h >> 10u) & 0x1fu;
    let m = h & 0x3ffu;
    if (e == 0u) {
      return select(1.0, -1.0, sign != 0u) * (f32(m) / 16777216.0);
    }
    if (e == 31u) {
      return bitcast<f32>(sign | 0x7f800000u | (m << 13u));
    }
    return bitcast<f32>(sign | ((e + 112u) << 23u) | (m << 13u));
  }
`;

/**
 * Packs n float32 values (input A) into ceil(n / 2) int32 words, each two of them rounded to f16
 * (as {@link ROUND_F16_PROGRAM_WGSL}: nearest even, subnormals, infinite past f16's range),
 * element 2i in the low half of word i.
 */
const PACK_F16_WGSL = `
  ${ROUND_F16_WGSL}
  ${F16_BITS_WGSL}
  fn main(index : i32) {
    if (index < uniforms.size) {
      let i = 2 * index;
      let lo = f16Bits(roundF16(A[i]));
      var hi = 0u;
      if (i + 1 < uniforms.n) {
        hi = f16Bits(roundF16(A[i + 1]));
      }
      setOutputAtIndexI32(index, bitcast<i32>(lo | (hi << 16u)));
    }
  }
`;

/** The float32 values (exact) of the f16 values {@link PACK_F16_WGSL} packed (input A). */
const UNPACK_F16_WGSL = `
  ${F16_BITS_WGSL}
  fn main(index : i32) {
    if (index < uniforms.size) {
      let word = bitcast<u32>(A[index / 2]);
      let h = select(word & 0xffffu, word >> 16u, index % 2 == 1);
      setOutputAtIndex(index, f16Value(h));
    }
  }
`;

/** Runs one of this file's programs (`key`, `code`) on `x` (input A) into an output of `shape` and `dtype`. */
function runOn(
  backend: unknown,
  key: string,
  code: string,
  x: tf.TensorInfo,
  shape: number[],
  dtype: tf.DataType = 'float32',
  uniforms: readonly Uniform[] = [],
): tf.TensorInfo {
  const program = new LayerwiseProgram(key, ['A'], shape, code, uniforms);
  return run(backend, program, [x], uniforms, shape, dtype);
}

/** `x` rounded to f16 and back, a new TensorInfo of x's shape on `backend`. */
const roundedF16 = (backend: unknown, x: tf.TensorInfo) =>
  runOn(backend, 'layerwise_round_f16', ROUND_F16_PROGRAM_WGSL, x, x.shape);

/**
 * The float32 shape each packed f16 copy ({@link packF16}) stands for, by the copy's tensor
 * (not its data: copies of one activation seen in two shapes, a reshape's, share the data).
 */
const packedShapes = new WeakMap<tf.Tensor, number[]>();

/**
 * `t` (float32) packed as f16 on this thread's webgpu backend: an int32 tensor of
 * ceil(size / 2) words, 2 bytes an element (see {@link PACK_F16_WGSL}); {@link unpackF16}
 * gives the float32 tensor back. For tests and {@link installF16Saved}.
 */
export function packF16(t: tf.Tensor): tf.Tensor {
  const words = [Math.ceil(t.size / 2)];
  const info = runOn(
    tf.backend(),
    'layerwise_pack_f16',
    PACK_F16_WGSL,
    t,
    words,
    'int32',
    [['n', 'i32', t.size]],
  );
  const packed = tf.engine().makeTensorFromTensorInfo(info);
  packedShapes.set(packed, [...t.shape]);
  return packed;
}

/** The float32 tensor a {@link packF16} copy stands for (a new tensor), or null for any other tensor. */
export function unpackF16(t: tf.Tensor): tf.Tensor | null {
  const shape = packedShapes.get(t);
  if (shape === undefined) return null;
  const info = runOn(
    tf.backend(),
    'layerwise_unpack_f16',
    UNPACK_F16_WGSL,
    t,
    shape,
  );
  return tf.engine().makeTensorFromTensorInfo(info);
}

/**
 * Gives this thread's webgpu `backend` the f16 copies of saved activations that a policy whose
 * `saved` storage is float16 asks for (backend/low-precision.ts SAVED_HOLDERS): `f16Saved(t)`,
 * t packed as f16 ({@link packF16}: half the bytes while the activation waits for the
 * backward), or null where t stays float32 (a statistic: rank below 2, or a last axis of 1,
 * such as layer norm's rstd); `widenF16Saved(t)`, the float32 tensor an op's gradient reads,
 * made just before it runs. The products' saved operands lose nothing (their gradients round
 * them to f16 as they load them); the other saved activations (GELU's input, layer norm's
 * xhat, attention's inputs and probabilities) are rounded to f16 as autocast keeps them.
 */
export function installF16Saved(backend: object): void {
  Object.assign(backend, {
    f16Saved: (t: tf.Tensor): tf.Tensor | null =>
      t.dtype === 'float32' && t.rank >= 2 && t.shape[t.rank - 1]! > 1
        ? packF16(t)
        : null,
    widenF16Saved: (t: tf.Tensor): tf.Tensor | null => unpackF16(t),
    // another saved tensor on the packed data (a reshape of it): the same words, its shape
    sharedF16Saved: (copy: tf.Tensor, t: tf.Tensor): tf.Tensor => {
      const c = tf.clone(copy);
      packedShapes.set(c, [...t.shape]);
      return c;
    },
  });
}

/** The products whose operands {@link registerF16Products} rounds. */
const PRODUCTS = ['BatchMatMul', '_FusedMatMul'] as const;

let registered = false;

/**
 * Makes this thread's webgpu BatchMatMul and _FusedMatMul take their two operands in the
 * policy's compute format, f16 (forward and backward: the gradients' products are BatchMatMuls
 * too), and GELU and its gradient compute in f16 where the device has shader-f16. Where the
 * products are layerwise's (backend/webgpu-matmul.ts) they round the operands as they load
 * them, in their one dispatch; TF.js's stock kernels (LAYERWISE_WEBGPU_KERNELS=tfjs) are wrapped
 * to round both operands first (two dispatches more). Once per thread.
 * @throws Error for a policy whose compute format is not float16.
 */
export function registerF16Products(policy: PrecisionPolicy): void {
  if (registered) return;
  if (policy.compute !== 'float16')
    throw new Error(
      `registerF16Products is for a policy computing in float16, not ${policy.compute} (${policy.name})`,
    );
  registered = true;
  useF16Arithmetic(true);
  if (ownsWebGPUProducts()) {
    setProductOperands(policy.compute);
    return;
  }
  for (const name of PRODUCTS)
    wrapStockKernel(name, 'webgpu', (stock) => ({ inputs, backend, attrs }) => {
      const b = backend as unknown as WebGPUBackendish;
      const a16 = roundedF16(b, inputs.a as tf.TensorInfo);
      const b16 = roundedF16(b, inputs.b as tf.TensorInfo);
      try {
        return stock({
          inputs: { ...inputs, a: a16, b: b16 },
          backend,
          attrs,
        });
      } finally {
        b.disposeData(a16.dataId);
        b.disposeData(b16.dataId);
      }
    });
}

/** Rounds `t` to f16 on this thread's webgpu backend (a new tensor; for tests). */
export function roundF16(t: tf.Tensor): tf.Tensor {
  return tf.engine().makeTensorFromTensorInfo(roundedF16(tf.backend(), t));
}
