/**
 * Differentiable building blocks written with TF.js ops. Shapes use B = batch, T = time
 * (context), D = model width, H = heads, V = vocabulary, C = classes.
 */
import * as tf from '@tensorflow/tfjs-core';

/** y = x W + b over the last axis. x: [..., Din], w: [Din, Dout], b: [Dout] -> [..., Dout]. */
export function dense(x: tf.Tensor, w: tf.Tensor, b?: tf.Tensor): tf.Tensor {
  const din = x.shape[x.shape.length - 1];
  const lead = x.shape.slice(0, -1);
  const x2 = x.rank === 2 ? (x as tf.Tensor2D) : tf.reshape(x, [-1, din]) as tf.Tensor2D;
  let y: tf.Tensor = tf.matMul(x2, w as tf.Tensor2D);
  if (b) y = tf.add(y, b);
  return x.rank === 2 ? y : tf.reshape(y, [...lead, w.shape[1] as number]);
}

/** Layer normalisation over the last axis (Ba et al., 2016), eps = 1e-5. g, b: [D]. */
export function layerNorm(x: tf.Tensor, g: tf.Tensor, b: tf.Tensor, eps = 1e-5): tf.Tensor {
  const axis = x.rank - 1;
  const mean = tf.mean(x, axis, true);
  const centered = tf.sub(x, mean);
  const variance = tf.mean(tf.square(centered), axis, true);
  return tf.add(tf.mul(tf.mul(centered, tf.rsqrt(tf.add(variance, eps))), g), b);
}

/** GELU, tanh approximation (Hendrycks & Gimpel, 2016), as in GPT-2. */
export function gelu(x: tf.Tensor): tf.Tensor {
  const c = Math.sqrt(2 / Math.PI);
  const inner = tf.mul(tf.add(x, tf.mul(tf.pow(x, 3), 0.044715)), c);
  return tf.mul(tf.mul(x, 0.5), tf.add(tf.tanh(inner), 1));
}

const maskCache = new Map<number, Float32Array>();
/** Additive causal mask [T, T]: 0 on and below the diagonal, -1e9 above. */
export function causalMask(t: number): tf.Tensor2D {
  let m = maskCache.get(t);
  if (!m) {
    m = new Float32Array(t * t);
    for (let i = 0; i < t; i++) for (let j = i + 1; j < t; j++) m[i * t + j] = -1e9;
    maskCache.set(t, m);
  }
  return tf.tensor2d(m, [t, t]);
}

/**
 * Causal multi-head self-attention (Vaswani et al., 2017). x: [B, T, D]; wqkv: [D, 3D],
 * bqkv: [3D]; wo: [D, D], bo: [D]. Returns [B, T, D].
 */
export function causalSelfAttention(
  x: tf.Tensor, heads: number, wqkv: tf.Tensor, bqkv: tf.Tensor, wo: tf.Tensor, bo: tf.Tensor,
): tf.Tensor {
  const [B, T, D] = x.shape;
  const dh = D / heads;
  const qkv = dense(x, wqkv, bqkv); // [B, T, 3D]
  // [B, T, 3, H, dh] -> [3, B, H, T, dh]
  const split = tf.transpose(tf.reshape(qkv, [B, T, 3, heads, dh]), [2, 0, 3, 1, 4]);
  const [q, k, v] = tf.unstack(split, 0).map((t) => tf.reshape(t, [B * heads, T, dh]));
  const scores = tf.add(tf.mul(tf.matMul(q, k, false, true), 1 / Math.sqrt(dh)), causalMask(T)); // [BH, T, T]
  const att = tf.softmax(scores, -1);
  const ctx = tf.matMul(att, v); // [BH, T, dh]
  const merged = tf.reshape(tf.transpose(tf.reshape(ctx, [B, heads, T, dh]), [0, 2, 1, 3]), [B, T, D]);
  return dense(merged, wo, bo);
}

/**
 * Mean softmax cross-entropy. logits: [..., V] float32; labels: [...] int32 class indices.
 * Returns a scalar (nats per prediction).
 */
export function softmaxCrossEntropy(logits: tf.Tensor, labels: tf.Tensor): tf.Scalar {
  const v = logits.shape[logits.shape.length - 1];
  const flat = tf.reshape(logits, [-1, v]);
  const oneHot = tf.oneHot(tf.reshape(labels, [-1]) as tf.Tensor1D, v);
  const logp = tf.logSoftmax(flat, -1);
  return tf.neg(tf.mean(tf.sum(tf.mul(oneHot, logp), -1))) as tf.Scalar;
}
