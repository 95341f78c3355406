/** A test model module: a layerwise block list (three dense blocks written with tfjs-core ops) on [4, 4, 1] inputs, 3 classes. */
import * as tf from '@tensorflow/tfjs-core';
import type { Block } from '../../model/block.js';

const denseBlock = (
  name: string,
  din: number,
  dout: number,
  relu: boolean,
): Block => ({
  name,
  params: [
    {
      name: 'w',
      shape: [din, dout],
      init: { kind: 'uniform', limit: Math.sqrt(6 / (din + dout)) },
    },
    { name: 'b', shape: [dout], init: { kind: 'zeros' } },
  ],
  outputShape: ([b]) => [b!, dout],
  forward: (p, x) => {
    const y = tf.add(tf.matMul(tf.reshape(x, [x.shape[0]!, din]), p.w!), p.b!);
    return relu ? tf.relu(y) : y;
  },
  flops: ([b]) => 2 * b! * din * dout,
});

export default {
  blocks: [
    denseBlock('hidden', 16, 9, true),
    denseBlock('hidden2', 9, 6, true),
    denseBlock('out', 6, 3, false),
  ],
  inputShape: [4, 4, 1],
};
