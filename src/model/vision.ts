/** Blocks for image classifiers: dense/MLP and conv2d + pooling. NHWC layout. */
import * as tf from '@tensorflow/tfjs-core';
import type { Block } from './block.js';
import { sizeOf } from './block.js';
import { dense } from './layers.js';

/**
 * Fully connected layer with optional ReLU. Flattens its input first, so it also serves as the
 * first layer after images: [B, ...] -> [B, out].
 */
export function denseBlock(
  name: string,
  inFeatures: number,
  out: number,
  relu: boolean,
): Block {
  return {
    name,
    params: [
      {
        name: 'w',
        shape: [inFeatures, out],
        init: { kind: 'uniform', limit: Math.sqrt(6 / (inFeatures + out)) },
      },
      { name: 'b', shape: [out], init: { kind: 'zeros' } },
    ],
    outputShape: ([b]) => [b, out],
    forward(p, x) {
      const flat = x.rank === 2 ? x : tf.reshape(x, [x.shape[0], -1]);
      const y = dense(flat, p.w, p.b);
      return relu ? tf.relu(y) : y;
    },
    flops: ([b]) => 2 * b * inFeatures * out,
  };
}

/**
 * k x k (default 3x3) 'same' convolution with bias, then ReLU: [B, H, W, Cin] -> [B, H, W, Cout].
 * Pooling is a block of its own ({@link maxPoolBlock}): partitions cut between layers, and the
 * finer blocks let a balance even out stages (GPipe and torchgpipe partition by layer).
 */
export function convBlock(
  name: string,
  cin: number,
  cout: number,
  k = 3,
): Block {
  return {
    name,
    params: [
      {
        name: 'w',
        shape: [k, k, cin, cout],
        init: { kind: 'uniform', limit: Math.sqrt(6 / (k * k * (cin + cout))) },
      },
      { name: 'b', shape: [cout], init: { kind: 'zeros' } },
    ],
    outputShape: ([b, h, w]) => [b, h, w, cout],
    forward(p, x) {
      return tf.relu(
        tf.add(tf.conv2d(x as tf.Tensor4D, p.w as tf.Tensor4D, 1, 'same'), p.b),
      );
    },
    flops: ([b, h, w]) => 2 * b * h * w * k * k * cin * cout,
  };
}

/**
 * 2x2 max pooling, stride 2, 'same' padding; no parameters. [B, H, W, C] -> [B, ceil(H/2), ceil(W/2), C].
 * Its FLOP count is one comparison per input element.
 */
export function maxPoolBlock(name: string): Block {
  return {
    name,
    params: [],
    outputShape: ([b, h, w, c]) => [b, Math.ceil(h / 2), Math.ceil(w / 2), c],
    forward(_p, x) {
      return tf.maxPool(x as tf.Tensor4D, 2, 2, 'same');
    },
    flops: ([b, h, w, c]) => b * h * w * c,
  };
}

/** Number of features of one example of this shape (without the batch dimension). */
export function features(shape: number[]): number {
  return sizeOf(shape);
}
