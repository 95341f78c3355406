/**
 * Differentiable building blocks written with TF.js ops. Shapes use B = batch, T = time
 * (context), D = model width, H = heads, V = vocabulary, C = classes.
 */
import * as tf from '@tensorflow/tfjs-core';
import {
  CAUSAL_ATTENTION_GRAD_KERNEL,
  CAUSAL_ATTENTION_KERNEL,
  CAUSAL_SOFTMAX_GRAD_KERNEL,
  CAUSAL_SOFTMAX_KERNEL,
  GELU_GRAD_KERNEL,
  GELU_KERNEL,
  LAYER_NORM_GRAD_KERNEL,
  LAYER_NORM_KERNEL,
  SOFTMAX_CROSS_ENTROPY_GRAD_KERNEL,
  SOFTMAX_CROSS_ENTROPY_KERNEL,
} from '../backend/kernel-names.js';

/** The result of a custom-gradient forward function: its value and the gradient function. */
interface CustomResult {
  value: tf.Tensor;
  gradFunc: (dy: tf.Tensor | tf.Tensor[], saved: tf.Tensor[]) => tf.Tensor[];
}

/**
 * tf.customGrad with tensor arguments typed positionally (the save function comes last). The
 * gradient function runs in a tidy scope, so its temporaries are freed as soon as it returns
 * rather than when the whole backward pass (tf.grads) ends: on wasm, where GELU and layer norm
 * are composed of stock ops, that took l2l's peak device memory (charlm-small `--layers 16`, micro-batch 2) from 43.6 to 31.8 MiB.
 */
function customGrad<A extends tf.Tensor[]>(
  f: (...args: [...A, tf.GradSaveFunc]) => CustomResult,
): (...args: A) => tf.Tensor {
  const tidied = (...args: [...A, tf.GradSaveFunc]): CustomResult => {
    const r = f(...args);
    return {
      value: r.value,
      gradFunc: (dy, saved) => tf.tidy(() => r.gradFunc(dy, saved)),
    };
  };
  const g = tf.customGrad(
    tidied as unknown as Parameters<typeof tf.customGrad>[0],
  );
  return (...args: A) => g(...args);
}

/** Whether the current backend registers both kernels of a fused pair (backend/kernel-names.ts). */
const hasFused = (forward: string, gradient: string): boolean =>
  tf.getKernel(forward, tf.getBackend()) !== undefined &&
  tf.getKernel(gradient, tf.getBackend()) !== undefined;

/** y = x W + b over the last axis. x: [..., Din], w: [Din, Dout], b: [Dout] -> [..., Dout]. */
export function dense(x: tf.Tensor, w: tf.Tensor, b?: tf.Tensor): tf.Tensor {
  const din = x.shape[x.shape.length - 1];
  const lead = x.shape.slice(0, -1);
  const x2 =
    x.rank === 2
      ? (x as tf.Tensor2D)
      : (tf.reshape(x, [-1, din]) as tf.Tensor2D);
  // fused: the backend adds the bias in the product's output (the native device in place)
  const y: tf.Tensor = b
    ? tf.fused.matMul({ a: x2, b: w as tf.Tensor2D, bias: b })
    : tf.matMul(x2, w as tf.Tensor2D);
  return x.rank === 2 ? y : tf.reshape(y, [...lead, w.shape[1] as number]);
}

/** Axes 0..rank-2: the rows of a tensor normalised over its last axis. */
const leadingAxes = (rank: number): number[] => [...Array(rank - 1).keys()];

/**
 * Layer normalisation over the last axis (Ba et al., 2016), epsilon = 1e-5. g, b: [D].
 * Custom gradient: saves only xhat = (x - mean) * rstd and rstd (the stock autodiff of the
 * composition saves about 8 tensors and runs 20 kernels), and computes
 * dx = rstd * (dxhat - mean(dxhat) - xhat * mean(dxhat * xhat)) with dxhat = dy * g,
 * dg = sum over rows of dy * xhat, db = sum over rows of dy. On a backend that registers the
 * fused kernels (backend/kernel-names.ts: native), forward and gradient are one kernel each.
 */
