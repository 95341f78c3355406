/**
 * Kernels layerwise adds to TF.js (not stock kernels). The model calls each forward/gradient pair
 * as one op (model/layers.ts); the native backend registers its own C++ kernels
 * (backend/native.ts), webgpu its own WGSL kernels (backend/webgpu-kernels.ts,
 * backend/webgpu-attention.ts, backend/webgpu-matmul-gelu.ts), every other backend the
 * composed form of stock ops (backend/composed-kernels.ts), under the same names (but for the
 * flash attention and dense + GELU pairs, which only webgpu registers: model/layers.ts runs
 * another op where they are missing; and DENSE_KERNEL, every backend's own product on views,
 * backend/dense.ts). The optimizer's fused updates (ADAMW_KERNEL, SGD_KERNEL)
 * are native's and webgpu's: optim/optimizer.ts composes the update where they are missing.
 */

/** GELU, tanh approximation (model/layers.ts gelu): inputs {x}. */
export const GELU_KERNEL = 'LayerwiseGelu';
/** GELU's gradient: inputs {x, dy}, output dy * GELU'(x). */
export const GELU_GRAD_KERNEL = 'LayerwiseGeluGrad';
/**
 * A dense layer's product with its bias as one op (model/layers.ts dense): inputs {x [..., Din],
 * w [Din, Dout], b [Dout]} (float32); output y = x w + b ([..., Dout]). Every backend runs it as
 * its own `_FusedMatMul` on x viewed [1, rows, Din] and w viewed [1, Din, Dout]
 * (backend/dense.ts), the shapes dense gave that kernel through three Reshape ops; its gradient
 * runs the same products and bias sum on views (backend/matmul-grad.ts). Check the inputs with
 * {@link checkDenseGelu} (naming this kernel).
 */
export const DENSE_KERNEL = 'LayerwiseDense';

/**
 * The MLP's first product with its bias and GELU as one op (model/layers.ts denseGelu): inputs
 * {x [..., Din], w [Din, Dout], b [Dout]} (float32); outputs [y = GELU(h), h = x w + b] (both
 * [..., Dout]; h kept for the gradient, backend/matmul-grad.ts). Registered only for webgpu, one
 * dispatch (backend/webgpu-matmul-gelu.ts; its fallback for the inputs it leaves is
 * backend/composed-kernels.ts composedDenseGelu: `_FusedMatMul` then GELU_KERNEL); elsewhere
 * denseGelu runs dense then gelu. Check the inputs with {@link checkDenseGelu}.
 */
export const DENSE_GELU_KERNEL = 'LayerwiseDenseGelu';

/**
 * Outputs (indices, by kernel) whose own gradient the kernel's gradient function never reads.
 * For an output the backward did not reach, tfjs-core's tape node makes zeros on the host
 * (`makeZerosTypedArray`) and uploads them; the tape (pipeline/tape.ts dysOf) passes a kept
 * scalar placeholder there instead. DENSE_GELU_KERNEL's h is its internal output: on an H200
 * its zeros were 8.4 ms of host time in a 45 ms charlm-small step (4 x [4096, 1024] floats;
 * 8 x [8192, 4096] for d_model 1024), the largest item of the step's host profile.
 */
export const UNREAD_OUTPUT_GRADIENTS: ReadonlyMap<string, readonly number[]> =
  new Map([[DENSE_GELU_KERNEL, [1]]]);

/**
 * DENSE_GELU_KERNEL's gradient before the products (backend/matmul-grad.ts): inputs {h, dy}
 * ([..., Dout] each); outputs [dh = dy GELU'(h) (h's shape), db [Dout] = dh summed over the
 * leading axes]. webgpu's is one dispatch (its fallback: GELU_GRAD_KERNEL then `Sum`).
 */
export const DENSE_GELU_GRAD_KERNEL = 'LayerwiseDenseGeluGrad';

/**
 * [rows, Din, Dout] of DENSE_GELU_KERNEL's (or, with `kernel`, DENSE_KERNEL's) inputs (shapes
 * only): rows = the product of x's leading axes.
 * @throws Error naming `kernel` and the mismatch (w not 2-D, b not [Dout], x's last axis not Din).
 */
