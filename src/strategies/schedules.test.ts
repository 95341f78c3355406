/**
 * Issue 22's bar for the schedules of the field: zb-h1, interleaved-1f1b (V = 2), zbv and
 * dualpipev at K = 2, M = 8 on charlm-small's shape (4 decoder blocks, d_model 256, 4 heads,
 * context 128; on wasm, batch 8) reach single-device training's loss after 3 steps within
 * 1e-5, and its parameters within 1e-4. (Smaller models and every re-materialization mode:
 * transparency.test.ts; tf.layers modules: model/module.test.ts.)
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

test('charlm-small shape: zb-h1, interleaved-1f1b, zbv and dualpipev at K=2, M=8 reach single-device losses within 1e-5 after 3 steps', async () => {
  const single = await trainTinyLm({ ...base, strategy: 'single' }, RUN);
  assert.ok(single.losses.every((l) => Number.isFinite(l) && l > 0));
  assert.ok(
    single.losses[2]! < single.losses[0]!,
    `single's loss falls: ${single.losses}`,
  );
  for (const [schedule, remat] of [
    ['zb-h1', 'never'],
    ['interleaved-1f1b', 'except_last'],
    ['zbv', 'never'],
    ['dualpipev', 'always'],
  ] as const) {
    const r = await trainTinyLm(
      {
        ...base,
        strategy: 'gpipe',
        stages: 2,
        microBatches: 8,
        schedule,
        remat,
      },
      RUN,
    );
    r.losses.forEach((l, i) =>
      assert.ok(
        Math.abs(l - single.losses[i]!) <= 1e-5,
        `${schedule} step ${i}: loss ${l} vs single ${single.losses[i]}`,
      ),
    );
    const d = maxParamDiff(r.params, single.params);
    assert.ok(d <= 1e-4, `${schedule}: parameters differ from single by ${d}`);
    // two devices report, whatever the number of stages
    assert.equal(r.reports[0]!.peakBytes.length, 2);
  }
});
