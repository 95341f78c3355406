/**
 * The MLP's product + bias + GELU on webgpu (kernel-names.ts DENSE_GELU_KERNEL, issue 36 item 1)
 * in one dispatch where `_FusedMatMul` then LayerwiseGelu took two: layerwise's tiled product
 * (backend/webgpu-matmul.ts, wgsl/matmul.ts) whose epilogue writes both outputs, h = x w + b
 * and y = GELU(h) (wgsl/dense-gelu.ts). The numbers are the two kernels': the same tiles and
 * f32 sums, the same bias add, GELU's math; under `--precision f16` the operands are rounded to
 * f16 as they are loaded (backend/webgpu-matmul.ts setProductOperands) and GELU's sigmoid factor
 * is computed in f16 where the device has shader-f16 (webgpu-kernels.ts f16Arithmetic), as the
 * two kernels do. Its gradient (backend/matmul-grad.ts) starts with DENSE_GELU_GRAD_KERNEL,
 * here one dispatch too: dh = dy GELU'(h) with the bias's gradient, dh's column sums, where
 * GELU's gradient and the column sum (webgpu-matmul-bias.ts) took two; then the products.
 *
 * Two outputs, so not a TF.js program (which writes one): a pipeline of ours on TF.js's command
 * encoder (backend/webgpu-multi.ts dispatch, counted by gpu-queue.ts like TF.js's programs).
 * Inputs it leaves to the composed form (composed-kernels.ts composedDenseGelu: our
 * `_FusedMatMul`, then GELU): non-float32 tensors, empty outputs, and more output tiles than
 * one dispatch holds (65,535^2).
 */
import {
  composedDenseGelu,
  composedDenseGeluGrad,
} from './composed-kernels.js';
import {
  checkDenseGelu,
  DENSE_GELU_GRAD_KERNEL,
  DENSE_GELU_KERNEL,
} from './kernel-names.js';
import { tf } from './tfjs.js';
import { f16Arithmetic } from './webgpu-kernels.js';
import { productOperands, productTiling } from './webgpu-matmul.js';
import {
  bufferOf,
  constantUniforms,
  dispatch,
  newOutput,
  type RawBackend,
  stateOf,
} from './webgpu-multi.js';
import {
  denseGeluWgsl,
  GRAD_COLUMNS,
  geluGradColumnSumWgsl,
} from './wgsl/dense-gelu.js';
import type { MatMulTiling } from './wgsl/matmul.js';

/** WebGPU's default maxComputeWorkgroupsPerDimension: the tiles are numbered over x and y. */
const MAX_WORKGROUPS = 65535;

/** The compiled modules' code by variant (the pipelines are cached by code in webgpu-multi.ts). */
const modules = new Map<string, string>();

function moduleOf(
  kind: 'forward' | 'grad',
  operands: 'float32' | 'float16',
  geluF16: boolean,
  tiling?: MatMulTiling,
): string {
  const key = `${kind}_${operands}_${geluF16}_${tiling?.name}`;
  let code = modules.get(key);
  if (code === undefined) {
    code =
      kind === 'forward'
        ? denseGeluWgsl(operands, geluF16, tiling!)
        : geluGradColumnSumWgsl(geluF16);
    modules.set(key, code);
  }
  return code;
}

/**
 * The tiling of the dense + GELU product of an [m, k] x [k, n] product (backend/webgpu-matmul.ts
 * productTiling: the large tile for large outputs), its output tiles along N and in all (the
 * dispatch's workgroups).
 */
export function denseGeluTiles(
  m: number,
  n: number,
): { tiling: MatMulTiling; tilesN: number; tiles: number } {
  const tiling = productTiling(m, n, 1);
  const tilesN = Math.ceil(n / tiling.tileN);
  return { tiling, tilesN, tiles: tilesN * Math.ceil(m / tiling.tileM) };
}

/** The uniforms of wgsl/dense-gelu.ts DENSE_GELU_UNIFORMS for an [m, k] x [k, n] product and its tiles ({@link denseGeluTiles}, computed once by the caller). */
function denseGeluUniforms(
  m: number,
  k: number,
  n: number,
  { tilesN, tiles }: ReturnType<typeof denseGeluTiles>,
): ArrayBuffer {
  const u = new ArrayBuffer(13 * 4);
  // M, N, K; batches of A, B and the bias; the bias's strides per batch, row and column
  new Int32Array(u, 0, 9).set([m, n, k, 1, 1, 1, 0, 0, 1]);
  new Float32Array(u, 36, 2).set([0, Number.POSITIVE_INFINITY]); // alpha, INFINITY
  new Int32Array(u, 44, 2).set([tilesN, tiles]);
  return u;
}

