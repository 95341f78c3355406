/**
 * Dynamic architectures (issue 24 item 3, model/layer-drop.ts): the pattern depends only on
 * (seed, step) and never skips the first or the last block; single, gpipe (any K, schedule
 * and re-materialization) and l2l (one device, and pipelined on 2) with the same --layer-drop
 * train alike; a skipped block is not
 * stepped; a resumed run draws what the uninterrupted one did; bad uses are refused.
 */
import assert from 'node:assert/strict';
import { mkdtempSync, rmSync } from 'node:fs';
import { tmpdir } from 'node:os';
import { join } from 'node:path';
import { test } from 'node:test';
import { resolveConfig } from '../config/config.js';
import { makeBatcher } from '../data/batcher.js';
import { initParams } from '../model/init.js';
import {
  checkLayerDrop,
  droppedBlocks,
  keepProbability,
} from '../model/layer-drop.js';
import { buildModel } from '../model/model.js';
import { getPreset } from '../model/presets.js';
import { relayCompute } from '../schedule/schedule.js';
import { tinyWhaleDataset } from '../testing/fixtures.js';
import { readStepMetrics } from '../train/metrics.js';
import { LayerwiseError } from '../util/errors.js';
import { createStrategy } from './index.js';

test('the pattern: drawn from (seed, step) alone, blocks 1..n-2 only, at the rate P (constant) or by PLD (progressive)', () => {
  const o = { p: 0.5, schedule: 'constant' as const, seed: 7 };
  assert.deepEqual(droppedBlocks(o, 12, 8), droppedBlocks(o, 12, 8));
  assert.deepEqual(droppedBlocks({ ...o, p: 0 }, 12, 8), []);
  let dropped = 0;
  const draws = 2000;
  const seen = new Set<string>();
  for (let step = 0; step < draws; step++) {
    const d = droppedBlocks(o, step, 8);
    seen.add(d.join(','));
    for (const b of d) assert.ok(b >= 1 && b <= 6, `block ${b} of 8`);
    dropped += d.length;
  }
  const rate = dropped / (draws * 6);
  assert.ok(Math.abs(rate - 0.5) < 0.03, `drop rate ${rate}`);
  assert.ok(seen.size > 50, 'patterns vary from step to step');
  assert.notDeepEqual(
    Array.from({ length: 20 }, (_, s) => droppedBlocks(o, s, 8)),
    Array.from({ length: 20 }, (_, s) =>
      droppedBlocks({ ...o, seed: 8 }, s, 8),
    ),
    'another seed, another pattern',
  );
  // PLD: nothing dropped at first, then deeper blocks more often, the deepest towards P
  const pld = { ...o, schedule: 'progressive' as const };
  assert.equal(keepProbability(pld, 6, 6, 0), 1);
  assert.ok(
    keepProbability(pld, 6, 6, 10_000) - 0.5 < 1e-4,
    'the deepest block keeps with theta_bar = 1 - P late in training',
  );
  assert.ok(
    keepProbability(pld, 1, 6, 5000) > keepProbability(pld, 6, 6, 5000),
  );
  assert.deepEqual(droppedBlocks(pld, 0, 8), []);
});

test('the relay loads, computes and pushes only the layers a step keeps', () => {
  const acts = relayCompute(6, 2, new Set([2, 4]))[0]!;
  const layersOf = (op: string) =>
    new Set(
      acts
        .filter((a) => a.op === op)
        .map((a) => (a as { layer: number }).layer),
    );
  for (const op of [
    'load_layer',
    'prefetch_layer',
    'layer_backward',
    'push_grads',
  ])
    assert.deepEqual([...layersOf(op)].sort(), [0, 1, 3, 5], op);
  assert.deepEqual([...layersOf('layer_forward')].sort(), [0, 1, 3]); // the last layer's forward is fused into its backward
  assert.throws(() => relayCompute(6, 2, new Set([5])), /never skips/);
});

/** charlm-tiny with 4 decoder blocks (6 blocks: 1..4 droppable), small enough for seconds. */
const SHAPE = { layers: 4, dModel: 16, heads: 2, context: 8 };

