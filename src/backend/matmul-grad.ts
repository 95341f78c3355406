/**
 * Gradient of `BatchMatMul` (tf.matMul) that supports broadcast batch dimensions.
 *
 * For C = op(A) @ op(B), op = optional transpose of the last two axes:
 *   dA = tA ? op(B) @ dC^T : dC @ op(B)^T,   dB = tB ? dC^T @ op(A) : op(A)^T @ dC
 * (the stock tfjs-core 4.22 rule), then summed over the batch axes along which the input was
 * broadcast, which the stock rule omits (it throws a shape-mismatch error, e.g. for
 * [B,T,D] @ [D,E]). When `b` has no batch but `a` does, the batch is folded into the rows of a
 * single 2-D product instead of B products and a sum.
 */
import * as tf from '@tensorflow/tfjs-core';
import { kernelOnViews, view } from './dense.js';
import {
  checkDenseGelu,
  DENSE_GELU_GRAD_KERNEL,
  DENSE_GELU_KERNEL,
  DENSE_KERNEL,
} from './kernel-names.js';

/**
 * Sum `grad` over the axes along which `shape` was broadcast, and give it `shape` (no reshape
 * where the sum without the reduced axes has it already: a bias's [N] from dy [1, M, N]).
 */
function unbroadcast(grad: tf.Tensor, shape: number[]): tf.Tensor {
  if (tf.util.arraysEqual(grad.shape, shape)) return grad;
  const axes = tf.backend_util.getReductionAxes(shape, grad.shape);
  if (axes.length === 0) return tf.reshape(grad, shape);
  const summed = tf.sum(grad, axes);
  return tf.util.arraysEqual(summed.shape, shape)
    ? summed
    : tf.reshape(summed, shape);
}

const batchSize = (t: tf.Tensor): number =>
  tf.util.sizeFromShape(t.shape.slice(0, -2));

function gradFunc(
  dy: tf.Tensor | tf.Tensor[],
  saved: tf.Tensor[],
  attrs: tf.NamedAttrMap,
): Record<string, () => tf.Tensor> {
  const dC = dy as tf.Tensor;
  const [a, b] = saved as [tf.Tensor, tf.Tensor];
  const tA = attrs.transposeA === true;
  const tB = attrs.transposeB === true;
  // each closure in a tidy scope: its temporaries go when it returns, not when tf.grads ends
  return {
    a: () =>
      tf.tidy(() => {
        const da = tA
          ? tf.matMul(b, dC, tB, true)
          : tf.matMul(dC, b, false, !tB);
        return unbroadcast(da, a.shape);
      }),
    b: () =>
      tf.tidy(() => {
        // a batch of one (dense's [1, N, Din]) needs no folding: one product as it is
        if (
          !tA &&
          batchSize(b) === 1 &&
          batchSize(a) > 1 &&
          batchSize(a) === batchSize(dC) &&
          a.rank > 2
        ) {
          const a2 = tf.reshape(a, [-1, a.shape[a.rank - 1]!]);
          const dC2 = tf.reshape(dC, [-1, dC.shape[dC.rank - 1]!]);
          const db = tB
            ? tf.matMul(dC2, a2, true, false)
            : tf.matMul(a2, dC2, true, false);
          return tf.reshape(db, b.shape);
        }
        const db = tB
          ? tf.matMul(dC, a, true, tA)
          : tf.matMul(a, dC, !tA, false);
        return unbroadcast(db, b.shape);
      }),
  };
}

/**
 * Gradient of the `_FusedMatMul` kernel run directly (model/layers.ts dense: y = op(a) op(b) +
 * bias, linear activation), which tfjs-core leaves unregistered (its `tf.fused.matMul` op wraps
 * the kernel in a customGrad that computes every input's gradient at once): `a` and `b` as
 * `BatchMatMul`'s, `bias` the sum of dy over the broadcast axes, each a lazy closure, so that a
 * split backward runs the input's and the weights' products apart. Throws for a non-linear
 * activation (the fused activation's derivative is not implemented here).
 */
function fusedGradFunc(
  dy: tf.Tensor | tf.Tensor[],
  saved: tf.Tensor[],
  attrs: tf.NamedAttrMap,
): Record<string, () => tf.Tensor> {
  if ((attrs.activation ?? 'linear') !== 'linear')
    throw new Error(
      `_FusedMatMul gradient: activation ${String(attrs.activation)} is not supported; use dense then the activation`,
    );
  const [a, b, bias] = saved as [tf.Tensor, tf.Tensor, tf.Tensor | undefined];
  const grads = gradFunc(dy, [a, b], attrs);
  if (bias === undefined) return grads;
  return {
    ...grads,
    bias: () => tf.tidy(() => unbroadcast(dy as tf.Tensor, bias.shape)),
  };
}

/**
 * Gradient of DENSE_KERNEL (backend/dense.ts: y = x w + b, the backend's `_FusedMatMul` on x as
 * [1, rows, Din] and w as [1, Din, Dout]), from the saved x, w, b: each input's gradient a lazy
 * closure (a split backward asks for dx in its input part, dw and db in its weight part), each
 * one kernel run on views of dy [1, rows, Dout], x and w (backend/dense.ts kernelOnViews), the
 * runs the reshaped product's gradient made ({@link fusedGradFunc}: dx = dy w^T and dw = x^T dy
 * as `BatchMatMul`, db = `Sum` of dy over axes 0 and 1), now without the Reshape ops around them.
 */