type KernelArgs = Parameters<tf.KernelConfig['kernelFunc']>[0];

/** DENSE_GELU_KERNEL on webgpu: [y, h] in one dispatch, or the composed form (see the module's comment). */
function denseGelu(args: KernelArgs): tf.TensorInfo[] {
  const { x, w, b } = args.inputs as Record<string, tf.TensorInfo>;
  const [m, k, n] = checkDenseGelu(x!, w!, b!);
  const tiled = denseGeluTiles(m, n);
  const { tiling, tiles } = tiled;
  if (
    [x!, w!, b!].some((t) => t.dtype !== 'float32') ||
    m * n === 0 ||
    tiles > MAX_WORKGROUPS * MAX_WORKGROUPS
  )
    return tf.tidy(() =>
      composedDenseGelu(args.inputs as Record<string, tf.Tensor>),
    );
  const raw = args.backend as unknown as RawBackend;
  const s = stateOf(raw);
  const shape = [...x!.shape.slice(0, -1), n];
  const [y, yBuffer] = newOutput(raw, shape);
  const [h, hBuffer] = newOutput(raw, shape);
  const inputs = [x!, w!, b!].map((t) => bufferOf(raw, t));
  const uniforms = constantUniforms(raw, s, denseGeluUniforms(m, k, n, tiled));
  const code = moduleOf(
    'forward',
    productOperands(),
    f16Arithmetic(args.backend),
    tiling,
  );
  const label = `lw_dense_gelu [${h.shape}]`;
  dispatch(raw, s, code, [...inputs, yBuffer, hBuffer, uniforms], tiles, label);
  return [y, h];
}

/**
 * DENSE_GELU_GRAD_KERNEL on webgpu: [dh, db] in one dispatch (wgsl/dense-gelu.ts
 * geluGradColumnSumWgsl), or the composed form for non-float32 or empty tensors.
 */
function denseGeluGrad(args: KernelArgs): tf.TensorInfo[] {
  const { h, dy } = args.inputs as Record<string, tf.TensorInfo>;
  const cols = h!.shape[h!.shape.length - 1] ?? 1;
  const size = tf.util.sizeFromShape(h!.shape);
  const groups = Math.ceil(cols / GRAD_COLUMNS);
  if (
    [h!, dy!].some((t) => t.dtype !== 'float32') ||
    size === 0 ||
    groups > MAX_WORKGROUPS * MAX_WORKGROUPS
  )
    return tf.tidy(() =>
      composedDenseGeluGrad(args.inputs as Record<string, tf.Tensor>),
    );
  if (!tf.util.arraysEqual(h!.shape, dy!.shape))
    throw new Error(
      `${DENSE_GELU_GRAD_KERNEL}: h [${h!.shape}] and dy [${dy!.shape}] differ`,
    );
  const raw = args.backend as unknown as RawBackend;
  const s = stateOf(raw);
  const [dh, dhBuffer] = newOutput(raw, h!.shape);
  const [db, dbBuffer] = newOutput(raw, [cols]);
  const u = new Uint32Array([size / cols, cols, groups]).buffer;
  const code = moduleOf('grad', 'float32', f16Arithmetic(args.backend));
  const buffers = [h!, dy!].map((t) => bufferOf(raw, t));
  const uniforms = constantUniforms(raw, s, u);
  const label = `lw_dense_gelu_grad [${dh.shape}]`;
  dispatch(
    raw,
    s,
    code,
    [...buffers, dhBuffer, dbBuffer, uniforms],
    groups,
    label,
  );
  return [dh, db];
}

/**
 * Registers DENSE_GELU_KERNEL's and DENSE_GELU_GRAD_KERNEL's one-dispatch forms for 'webgpu' in
 * this thread (the only backend that has the op: elsewhere model/layers.ts denseGelu runs dense
 * then gelu). Called by backend/index.ts initBackend after webgpu-matmul.ts registerWebGPUMatMul.
 */
export function registerWebGPUDenseGelu(): void {
  for (const [kernelName, kernelFunc] of [
    [DENSE_GELU_KERNEL, denseGelu],
    [DENSE_GELU_GRAD_KERNEL, denseGeluGrad],
  ] as const) {
    if (tf.getKernel(kernelName, 'webgpu') !== undefined)
      tf.unregisterKernel(kernelName, 'webgpu');
    tf.registerKernel({
      kernelName,
      backendName: 'webgpu',
      kernelFunc: kernelFunc as unknown as tf.KernelFunc,
    });
  }
}
