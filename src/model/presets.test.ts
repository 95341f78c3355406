/**
 * Every preset trains on every shipped backend: one plain-backprop step (the Stage that every
 * strategy uses, in this thread) lowers the loss on the same batch, and every parameter gets
 * a finite, non-zero gradient (which fails if a backend lacks a kernel or gradient).
 */
import { test } from 'node:test';
import assert from 'node:assert/strict';
import { initBackend } from '../backend/index.js';
import { nativeAddon, nativeUnavailable } from '../backend/native-addon.js';
import { makeBatcher } from '../data/batcher.js';
import { loadDataset, type Dataset } from '../data/index.js';
import { Stage } from '../pipeline/stage.js';
import { defaultOptimizerConfig } from '../optim/optimizer.js';
import { tf } from '../backend/tfjs.js';
import { buildModel } from './model.js';
import { initParams } from './init.js';
import { PRESETS } from './presets.js';

const datasets = new Map<string, Dataset>();
async function data(name: string): Promise<Dataset> {
  if (!datasets.has(name)) datasets.set(name, await loadDataset(name));
  return datasets.get(name)!;
}

for (const backend of ['wasm', 'cpu', 'native']) {
  // the native backend where its addon is built (npm ci builds it where libdnnl-dev is installed)
  const skip = backend === 'native' && !nativeAddon() ? `native backend unavailable: ${nativeUnavailable()}` : false;
  for (const [name, preset] of Object.entries(PRESETS)) {
    test(`${name} trains on ${backend}`, { skip }, async () => {
      await initBackend(backend);
      const ds = await data(preset.defaultData);
      assert.ok(ds.kind !== 'tensor', 'presets train on text or image data sets');
      const shape = ds.kind === 'text' ? { vocab: ds.vocab.size } : { inputShape: ds.shape, classes: ds.classes };
      const config = preset.make(shape, {});
      const model = buildModel(config);
      // the cpu backend is slow on the larger presets: one example per batch there
      const batchSize = backend === 'cpu' && name === 'charlm-small' ? 1 : 4;
      const context = config.arch === 'charlm' ? config.context : undefined;
      const batch = makeBatcher(ds, { batchSize, context, seed: 3 }).next();
      const before = tf.memory().numTensors;
      const stage = new Stage(model, { from: 0, to: model.blocks.length }, initParams(model.blocks, 7), { ...defaultOptimizerConfig('sgd'), momentum: 0, clipNorm: 0 });
      try {
        const x = () => tf.tensor(batch.x, batch.xShape, model.inputDtype);
        const y = () => tf.tensor(batch.y, batch.yShape, 'int32');
        stage.forward(0, x(), { keep: true, grad: true, labels: y() });
        await stage.flush(); // the loss is read at the step's end
        const loss0 = stage.losses.get(0)!;
        stage.backward(0, null, 1);
        // every parameter has a finite, non-zero gradient
        const grads = stage.grads;
        assert.equal(grads.size, stage.params.size);
        for (const [k, g] of grads.entries()) {
          const n = tf.tidy(() => tf.sum(tf.square(g)).dataSync()[0]);
          assert.ok(Number.isFinite(n) && n > 0, `${k}: gradient norm^2 ${n}`);
        }
        stage.step(0.05, 1);
        stage.forward(0, x(), { keep: false, grad: false, labels: y() });
        await stage.flush();
        const loss1 = stage.losses.get(0)!;
        assert.ok(Number.isFinite(loss0) && loss1 < loss0, `loss ${loss0} -> ${loss1}`);
      } finally {
        stage.dispose();
      }
      assert.equal(tf.memory().numTensors, before, 'every tensor of the step was freed');
    });
  }
}
