/** The names of the losses a model can declare (model/losses.ts), without loading TF.js. */

/**
 * - `softmax-cross-entropy`: the output is logits [..., C], labels int32 class indices [...];
 *   nats per prediction (numerically stable, fused on native).
 * - `sparse-categorical-crossentropy`: the output is probabilities [..., C] (a softmax last
 *   layer), labels class indices; -log(clip(p[label], 1e-7, 1 - 1e-7)) as tfjs-layers computes
 *   it for a model compiled with `loss: 'sparseCategoricalCrossentropy'`.
 * - `mse`: mean squared error between the output and float32 targets of the same shape.
 */
export const LOSSES = [
  'softmax-cross-entropy',
  'sparse-categorical-crossentropy',
  'mse',
] as const;
export type LossName = (typeof LOSSES)[number];

/** Whether a loss compares class indices (classification) rather than values. */
export const isClassification = (loss: LossName): boolean => loss !== 'mse';
