/**
 * Causal attention on the webgpu backend as WGSL kernels of our own (issue 36 item 1), in place
 * of the composed form's chain of stock ops (backend/composed-kernels.ts: head split, transposes,
 * two batched products, mask, softmax, merge). Same names, inputs, outputs and math as
 * kernel-names.ts declares (the native kernels' too): the forward outputs ctx [B, T, D] and the
 * probabilities P [B, H, T, T], which the gradient reads; two dispatches each way:
 *
 * - forward: P by rows (a workgroup of 64 query rows of one (batch, head) walks the key blocks,
 *   held in workgroup memory, with a running max and sum, then writes its rows of P), and
 *   ctx = P V by rows (the values in workgroup memory block by block);
 * - gradient: dS = scale P (dP - rowsum(dP P)) by rows (dP = dctx v^T, values in workgroup
 *   memory block by block), then dqkv by rows (dq = dS k over keys j <= t; dk = dS^T q and
 *   dv = P^T dctx over queries i >= t; one set of workgroups each); dS is a temporary of P's
 *   size, freed before the kernel returns.
 *
 * Measured on an H100 through Dawn's Vulkan backend (forward + gradient, float32, 10 runs
 * after 2, two rounds each, 2026-11-26): 1.6 ms against the composed form's 5.1-6.4 at B 8,
 * T 256, H 8, dh 64; 4.6-9.9 against 5.7-8.1 at T 512; 10.1-10.2 against 8.3-12.9 at B 4,
 * T 1024, H 12. With one invocation per row the long contexts keep few invocations busy
 * (B H T of them, each looping over T): splitting the key range among more invocations, or
 * tiled products, are the next step there.
 *
 * `--precision f16` where the device has shader-f16 (webgpu-kernels.ts f16Arithmetic): every
 * product's operands rounded to f16 as the composed form's f16 matmuls round them
 * (backend/webgpu-f16.ts), products exact and sums in f32, and the softmax's exps in f16; the
 * scores, the running max and sum, and dS = scale P (dP - delta) (loss-scaled) stay f32
 * (wgsl-attention/'s doc comments say why).
 *
 * This module imports only types from `@tensorflow/tfjs-backend-webgpu` (whose import needs
 * navigator.gpu), so registering is safe before the webgpu backend is loaded. WGSL in
 * backend/wgsl-attention/.
 */
import type { WebGPUProgram } from '@tensorflow/tfjs-backend-webgpu';
import {
  CAUSAL_ATTENTION_GRAD_KERNEL,
  CAUSAL_ATTENTION_KERNEL,
} from './kernel-names.js';
import { tf } from './tfjs.js';
import { f16Arithmetic, type WebGPUBackendish } from './webgpu-kernels.js';
import { qkvGradShader, scoreGradShader } from './wgsl-attention/backward.js';
import {
  contextShader,
  probsShader,
  ROW_UNIFORMS,
  ROWS_PER_WORKGROUP,
} from './wgsl-attention/forward.js';

type Dispatch = [number, number, number];

/** Attention's sizes: batch, time, heads, head width. */
interface Dims {
  b: number;
  t: number;
  h: number;
  dh: number;
}

/**
 * A program with one invocation per row of P (a query or key position of one (batch, head)),
 * 64 rows of one (batch, head) per workgroup, `parts` such sets of workgroups (the dispatch's z).
 */
class RowProgram implements WebGPUProgram {
  readonly workgroupSize: Dispatch = [ROWS_PER_WORKGROUP, 1, 1];
  readonly uniforms = ROW_UNIFORMS;
  readonly dispatchLayout: { x: number[] };
  readonly dispatch: Dispatch;
  shaderKey: string;
  private readonly dh: number;
  constructor(
    readonly variableNames: string[],
    readonly outputShape: number[],
    { b, t, h, dh }: Dims,
    private readonly code: (dh: number, f16: boolean) => string,
    name: string,
    parts = 1,
    private readonly f16 = false,
  ) {
    this.dispatchLayout = { x: outputShape.map((_, i) => i) };
    this.dispatch = [Math.ceil(t / ROWS_PER_WORKGROUP), b * h, parts];
    this.dh = dh;
    this.shaderKey = `layerwise_attention_${name}_${dh}${f16 ? '_f16' : ''}`;
  }
  getUserCode(): string {
    return this.code(this.dh, this.f16);
  }
}