export function layerNorm(
  x: tf.Tensor,
  g: tf.Tensor,
  b: tf.Tensor,
  epsilon = 1e-5,
): tf.Tensor {
  if (
    x.dtype === 'float32' &&
    hasFused(LAYER_NORM_KERNEL, LAYER_NORM_GRAD_KERNEL)
  ) {
    // one fused kernel each way where the backend has them (native): the same math
    const fused = customGrad(
      (x: tf.Tensor, g: tf.Tensor, b: tf.Tensor, save: tf.GradSaveFunc) => {
        const [y, xhat, rstd] = tf
          .engine()
          .runKernel(
            LAYER_NORM_KERNEL,
            { x, g, b },
            { epsilon },
          ) as tf.Tensor[];
        save([xhat!, rstd!, g]);
        return {
          value: y!,
          gradFunc: (dy: tf.Tensor | tf.Tensor[], saved: tf.Tensor[]) => {
            const [xh, rs, gg] = saved as [tf.Tensor, tf.Tensor, tf.Tensor];
            return tf.engine().runKernel(LAYER_NORM_GRAD_KERNEL, {
              dy: dy as tf.Tensor,
              xhat: xh,
              rstd: rs,
              g: gg,
            }) as tf.Tensor[];
          },
        };
      },
    );
    return fused(x, g, b);
  }
  const f = customGrad(
    (x: tf.Tensor, g: tf.Tensor, b: tf.Tensor, save: tf.GradSaveFunc) => {
      const axis = x.rank - 1;
      const centered = tf.sub(x, tf.mean(x, axis, true));
      const rstd = tf.rsqrt(
        tf.add(tf.mean(tf.square(centered), axis, true), epsilon),
      );
      const xhat = tf.mul(centered, rstd);
      save([xhat, rstd, g]);
      return {
        value: tf.add(tf.mul(xhat, g), b),
        gradFunc: (dy: tf.Tensor | tf.Tensor[], saved: tf.Tensor[]) => {
          const d = dy as tf.Tensor;
          const [xh, rs, gg] = saved as [tf.Tensor, tf.Tensor, tf.Tensor];
          const rows = leadingAxes(d.rank);
          const dg = tf.sum(tf.mul(d, xh), rows);
          const db = tf.sum(d, rows);
          const dxhat = tf.mul(d, gg);
          const m1 = tf.mean(dxhat, axis, true);
          const m2 = tf.mean(tf.mul(dxhat, xh), axis, true);
          const dx = tf.mul(tf.sub(tf.sub(dxhat, m1), tf.mul(xh, m2)), rs);
          return [dx, dg, db];
        },
      };
    },
  );
  return f(x, g, b);
}

const GELU_C1 = 2 * Math.sqrt(2 / Math.PI);
const GELU_C2 = GELU_C1 * 0.044715;

/**
 * GELU, tanh approximation (Hendrycks & Gimpel, 2016), as in GPT-2:
 * 0.5 x (1 + tanh(sqrt(2/pi) (x + 0.044715 x^3))), computed as x * sigmoid(u) with
 * u = x (c1 + c2 x^2), c1 = 2 sqrt(2/pi), c2 = 0.044715 c1 (0.5 (1 + tanh(z)) = sigmoid(2z)):
 * sigmoid is a vectorised XNNPACK kernel on wasm, tanh and pow are scalar and slow.
 * Custom gradient: saves only x; dy/dx = s + x (c1 + 3 c2 x^2) s (1 - s), s = sigmoid(u).
 * On a backend that registers the fused kernels (backend/kernel-names.ts: native), forward and
 * gradient are one kernel each.
 */
