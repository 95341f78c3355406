/**
 * The device-memory budget: the prediction before training fails fast with the budget's error,
 * and the runtime guard on the engine's exact byte counter throws when a tensor takes the
 * engine above the budget (in this thread, on the cpu backend).
 */

import assert from 'node:assert/strict';
import { test } from 'node:test';
import { initBackend } from '../backend/index.js';
import {
  deviceBudget,
  deviceBytes,
  setDeviceBudget,
} from '../backend/memory.js';
import {
  DeviceOutOfMemoryError,
  formatDeviceOutOfMemory,
} from '../backend/out-of-memory.js';
import { tf } from '../backend/tfjs.js';
import { resolveConfig, type TrainConfig } from '../config/config.js';
import { buildModel } from '../model/model.js';
import { getPreset } from '../model/presets.js';
import { StageError } from '../runtime/device.js';
import { resolveStages, STRATEGY_NAMES, specOf } from '../strategies/index.js';
import { LayerwiseError } from '../util/errors.js';
import { formatSize } from '../util/size.js';
import { budgetProfileSizes, checkDeviceBudget } from './budget.js';

const SHAPE = { layers: 1, dModel: 16, heads: 2, context: 8 };
const model = buildModel(getPreset('charlm-tiny').make({ vocab: 20 }, SHAPE));
const config = (o: Partial<TrainConfig>) =>
  resolveConfig({
    preset: 'charlm-tiny',
    backend: 'cpu',
    batchSize: 8,
    ...SHAPE,
    ...o,
  } as Parameters<typeof resolveConfig>[0]);

test('the message names what is needed, the budget, where, how it was found, and what to try', () => {
  const e = new DeviceOutOfMemoryError({
    needs: 1.2 * 2 ** 30,
    budget: 512 * 2 ** 20,
    stage: 0,
    strategy: 'gpipe',
    how: 'predicted',
  });
  assert.ok(
    e instanceof LayerwiseError,
    'the CLI treats it as bad input (status 2)',
  );
  assert.equal(e.name, 'DeviceOutOfMemoryError');
  assert.equal(
    e.message,
    'device out of memory: needs 1.2 GiB, budget 512 MiB (stage 0 of gpipe, predicted); try --strategy l2l, or more --stages',
  );
  assert.equal(
    formatDeviceOutOfMemory({ needs: 2048, budget: 1024, how: 'measured' }),
    'device out of memory: needs 2 KiB, budget 1 KiB (measured); try --strategy l2l, or more --stages',
  );
  assert.match(
    specOf('l2l').outOfMemoryAdvice({ stash: 'device' }),
    /smaller --batch-size or more --micro-batches, or --stash host$/,
  );
  assert.doesNotMatch(
    specOf('l2l').outOfMemoryAdvice({ stash: 'host' }),
    /--stash/,
  );
  // thrown in a stage worker, it reaches the main thread as a StageError with its message intact
  const s = new StageError(1, e.message, e.name);
  assert.equal(s.message, `stage 1: ${e.message}`);
  assert.equal(s.causeName, 'DeviceOutOfMemoryError');
});

test('runtime guard: an allocation above the budget throws; frees never do; no budget, no guard', async () => {
  await initBackend('cpu');
  const keep = tf.zeros([100]); // 400 bytes
  const base = deviceBytes();
  setDeviceBudget(base + 1000, { stage: 1, strategy: 'gpipe' });
  try {
    assert.equal(deviceBudget(), base + 1000);
    const small = tf.ones([200]); // 800 bytes: within
    assert.throws(
      () => tf.ones([100]),
      (e: Error) => {
        assert.ok(e instanceof DeviceOutOfMemoryError);
        assert.equal(e.info.needs, base + 800 + 400); // the engine's bytes with the new tensor
        assert.equal(e.info.budget, base + 1000);
        assert.equal(
          e.message,
          `device out of memory: needs ${formatSize(base + 1200)}, budget ${formatSize(base + 1000)} (stage 1 of gpipe, measured); try --strategy l2l, or more --stages`,
        );
        return true;
      },
    );
    // the op that allocates its output throws as well, inside a tidy
    assert.throws(
      () => tf.tidy(() => tf.add(small, small)),
      DeviceOutOfMemoryError,
    );
    small.dispose();
    keep.dispose(); // freeing above the budget after a failure must not throw
  } finally {
    setDeviceBudget(undefined);
  }
  const big = tf.zeros([10_000]);
  big.dispose();
  assert.throws(() => setDeviceBudget(0), RangeError);
});

test('prediction: a run over the budget fails before training, naming the stage with the largest peak', async () => {
  const single = config({ deviceMemory: 1000 });
  await assert.rejects(
    checkDeviceBudget(single, model, await resolveStages(single, model)),
    (e: Error) => {
      assert.ok(e instanceof DeviceOutOfMemoryError);
      assert.match(
        e.message,
        /^device out of memory: needs [\d.]+ KiB, budget 1000 B \(stage 0 of single, predicted\); try --strategy l2l, or --strategy gpipe with more --stages$/,
      );
      return true;
    },
  );
  const gpipe = config({
    strategy: 'gpipe',
    stages: 2,
    microBatches: 2,
    deviceMemory: 1e9,
  });
  const ranges = await resolveStages(gpipe, model);
  const ok = await checkDeviceBudget(gpipe, model, ranges);
  assert.equal(ok.predicted!.length, 2);
  assert.equal(ok.microBatch, 4);
  assert.equal(ok.budget, 1e9);
  const worst = ok.predicted!.indexOf(Math.max(...ok.predicted!));
  const tight = {
    ...gpipe,
    deviceMemory: Math.floor(Math.max(...ok.predicted!)) - 1,
  };
  await assert.rejects(
    checkDeviceBudget(tight, model, ranges),
    new RegExp(
      `\\(stage ${worst} of gpipe, predicted\\); try --strategy l2l, or more --stages$`,
    ),
  );
  const local = config({
    strategy: 'local',
    stages: 2,
    microBatches: 2,
    deviceMemory: 1e9,
  });
  const l = await checkDeviceBudget(
    local,
    model,
    await resolveStages(local, model),
  );
  assert.equal(l.predicted!.length, 2);
  assert.ok(l.predicted!.every((b) => b > 0));
});

test('every strategy predicts its peak through its spec; an unknown strategy is refused before profiling', async () => {
  const cfg = {
    ...config({ deviceMemory: 1 }),
    strategy: 'nonesuch',
  } as unknown as TrainConfig;
  await assert.rejects(
    checkDeviceBudget(cfg, model, [{ from: 0, to: model.blocks.length }]),
    (e) =>
      e instanceof LayerwiseError &&
      /unknown strategy 'nonesuch'; valid: single, gpipe, local, l2l/.test(
        e.message,
      ),
  );
  assert.deepEqual(STRATEGY_NAMES, ['single', 'gpipe', 'local', 'l2l']);
  for (const name of STRATEGY_NAMES)
    assert.equal(typeof specOf(name).memory.predictPeakBytes, 'function', name);
  assert.deepEqual(budgetProfileSizes(3), [3]);
  assert.deepEqual(budgetProfileSizes(32), [32]); // exact at the run's size, not extrapolated
});
