// A user's own model for layerwise, written with plain TF.js Layers (not a preset):
//   layerwise train --model examples/mnist-cnn.mjs --data mnist --strategy gpipe --stages 2
// The default export builds the model; every device (worker thread) imports this file and
// calls it, so it must build the same model each time. Layers become blocks one per layer,
// or per named group (`groups`); the loss follows from the softmax output layer
// (sparse categorical cross-entropy, as model.compile({loss: 'sparseCategoricalCrossentropy'})).
import * as tf from '@tensorflow/tfjs';

export function build() {
  return tf.sequential({
    layers: [
      tf.layers.conv2d({
        name: 'conv1',
        inputShape: [28, 28, 1],
        filters: 8,
        kernelSize: 3,
        padding: 'same',
        activation: 'relu',
      }),
      tf.layers.maxPooling2d({ name: 'pool1', poolSize: 2 }),
      tf.layers.conv2d({
        name: 'conv2',
        filters: 16,
        kernelSize: 3,
        padding: 'same',
        activation: 'relu',
      }),
      tf.layers.maxPooling2d({ name: 'pool2', poolSize: 2 }),
      tf.layers.flatten({ name: 'flatten' }),
      tf.layers.dense({ name: 'hidden', units: 64, activation: 'relu' }),
      tf.layers.dense({ name: 'classes', units: 10, activation: 'softmax' }),
    ],
  });
}

export default {
  model: build,
  // a pooling layer has no weights: keep it in one block with the convolution before it
  groups: [
    ['conv1', 'pool1'],
    ['conv2', 'pool2'],
    ['flatten', 'hidden'],
    ['classes'],
  ],
};
