/** A test model module: a small CNN (conv2d, maxPooling2d twice, flatten, dense softmax) on [8, 8, 1] inputs, 3 classes, one block per layer. */
import * as tfl from '@tensorflow/tfjs-layers';

export default function build(): tfl.Sequential {
  return tfl.sequential({
    layers: [
      tfl.layers.conv2d({
        inputShape: [8, 8, 1],
        filters: 4,
        kernelSize: 3,
        padding: 'same',
        activation: 'relu',
      }),
      tfl.layers.maxPooling2d({ poolSize: 2 }),
      tfl.layers.conv2d({
        filters: 4,
        kernelSize: 3,
        padding: 'same',
        activation: 'relu',
      }),
      tfl.layers.maxPooling2d({ poolSize: 2 }),
      tfl.layers.flatten(),
      tfl.layers.dense({ units: 3, activation: 'softmax' }),
    ],
  });
}