export function checkDenseGelu(
  x: { readonly shape: readonly number[] },
  w: { readonly shape: readonly number[] },
  b: { readonly shape: readonly number[] },
  kernel: string = DENSE_GELU_KERNEL,
): [number, number, number] {
  const [din, dout] = w.shape as [number, number];
  if (w.shape.length !== 2)
    throw new Error(`${kernel}: w must be [Din, Dout], got [${w.shape}]`);
  if (b.shape.length !== 1 || b.shape[0] !== dout)
    throw new Error(
      `${kernel}: b must be [${dout}] (w's columns), got [${b.shape}]`,
    );
  if (x.shape.length < 1 || x.shape[x.shape.length - 1] !== din)
    throw new Error(
      `${kernel}: x [${x.shape}] must end in Din = ${din} (w's rows)`,
    );
  const rows = x.shape.slice(0, -1).reduce((a, c) => a * c, 1);
  return [rows, din, dout];
}

/** Layer norm over the last axis (model/layers.ts layerNorm): inputs {x, g, b}, attrs {epsilon}; outputs [y, xhat, rstd (rows, 1)]. */
export const LAYER_NORM_KERNEL = 'LayerwiseLayerNorm';
/** Layer norm's gradient: inputs {dy, xhat, rstd, g}; outputs [dx, dg, db]. */
export const LAYER_NORM_GRAD_KERNEL = 'LayerwiseLayerNormGrad';
/** Causal softmax of scale * scores over the last axis (model/layers.ts maskedSoftmax): inputs {x} [..., T, T], attrs {scale}. */
export const CAUSAL_SOFTMAX_KERNEL = 'LayerwiseCausalSoftmax';
/** Its gradient: inputs {y, dy}, attrs {scale}; output scale * y * (dy - sum(dy * y)) over the last axis. */
export const CAUSAL_SOFTMAX_GRAD_KERNEL = 'LayerwiseCausalSoftmaxGrad';
/**
 * Causal multi-head self-attention after the qkv projection (model/layers.ts
 * causalSelfAttention): inputs {qkv} [B, T, 3D] laid out [B, T, 3, H, dh], attrs {heads};
 * outputs [ctx [B, T, D] (heads side by side), p [B, H, T, T] (the attention probabilities, kept
 * for the gradient)].
 */
export const CAUSAL_ATTENTION_KERNEL = 'LayerwiseCausalAttention';
/** Its gradient: inputs {dy [B, T, D], qkv, p}, attrs {heads}; output dqkv [B, T, 3D]. */
export const CAUSAL_ATTENTION_GRAD_KERNEL = 'LayerwiseCausalAttentionGrad';
/**
 * Causal multi-head self-attention as {@link CAUSAL_ATTENTION_KERNEL}, flash-style (Dao et al.
 * 2022, FlashAttention; Dao 2023, FlashAttention-2): nothing of size T x T is kept or written.
 * Inputs {qkv} [B, T, 3D] float32 laid out [B, T, 3, H, dh], attrs {heads}; outputs [ctx [B, T, D]
 * (heads side by side), lse [B, H, T] float32 (each query row's log-sum-exp of its scaled causal
 * scores, log sum_{j <= t} exp(q_t . k_j / sqrt(dh)), which lets the gradient recompute P)].
 * Registered only where it pays (webgpu, backend/webgpu-attention.ts: device memory); where a
 * backend has none, model/layers.ts causalSelfAttention runs the P pair above.
 */
export const FLASH_ATTENTION_KERNEL = 'LayerwiseFlashAttention';
/**
 * Its gradient: inputs {dy [B, T, D], qkv, ctx, lse} (the forward's outputs), attrs {heads};
 * output dqkv [B, T, 3D]: P recomputed block by block as exp(scale q k^T - lse), and
 * rowsum(dP P) as rowsum(dy ctx) (FlashAttention-2's D).
 */
export const FLASH_ATTENTION_GRAD_KERNEL = 'LayerwiseFlashAttentionGrad';
/**
 * Mean softmax cross-entropy (model/layers.ts softmaxCrossEntropy): inputs {logits [N, C]
 * float32, labels [N] int32}; outputs [loss (scalar, nats), probs [N, C] (kept for the gradient)].
 */
export const SOFTMAX_CROSS_ENTROPY_KERNEL = 'LayerwiseSoftmaxCrossEntropy';
/** Its gradient: inputs {probs, labels, dy (scalar)}; output dlogits = (probs - onehot(labels)) * dy / N. */
export const SOFTMAX_CROSS_ENTROPY_GRAD_KERNEL =
  'LayerwiseSoftmaxCrossEntropyGrad';
