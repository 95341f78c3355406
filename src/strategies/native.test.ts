/**
 * Every strategy on the native backend reproduces single-device training on the native
 * backend, as on wasm: gpipe (K = 2, 3) and l2l equal single within 1e-4 after 3 steps (losses
 * and parameters); local K = 1 (one stage, no auxiliary head) is single too. Skipped, saying
 * why, where the native addon is not built.
 */

import assert from 'node:assert/strict';
import { test } from 'node:test';
import { nativeAddon, nativeUnavailable } from '../backend/native.js';
import type { TrainConfig } from '../config/config.js';
import { maxParamDiff } from '../testing/assert-close.js';
import { trainTinyLm } from '../testing/fixtures.js';

const skip = nativeAddon()
  ? false
  : `native backend unavailable: ${nativeUnavailable()}`;
const TOL = 1e-4;
const SHAPE = { layers: 2, dModel: 32, heads: 2, context: 16 };

const run = (o: Partial<TrainConfig>) =>
  trainTinyLm(
    { backend: 'native', ...o },
    { shape: SHAPE, batchSize: 8, lrs: [3e-3, 2e-3, 1e-3] },
  );

test('on native, gpipe K=2 and K=3, local K=1 and l2l train exactly like single', {
  skip,
}, async () => {
  const ref = await run({ strategy: 'single' });
  assert.ok(
    ref.losses.every(Number.isFinite) && ref.losses[2]! < ref.losses[0]!,
    `single on native learns: ${ref.losses}`,
  );
  const runs: Array<[string, Partial<TrainConfig>]> = [
    [
      'gpipe K=2 M=2',
      { strategy: 'gpipe', stages: 2, microBatches: 2, remat: 'except_last' },
    ],
    [
      'gpipe K=3 M=4 1f1b',
      {
        strategy: 'gpipe',
        stages: 3,
        microBatches: 4,
        remat: 'always',
        schedule: '1f1b',
      },
    ],
    ['local K=1', { strategy: 'local', stages: 1, microBatches: 1 }],
    ['l2l M=2', { strategy: 'l2l', microBatches: 2, stash: 'host' }],
  ];
  for (const [name, o] of runs) {
    const r = await run(o);
    r.losses.forEach((l, i) =>
      assert.ok(
        Math.abs(l - ref.losses[i]!) <= TOL,
        `${name} step ${i}: loss ${l} vs single ${ref.losses[i]}`,
      ),
    );
    const d = maxParamDiff(r.params, ref.params);
    assert.ok(d <= TOL, `${name}: parameters differ from single by ${d}`);
  }
});