function denseGradFunc(
  dy: tf.Tensor | tf.Tensor[],
  saved: tf.Tensor[],
): Record<string, () => tf.Tensor> {
  const [x, w, b] = saved as [tf.Tensor, tf.Tensor, tf.Tensor];
  const [rows, din, dout] = checkDenseGelu(x, w, b, DENSE_KERNEL);
  const dy3 = view(dy as tf.Tensor, [1, rows, dout]);
  return {
    x: () =>
      kernelOnViews(
        'BatchMatMul',
        { a: dy3, b: view(w, [1, din, dout]) },
        { transposeA: false, transposeB: true },
        x.shape,
      ),
    w: () =>
      kernelOnViews(
        'BatchMatMul',
        { a: view(x, [1, rows, din]), b: dy3 },
        { transposeA: true, transposeB: false },
        w.shape,
      ),
    b: () =>
      kernelOnViews('Sum', { x: dy3 }, { axis: [0, 1], keepDims: false }, [
        dout,
      ]),
  };
}

/**
 * Gradient of DENSE_GELU_KERNEL (model/layers.ts denseGelu: y = GELU(h), h = x w + b), from the
 * saved x, w, b and h: DENSE_GELU_GRAD_KERNEL makes dh = GELU'(h) dy and db (dh's column sums)
 * when the gradient is asked for (one dispatch on webgpu; elsewhere GELU's gradient kernel and
 * `Sum`, the kernels gelu's and dense's gradients ran), then dx and dw are `_FusedMatMul`'s
 * gradient ({@link gradFunc}) of h = x w + b on the shapes the forward's product had
 * ([1, rows, Din] x [1, Din, Dout]: the same kernels, so the same numbers, as dense then gelu),
 * each a lazy closure sharing dh: a split backward (pipeline/split-backward.ts) asks for dx in
 * its input part and for dw, db in its weight part, each part making dh and db again from the
 * saved h and the kept dy (the input part's db unused: where dense then gelu made dh once and
 * db only in the weight part). h is the op's internal output (layers.ts frees its handle, so no
 * op reads it): its own gradient, zeros the engine makes for an output the backward did not
 * reach, is not read: the tape passes a placeholder (backend/kernel-names.ts
 * UNREAD_OUTPUT_GRADIENTS), tf.grads the engine's zeros, freed at once.
 */
function denseGeluGradFunc(
  dy: tf.Tensor | tf.Tensor[],
  saved: tf.Tensor[],
): Record<string, () => tf.Tensor> {
  const dys = Array.isArray(dy) ? dy : [dy];
  const [x, w, b, h] = saved as [tf.Tensor, tf.Tensor, tf.Tensor, tf.Tensor];
  const [rows, din, dout] = checkDenseGelu(x, w, b);
  // h's own gradient is never read: the tape's kept scalar placeholder (pipeline/tape.ts dysOf),
  // or under tf.grads the engine's zeros, [rows, Dout] floats freed now rather than with its scope
  if (dys[1] && !isUnreadGradient(dys[1])) dys[1].dispose();
  const [dh, db] = tf
    .engine()
    .runKernel(DENSE_GELU_GRAD_KERNEL, { h, dy: dys[0]! }) as tf.Tensor[];
  const g = gradFunc(
    tf.reshape(dh!, [1, rows, dout]),
    [tf.reshape(x, [1, rows, din]), tf.reshape(w, [1, din, dout])],
    { transposeA: false, transposeB: false },
  );
  return {
    x: () => tf.tidy(() => tf.reshape(g.a!(), x.shape)),
    w: () => tf.tidy(() => tf.reshape(g.b!(), w.shape)),
    b: () => db!,
  };
}

let placeholder: tf.Tensor | undefined;

/**
 * A kept float32 scalar that stands for an output gradient the gradient function never reads
 * (kernel-names.ts UNREAD_OUTPUT_GRADIENTS; pipeline/tape.ts dysOf passes it). One per thread,
 * made by initBackend for a backend that registers such a kernel (so that it is not a new
 * tensor in the first backward), again if an engine reset disposed it.
 */
export function unreadGradient(): tf.Tensor {
  if (!placeholder || placeholder.isDisposed)
    placeholder = tf.keep(tf.scalar(0));
  return placeholder;
}

/** Whether `t` is {@link unreadGradient}'s placeholder (kept: never to be disposed by a gradient). */
function isUnreadGradient(t: tf.Tensor): boolean {
  return t === placeholder;
}

/**
 * Register the broadcasting `BatchMatMul` gradient in place of the stock one, the
 * `_FusedMatMul` kernel's ({@link fusedGradFunc}), DENSE_KERNEL's ({@link denseGradFunc}) and
 * DENSE_GELU_KERNEL's
 * ({@link denseGeluGradFunc}). Gradients are global to the tfjs-core instance (all backends).
 * Call once per thread.
 */
export function registerMatMulGrad(): void {
  tf.registerGradient({
    kernelName: 'BatchMatMul',
    inputsToSave: ['a', 'b'],
    gradFunc,
  });
  tf.registerGradient({
    kernelName: '_FusedMatMul',
    inputsToSave: ['a', 'b', 'bias'],
    gradFunc: fusedGradFunc,
  });
  tf.registerGradient({
    kernelName: DENSE_KERNEL,
    inputsToSave: ['x', 'w', 'b'],
    gradFunc: denseGradFunc,
  });
  tf.registerGradient({
    kernelName: DENSE_GELU_KERNEL,
    inputsToSave: ['x', 'w', 'b'],
    outputsToSave: [false, true],
    gradFunc: denseGeluGradFunc,
  });
}