test('--layer-drop 0.5: gpipe K=2 (gpipe, 1F1B), K=3 (re-materialization), l2l (both stash places) and l2l --stages 2 (gpipe, 1F1B) equal single with the same flag within 1e-5; resumed runs too', {
  timeout: 240_000,
}, async () => {
  const { train } = await import('../train/trainer.js');
  const dir = mkdtempSync(join(tmpdir(), 'layerwise-layer-drop-'));
  try {
    const common = {
      preset: 'charlm-tiny',
      ...SHAPE,
      batchSize: 8,
      evalBatches: 1,
      evalEvery: 0,
      lr: 0.01,
      warmup: 1,
      backend: 'cpu',
      layerDrop: 0.5,
      steps: 4,
    };
    const losses = (run: string) => readStepMetrics(join(dir, run));
    await train({ ...common, strategy: 'single', out: join(dir, 'single') });
    const ref = losses('single');
    // the steps really vary the architecture: some skip blocks, the losses differ from no drop
    assert.ok(ref.some((m) => m.dropped_blocks!.length > 0));
    await train({
      ...common,
      layerDrop: 0,
      strategy: 'single',
      out: join(dir, 'none'),
    });
    assert.notEqual(losses('none')[3].loss, ref[3].loss);
    assert.ok(
      ref.some((m) => m.dropped_blocks!.includes(2)),
      'some step skips block 2 (l2l-k3 below passes through its stage 1)',
    );
    const runs: Array<[string, Record<string, unknown>]> = [
      ['gpipe-k2', { strategy: 'gpipe', stages: 2, microBatches: 4 }],
      [
        '1f1b-k2',
        { strategy: 'gpipe', stages: 2, microBatches: 2, schedule: '1f1b' },
      ],
      ['l2l-host', { strategy: 'l2l', microBatches: 2 }],
      ['l2l-device', { strategy: 'l2l', microBatches: 2, stash: 'device' }],
      ['l2l-k2', { strategy: 'l2l', stages: 2, microBatches: 2 }],
      // stage 1 is block 2 alone: a step that drops it passes micro-batches through the stage
      [
        'l2l-k3',
        { strategy: 'l2l', stages: 3, microBatches: 2, balance: [2, 1, 3] },
      ],
      [
        'l2l-k2-1f1b',
        {
          strategy: 'l2l',
          stages: 2,
          microBatches: 4,
          schedule: '1f1b',
          stash: 'device',
        },
      ],
      [
        'k3-remat',
        {
          strategy: 'gpipe',
          stages: 3,
          microBatches: 2,
          schedule: '1f1b',
          remat: 'always',
        },
      ],
    ];
    for (const [name, flags] of runs) {
      await train({ ...common, ...flags, out: join(dir, name) });
      const got = losses(name);
      got.forEach((m, i) => {
        assert.deepEqual(m.dropped_blocks, ref[i].dropped_blocks, name);
        assert.ok(
          Math.abs(m.loss - ref[i].loss) <= 1e-5,
          `${name} step ${i + 1}: ${m.loss} vs ${ref[i].loss}`,
        );
      });
    }
    // resume: the pattern of the steps after the checkpoint is the uninterrupted run's (the
    // pipelined relay resumes from the parameter server's masters and AdamW state)
    for (const [name, flags] of [
      ['part', { strategy: 'single' }],
      ['part-l2l-k2', { strategy: 'l2l', stages: 2, microBatches: 2 }],
    ] as const) {
      await train({ ...common, ...flags, steps: 2, out: join(dir, name) });
      await train({ steps: 4 }, join(dir, name));
      losses(name).forEach((m, i) => {
        assert.deepEqual(m.dropped_blocks, ref[i].dropped_blocks, name);
        assert.ok(
          Math.abs(m.loss - ref[i].loss) <= 1e-5,
          `${name} step ${i + 1}: ${m.loss} vs ${ref[i].loss}`,
        );
      });
    }
  } finally {
    rmSync(dir, { recursive: true, force: true });
  }
});

test('a skipped block is not computed, gets no gradient and is not stepped (AdamW with weight decay)', async () => {
  const ds = tinyWhaleDataset();
  const cfg = resolveConfig({
    preset: 'charlm-tiny',
    ...SHAPE,
    batchSize: 4,
    backend: 'cpu',
    threads: 1,
    strategy: 'single',
    weightDecay: 0.1,
  } as Parameters<typeof resolveConfig>[0]);
  const model = buildModel(
    getPreset('charlm-tiny').make({ vocab: ds.vocab.size }, cfg),
  );
  const batcher = makeBatcher(ds, {
    batchSize: 4,
    context: SHAPE.context,
    seed: 2,
  });
  const s = await createStrategy(cfg, model, initParams(model.blocks, 5));
  try {
    const before = await s.getParams();
    await s.submit(batcher.next(), 0.01, [2, 3]).done;
    const after = await s.getParams();
    for (const [key, v] of before) {
      const block = Number(key.slice(0, key.indexOf('.')));
      const same = v.every((x, i) => x === after.get(key)![i]);
      assert.equal(
        same,
        block === 2 || block === 3,
        `${key}: ${same ? 'unchanged' : 'updated'}`,
      );
    }
  } finally {
    await s.close();
  }
});

test('--layer-drop refused where it cannot run: local parallelism, a model whose middle blocks change shape, P outside [0, 1)', async () => {
  const { prepare } = await import('../train/trainer.js');
  const base = {
    preset: 'charlm-tiny',
    ...SHAPE,
    batchSize: 8,
    backend: 'cpu',
    out: join(tmpdir(), 'layerwise-layer-drop-never-written'),
  };
  await assert.rejects(
    prepare({ ...base, layerDrop: 0.5, strategy: 'local', stages: 2 }),
    (e: Error) =>
      e instanceof LayerwiseError &&
      /--layer-drop runs on --strategy .*single.* so far, not local/.test(
        e.message,
      ),
  );
  await assert.rejects(
    prepare({ ...base, layerDrop: 1, strategy: 'single' }),
    /--layer-drop must be a probability in \[0, 1\), got 1/,
  );
  const cnn = buildModel(
    getPreset('cnn-mnist').make({ inputShape: [28, 28, 1], classes: 10 }, {}),
  );
  assert.throws(
    () => checkLayerDrop(cnn),
    /--layer-drop skips blocks by passing their input on, but block 1 \(.*\) turns \[.*\] into \[.*\]/,
  );
});
