/**
 * Local parallelism (Laskin et al., 2020): gradients never cross a stage boundary in greedy
 * mode; with K = 1 it is plain single-device training; --overlap n trains exactly the last n
 * blocks of the previous stage; a failing stage stops the run, and a stopped run leaves no
 * partial checkpoint.
 */

import assert from 'node:assert/strict';
import { existsSync, mkdtempSync, readdirSync, rmSync } from 'node:fs';
import { tmpdir } from 'node:os';
import { join } from 'node:path';
import { test } from 'node:test';
import { initBackend } from '../backend/index.js';
import { tf } from '../backend/tfjs.js';
import { type Batch, makeBatcher } from '../data/batcher.js';
import { textDatasetFromString } from '../data/text.js';
import { auxKey, initAuxParams } from '../model/aux-head.js';
import { paramKey } from '../model/block.js';
import { type HostParams, initParams } from '../model/init.js';
import { buildModel, type CharLmConfig } from '../model/model.js';
import {
  defaultOptimizerConfig,
  type OptimizerConfig,
} from '../optim/optimizer.js';
import { LocalStage } from '../pipeline/local-stage.js';
import { StageError } from '../runtime/device.js';
import { checkpointDir, loadCheckpoint } from '../train/checkpoint-io.js';
import { train } from '../train/trainer.js';
import { Rng } from '../util/rng.js';
import { backpropPipeline } from './gpipe.js';
import { localPipeline } from './local.js';
import { PipelineStrategy } from './pipeline.js';

const WORDS = [
  'the',
  'whale',
  'sea',
  'ship',
  'ahab',
  'white',
  'call',
  'me',
  'ishmael',
  'and',
  'of',
  'a',
];
const rng = new Rng(9);
let text = '';
while (text.length < 3000)
  text += WORDS[rng.int(WORDS.length)] + (rng.int(7) === 0 ? '.\n' : ' ');
const ds = textDatasetFromString('words', text);
// blocks: embed, decoder0, decoder1, decoder2, head -> stages [embed, decoder0, decoder1] [decoder2, head]
const LM: CharLmConfig = {
  arch: 'charlm',
  layers: 3,
  dModel: 16,
  heads: 2,
  context: 8,
  vocab: ds.vocab.size,
};
const model = buildModel(LM);
const RANGES = [
  { from: 0, to: 3 },
  { from: 3, to: 5 },
];
const OPT: OptimizerConfig = {
  ...defaultOptimizerConfig('sgd'),
  momentum: 0,
  clipNorm: 0,
};
const batches: Batch[] = (() => {
  const b = makeBatcher(ds, { batchSize: 4, context: 8, seed: 2 });
  return [b.next(), b.next(), b.next()];
})();

function params(seed: number): HostParams {
  return new Map([
    ...initParams(model.blocks, seed),
    ...initAuxParams(
      model,
      RANGES.map((r) => r.to),
      seed,
    ),
  ]);
}

/** Stage 1's parameters (blocks 3, 4) from another seed: a different stage-1 loss. */
function perturbStage1(p: HostParams): HostParams {
  const other = initParams(model.blocks, 99);
  const out = new Map(p);
  for (const [k, v] of other) if (Number(k.split('.')[0]) >= 3) out.set(k, v);
  return out;
}

async function run(
  p: HostParams,
  ranges: typeof RANGES,
  m: number,
  local: { overlap: number; deterministic: boolean } | undefined,
  opt = OPT,
): Promise<{ params: HostParams; losses: number[] }> {
  const kind = local
    ? localPipeline(m, ranges.length, local.overlap, local.deterministic)
    : backpropPipeline(m, ranges.length, 'never', 'gpipe');
  const s = await PipelineStrategy.create(
    {
      name: 'local',
      backend: 'wasm',
      model: LM,
      ranges,
      microBatches: m,
      optimizer: opt,
      kind,
    },
    p,
  );
  try {
    const losses: number[] = [];
    for (const b of batches) losses.push((await s.trainStep(b, 0.05)).loss);
    return { params: await s.getParams(), losses };
  } finally {
    await s.close();
  }
}

function maxDiff(a: Float32Array, b: Float32Array): number {
  let d = 0;
  for (let i = 0; i < a.length; i++) d = Math.max(d, Math.abs(a[i] - b[i]));
  return d;
}

test('greedy: a different stage-1 loss leaves stage 0 untouched; stage 1 does change', async () => {
  const base = params(1);
  const a = await run(base, RANGES, 2, { overlap: 0, deterministic: false });
  const b = await run(perturbStage1(base), RANGES, 2, {
    overlap: 0,
    deterministic: false,
  });
  for (const [k, v] of a.params) {
    const stage0 = k.startsWith('aux0.') || Number(k.split('.')[0]) < 3;
    if (stage0)
      assert.equal(
        maxDiff(v, b.params.get(k)!),
        0,
        `${k} must not depend on stage 1`,
      );
  }
  assert.ok(
    maxDiff(a.params.get(paramKey(4, 'w'))!, b.params.get(paramKey(4, 'w'))!) >
      1e-3,
  );
  // and stage 0 did train
  assert.ok(
    maxDiff(a.params.get(paramKey(1, 'w1'))!, base.get(paramKey(1, 'w1'))!) >
      1e-4,
  );
});

