/**
 * Flash-style causal attention on the webgpu backend as WGSL kernels of our own (issue 36
 * item 1; FlashAttention, Dao et al. 2022, and FlashAttention-2, Dao 2023): the
 * FLASH_ATTENTION_KERNEL pair of kernel-names.ts, which model/layers.ts causalSelfAttention
 * runs where the backend registers it. Nothing of size T x T is written or kept: the forward
 * outputs ctx [B, T, D] and lse [B, H, T] (each query row's log-sum-exp), the gradient
 * recomputes P from them block by block. On a GPU at long contexts this is what saves the
 * B H T^2 floats a layer the P form kept for the gradient (8 layers, B 8, H 16, T 1024: 4 GiB)
 * and its gradient's dS temporary of the same size. One dispatch each way:
 *
 * - forward: a workgroup of 64 query rows of one (batch, head) walks the key blocks (keys and
 *   values in workgroup memory), each invocation keeping its row's running max, running sum
 *   and context (online softmax), then writes ctx and lse;
 * - gradient: workgroups of 64 query rows write dq (over keys j <= t), workgroups of 64 key rows
 *   write dk and dv (over queries i >= t), each recomputing P = exp(scale q k^T - lse) and
 *   dS = scale P (dP - D) with D = rowsum(dy ctx); deterministic, no atomics (FlashAttention-2's
 *   split of the gradient into a key-block and a query-block pass, here two sets of workgroups
 *   of one dispatch).
 *
 * The forward writes two outputs, which a TF.js program (one output each) cannot: both kernels
 * run as pipelines of their own through backend/webgpu-multi.ts's `dispatch`, on TF.js's
 * command encoder and counted by backend/gpu-queue.ts like TF.js's programs. The stock P pair
 * (CAUSAL_ATTENTION_KERNEL) stays the composed form on webgpu (LAYERWISE_WEBGPU_KERNELS=tfjs
 * runs it), and the native kernels' and the cpu/wasm composed form's on those backends: there,
 * caching P costs host memory and saves the gradient a second exp per score.
 *
 * `--precision f16` where the device has shader-f16 (webgpu-kernels.ts f16Arithmetic): every
 * product's operands rounded to f16 as the f16 matmuls round them (backend/webgpu-f16.ts),
 * products exact and sums in f32, and the softmax's exps (the forward's and the gradient's
 * recomputed P) in f16; the scores, the running max and sum, lse, D and dS = scale P (dP - D)
 * (loss-scaled) stay f32 (wgsl-attention/'s doc comments say why).
 *
 * This module imports only types from `@tensorflow/tfjs-backend-webgpu` (whose import needs
 * navigator.gpu), so registering is safe before the webgpu backend is loaded. WGSL in
 * backend/wgsl-attention/.
 */
import {
  FLASH_ATTENTION_GRAD_KERNEL,
  FLASH_ATTENTION_KERNEL,
} from './kernel-names.js';
import { keepFloat32Saved } from './low-precision.js';
import { tf } from './tfjs.js';
import { f16Arithmetic } from './webgpu-kernels.js';
import {
  bufferOf,
  constantUniforms,
  dispatch,
  newOutput,
  type RawBackend,
  stateOf,
} from './webgpu-multi.js';
import { gradShader } from './wgsl-attention/backward.js';
import {
  attentionUniforms,
  forwardShader,
  ROWS_PER_WORKGROUP,
} from './wgsl-attention/forward.js';

/** Attention's sizes: batch, time, heads, head width. */
interface Dims {
  b: number;
  t: number;
  h: number;
  dh: number;
}

/**
 * The sizes of attention over `qkv` [B, T, 3D] with `heads` heads.
 * @throws Error when qkv is not [B, T, 3D] float32 with 3D a multiple of 3 * heads.
 */
function dims(qkv: tf.TensorInfo, heads: number): Dims {
  const [b, t, d3] = qkv.shape as [number, number, number];
  if (
    qkv.shape.length !== 3 ||
    qkv.dtype !== 'float32' ||
    !(heads > 0) ||
    d3 % (3 * heads) !== 0
  )
    throw new Error(
      `${FLASH_ATTENTION_KERNEL}: qkv must be float32 [B, T, 3 * heads * dh], got ${qkv.dtype} [${qkv.shape}] with heads ${heads}; project x to 3 * D features with D a multiple of heads`,
    );
  return { b, t, h: heads, dh: d3 / 3 / heads };
}

