/**
 * Profiling on a real backend: --balance time separates deliberately heavy blocks, and the
 * memory model's predicted peak device bytes per stage are within 15% of what real runs
 * (worker-thread stages, StepReport.peakBytes) measure, for single and gpipe on two presets.
 */

import assert from 'node:assert/strict';
import { test } from 'node:test';
import {
  resolveConfig,
  stageCount,
  type TrainConfig,
} from '../config/config.js';
import { initParams } from '../model/init.js';
import { buildModel, type Model } from '../model/model.js';
import { getPreset } from '../model/presets.js';
import { defaultOptimizerConfig } from '../optim/optimizer.js';
import { createStrategy, resolveStages } from '../strategies/index.js';
import { steadyPeakBytes } from '../testing/fixtures.js';
import { Rng } from '../util/rng.js';
import { costsAt, optimizerSlots } from './costs.js';
import { predictPeakBytes } from './memory.js';
import { profileModel } from './profile.js';

const BACKEND = 'wasm';

interface Case {
  preset: string;
  model: Model;
  overrides: Partial<TrainConfig>;
}

const CASES: Case[] = [
  {
    preset: 'charlm-tiny',
    model: buildModel(
      getPreset('charlm-tiny').make(
        { vocab: 40 },
        { layers: 2, dModel: 32, heads: 2, context: 16 },
      ),
    ),
    overrides: { layers: 2, dModel: 32, heads: 2, context: 16 },
  },
  {
    preset: 'mlp-mnist',
    model: buildModel(
      getPreset('mlp-mnist').make(
        { inputShape: [28, 28, 1], classes: 10 },
        { layers: 2, dModel: 64 },
      ),
    ),
    overrides: { layers: 2, dModel: 64 },
  },
];

const RUNS: Array<Partial<TrainConfig>> = [
  { strategy: 'single' },
  {
    strategy: 'gpipe',
    stages: 2,
    microBatches: 4,
    remat: 'except_last',
    schedule: 'gpipe',
  },
  {
    strategy: 'gpipe',
    stages: 2,
    microBatches: 4,
    remat: 'never',
    schedule: '1f1b',
  },
  {
    strategy: 'gpipe',
    stages: 3,
    microBatches: 2,
    remat: 'always',
    schedule: 'gpipe',
  },
  // the split backward holds each micro-batch's weight-gradient inputs from its I to its W
  {
    strategy: 'gpipe',
    stages: 2,
    microBatches: 4,
    remat: 'never',
    schedule: 'zb-h1',
  },
  // two stages per device (the V-shape): a device's peak is both stages' bytes together
  {
    strategy: 'gpipe',
    stages: 2,
    microBatches: 4,
    remat: 'never',
    schedule: 'zbv',
  },
];

for (const c of CASES) {
  test(`predicted peak device bytes within 15% of measured: ${c.preset}`, async () => {
    const n = 16;
    const opt = defaultOptimizerConfig('adamw');
    const profile = await profileModel(c.model, {
      backend: BACKEND,
      microBatchSizes: [n / 4, n / 2, n],
      optimizer: opt,
      repeats: 1,
      warmup: 0,
    });
    const params = initParams(c.model.blocks, 1);
    const rng = new Rng(3);
    for (const run of RUNS) {
      const cfg = resolveConfig({
        preset: c.preset,
        batchSize: n,
        backend: BACKEND,
        ...c.overrides,
        ...run,
      } as Parameters<typeof resolveConfig>[0]);
      if (stageCount(cfg) > c.model.blocks.length) continue;
      const ranges = await resolveStages(cfg, c.model);
      const single = cfg.strategy === 'single';
      const m = single ? 1 : cfg.microBatches;
      const predicted = predictPeakBytes(costsAt(profile, n / m), ranges, {
        m,
        remat: single ? 'never' : cfg.remat,
        schedule: single ? 'gpipe' : cfg.schedule,
        virtualStages: cfg.virtualStages,
        slots: optimizerSlots(opt),
      });
      const measured = await steadyPeakBytes(
        await createStrategy(cfg, c.model, params, ranges),
        c.model,
        n,
        rng,
      );
      const what = `${c.preset} ${JSON.stringify(run)} balance ${ranges.map((r) => r.to - r.from)}: predicted ${predicted} measured ${measured}`;
      assert.equal(predicted.length, measured.length, what);
      predicted.forEach((p, i) =>
        assert.ok(
          Math.abs(p - measured[i]) <= 0.15 * measured[i],
          `stage ${i}: ${what}`,
        ),
      );
      console.log(what);
    }
  });
}

test('--balance time separates the heavy blocks of a deliberately uneven model', async () => {
  // dense0 and dense1 are 1024x1024 (heavy), the five after them 8 wide (light): an even split
  // by block count would put both heavy blocks on stage 0. (At 512 wide the light blocks' fixed
  // costs came near a heavy one's, and dense0's backward has no input gradient to compute.)
  const model = buildModel({
    arch: 'mlp',
    inputShape: [1024, 1, 1],
    hidden: [1024, 1024, 8, 8, 8, 8],
    classes: 4,
  });
  const cfg = resolveConfig({
    preset: 'mlp-mnist',
    strategy: 'gpipe',
    stages: 2,
    microBatches: 2,
    batchSize: 32,
    backend: BACKEND,
    balance: 'time',
  });
  const ranges = await resolveStages(cfg, model);
  const stageOf = (b: number) =>
    ranges.findIndex((r) => b >= r.from && b < r.to);
  assert.notEqual(
    stageOf(0),
    stageOf(1),
    `balance ${ranges.map((r) => r.to - r.from)}`,
  );
  assert.deepEqual(
    ranges.map((r) => r.to - r.from),
    [1, 6],
  );
  const mem = await resolveStages({ ...cfg, balance: 'memory' }, model);
  assert.equal(mem.length, 2);
  assert.throws(
    () => resolveConfig({ preset: 'mlp-mnist', balance: 'speed' }),
    /--balance 'speed' must be comma-separated block counts.*or one of flops, params, time, memory/,
  );
  await assert.rejects(
    resolveStages({ ...cfg, stages: 8 }, model),
    /--stages 8 exceeds the model's 7 blocks; use at most 7 stages/,
  );
});

const native = await import('../backend/native-addon.js');

test("profiling on native with a device's thread count measures with it and gives the main thread its team back", {
  skip: native.nativeAddon()
    ? false
    : `native backend unavailable: ${native.nativeUnavailable()}`,
}, async () => {
  const { nativeAddon } = await import('../backend/native-addon.js');
  const addon = nativeAddon()!;
  const model = buildModel({
    arch: 'mlp',
    inputShape: [4, 4, 1],
    hidden: [8],
    classes: 3,
  });
  addon.setThreads(2);
  let during = 0;
  const opt = defaultOptimizerConfig('adamw');
  // a block whose forward notes the team it runs on
  const probe: Model = {
    ...model,
    blocks: model.blocks.map((b, i) =>
      i > 0
        ? b
        : {
            ...b,
            forward: (p, x) => {
              during = addon.threads();
              return b.forward(p, x);
            },
          },
    ),
  };
  await profileModel(probe, {
    backend: 'native',
    microBatchSizes: [2],
    optimizer: opt,
    repeats: 1,
    warmup: 0,
    threads: 1,
  });
  assert.equal(during, 1, "the blocks ran on the device's thread count");
  assert.equal(addon.threads(), 2, "the main thread's team is restored");
});
