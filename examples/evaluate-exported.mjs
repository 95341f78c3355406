// Load a model exported by `layerwise export` with plain TF.js (no layerwise) and measure its
// accuracy on the 10,000 Fashion-MNIST test images (Debian's dataset-fashion-mnist; layerwise
// never trains on them: with --data fashion-mnist they are only its validation split):
//   node examples/evaluate-exported.mjs exported/fashion

import { readFile } from 'node:fs/promises';
import { join } from 'node:path';
import { gunzipSync } from 'node:zlib';
import * as tf from '@tensorflow/tfjs';

const dir = process.argv[2] ?? 'exported/fashion';
const data = process.argv[3] ?? '/usr/share/datasets/fashion-mnist';
const json = JSON.parse(await readFile(join(dir, 'model.json'), 'utf8'));
const bin = await readFile(join(dir, 'weights.bin'));
const model = await tf.loadLayersModel(
  tf.io.fromMemory({
    modelTopology: json.modelTopology,
    weightSpecs: json.weightsManifest[0].weights,
    weightData: bin.buffer.slice(
      bin.byteOffset,
      bin.byteOffset + bin.byteLength,
    ),
  }),
);

// IDX files: a big-endian header (magic, then one 32-bit size per dimension), then uint8 values
const images = gunzipSync(
  await readFile(join(data, 't10k-images-idx3-ubyte.gz')),
).subarray(16);
const labels = gunzipSync(
  await readFile(join(data, 't10k-labels-idx1-ubyte.gz')),
).subarray(8);
const x = tf.div(
  tf.tensor4d(Float32Array.from(images), [labels.length, 28, 28, 1]),
  255,
);
const predicted = tf.argMax(model.predict(x), -1);
const accuracy = tf
  .mean(
    tf.cast(
      tf.equal(predicted, tf.tensor1d(Int32Array.from(labels), 'int32')),
      'float32',
    ),
  )
  .dataSync()[0];
console.log(
  `${dir}: accuracy ${(100 * accuracy).toFixed(1)}% on ${labels.length} Fashion-MNIST test images`,
);
