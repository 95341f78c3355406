/** A bad test model module: 2 output units, fewer than the data's 10 classes. */
import * as tfl from '@tensorflow/tfjs-layers';

export default () =>
  tfl.sequential({
    layers: [
      tfl.layers.flatten({ inputShape: [28, 28, 1] }),
      tfl.layers.dense({ units: 2 }),
    ],
  });
