/**
 * A test model module with training-time noise: dense 16, then two blocks of (layer
 * normalization, dense 16 relu, dropout 0.25) that keep their input's shape (so --layer-drop can
 * skip them), then dense 3 softmax, on [8] inputs. Four blocks by `groups`.
 */
import * as tfl from '@tensorflow/tfjs-layers';

export default {
  model: () =>
    tfl.sequential({
      layers: [
        tfl.layers.dense({ name: 'in', inputShape: [8], units: 16 }),
        tfl.layers.layerNormalization({ name: 'ln1' }),
        tfl.layers.dense({ name: 'd1', units: 16, activation: 'relu' }),
        tfl.layers.dropout({ name: 'drop1', rate: 0.25 }),
        tfl.layers.layerNormalization({ name: 'ln2' }),
        tfl.layers.dense({ name: 'd2', units: 16, activation: 'relu' }),
        tfl.layers.dropout({ name: 'drop2', rate: 0.25 }),
        tfl.layers.dense({ name: 'out', units: 3, activation: 'softmax' }),
      ],
    }),
  groups: [['in'], ['ln1', 'd1', 'drop1'], ['ln2', 'd2', 'drop2'], ['out']],
};
