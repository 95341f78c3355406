import assert from 'node:assert/strict';
import { test } from 'node:test';
import * as tf from '@tensorflow/tfjs-core';
import { engineRuns } from '../testing/engine-runs.js';
import { initBackend } from './index.js';

for (const backend of ['cpu', 'native']) {
  test(`Add's gradient (${backend}): dy under each input's shape, summed where it was broadcast, with no Reshape op where it was not`, async (t) => {
    try {
      await initBackend(backend);
    } catch {
      t.skip(`no ${backend} backend here`);
      return;
    }
    const dyValues = Float32Array.from({ length: 24 }, (_, i) => i * 0.5 - 3);
    const a = tf.zeros([2, 3, 4]);
    const dy = tf.tensor3d(dyValues, [2, 3, 4]);
    // a residual connection: both inputs [2, 3, 4]
    const { result: same, runs } = engineRuns(() =>
      tf.grads((x, y) => tf.add(x!, y!))([a, tf.ones([2, 3, 4])], dy),
    );
    assert.equal(runs.get('Reshape'), undefined);
    dy.dispose(); // each gradient holds dy's data itself
    for (const g of same) {
      assert.deepEqual(g.shape, [2, 3, 4]);
      assert.deepEqual(g.dataSync(), dyValues);
    }
    // broadcast: b [4] and c [1, 3, 1] get dy's sums over the axes they were broadcast along
    const dy2 = tf.tensor3d(dyValues, [2, 3, 4]);
    const [gb, gc] = tf.grads((b, c) => tf.add(tf.add(a, b!), c!))(
      [tf.zeros([4]), tf.zeros([1, 3, 1])],
      dy2,
    );
    const at = (i: number, j: number, k: number) =>
      dyValues[i * 12 + j * 4 + k]!;
    assert.deepEqual(gb!.shape, [4]);
    assert.deepEqual(
      [...gb!.dataSync()],
      [0, 1, 2, 3].map(
        (k) =>
          at(0, 0, k) +
          at(0, 1, k) +
          at(0, 2, k) +
          at(1, 0, k) +
          at(1, 1, k) +
          at(1, 2, k),
      ),
    );
    assert.deepEqual(gc!.shape, [1, 3, 1]);
    assert.deepEqual(
      [...gc!.dataSync()],
      [0, 1, 2].map((j) =>
        [0, 1].reduce(
          (s, i) => s + [0, 1, 2, 3].reduce((u, k) => u + at(i, j, k), 0),
          0,
        ),
      ),
    );
    tf.dispose([a, dy2, gb!, gc!, ...same]);
  });
}
