/** A test model module: a tf.sequential classifier (flatten, dense relu, dense softmax) on [4, 4, 1] inputs, 3 classes. */
import * as tfl from '@tensorflow/tfjs-layers';

export default function build(): tfl.Sequential {
  return tfl.sequential({
    layers: [
      tfl.layers.flatten({ inputShape: [4, 4, 1] }),
      tfl.layers.dense({ units: 10, activation: 'relu' }),
      tfl.layers.dense({ units: 7, activation: 'tanh' }),
      tfl.layers.dense({ units: 3, activation: 'softmax' }),
    ],
  });
}
