/**
 * The one place layerwise imports TensorFlow.js's core with its gradients.
 *
 * `@tensorflow/tfjs-core`'s Node bundle ships the ops and the engine but registers no
 * gradients: they are registered by the `@tensorflow/tfjs` union package's bundle (the
 * official way; tfjs-core's own `register_all_gradients` is an ES module with extension-less
 * imports that Node cannot load). Importing this module once per thread makes `tf.grads` work
 * for every stock op.
 */
import '@tensorflow/tfjs';
import * as tf from '@tensorflow/tfjs-core';

export { tf };
