/**
 * layerwise's own kernels (backend/kernel-names.ts) composed of stock TF.js ops, registered under
 * the kernel's name on every backend that has no kernel of its own for it (wasm, cpu, webgpu,
 * tensorflow; native registers its oneDNN kernels in backend/native.ts). So the model calls one
 * op per fused operation (model/layers.ts), whatever the backend, and what runs, in which
 * precision, is the backend's business: a faster or lower-precision version of an op is a kernel,
 * never a branch in model code (as tfjs-core keeps ops, kernels and gradients apart).
 *
 * Each kernel function runs its stock ops in a tidy scope and returns the output tensors: the
 * engine takes a returned tensor as the kernel's output, and the ops inside a kernel are not
 * recorded on the gradient tape (the engine records only at kernel depth 0), so a composed
 * kernel's temporaries are freed when it returns, as a native kernel's would be.
 *
 * The math of each pair (forward, gradient) is the one written in the kernel name's docstring;
 * shapes and dtypes are the same as the native kernels' (float32 everywhere, int32 labels), with
 * one difference that stays inside a backend: layer norm's `rstd` is [..., 1] here (the native
 * kernel's is [rows, 1]); each backend's gradient kernel reads its own forward's outputs.
 */
import * as tf from '@tensorflow/tfjs-core';
import { fusedDense } from './dense.js';
import {
  CAUSAL_ATTENTION_GRAD_KERNEL,
  CAUSAL_ATTENTION_KERNEL,
  CAUSAL_SOFTMAX_GRAD_KERNEL,
  CAUSAL_SOFTMAX_KERNEL,
  checkDenseGelu,
  GELU_GRAD_KERNEL,
  GELU_KERNEL,
  LAYER_NORM_GRAD_KERNEL,
  LAYER_NORM_KERNEL,
  SOFTMAX_CROSS_ENTROPY_GRAD_KERNEL,
  SOFTMAX_CROSS_ENTROPY_KERNEL,
  SUM_SQUARES_KERNEL,
} from './kernel-names.js';

type Inputs = Record<string, tf.Tensor>;
type ComposedKernel = (
  inputs: Inputs,
  attrs: tf.NamedAttrMap,
) => tf.Tensor | tf.Tensor[];

const GELU_C1 = 2 * Math.sqrt(2 / Math.PI);
const GELU_C2 = GELU_C1 * 0.044715;

/** Axes 0..rank-2: the rows of a tensor normalised over its last axis. */
const leadingAxes = (rank: number): number[] => [...Array(rank - 1).keys()];

const maskCache = new Map<number, Float32Array>();
/** Additive causal mask [T, T]: 0 on and below the diagonal, -1e9 above. */
export function causalMask(t: number): tf.Tensor2D {
  let m = maskCache.get(t);
  if (!m) {
    m = new Float32Array(t * t);
    for (let i = 0; i < t; i++)
      for (let j = i + 1; j < t; j++) m[i * t + j] = -1e9;
    maskCache.set(t, m);
  }
  return tf.tensor2d(m, [t, t]);
}

/** softmax(x * scale + causal mask) over the last axis; x: [..., T, T]. */
function causalSoftmax(x: tf.Tensor, scale: number): tf.Tensor {
  const t = x.shape[x.rank - 1]!;
  const scaled = scale === 1 ? x : tf.mul(x, scale);
  return tf.softmax(tf.add(scaled, causalMask(t)), -1);
}

/** scale * y * (dy - sum(dy * y)) over the last axis: the causal softmax's input gradient. */
function causalSoftmaxGrad(y: tf.Tensor, dy: tf.Tensor, scale: number) {
  const dot = tf.sum(tf.mul(dy, y), -1, true);
  const dx = tf.mul(tf.sub(dy, dot), y);
  return scale === 1 ? dx : tf.mul(dx, scale);
}

/** qkv [B, T, 3D] laid out [B, T, 3, H, dh] -> q, k, v as [B*H, T, dh]. */
function splitHeads(qkv: tf.Tensor, heads: number): tf.Tensor[] {
  const [B, T, D3] = qkv.shape as [number, number, number];
  const dh = D3 / 3 / heads;
  const split = tf.transpose(
    tf.reshape(qkv, [B, T, 3, heads, dh]),
    [2, 0, 3, 1, 4],
  );
  return tf.unstack(split, 0).map((t) => tf.reshape(t, [B * heads, T, dh]));
}