/**
 * AdamW's update of one parameter in one pass (optim/optimizer.ts DeviceOptimizer): inputs
 * {p, g, m, v}, attrs {lr, beta1, beta2, epsilon, weightDecay, step (1-based), scale (gradient
 * scale)}; outputs [p, m, v] after the update.
 */
export const ADAMW_KERNEL = 'LayerwiseAdamW';
/** SGD's update: inputs {p, g, velocity (only with momentum)}, attrs {lr, momentum, weightDecay, scale}; outputs [p] or [p, velocity]. */
export const SGD_KERNEL = 'LayerwiseSgd';
/**
 * AdamW over many parameters at once (optim/optimizer.ts DeviceOptimizer, where the backend
 * registers it: webgpu, backend/webgpu-multi.ts; native, backend/native.ts): inputs
 * [p_0..p_n-1, g_0..g_n-1, m, v] (float32; g_i of p_i's shape; m and v the first and second
 * moments of all n parameters as two flat tensors, p_0's elements first, then p_1's...), attrs
 * {lr, beta1, beta2, epsilon, weightDecay, decayed (the first `decayed` parameters get
 * weightDecay, the rest none), step (1-based), scale}; outputs [p'_0..p'_n-1, m', v'], each as
 * ADAMW_KERNEL's. The optimizer passes the parameters in {@link multiOrder}. A backend may
 * register it with `elementsPerCall` (a number, on the kernel config): the optimizer then
 * updates at most that many parameter elements a call, each call with its own flat moments and
 * its outputs assigned before the next (native: 2^22, which bounds the outputs a call holds beside
 * its inputs).
 */
export const ADAMW_MULTI_KERNEL = 'LayerwiseAdamWMulti';

/**
 * The parameter count n of ADAMW_MULTI_KERNEL's `inputs` (shapes only), checked against its
 * layout: 2n + 2 tensors, each gradient of its parameter's size, m and v each of all n
 * parameters' elements. Every backend's kernel checks its inputs with this.
 * @throws Error naming the mismatch (the optimizer builds them; a caller of the kernel must too).
 */
export function adamwMultiCount(
  inputs: ReadonlyArray<{ readonly shape: readonly number[] }>,
): number {
  const size = (i: number) => inputs[i]!.shape.reduce((a, b) => a * b, 1);
  const n = (inputs.length - 2) / 2;
  if (!Number.isInteger(n) || n < 0)
    throw new Error(
      `${ADAMW_MULTI_KERNEL} takes 2n + 2 tensors (n parameters, their n gradients, the flat m and v), got ${inputs.length}`,
    );
  let total = 0;
  for (let i = 0; i < n; i++) {
    if (size(i) !== size(n + i))
      throw new Error(
        `${ADAMW_MULTI_KERNEL}: parameter ${i} has ${size(i)} elements, its gradient ${size(n + i)}`,
      );
    total += size(i);
  }
  for (const [k, i] of [2 * n, 2 * n + 1].entries())
    if (size(i) !== total)
      throw new Error(
        `${ADAMW_MULTI_KERNEL}: the flat ${k === 0 ? 'm' : 'v'} has ${size(i)} elements, the parameters ${total}: lay the moments out as the parameters, back to back`,
      );
  return n;
}
/**
 * Sum of squares of each of many tensors (the gradient norm's per-parameter terms,
 * pipeline/stage-params.ts GradAccumulator.sumSquares): inputs [x_0..x_n-1] (float32, any
 * shapes); output [n] float32, sum(x_i^2) each, summed in float32 (native: each square in
 * float32, summed in double, as its Square then Sum kernels).
 */
export const SUM_SQUARES_KERNEL = 'LayerwiseSumSquares';

/**
 * The order of the multi-tensor kernels' tensors (ADAMW_MULTI_KERNEL, SUM_SQUARES_KERNEL), as
 * indices into `shapes`: the tensors of rank >= 2 (those weight decay applies to,
 * optim/weight-decay.ts) in their given order, then the others in theirs. The optimizer passes
 * its parameters so (the decayed ones are a prefix), and webgpu's sums of squares lay the
 * gradients out so in their scratch buffer, where AdamW then finds them without copying
 * (backend/webgpu-multi.ts).
 */
export function multiOrder(shapes: readonly (readonly number[])[]): number[] {
  const all = shapes.map((_, i) => i);
  return [
    ...all.filter((i) => shapes[i]!.length >= 2),
    ...all.filter((i) => shapes[i]!.length < 2),
  ];
}