export function gelu(x: tf.Tensor): tf.Tensor {
  if (x.dtype === 'float32' && hasFused(GELU_KERNEL, GELU_GRAD_KERNEL)) {
    // one fused kernel each way where the backend has them (native): the same math
    const fused = customGrad((x: tf.Tensor, save: tf.GradSaveFunc) => {
      save([x]);
      return {
        value: tf.engine().runKernel(GELU_KERNEL, { x }) as tf.Tensor,
        gradFunc: (dy: tf.Tensor | tf.Tensor[], saved: tf.Tensor[]) => [
          tf.engine().runKernel(GELU_GRAD_KERNEL, {
            x: saved[0]!,
            dy: dy as tf.Tensor,
          }) as tf.Tensor,
        ],
      };
    });
    return fused(x);
  }
  const f = customGrad((x: tf.Tensor, save: tf.GradSaveFunc) => {
    save([x]);
    const x2 = tf.square(x);
    const s = tf.sigmoid(tf.mul(x, tf.add(tf.mul(x2, GELU_C2), GELU_C1)));
    return {
      value: tf.mul(x, s),
      gradFunc: (dy: tf.Tensor | tf.Tensor[], saved: tf.Tensor[]) => {
        const [xs] = saved as [tf.Tensor];
        const sq = tf.square(xs);
        const sg = tf.sigmoid(tf.mul(xs, tf.add(tf.mul(sq, GELU_C2), GELU_C1)));
        const du = tf.mul(xs, tf.add(tf.mul(sq, 3 * GELU_C2), GELU_C1));
        const slope = tf.add(sg, tf.mul(du, tf.sub(sg, tf.square(sg))));
        return [tf.mul(dy as tf.Tensor, slope)];
      },
    };
  });
  return f(x);
}

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

/**
 * softmax(scores * scale + causal mask) over the last axis. scores: [..., T, T]. Custom
 * gradient: saves only the output y; dscores = scale * y * (dy - sum(dy * y)). On a backend
 * that registers the fused kernels (backend/kernel-names.ts: native), one kernel each way.
 */
export function maskedSoftmax(scores: tf.Tensor, scale: number): tf.Tensor {
  const t = scores.shape[scores.rank - 1]!;
  if (
    scores.dtype === 'float32' &&
    hasFused(CAUSAL_SOFTMAX_KERNEL, CAUSAL_SOFTMAX_GRAD_KERNEL)
  ) {
    // one fused kernel each way where the backend has them (native): the same math
    const fused = customGrad((s: tf.Tensor, save: tf.GradSaveFunc) => {
      const y = tf
        .engine()
        .runKernel(CAUSAL_SOFTMAX_KERNEL, { x: s }, { scale }) as tf.Tensor;
      save([y]);
      return {
        value: y,
        gradFunc: (dy: tf.Tensor | tf.Tensor[], saved: tf.Tensor[]) => [
          tf
            .engine()
            .runKernel(
              CAUSAL_SOFTMAX_GRAD_KERNEL,
              { y: saved[0]!, dy: dy as tf.Tensor },
              { scale },
            ) as tf.Tensor,
        ],
      };
    });
    return fused(scores);
  }
  const f = customGrad((s: tf.Tensor, save: tf.GradSaveFunc) => {
    const scaled = scale === 1 ? s : tf.mul(s, scale);
    const y = tf.softmax(tf.add(scaled, causalMask(t)), -1);
    save([y]);
    return {
      value: y,
      gradFunc: (dy: tf.Tensor | tf.Tensor[], saved: tf.Tensor[]) => {
        const d = dy as tf.Tensor;
        const [ys] = saved as [tf.Tensor];
        const dot = tf.sum(tf.mul(d, ys), -1, true);
        const dx = tf.mul(tf.sub(d, dot), ys);
        return [scale === 1 ? dx : tf.mul(dx, scale)];
      },
    };
  });
  return f(scores);
}

/**
 * Causal multi-head self-attention (Vaswani et al., 2017). x: [B, T, D]; wqkv: [D, 3D],
 * bqkv: [3D]; wo: [D, D], bo: [D]. Returns [B, T, D]. On a backend that registers the fused
 * attention kernels (native), softmax(q k^T / sqrt(dh) + causal mask) v is one kernel each way
 * that reads q, k and v in place from the projection and keeps only the probabilities
 * [B, H, T, T] for the gradient; elsewhere it is composed of stock ops (the same math).
 */
