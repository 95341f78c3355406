/**
 * A test model module whose weights are set after they were drawn, as a loaded (pretrained)
 * model's are: dense 4 relu, dense 3 softmax on [4] inputs, every weight set to 0.01 * (its
 * element index + 1) with setWeights. layerwise must keep those values, not draw new ones.
 */
import * as tf from '@tensorflow/tfjs-core';
import * as tfl from '@tensorflow/tfjs-layers';

export default function build(): tfl.Sequential {
  const m = tfl.sequential({
    layers: [
      tfl.layers.dense({ inputShape: [4], units: 4, activation: 'relu' }),
      tfl.layers.dense({ units: 3, activation: 'softmax' }),
    ],
  });
  m.setWeights(
    m.getWeights().map((w) =>
      tf.tensor(
        Array.from({ length: w.size }, (_, i) => 0.01 * (i + 1)),
        w.shape,
      ),
    ),
  );
  return m;
}
