/** A bad test model module: a model without trainable weights. */
import * as tfl from '@tensorflow/tfjs-layers';

export default () =>
  tfl.sequential({ layers: [tfl.layers.flatten({ inputShape: [4, 4, 1] })] });