export function causalSelfAttention(
  x: tf.Tensor,
  heads: number,
  wqkv: tf.Tensor,
  bqkv: tf.Tensor,
  wo: tf.Tensor,
  bo: tf.Tensor,
): tf.Tensor {
  const [B, T, D] = x.shape as [number, number, number];
  const dh = D / heads;
  const qkv = dense(x, wqkv, bqkv); // [B, T, 3D]
  if (
    qkv.dtype === 'float32' &&
    hasFused(CAUSAL_ATTENTION_KERNEL, CAUSAL_ATTENTION_GRAD_KERNEL)
  ) {
    const fused = customGrad((qkv: tf.Tensor, save: tf.GradSaveFunc) => {
      const [ctx, p] = tf
        .engine()
        .runKernel(CAUSAL_ATTENTION_KERNEL, { qkv }, { heads }) as tf.Tensor[];
      save([qkv, p!]);
      return {
        value: ctx!,
        gradFunc: (dy: tf.Tensor | tf.Tensor[], saved: tf.Tensor[]) => [
          tf
            .engine()
            .runKernel(
              CAUSAL_ATTENTION_GRAD_KERNEL,
              { dy: dy as tf.Tensor, qkv: saved[0]!, p: saved[1]! },
              { heads },
            ) as tf.Tensor,
        ],
      };
    });
    return dense(fused(qkv), wo, bo);
  }
  // [B, T, 3, H, dh] -> [3, B, H, T, dh] (rows of dh move whole), then q, k, v: [BH, T, dh]
  const split = tf.transpose(
    tf.reshape(qkv, [B, T, 3, heads, dh]),
    [2, 0, 3, 1, 4],
  );
  const [q, k, v] = tf
    .unstack(split, 0)
    .map((t) => tf.reshape(t, [B * heads, T, dh])) as [
    tf.Tensor,
    tf.Tensor,
    tf.Tensor,
  ];
  const att = maskedSoftmax(tf.matMul(q, k, false, true), 1 / Math.sqrt(dh)); // [BH, T, T]
  const ctx = tf.matMul(att, v); // [BH, T, dh]
  const merged = tf.reshape(
    tf.transpose(tf.reshape(ctx, [B, heads, T, dh]), [0, 2, 1, 3]),
    [B, T, D],
  );
  return dense(merged, wo, bo);
}

/**
 * Mean softmax cross-entropy. logits: [..., V] float32; labels: [...] int32 class indices.
 * Returns a scalar (nats per prediction). Custom gradient: saves log-softmax and the one-hot
 * labels; dlogits = (softmax - onehot) * dy / N over the N predictions. On a backend that
 * registers the fused kernels (native), one kernel each way, saving only the probabilities.
 */
export function softmaxCrossEntropy(
  logits: tf.Tensor,
  labels: tf.Tensor,
): tf.Scalar {
  const v = logits.shape[logits.shape.length - 1]!;
  const shape = logits.shape;
  if (
    logits.dtype === 'float32' &&
    hasFused(SOFTMAX_CROSS_ENTROPY_KERNEL, SOFTMAX_CROSS_ENTROPY_GRAD_KERNEL)
  ) {
    const flatLabels = tf.reshape(labels, [-1]);
    const fused = customGrad((lg: tf.Tensor, save: tf.GradSaveFunc) => {
      const [loss, probs] = tf
        .engine()
        .runKernel(SOFTMAX_CROSS_ENTROPY_KERNEL, {
          logits: tf.reshape(lg, [-1, v]),
          labels: flatLabels,
        }) as tf.Tensor[];
      save([probs!, flatLabels]);
      return {
        value: loss!,
        gradFunc: (dy: tf.Tensor | tf.Tensor[], saved: tf.Tensor[]) => [
          tf.reshape(
            tf.engine().runKernel(SOFTMAX_CROSS_ENTROPY_GRAD_KERNEL, {
              probs: saved[0]!,
              labels: saved[1]!,
              dy: dy as tf.Tensor,
            }) as tf.Tensor,
            shape,
          ),
        ],
      };
    });
    return fused(logits) as tf.Scalar;
  }
  const f = customGrad((lg: tf.Tensor, save: tf.GradSaveFunc) => {
    const flat = tf.reshape(lg, [-1, v]);
    const oneHot = tf.oneHot(tf.reshape(labels, [-1]) as tf.Tensor1D, v);
    const logp = tf.logSoftmax(flat, -1);
    save([logp, oneHot]);
    return {
      value: tf.neg(tf.mean(tf.sum(tf.mul(oneHot, logp), -1))),
      gradFunc: (dy: tf.Tensor | tf.Tensor[], saved: tf.Tensor[]) => {
        const [lp, oh] = saved as [tf.Tensor, tf.Tensor];
        const n = lp.shape[0]!;
        const g = tf.mul(tf.sub(tf.exp(lp), oh), tf.div(dy as tf.Tensor, n));
        return [tf.reshape(g, shape)];
      },
    };
  });
  return f(logits) as tf.Scalar;
}
