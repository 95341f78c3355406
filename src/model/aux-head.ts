/**
 * Auxiliary heads for local parallelism (Laskin et al., 2020; Belilovsky et al., 2020): a small
 * head on a stage's output that turns it into a prediction, so the stage has a local loss of
 * its own. For a language model: layer norm + projection to the vocabulary (like the model's
 * own head); for classifiers: global average pooling (over H, W if the activation is an image)
 * + a linear layer to the classes.
 */
import * as tf from '@tensorflow/tfjs-core';
import type { Block } from './block.js';
import { type HostParams, initBlockParams } from './init.js';
import { dense } from './layers.js';
import type { Model } from './model.js';
import { lmHead } from './transformer.js';

/** Parameter key of an auxiliary head's parameter: `aux<stage>.<name>`. */
export function auxKey(stage: number, name: string): string {
  return `aux${stage}.${name}`;
}

/**
 * The auxiliary head for the output of the block `lastBlock` (exclusive end of a stage) of
 * `model`. Its output is logits like the model's: [B, T, V] or [B, C].
 */
export function auxHead(model: Model, stage: number, lastBlock: number): Block {
  const c = model.config;
  if (c.arch === 'charlm') return lmHead(`aux${stage}`, c.dModel, c.vocab);
  // activation shape of one example after blocks [0, lastBlock)
  let shape = model.inputShape(1);
  for (let b = 0; b < lastBlock; b++)
    shape = model.blocks[b].outputShape(shape);
  const image = shape.length === 4;
  const features = image ? shape[3] : shape.slice(1).reduce((a, b) => a * b, 1);
  // a module model's head predicts what its own output does: its final shape, probabilities
  // where its loss takes probabilities
  let outShape =
    c.arch === 'module'
      ? model.blocks
          .reduce((s, b) => b.outputShape(s), model.inputShape(1))
          .slice(1)
      : [c.classes];
  const probabilities =
    c.arch === 'module' && c.loss === 'sparse-categorical-crossentropy';
  if (c.arch === 'module' && c.loss !== 'mse')
    outShape = [outShape[outShape.length - 1]!];
  const units = outShape.reduce((a, b) => a * b, 1);
  return {
    name: `aux${stage}`,
    params: [
      {
        name: 'w',
        shape: [features, units],
        init: { kind: 'uniform', limit: Math.sqrt(6 / (features + units)) },
      },
      { name: 'b', shape: [units], init: { kind: 'zeros' } },
    ],
    outputShape: ([b]) => [b, ...outShape],
    forward(p, x) {
      const pooled = image
        ? tf.mean(x, [1, 2])
        : x.rank === 2
          ? x
          : tf.reshape(x, [x.shape[0], -1]);
      const y = dense(pooled, p.w, p.b);
      if (probabilities) return tf.softmax(y);
      return outShape.length === 1
        ? y
        : tf.reshape(y, [x.shape[0]!, ...outShape]);
    },
    flops: ([b]) => 2 * b * features * units,
  };
}

/**
 * Initial values of the auxiliary heads of stages 0..K-2 (stage s's head sits after block
 * ends[s] - 1), seeded like model parameters on streams past the model's blocks.
 */
export function initAuxParams(
  model: Model,
  ends: readonly number[],
  seed: number,
): HostParams {
  const out: HostParams = new Map();
  ends.slice(0, -1).forEach((end, s) => {
    initBlockParams(
      auxHead(model, s, end),
      seed,
      model.blocks.length + 1000 + s,
      (name) => auxKey(s, name),
      out,
    );
  });
  return out;
}
