/**
 * The default balance (by the blocks' FLOP counts) keeps compute-heavy blocks on their own
 * stages; the parameter-count balance stays available as --balance params.
 */

import assert from 'node:assert/strict';
import { test } from 'node:test';
import { resolveConfig } from '../config/config.js';
import { buildModel } from '../model/model.js';
import { blockFlops, planStages } from './index.js';

const cnn = buildModel({
  arch: 'cnn',
  inputShape: [28, 28, 1],
  channels: [16, 32],
  hidden: 128,
  classes: 10,
});
const sizes = (cfg: Parameters<typeof planStages>[0]) =>
  planStages(cfg, cnn).map((r) => r.to - r.from);

test('the default balance is by FLOPs: cnn-mnist K=3 puts the second convolution alone, params puts both convolutions on stage 0', () => {
  const cfg = resolveConfig({
    preset: 'cnn-mnist',
    strategy: 'gpipe',
    stages: 3,
    microBatches: 4,
  });
  assert.equal(cfg.balance, 'flops');
  assert.deepEqual(
    cnn.blocks.map((b) => b.name),
    ['conv0', 'pool0', 'conv1', 'pool1', 'dense0', 'classifier'],
  );
  const f = blockFlops(cnn, 8);
  assert.ok(
    f[2]! > f[4]! &&
      f[4]! > f[0]! &&
      f[0]! > f[1]! &&
      f[1]! > f[3]! &&
      f[3]! > f[5]!,
    `flops ${f}`,
  );
  // conv0 + pool0 | conv1 | pool1 + dense0 + classifier: the pooling of conv1 goes with the light dense stage
  assert.deepEqual(sizes(cfg), [2, 1, 3]);
  assert.deepEqual(sizes({ ...cfg, balance: 'params' }), [4, 1, 1]);
  assert.deepEqual(
    sizes(
      resolveConfig({
        preset: 'cnn-mnist',
        strategy: 'gpipe',
        stages: 3,
        microBatches: 4,
        balance: 'flops',
      }),
    ),
    [2, 1, 3],
  );
});

test('a block without products (an embedding) still weighs something', () => {
  const lm = buildModel({
    arch: 'charlm',
    vocab: 20,
    context: 16,
    dModel: 32,
    heads: 2,
    layers: 2,
  });
  const f = blockFlops(lm, 4);
  assert.ok(
    f.every((x) => x >= 1),
    `flops ${f}`,
  );
});
