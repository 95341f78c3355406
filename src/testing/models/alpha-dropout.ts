/** A test model module with a layer whose training noise layerwise does not draw per example (alphaDropout): dense 8 selu, alphaDropout 0.1, dense 3 softmax on [4] inputs. */
import * as tfl from '@tensorflow/tfjs-layers';

export default function build(): tfl.Sequential {
  return tfl.sequential({
    layers: [
      tfl.layers.dense({ inputShape: [4], units: 8, activation: 'selu' }),
      tfl.layers.alphaDropout({ name: 'noisy', rate: 0.1 }),
      tfl.layers.dense({ units: 3, activation: 'softmax' }),
    ],
  });
}
