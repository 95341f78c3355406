/**
 * Every preset trains on every shipped backend: one plain-backprop step (the Stage that every
 * strategy uses, in this thread) lowers the loss on the same batch, and every parameter gets
 * a finite, non-zero gradient (which fails if a backend lacks a kernel or gradient).
 */

import assert from 'node:assert/strict';
import { test } from 'node:test';
import { initBackend } from '../backend/index.js';
import { nativeAddon, nativeUnavailable } from '../backend/native-addon.js';
import { tf } from '../backend/tfjs.js';
import { presetSgdStep } from '../testing/fixtures.js';
import { PRESETS } from './presets.js';

for (const backend of ['wasm', 'cpu', 'native']) {
  // the native backend where its addon is built (npm ci builds it where libdnnl-dev is installed)
  const skip =
    backend === 'native' && !nativeAddon()
      ? `native backend unavailable: ${nativeUnavailable()}`
      : false;
  for (const name of Object.keys(PRESETS)) {
    test(`${name} trains on ${backend}`, { skip }, async () => {
      await initBackend(backend);
      // the cpu backend is slow on the larger presets: one example per batch there
      const batchSize = backend === 'cpu' && name === 'charlm-small' ? 1 : 4;
      const before = tf.memory().numTensors;
      const { loss0, loss1 } = await presetSgdStep(name, batchSize, (stage) => {
        // every parameter has a finite, non-zero gradient
        const grads = stage.grads;
        assert.equal(grads.size, stage.params.size);
        for (const [k, g] of grads.entries()) {
          const n = tf.tidy(() => tf.sum(tf.square(g)).dataSync()[0]);
          assert.ok(Number.isFinite(n) && n > 0, `${k}: gradient norm^2 ${n}`);
        }
      });
      assert.ok(
        Number.isFinite(loss0) && loss1 < loss0,
        `loss ${loss0} -> ${loss1}`,
      );
      assert.equal(
        tf.memory().numTensors,
        before,
        'every tensor of the step was freed',
      );
    });
  }
}