/** The sizes of attention over `qkv` [B, T, 3D] with `heads` heads. */
function dims(qkv: tf.TensorInfo, heads: number): Dims {
  const [b, t, d3] = qkv.shape as [number, number, number];
  return { b, t, h: heads, dh: d3 / 3 / heads };
}

/** The uniforms of a row program (ROW_UNIFORMS). */
function rowUniforms({ b, t, h, dh }: Dims) {
  return [
    { type: 'int32', data: [t] },
    { type: 'int32', data: [h] },
    { type: 'int32', data: [Math.ceil(t / ROWS_PER_WORKGROUP)] },
    { type: 'int32', data: [b * h] },
    { type: 'float32', data: [1 / Math.sqrt(dh)] },
  ];
}

/** CAUSAL_ATTENTION_KERNEL: inputs {qkv}, attrs {heads}; outputs [ctx, p]. */
const attention: tf.KernelFunc = ({ inputs, backend, attrs }) => {
  const gpu = backend as unknown as WebGPUBackendish;
  const qkv = inputs.qkv as tf.TensorInfo;
  const d = dims(qkv, attrs!.heads as number);
  const pShape = [d.b, d.h, d.t, d.t];
  const h = f16Arithmetic(backend);
  const probs = new RowProgram(['qkv'], pShape, d, probsShader, 'probs', 1, h);
  const p = gpu.runWebGPUProgram(probs, [qkv], 'float32', rowUniforms(d));
  const ctxShape = [d.b, d.t, d.h * d.dh];
  const context = new RowProgram(
    ['probs', 'qkv'],
    ctxShape,
    d,
    contextShader,
    'context',
    1,
    h,
  );
  const ctx = gpu.runWebGPUProgram(
    context,
    [p, qkv],
    'float32',
    rowUniforms(d),
  );
  return [ctx, p];
};

/** CAUSAL_ATTENTION_GRAD_KERNEL: inputs {dy, qkv, p}, attrs {heads}; output dqkv. */
const attentionGrad: tf.KernelFunc = ({ inputs, backend, attrs }) => {
  const gpu = backend as unknown as WebGPUBackendish;
  const { dy, qkv, p } = inputs as Record<string, tf.TensorInfo>;
  const d = dims(qkv!, attrs!.heads as number);
  const h = f16Arithmetic(backend);
  const scores = new RowProgram(
    ['dy', 'qkv', 'probs'],
    p!.shape,
    d,
    scoreGradShader,
    'dscores',
    1,
    h,
  );
  const ds = gpu.runWebGPUProgram(
    scores,
    [dy!, qkv!, p!],
    'float32',
    rowUniforms(d),
  );
  const grad = new RowProgram(
    ['ds', 'probs', 'qkv', 'dy'],
    qkv!.shape,
    d,
    qkvGradShader,
    'dqkv',
    3,
    h,
  );
  try {
    return gpu.runWebGPUProgram(
      grad,
      [ds, p!, qkv!, dy!],
      'float32',
      rowUniforms(d),
    );
  } finally {
    gpu.disposeData(ds.dataId);
  }
};

/**
 * Registers the WGSL causal attention and its gradient for backend 'webgpu', in place of any
 * kernel of those names there (the composed form). Safe to call again, and before the webgpu
 * backend is loaded.
 */
export function registerWebGpuAttention(): void {
  const kernels: Array<[string, tf.KernelFunc]> = [
    [CAUSAL_ATTENTION_KERNEL, attention],
    [CAUSAL_ATTENTION_GRAD_KERNEL, attentionGrad],
  ];
  for (const [kernelName, kernelFunc] of kernels) {
    if (tf.getKernel(kernelName, 'webgpu') !== undefined)
      tf.unregisterKernel(kernelName, 'webgpu');
    tf.registerKernel({ kernelName, backendName: 'webgpu', kernelFunc });
  }
}
