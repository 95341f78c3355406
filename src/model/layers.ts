/**
 * Differentiable building blocks written with TF.js ops. Shapes use B = batch, T = time
 * (context), D = model width, H = heads, V = vocabulary, C = classes.
 */
import * as tf from '@tensorflow/tfjs-core';
import { fusedDense, hasDenseKernel } from '../backend/dense.js';
import {
  CAUSAL_ATTENTION_GRAD_KERNEL,
  CAUSAL_ATTENTION_KERNEL,
  CAUSAL_SOFTMAX_GRAD_KERNEL,
  CAUSAL_SOFTMAX_KERNEL,
  checkDenseGelu,
  DENSE_GELU_KERNEL,
  DENSE_KERNEL,
  FLASH_ATTENTION_GRAD_KERNEL,
  FLASH_ATTENTION_KERNEL,
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

/**
 * y = x W + b over the last axis. x: [..., Din], w: [Din, Dout], b: [Dout] -> [..., Dout]. With
 * a bias, one op (DENSE_KERNEL, backend/dense.ts: the backend's `_FusedMatMul` on views of x and
 * w, so no Reshape ops on the tape) where initBackend registered it, else {@link fusedDense}.
 */
export function dense(x: tf.Tensor, w: tf.Tensor, b?: tf.Tensor): tf.Tensor {
  // fused: the backend adds the bias in the product's output (the native device in place)
  if (b && hasDenseKernel())
    return tf.engine().runKernel(DENSE_KERNEL, { x, w, b }) as tf.Tensor;
  if (b) return fusedDense(x, w, b);
  const din = x.shape[x.shape.length - 1];
  const lead = x.shape.slice(0, -1);
  const x2 =
    x.rank === 2
      ? (x as tf.Tensor2D)
      : (tf.reshape(x, [-1, din]) as tf.Tensor2D);
  const y = tf.matMul(x2, w as tf.Tensor2D);
  return x.rank === 2 ? y : tf.reshape(y, [...lead, w.shape[1] as number]);
}

/**
 * GELU(x W + b) ({@link dense} then {@link gelu}) as one op: x [..., Din], w [Din, Dout], b
 * [Dout] (float32) -> [..., Dout]. The kernel DENSE_GELU_KERNEL (backend/kernel-names.ts) is one
 * dispatch on webgpu (the product's epilogue adds the bias and applies GELU,
 * backend/webgpu-matmul-gelu.ts), with no reshape on the tape; a backend that does not register
 * it (all but webgpu) runs dense then gelu themselves, as before the op existed: on native a
 * composed form of the pair inside one op cost bf16 charlm-small 0.20 -> 0.26 s a step at 2
 * threads (its bias gradient's `Sum` over [1, rows, Dout] and the products ran slower). Its second
 * output, h = x W + b, is kept for the gradient only (backend/matmul-grad.ts: dh = GELU'(h) dy,
 * then the product's gradients, one lazy closure per input, so that a split backward still
 * computes dx apart from dW and db).
 * @throws Error naming the mismatch where w is not [Din, Dout] or b not [Dout].
 */
export function denseGelu(x: tf.Tensor, w: tf.Tensor, b: tf.Tensor): tf.Tensor {
  checkDenseGelu(x, w, b);
  if (tf.getKernel(DENSE_GELU_KERNEL, tf.getBackend()) === undefined)
    return gelu(dense(x, w, b));
  const [y, h] = tf
    .engine()
    .runKernel(DENSE_GELU_KERNEL, { x, w, b }) as tf.Tensor[];
  h!.dispose(); // the tape keeps its own copy for the gradient
  return y!;
}

/**
 * Layer normalisation over the last axis (Ba et al., 2016), epsilon = 1e-5. x: [..., D]; g, b:
 * [D]. One op over the kernel pair LAYER_NORM_KERNEL / LAYER_NORM_GRAD_KERNEL
 * (backend/kernel-names.ts: the native backend's C++ kernels, elsewhere composed of stock ops in
 * backend/composed-kernels.ts). The gradient saves only xhat = (x - mean) * rstd and rstd (the
 * stock autodiff of the composition saves about 8 tensors and runs 20 kernels):
 * dx = rstd * (dxhat - mean(dxhat) - xhat * mean(dxhat * xhat)) with dxhat = dy * g,
 * dg = sum over rows of dy * xhat, db = sum over rows of dy.
 */
export function layerNorm(
  x: tf.Tensor,
  g: tf.Tensor,
  b: tf.Tensor,
  epsilon = 1e-5,
): tf.Tensor {
  const op = customGrad(
    (x: tf.Tensor, g: tf.Tensor, b: tf.Tensor, save: tf.GradSaveFunc) => {
      const [y, xhat, rstd] = tf
        .engine()
        .runKernel(LAYER_NORM_KERNEL, { x, g, b }, { epsilon }) as tf.Tensor[];
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
  return op(x, g, b);
}

/**
 * GELU, tanh approximation (Hendrycks & Gimpel, 2016), as in GPT-2:
 * 0.5 x (1 + tanh(sqrt(2/pi) (x + 0.044715 x^3))). One op over GELU_KERNEL / GELU_GRAD_KERNEL
 * (the composed form computes x * sigmoid(u), u = x (c1 + c2 x^2), since sigmoid is a vectorised
 * XNNPACK kernel on wasm where tanh and pow are scalar). The gradient saves only x:
 * dy/dx = s + x (c1 + 3 c2 x^2) s (1 - s), s = sigmoid(u).
 */
export function gelu(x: tf.Tensor): tf.Tensor {
  const op = customGrad((x: tf.Tensor, save: tf.GradSaveFunc) => {
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
  return op(x);
}

/**
 * softmax(scores * scale + causal mask) over the last axis. scores: [..., T, T]. One op over
 * CAUSAL_SOFTMAX_KERNEL / CAUSAL_SOFTMAX_GRAD_KERNEL; the gradient saves only the output y:
 * dscores = scale * y * (dy - sum(dy * y)).
 */
export function maskedSoftmax(scores: tf.Tensor, scale: number): tf.Tensor {
  const op = customGrad((s: tf.Tensor, save: tf.GradSaveFunc) => {
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
  return op(scores);
}

/**
 * Causal multi-head self-attention (Vaswani et al., 2017). x: [B, T, D]; wqkv: [D, 3D],
 * bqkv: [3D]; wo: [D, D], bo: [D]. Returns [B, T, D]. softmax(q k^T / sqrt(dh) + causal mask) v
 * is one op reading q, k and v from the projection laid out [B, T, 3, H, dh]: over
 * FLASH_ATTENTION_KERNEL / FLASH_ATTENTION_GRAD_KERNEL where the active backend registers them
 * (webgpu: ctx and each row's log-sum-exp [B, H, T] kept for the gradient, nothing T x T), else
 * over CAUSAL_ATTENTION_KERNEL / CAUSAL_ATTENTION_GRAD_KERNEL, which keep the probabilities
 * [B, H, T, T] for the gradient (native reads them in place; the composed form transposes).
 */
export function causalSelfAttention(
  x: tf.Tensor,
  heads: number,
  wqkv: tf.Tensor,
  bqkv: tf.Tensor,
  wo: tf.Tensor,
  bo: tf.Tensor,
): tf.Tensor {
  const qkv = dense(x, wqkv, bqkv); // [B, T, 3D]
  const flash =
    tf.getKernel(FLASH_ATTENTION_KERNEL, tf.getBackend()) !== undefined;
  const [forward, grad] = flash
    ? [FLASH_ATTENTION_KERNEL, FLASH_ATTENTION_GRAD_KERNEL]
    : [CAUSAL_ATTENTION_KERNEL, CAUSAL_ATTENTION_GRAD_KERNEL];
  const op = customGrad((qkv: tf.Tensor, save: tf.GradSaveFunc) => {
    const [ctx, kept] = tf
      .engine()
      .runKernel(forward, { qkv }, { heads }) as tf.Tensor[];
    // flash: the gradient reads ctx and lse; the P form: P
    save(flash ? [qkv, kept!, ctx!] : [qkv, kept!]);
    return {
      value: ctx!,
      gradFunc: (dy: tf.Tensor | tf.Tensor[], saved: tf.Tensor[]) => {
        const [qkvSaved, kept, ctxSaved] = saved as [
          tf.Tensor,
          tf.Tensor,
          tf.Tensor?,
        ];
        const inputs: tf.NamedTensorMap = flash
          ? { dy: dy as tf.Tensor, qkv: qkvSaved, ctx: ctxSaved!, lse: kept }
          : { dy: dy as tf.Tensor, qkv: qkvSaved, p: kept };
        return [tf.engine().runKernel(grad, inputs, { heads }) as tf.Tensor];
      },
    };
  });
  return dense(op(qkv), wo, bo);
}

/**
 * Mean softmax cross-entropy. logits: [..., V] float32; labels: [...] int32 class indices.
 * Returns a scalar (nats per prediction). One op over SOFTMAX_CROSS_ENTROPY_KERNEL /
 * SOFTMAX_CROSS_ENTROPY_GRAD_KERNEL on the logits flattened to [N, V]; the gradient saves only
 * the probabilities: dlogits = (softmax - onehot) * dy / N over the N predictions.
 */
export function softmaxCrossEntropy(
  logits: tf.Tensor,
  labels: tf.Tensor,
): tf.Scalar {
  const v = logits.shape[logits.shape.length - 1]!;
  const shape = logits.shape;
  const flatLabels = tf.reshape(labels, [-1]);
  const op = customGrad((lg: tf.Tensor, save: tf.GradSaveFunc) => {
    const [loss, probs] = tf.engine().runKernel(SOFTMAX_CROSS_ENTROPY_KERNEL, {
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
  return op(logits) as tf.Scalar;
}