/**
 * DENSE_GELU_KERNEL composed of the kernels the MLP ran before the op existed (bit for bit):
 * webgpu's fallback for the inputs its one-dispatch kernel leaves (backend/webgpu-matmul-gelu.ts);
 * not registered for other backends, where model/layers.ts denseGelu runs dense then gelu.
 * `_FusedMatMul` on [1, rows, Din] x [1, Din, Dout] + b (the shapes of
 * model/layers.ts dense), then GELU_KERNEL. Returns [y, h] (x's leading axes, then Dout).
 * @throws Error from kernel-names.ts checkDenseGelu for mismatched shapes.
 */
export function composedDenseGelu({ x, w, b }: Inputs): tf.Tensor[] {
  checkDenseGelu(x!, w!, b!);
  const h = fusedDense(x!, w!, b!);
  return [tf.engine().runKernel(GELU_KERNEL, { x: h }) as tf.Tensor, h];
}

/**
 * DENSE_GELU_GRAD_KERNEL composed of the kernels the gradients of gelu and of dense's bias ran:
 * GELU_GRAD_KERNEL, then `Sum` of dh viewed [1, rows, Dout] over axes 0 and 1 (backend/matmul-
 * grad.ts's bias gradient on the product's shape). Returns [dh, db]. webgpu's fallback only.
 */
export function composedDenseGeluGrad({ h, dy }: Inputs): tf.Tensor[] {
  const dout = h!.shape[h!.rank - 1]!;
  const dh = tf.engine().runKernel(GELU_GRAD_KERNEL, {
    x: h!,
    dy: dy!,
  }) as tf.Tensor;
  const rows = dout > 0 ? h!.size / dout : 0;
  return [dh, tf.sum(tf.reshape(dh, [1, rows, dout]), [0, 1])];
}

