/**
 * Losses and metrics a model can declare, by name. Every loss returns the mean over the
 * predictions of a micro-batch as a scalar; the mini-batch loss is the mean of the micro-batch
 * losses (pipeline/stage.ts).
 */
import * as tf from '@tensorflow/tfjs-core';
import { LayerwiseError } from '../util/errors.js';
import { softmaxCrossEntropy } from './layers.js';
import { LOSSES, type LossName } from './loss-names.js';

export { isClassification, LOSSES, type LossName } from './loss-names.js';

/** tfjs-layers' epsilon (backend/common.ts) for clipping probabilities. */
const EPSILON = 1e-7;

/** The loss function of this name: (output, labels) -> scalar mean. */
export function lossFunction(
  name: LossName,
): (output: tf.Tensor, labels: tf.Tensor) => tf.Scalar {
  switch (name) {
    case 'softmax-cross-entropy':
      return softmaxCrossEntropy;
    case 'sparse-categorical-crossentropy':
      return (output, labels) =>
        tf.tidy(() => {
          const c = output.shape[output.shape.length - 1]!;
          // as tfjs-layers' categoricalCrossentropy: renormalise, clip, -sum(onehot * log p)
          const p = tf.clipByValue(
            tf.div(output, tf.sum(output, -1, true)),
            EPSILON,
            1 - EPSILON,
          );
          const onehot = tf.oneHot(
            tf.reshape(tf.cast(labels, 'int32'), [-1]) as tf.Tensor1D,
            c,
          );
          return tf.neg(
            tf.mean(tf.sum(tf.mul(onehot, tf.log(tf.reshape(p, [-1, c]))), -1)),
          ) as tf.Scalar;
        });
    case 'mse':
      return (output, labels) =>
        tf.mean(
          tf.squaredDifference(output, tf.reshape(labels, output.shape)),
        ) as tf.Scalar;
    default:
      throw new LayerwiseError(
        `unknown loss '${name as string}'; valid: ${LOSSES.join(', ')}`,
      );
  }
}

/**
 * Fraction of predictions whose arg-max over the last axis equals the label. output: [..., C];
 * labels: [...] class indices. Returns a scalar in [0, 1].
 */
export function accuracy(output: tf.Tensor, labels: tf.Tensor): tf.Scalar {
  return tf.tidy(
    () =>
      tf.mean(
        tf.cast(
          tf.equal(
            tf.argMax(output, -1),
            tf.reshape(tf.cast(labels, 'int32'), output.shape.slice(0, -1)),
          ),
          'float32',
        ),
      ) as tf.Scalar,
  );
}
