/** A test model module: a small regression MLP on 4 features (mean squared error), compiled as a TF.js user would. */
import * as tfl from '@tensorflow/tfjs-layers';

export default function build(): tfl.Sequential {
  const m = tfl.sequential({
    layers: [
      tfl.layers.dense({ units: 8, activation: 'tanh', inputShape: [4] }),
      tfl.layers.dense({ units: 8, activation: 'tanh' }),
      tfl.layers.dense({ units: 1 }),
    ],
  });
  m.compile({ loss: 'meanSquaredError', optimizer: 'sgd' });
  return m;
}