/** The composed form of each kernel, by kernel name. */
const COMPOSED: Record<string, ComposedKernel> = {
  [GELU_KERNEL]: ({ x }) => {
    const s = tf.sigmoid(
      tf.mul(x!, tf.add(tf.mul(tf.square(x!), GELU_C2), GELU_C1)),
    );
    return tf.mul(x!, s);
  },
  [GELU_GRAD_KERNEL]: ({ x, dy }) => {
    const sq = tf.square(x!);
    const sg = tf.sigmoid(tf.mul(x!, tf.add(tf.mul(sq, GELU_C2), GELU_C1)));
    const du = tf.mul(x!, tf.add(tf.mul(sq, 3 * GELU_C2), GELU_C1));
    const slope = tf.add(sg, tf.mul(du, tf.sub(sg, tf.square(sg))));
    return tf.mul(dy!, slope);
  },
  [LAYER_NORM_KERNEL]: ({ x, g, b }, { epsilon }) => {
    const axis = x!.rank - 1;
    const centered = tf.sub(x!, tf.mean(x!, axis, true));
    const rstd = tf.rsqrt(
      tf.add(tf.mean(tf.square(centered), axis, true), epsilon as number),
    );
    const xhat = tf.mul(centered, rstd);
    return [tf.add(tf.mul(xhat, g!), b!), xhat, rstd];
  },
  [LAYER_NORM_GRAD_KERNEL]: ({ dy, xhat, rstd, g }) => {
    const axis = dy!.rank - 1;
    const rows = leadingAxes(dy!.rank);
    const dg = tf.sum(tf.mul(dy!, xhat!), rows);
    const db = tf.sum(dy!, rows);
    const dxhat = tf.mul(dy!, g!);
    const m1 = tf.mean(dxhat, axis, true);
    const m2 = tf.mean(tf.mul(dxhat, xhat!), axis, true);
    const dx = tf.mul(tf.sub(tf.sub(dxhat, m1), tf.mul(xhat!, m2)), rstd!);
    return [dx, dg, db];
  },
  [CAUSAL_SOFTMAX_KERNEL]: ({ x }, { scale }) =>
    causalSoftmax(x!, scale as number),
  [CAUSAL_SOFTMAX_GRAD_KERNEL]: ({ y, dy }, { scale }) =>
    causalSoftmaxGrad(y!, dy!, scale as number),
  [CAUSAL_ATTENTION_KERNEL]: ({ qkv }, { heads }) => {
    const h = heads as number;
    const [B, T, D3] = qkv!.shape as [number, number, number];
    const D = D3 / 3;
    const dh = D / h;
    const [q, k, v] = splitHeads(qkv!, h) as [tf.Tensor, tf.Tensor, tf.Tensor];
    const p = causalSoftmax(tf.matMul(q, k, false, true), 1 / Math.sqrt(dh)); // [BH, T, T]
    const ctx = tf.matMul(p, v); // [BH, T, dh]
    const merged = tf.reshape(
      tf.transpose(tf.reshape(ctx, [B, h, T, dh]), [0, 2, 1, 3]),
      [B, T, D],
    );
    return [merged, tf.reshape(p, [B, h, T, T])];
  },
  [CAUSAL_ATTENTION_GRAD_KERNEL]: ({ dy, qkv, p }, { heads }) => {
    const h = heads as number;
    const [B, T, D] = dy!.shape as [number, number, number];
    const dh = D / h;
    const [q, k, v] = splitHeads(qkv!, h) as [tf.Tensor, tf.Tensor, tf.Tensor];
    const p3 = tf.reshape(p!, [B * h, T, T]);
    // dy [B, T, D] laid out [B, T, H, dh] -> dctx [B*H, T, dh]
    const dctx = tf.reshape(
      tf.transpose(tf.reshape(dy!, [B, T, h, dh]), [0, 2, 1, 3]),
      [B * h, T, dh],
    );
    const dv = tf.matMul(p3, dctx, true, false); // [BH, T, dh]
    const dp = tf.matMul(dctx, v, false, true); // [BH, T, T]
    const ds = causalSoftmaxGrad(p3, dp, 1 / Math.sqrt(dh)); // d(q k^T)
    const dq = tf.matMul(ds, k); // [BH, T, dh]
    const dk = tf.matMul(ds, q, true, false); // [BH, T, dh]
    // [3, B*H, T, dh] -> [3, B, H, T, dh] -> [B, T, 3, H, dh]
    const stacked = tf.reshape(tf.stack([dq, dk, dv]), [3, B, h, T, dh]);
    return tf.reshape(tf.transpose(stacked, [1, 3, 0, 2, 4]), [B, T, 3 * D]);
  },
  [SOFTMAX_CROSS_ENTROPY_KERNEL]: ({ logits, labels }) => {
    const c = logits!.shape[1]!;
    const logp = tf.logSoftmax(logits!, -1);
    const oneHot = tf.oneHot(labels! as tf.Tensor1D, c);
    const loss = tf.neg(tf.mean(tf.sum(tf.mul(oneHot, logp), -1)));
    return [loss, tf.exp(logp)];
  },
  [SOFTMAX_CROSS_ENTROPY_GRAD_KERNEL]: ({ probs, labels, dy }) => {
    const [n, c] = probs!.shape as [number, number];
    const oneHot = tf.oneHot(labels! as tf.Tensor1D, c);
    return tf.mul(tf.sub(probs!, oneHot), tf.div(dy!, n));
  },
  // inputs are an array (keys '0'..'n-1', in order)
  [SUM_SQUARES_KERNEL]: (xs) =>
    tf.stack(Object.values(xs).map((x) => tf.sum(tf.square(x)))),
};

/** The names of layerwise's kernels that have a composed form here. */
export const COMPOSED_KERNEL_NAMES: readonly string[] = Object.keys(COMPOSED);

/**
 * Registers the composed form of each of layerwise's kernels for the backend `backendName`
 * wherever that backend has no kernel of that name yet (so native's own kernels stay). Safe to
 * call again. Call after the backend's own kernels are registered (backend/index.ts initBackend).
 */
export function registerComposedKernels(backendName: string): void {
  for (const [kernelName, compose] of Object.entries(COMPOSED)) {
    if (tf.getKernel(kernelName, backendName) !== undefined) continue;
    tf.registerKernel({
      kernelName,
      backendName,
      kernelFunc: ({ inputs, attrs }) =>
        tf.tidy(() => compose(inputs as Inputs, attrs ?? {})) as
          | tf.TensorInfo
          | tf.TensorInfo[],
    });
  }
}
