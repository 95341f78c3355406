/** A test model module as a new user writes one for --data mnist: flatten, dense 96 relu, dense 48 tanh, dense 10 (logits), default initializers. */
import * as tfl from '@tensorflow/tfjs-layers';

export default {
  model: () =>
    tfl.sequential({
      layers: [
        tfl.layers.flatten({ inputShape: [28, 28, 1] }),
        tfl.layers.dense({ units: 96, activation: 'relu' }),
        tfl.layers.dense({ units: 48, activation: 'tanh' }),
        tfl.layers.dense({ units: 10 }),
      ],
    }),
  loss: 'softmax-cross-entropy',
};
