/**
 * Causal attention on the webgpu backend as WGSL kernels of our own (issue 36 item 1), in place
 * of the composed form's chain of stock ops (backend/composed-kernels.ts: head split, transposes,
 * two batched products, mask, softmax, merge). Same names, inputs, outputs and math as
 * kernel-names.ts declares (the native kernels' too): the forward outputs ctx [B, T, D] and the
 * probabilities P [B, H, T, T], which the gradient reads; two dispatches each way:
 *
 * - forward: P by rows (a workgroup of 64 query rows of one (batch, head) walks the key blocks,
 *   held in workgroup memory, with a running max and sum, then writes its rows of P), and
 *   ctx = P V;
 * - gradient: dS = scale P (dP - rowsum(dP P)) by rows (dP = dctx v^T, values in workgroup
 *   memory block by block), then dqkv (dq = dS k, dk = dS^T q, dv = P^T dctx) by element; dS is
 *   a temporary of P's size, freed before the kernel returns.
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

/** A program with one invocation per row of a [B, H, T, T] output, 64 rows of one (batch, head) per workgroup. */
class RowProgram implements WebGPUProgram {
  readonly workgroupSize: Dispatch = [ROWS_PER_WORKGROUP, 1, 1];
  readonly uniforms = ROW_UNIFORMS;
  readonly outputShape: number[];
  readonly dispatchLayout: { x: number[] };
  readonly dispatch: Dispatch;
  shaderKey: string;
  private readonly dh: number;
  constructor(
    readonly variableNames: string[],
    { b, t, h, dh }: Dims,
    private readonly code: (dh: number) => string,
    name: string,
  ) {
    this.outputShape = [b, h, t, t];
    this.dispatchLayout = { x: [0, 1, 2, 3] };
    this.dispatch = [Math.ceil(t / ROWS_PER_WORKGROUP), b * h, 1];
    this.dh = dh;
    this.shaderKey = `layerwise_attention_${name}_${dh}`;
  }
  getUserCode(): string {
    return this.code(this.dh);
  }
}

/** A program with one invocation per element of its output. */
class ElementProgram implements WebGPUProgram {
  readonly workgroupSize: Dispatch = [64, 1, 1];
  readonly uniforms = 'nT : i32, nH : i32,';
  readonly size = true;
  readonly dispatchLayout: { x: number[] };
  readonly dispatch: Dispatch;
  shaderKey: string;
  constructor(
    readonly variableNames: string[],
    readonly outputShape: number[],
    private readonly dh: number,
    private readonly code: (dh: number) => string,
    name: string,
  ) {
    this.dispatchLayout = { x: outputShape.map((_, i) => i) };
    const n = outputShape.reduce((a, c) => a * c, 1);
    this.dispatch = [Math.ceil(n / 64), 1, 1];
    this.shaderKey = `layerwise_attention_${name}_${dh}`;
  }
  getUserCode(): string {
    return this.code(this.dh);
  }
}

interface WebGPUBackendish {
  runWebGPUProgram(
    p: WebGPUProgram,
    inputs: tf.TensorInfo[],
    dtype: tf.DataType,
    uniforms?: Array<{ type: string; data: number[] }>,
  ): tf.TensorInfo;
  disposeData(id: object): void;
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

/** The uniforms of an element program. */
const elementUniforms = ({ t, h }: Dims) => [
  { type: 'int32', data: [t] },
  { type: 'int32', data: [h] },
];

/** CAUSAL_ATTENTION_KERNEL: inputs {qkv}, attrs {heads}; outputs [ctx, p]. */
const attention: tf.KernelFunc = ({ inputs, backend, attrs }) => {
  const gpu = backend as unknown as WebGPUBackendish;
  const qkv = inputs.qkv as tf.TensorInfo;
  const d = dims(qkv, attrs!.heads as number);
  const probs = new RowProgram(['qkv'], d, probsShader, 'probs');
  const p = gpu.runWebGPUProgram(probs, [qkv], 'float32', rowUniforms(d));
  const ctxShape = [d.b, d.t, d.h * d.dh];
  const context = new ElementProgram(
    ['probs', 'qkv'],
    ctxShape,
    d.dh,
    contextShader,
    'context',
  );
  const ctx = gpu.runWebGPUProgram(
    context,
    [p, qkv],
    'float32',
    elementUniforms(d),
  );
  return [ctx, p];
};

/** CAUSAL_ATTENTION_GRAD_KERNEL: inputs {dy, qkv, p}, attrs {heads}; output dqkv. */
const attentionGrad: tf.KernelFunc = ({ inputs, backend, attrs }) => {
  const gpu = backend as unknown as WebGPUBackendish;
  const { dy, qkv, p } = inputs as Record<string, tf.TensorInfo>;
  const d = dims(qkv!, attrs!.heads as number);
  const scores = new RowProgram(
    ['dy', 'qkv', 'probs'],
    d,
    scoreGradShader,
    'dscores',
  );
  const ds = gpu.runWebGPUProgram(
    scores,
    [dy!, qkv!, p!],
    'float32',
    rowUniforms(d),
  );
  const grad = new ElementProgram(
    ['ds', 'probs', 'qkv', 'dy'],
    qkv!.shape,
    d.dh,
    qkvGradShader,
    'dqkv',
  );
  try {
    return gpu.runWebGPUProgram(
      grad,
      [ds, p!, qkv!, dy!],
      'float32',
      elementUniforms(d),
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
