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
  useF16Arithmetic,
  type WebGPUBackendish,
} from './webgpu-kernels.js';
import { ownsWebGPUProducts, setProductOperands } from './webgpu-matmul.js';
import {
  bufferOf,
  constantUniforms,
  dispatch,
  newOutput,
  type RawBackend,
  stateOf,
} from './webgpu-multi.js';
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

/** `x` rounded to f16 and back, a new TensorInfo of x's shape on `backend`. */
function roundedF16(backend: unknown, x: tf.TensorInfo): tf.TensorInfo {
  const key = 'layerwise_round_f16';
  const program = new LayerwiseProgram(
    key,
    ['A'],
    x.shape,
    ROUND_F16_PROGRAM_WGSL,
    [],
  );
  return run(backend, program, [x], [], x.shape);
}

/**
 * The float32 shape each packed f16 copy ({@link packF16}) stands for, by the copy's tensor
 * (not its data: copies of one activation seen in two shapes, a reshape's, share the data).
 */
const packedShapes = new WeakMap<tf.Tensor, number[]>();

/**
 * `t` (float32, at least one element) packed as f16 on this thread's webgpu backend: an int32
 * tensor of ceil(size / 2) words, 2 bytes an element, element 2i in the low half of word i, each
 * rounded as {@link roundF16} rounds (nearest even, subnormals, infinite past f16's range);
 * {@link unpackF16} gives the float32 tensor back. {@link packF16Many} of one tensor.
 */
export function packF16(t: tf.Tensor): tf.Tensor {
  return packF16Many([t])[0]!;
}

/** The float32 tensor a {@link packF16} copy stands for (a new tensor, exact), or null for any other tensor. */
export function unpackF16(t: tf.Tensor): tf.Tensor | null {
  return packedShapes.has(t) ? unpackF16Many([t])[0]! : null;
}

/** Tensors one {@link packF16Many} / {@link unpackF16Many} dispatch converts: 4 in, 4 out, WebGPU's default 8 storage buffers a stage. */
export const F16_GROUP = 4;

/** Threads per workgroup of the grouped packing and widening. */
const GROUP_THREADS = 64;

/**
 * A WGSL module converting `count` tensors (bindings 0..count-1, of `from` elements) into as
 * many outputs (bindings count..2 count-1, of `to` elements): `functions` declared, then
 * `body(k)` run for tensor k by the invocation of word w (i = 2 w its first element; u.n[k] the
 * tensor's elements). One invocation per word of the longest tensor, workgroups flat over x and
 * y. roundF16's infinity comes from the uniforms (WGSL rejects an infinite constant).
 */
function groupModule(
  count: number,
  from: 'f32' | 'u32',
  to: 'f32' | 'u32',
  functions: string,
  body: (k: number) => string,
): string {
  const j = [...Array(count).keys()];
  return `
struct U { n : vec4<u32>, INFINITY : f32 };
${j.map((i) => `@group(0) @binding(${i}) var<storage, read> x${i} : array<${from}>;`).join('\n')}
${j.map((i) => `@group(0) @binding(${count + i}) var<storage, read_write> y${i} : array<${to}>;`).join('\n')}
@group(0) @binding(${2 * count}) var<uniform> uniforms : U;
${functions}
@compute @workgroup_size(${GROUP_THREADS})
fn main(@builtin(workgroup_id) wid : vec3<u32>,
        @builtin(num_workgroups) groups : vec3<u32>,
        @builtin(local_invocation_id) lid : vec3<u32>) {
  let w = (wid.y * groups.x + wid.x) * ${GROUP_THREADS}u + lid.x;
  let i = 2u * w;
${j.map(body).join('\n')}
}
`;
}

/**
 * Packing `count` float32 tensors into their f16 words: word w of tensor k holds its elements 2w
 * (low half) and 2w + 1, each rounded by roundF16 (a last odd element's high half is 0).
 */
const packManyWgsl = (count: number): string =>
  groupModule(
    count,
    'f32',
    'u32',
    `${ROUND_F16_WGSL}
${F16_BITS_WGSL}
fn word(a : f32) -> u32 {
  return f16Bits(roundF16(a));
}`,
    (k) => `  if (i < uniforms.n[${k}]) {
    var hi = 0u;
    if (i + 1u < uniforms.n[${k}]) {
      hi = word(x${k}[i + 1u]);
    }
    y${k}[w] = word(x${k}[i]) | (hi << 16u);
  }`,
  );

/** Widening `count` packed tensors into float32, exactly. */
const unpackManyWgsl = (count: number): string =>
  groupModule(
    count,
    'u32',
    'f32',
    F16_BITS_WGSL,
    (k) => `  if (i < uniforms.n[${k}]) {
    let v = x${k}[w];
    y${k}[i] = f16Value(v & 0xffffu);
    if (i + 1u < uniforms.n[${k}]) {
      y${k}[i + 1u] = f16Value(v >> 16u);
    }
  }`,
  );

/** Each module's WGSL by kind and count, made once (webgpu-multi.ts caches pipelines by code). */
const groupCode = new Map<string, string>();
function groupWgsl(kind: 'pack' | 'unpack', count: number): string {
  const key = `${kind}${count}`;
  let code = groupCode.get(key);
  if (code === undefined) {
    code = kind === 'pack' ? packManyWgsl(count) : unpackManyWgsl(count);
    groupCode.set(key, code);
  }
  return code;
}

