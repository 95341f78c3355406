/**
 * A test model module: a functional model with a skip connection (kept inside one block by
 * `groups`) and a custom layer registered with tf.serialization.registerClass, trained with
 * softmax cross-entropy on logits. [4, 4, 1] inputs, 3 classes. Exports { model, groups, loss }.
 */
import * as tf from '@tensorflow/tfjs-core';
import * as tfl from '@tensorflow/tfjs-layers';

/** y = x * s, with a trainable per-feature scale s (a custom layer). */
export class Scale extends tfl.layers.Layer {
  static className = 'LayerwiseTestScale';
  private s: tfl.LayerVariable | null = null;
  override build(inputShape: tfl.Shape | tfl.Shape[]): void {
    const shape = inputShape as tfl.Shape;
    this.s = this.addWeight(
      's',
      [shape[shape.length - 1] as number],
      'float32',
      tfl.initializers.ones(),
    );
    this.built = true;
  }
  override call(inputs: tf.Tensor | tf.Tensor[]): tf.Tensor {
    return tf.tidy(() =>
      tf.mul(Array.isArray(inputs) ? inputs[0]! : inputs, this.s!.read()),
    );
  }
  override getClassName(): string {
    return Scale.className;
  }
}
tf.serialization.registerClass(Scale);

/** The functional model; with `named`, layers carry fixed names (used by the groups). */
export function residual(): tfl.LayersModel {
  const input = tfl.input({ shape: [4, 4, 1] });
  const flat = tfl.layers
    .flatten({ name: 'flat' })
    .apply(input) as tfl.SymbolicTensor;
  const h = tfl.layers
    .dense({ units: 8, activation: 'relu', name: 'in' })
    .apply(flat) as tfl.SymbolicTensor;
  const a = tfl.layers
    .dense({ units: 8, activation: 'tanh', name: 'branch' })
    .apply(h) as tfl.SymbolicTensor;
  const sum = tfl.layers
    .add({ name: 'skip' })
    .apply([a, h]) as tfl.SymbolicTensor;
  const scaled = new Scale({ name: 'scale' }).apply(sum) as tfl.SymbolicTensor;
  const out = tfl.layers
    .dense({ units: 3, name: 'logits' })
    .apply(scaled) as tfl.SymbolicTensor;
  return tfl.model({ inputs: input, outputs: out });
}

export default {
  model: residual,
  groups: [['flat', 'in'], ['branch', 'skip'], ['scale'], ['logits']],
  loss: 'softmax-cross-entropy',
};
