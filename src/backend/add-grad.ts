/**
 * The gradient of `Add` (tfjs-core 4.22 gradients/Add_grad.ts), with its no-reduction case run
 * as the Reshape kernel on dy directly (backend/dense.ts kernelOnViews) rather than the Reshape
 * op: a residual connection's two input gradients are dy itself under the inputs' shapes, and
 * the op's engine run per input (charlm-small: 18 a step, most of the Reshape runs left once
 * dense layers became one op) is host work that does not shrink with cores. The same kernels
 * on the same tensors as the stock gradient, so the same values; it reads only the saved inputs'
 * shapes, as the stock one does (pipeline/tape.ts keeps only those for `Add`).
 */
import * as tf from '@tensorflow/tfjs-core';
import { kernelOnViews } from './dense.js';

/** d(a + b): dy summed over the axes each input was broadcast along, given that input's shape. */
function addGradFunc(
  dy: tf.Tensor | tf.Tensor[],
  saved: tf.Tensor[],
): Record<string, () => tf.Tensor> {
  const d = dy as tf.Tensor;
  const [a, b] = saved as [tf.Tensor, tf.Tensor];
  const outShape = tf.broadcast_util.assertAndGetBroadcastShape(
    a.shape,
    b.shape,
  );
  const gradient = (shape: number[]) => () => {
    const axes = tf.backend_util.getReductionAxes(shape, outShape);
    if (axes.length > 0) return tf.reshape(tf.sum(d, axes), shape);
    return kernelOnViews('Reshape', { x: d }, { shape }, shape);
  };
  return { a: gradient(a.shape), b: gradient(b.shape) };
}

/** Registers {@link addGradFunc} for `Add` in place of the stock gradient (global to this thread's tfjs-core). */
export function registerAddGrad(): void {
  tf.registerGradient({
    kernelName: 'Add',
    inputsToSave: ['a', 'b'],
    gradFunc: addGradFunc,
  });
}