test('overlap 1: stage 1 loss reaches stage 0 (deterministic runs are reproducible)', async () => {
  const base = params(1);
  const a = await run(base, RANGES, 2, { overlap: 1, deterministic: true });
  const again = await run(base, RANGES, 2, { overlap: 1, deterministic: true });
  const b = await run(perturbStage1(base), RANGES, 2, {
    overlap: 1,
    deterministic: true,
  });
  for (const [k, v] of a.params)
    assert.equal(maxDiff(v, again.params.get(k)!), 0, `${k} reproducible`);
  assert.ok(
    maxDiff(
      a.params.get(paramKey(2, 'w1'))!,
      b.params.get(paramKey(2, 'w1'))!,
    ) > 0,
    'the overlapped block feels stage 1',
  );
});

test('K = 1 local parallelism is single-device training', async () => {
  const opt: OptimizerConfig = {
    ...defaultOptimizerConfig('adamw'),
    clipNorm: 1,
  };
  const p = initParams(model.blocks, 3);
  const one = [{ from: 0, to: 5 }];
  const local = await run(p, one, 1, { overlap: 0, deterministic: false }, opt);
  const single = await run(p, one, 1, undefined, opt);
  local.losses.forEach((l, i) =>
    assert.ok(
      Math.abs(l - single.losses[i]) <= 1e-5,
      `step ${i}: ${l} vs ${single.losses[i]}`,
    ),
  );
  for (const [k, v] of single.params)
    assert.ok(maxDiff(v, local.params.get(k)!) <= 1e-5, k);
});

test('--overlap n trains exactly the last n blocks of the previous stage', async () => {
  await initBackend('wasm');
  for (const n of [1, 2]) {
    const values = params(4);
    const role = { stage: 0, overlapTail: n, sendsInputGrad: false };
    const a = new LocalStage(model, RANGES[0], values, OPT, role);
    const b = new LocalStage(model, RANGES[0], values, OPT, role);
    try {
      const batch = batches[0];
      const x = () => tf.tensor(batch.x, batch.xShape, 'int32');
      const y = () => tf.tensor(batch.y, batch.yShape, 'int32');
      const outA = a.update(0, x(), y()).out!;
      const outB = b.update(0, x(), y()).out!;
      // b also gets a gradient from "stage 1" for its output
      b.overlapBackward(0, tf.randomNormal(outB.shape, 0, 1, 'float32', 5));
      outA.dispose();
      outB.dispose();
      await a.localStep(0.1);
      await b.localStep(0.1);
      const pa = await a.getParams();
      const pb = await b.getParams();
      for (const [k, v] of pa) {
        const block = k.startsWith('aux') ? -1 : Number(k.split('.')[0]);
        const inTail = block >= RANGES[0].to - n;
        const d = maxDiff(v, pb.get(k)!);
        if (inTail)
          assert.ok(
            d > 0,
            `overlap ${n}: ${k} (in the last ${n} blocks) must be trained by stage 1's gradient`,
          );
        else assert.equal(d, 0, `overlap ${n}: ${k} must not be`);
      }
      assert.ok(pa.has(auxKey(0, 'w')), 'stage 0 has an auxiliary head');
    } finally {
      a.dispose();
      b.dispose();
    }
  }
});

test('a stage that throws stops the run naming the stage; no worker keeps running', async () => {
  const s = await PipelineStrategy.create(
    {
      name: 'local',
      backend: 'wasm',
      model: LM,
      ranges: RANGES,
      microBatches: 2,
      optimizer: OPT,
      kind: localPipeline(2, RANGES.length, 1, false),
    },
    params(1),
  );
  await s.trainStep(batches[0], 0.05);
  // inputs longer than the context: the embedding on stage 0 throws
  const bad: Batch = {
    ...batches[1],
    x: new Int32Array(4 * 9),
    xShape: [4, 9],
  };
  await assert.rejects(
    s.trainStep(bad, 0.05),
    (e: unknown) =>
      e instanceof StageError &&
      e.stage === 0 &&
      /^stage 0: .*context 8/.test(e.message),
  );
  const workers = (
    s as unknown as { workers: Array<{ exited: Promise<number> }> }
  ).workers;
  await Promise.all(workers.map((w) => w.exited));
  await assert.rejects(s.getParams(), StageError);
});

test('a run stopped mid-way leaves its last complete checkpoint and no partial one', async () => {
  const out = mkdtempSync(join(tmpdir(), 'layerwise-local-'));
  try {
    await assert.rejects(
      train(
        {
          preset: 'charlm-tiny',
          strategy: 'local',
          stages: 2,
          microBatches: 2,
          batchSize: 8,
          layers: 1,
          dModel: 16,
          heads: 2,
          context: 8,
          steps: 4,
          saveEvery: 1,
          evalBatches: 1,
          out,
        },
        undefined,
        {
          onStep(m) {
            if (m.step === 2) throw new Error('stopped at step 2');
          },
        },
      ),
      /stopped at step 2/,
    );
    assert.deepEqual(
      readdirSync(out).filter((f) => f.includes('.tmp') || f.includes('.old')),
      [],
      'no temporary folders',
    );
    assert.ok(existsSync(join(checkpointDir(out), 'meta.json')));
    const ck = await loadCheckpoint(checkpointDir(out));
    assert.equal(ck.step, 1);
    assert.ok(
      ck.params.has(auxKey(0, 'w')),
      'the auxiliary head is saved with the checkpoint',
    );
  } finally {
    rmSync(out, { recursive: true, force: true });
  }
});