/** Workgroups of one role: a 64-row block of each (batch, head). */
const blocks = ({ b, t, h }: Dims) => Math.ceil(t / ROWS_PER_WORKGROUP) * b * h;

/**
 * The WGSL of a kernel for head width dh (f16: the f16-arithmetic variant), made once: the
 * pipeline cache (webgpu-multi.ts) is keyed by the code itself.
 */
const shaders = new Map<string, string>();
function shader(kind: 'forward' | 'grad', dh: number, f16: boolean): string {
  const key = `${kind}_${dh}_${f16}`;
  let code = shaders.get(key);
  if (code === undefined) {
    code = kind === 'forward' ? forwardShader(dh, f16) : gradShader(dh, f16);
    shaders.set(key, code);
  }
  return code;
}

/** FLASH_ATTENTION_KERNEL: inputs {qkv}, attrs {heads}; outputs [ctx, lse]. */
const attention: tf.KernelFunc = ({ inputs, backend, attrs }) => {
  const raw = backend as unknown as RawBackend;
  const qkv = inputs.qkv as tf.TensorInfo;
  const d = dims(qkv, attrs!.heads as number);
  const [ctx, ctxBuffer] = newOutput(raw, [d.b, d.t, d.h * d.dh]);
  const [lse, lseBuffer] = newOutput(raw, [d.b, d.h, d.t]);
  keepFloat32Saved(lse); // saved for the gradient: f32 in f16 runs too (see the file's comment)
  if (blocks(d) > 0 && d.dh > 0) {
    const s = stateOf(raw);
    const u = constantUniforms(raw, s, attentionUniforms(d.b, d.t, d.h, d.dh));
    const code = shader('forward', d.dh, f16Arithmetic(backend));
    const buffers = [bufferOf(raw, qkv), ctxBuffer, lseBuffer, u];
    dispatch(
      raw,
      s,
      code,
      buffers,
      blocks(d),
      `lw_flash_attention [${qkv.shape}]`,
    );
  }
  return [ctx, lse];
};

/** FLASH_ATTENTION_GRAD_KERNEL: inputs {dy, qkv, ctx, lse}, attrs {heads}; output dqkv. */
const attentionGrad: tf.KernelFunc = ({ inputs, backend, attrs }) => {
  const raw = backend as unknown as RawBackend;
  const { dy, qkv, ctx, lse } = inputs as Record<string, tf.TensorInfo>;
  const d = dims(qkv!, attrs!.heads as number);
  const [dqkv, dqkvBuffer] = newOutput(raw, qkv!.shape);
  if (blocks(d) > 0 && d.dh > 0) {
    const s = stateOf(raw);
    const u = constantUniforms(raw, s, attentionUniforms(d.b, d.t, d.h, d.dh));
    const code = shader('grad', d.dh, f16Arithmetic(backend));
    const reads = [dy!, qkv!, ctx!, lse!].map((x) => bufferOf(raw, x));
    const label = `lw_flash_attention_grad [${qkv!.shape}]`;
    dispatch(raw, s, code, [...reads, dqkvBuffer, u], 2 * blocks(d), label);
  }
  return dqkv;
};

/**
 * Registers the WGSL flash attention pair (FLASH_ATTENTION_KERNEL, FLASH_ATTENTION_GRAD_KERNEL)
 * for backend 'webgpu', in place of any kernel of those names there. Safe to call again, and
 * before the webgpu backend is loaded.
 */
export function registerWebGpuAttention(): void {
  const kernels: Array<[string, tf.KernelFunc]> = [
    [FLASH_ATTENTION_KERNEL, attention],
    [FLASH_ATTENTION_GRAD_KERNEL, attentionGrad],
  ];
  for (const [kernelName, kernelFunc] of kernels) {
    if (tf.getKernel(kernelName, 'webgpu') !== undefined)
      tf.unregisterKernel(kernelName, 'webgpu');
    tf.registerKernel({ kernelName, backendName: 'webgpu', kernelFunc });
  }
}