/**
 * One dispatch converting `xs` (at most {@link F16_GROUP}, each of `sizes[j]` > 0 elements)
 * into new tensors of `shapes` and `dtype`: the pack or the widening of each. The uniforms are
 * kept by contents (the same sizes every step: no upload, as a captured step needs).
 */
function convertGroup(
  kind: 'pack' | 'unpack',
  xs: readonly tf.TensorInfo[],
  sizes: readonly number[],
  shapes: readonly number[][],
  dtype: tf.DataType,
): tf.TensorInfo[] {
  const b = tf.backend() as unknown as RawBackend;
  const s = stateOf(b);
  const outs = shapes.map((shape) => newOutput(b, [...shape], dtype));
  const u = new ArrayBuffer(32);
  new Uint32Array(u, 0, 4).set(sizes);
  new Float32Array(u, 16, 1).set([Infinity]);
  const words = Math.max(...sizes.map((n) => Math.ceil(n / 2)));
  dispatch(
    b,
    s,
    groupWgsl(kind, xs.length),
    [
      ...xs.map((x) => bufferOf(b, x)),
      ...outs.map(([, buffer]) => buffer),
      constantUniforms(b, s, u),
    ],
    Math.ceil(words / GROUP_THREADS),
    `lw_${kind}_f16_group [${xs.length}]`,
  );
  return outs.map(([info]) => info);
}

/** Runs `convert` on `xs` in groups of {@link F16_GROUP}, in order. */
function inGroups<T>(
  xs: readonly T[],
  convert: (group: T[]) => tf.Tensor[],
): tf.Tensor[] {
  const out: tf.Tensor[] = [];
  for (let i = 0; i < xs.length; i += F16_GROUP)
    out.push(...convert(xs.slice(i, i + F16_GROUP)));
  return out;
}

/**
 * `ts` (float32, each of at least one element) packed as f16 on this thread's webgpu backend,
 * each as {@link packF16} describes, one dispatch per {@link F16_GROUP} tensors.
 */
export function packF16Many(ts: readonly tf.Tensor[]): tf.Tensor[] {
  return inGroups(ts, (group) =>
    convertGroup(
      'pack',
      group,
      group.map((t) => t.size),
      group.map((t) => [Math.ceil(t.size / 2)]),
      'int32',
    ).map((info, j) => {
      const packed = tf.engine().makeTensorFromTensorInfo(info);
      packedShapes.set(packed, [...group[j]!.shape]);
      return packed;
    }),
  );
}

/**
 * The float32 tensors (new, exact) that `ts`, copies {@link packF16} or {@link packF16Many}
 * made, stand for, one dispatch per {@link F16_GROUP} tensors.
 * @throws Error for a tensor that is no such copy.
 */
export function unpackF16Many(ts: readonly tf.Tensor[]): tf.Tensor[] {
  const shapes = ts.map((t) => {
    const shape = packedShapes.get(t);
    if (shape === undefined)
      throw new Error(
        `unpackF16Many: tensor ${t.id} [${t.shape}] is not a packed f16 copy; widen only what packF16 or packF16Many made`,
      );
    return shape;
  });
  let at = 0;
  return inGroups(ts, (group) => {
    const gs = shapes.slice(at, (at += group.length));
    return convertGroup(
      'unpack',
      group,
      gs.map((shape) => shape.reduce((a, c) => a * c, 1)),
      gs,
      'float32',
    ).map((info) => tf.engine().makeTensorFromTensorInfo(info));
  });
}

/** Whether a saved activation waits packed as f16: float32, not a statistic (rank below 2, a last axis of 1; marked ones, low-precision.ts keepFloat32Saved, never come here), not empty. */
const packable = (t: tf.Tensor): boolean =>
  t.dtype === 'float32' &&
  t.rank >= 2 &&
  t.shape[t.rank - 1]! > 1 &&
  t.size > 0;

/**
 * Gives this thread's webgpu `backend` the f16 copies of saved activations that a policy whose
 * `saved` storage is float16 asks for (backend/low-precision.ts SAVED_HOLDERS), each method
 * over a recorded forward's tensors at once, a dispatch per {@link F16_GROUP} of them:
 * `f16Saved(ts)`, each packed as f16 ({@link packF16Many}: half the bytes while the activation
 * waits for the backward), or null where it stays float32 (a statistic: rank below 2, a last
 * axis of 1, such as layer norm's rstd, or marked by its kernel, attention's lse);
 * `widenF16Saved(ts)`, the float32 tensors the ops' gradients read, made just before they run.
 * The products' saved operands lose nothing (their gradients round them to f16 as they load
 * them); the other saved activations (GELU's input, layer norm's xhat, attention's inputs and
 * output) are rounded to f16 as autocast keeps them.
 */
export function installF16Saved(backend: object): void {
  Object.assign(backend, {
    f16Saved: (ts: readonly tf.Tensor[]): (tf.Tensor | null)[] => {
      const packed = packF16Many(ts.filter(packable));
      let next = 0;
      return ts.map((t) => (packable(t) ? packed[next++]! : null));
    },
    widenF16Saved: (ts: readonly tf.Tensor[]): (tf.Tensor | null)[] => {
      const wide = unpackF16Many(ts.filter((t) => packedShapes.has(t)));
      let next = 0;
      return ts.map((t) => (packedShapes.has(t) ? wide[next++]! : null));
    },
    f16SavedGroup: F16_GROUP,
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
