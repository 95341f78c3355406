/**
 * L2L relay: trains exactly like one device (losses, parameters, validation loss within 1e-4
 * after 3 steps) with the stash on the device or in host memory, with and without global-norm
 * clipping (the parameter server holds the gradients until the norm is known, or updates each
 * layer as soon as its gradient arrives); and its device memory does not grow with depth.
 */

import assert from 'node:assert/strict';
import { test } from 'node:test';
import type { Batch } from '../data/batcher.js';
import { makeBatcher, validationBatches } from '../data/batcher.js';
import { type HostParams, initParams } from '../model/init.js';
import {
  buildModel,
  type CharLmConfig,
  type ModelConfig,
} from '../model/model.js';
import {
  defaultOptimizerConfig,
  type OptimizerConfig,
} from '../optim/optimizer.js';
import type { StashPlace } from '../pipeline/relay-stage.js';
import { formatSchedule, relaySchedule } from '../schedule/schedule.js';
import { maxParamDiff } from '../testing/assert-close.js';
import { tinyWhaleDataset } from '../testing/fixtures.js';
import { backpropPipeline } from './gpipe.js';
import { L2LStrategy } from './l2l.js';
import { PipelineStrategy } from './pipeline.js';
import type { StepReport, Strategy } from './strategy.js';

const TOL = 1e-4;
const LRS = [3e-3, 2e-3, 1e-3];

const ds = tinyWhaleDataset();
const batchesOf = (context: number, batchSize: number, n: number): Batch[] => {
  const b = makeBatcher(ds, { batchSize, context, seed: 1 });
  return Array.from({ length: n }, () => b.next());
};

interface Run {
  losses: number[];
  params: HostParams;
  reports: StepReport[];
  evalLoss: number;
}

async function run(
  s: Strategy,
  batches: Batch[],
  val: Batch[],
  lrScale: number,
): Promise<Run> {
  try {
    const reports: StepReport[] = [];
    for (let i = 0; i < batches.length; i++)
      reports.push(
        await s.trainStep(batches[i], LRS[i % LRS.length] * lrScale),
      );
    const evalLoss = val.length ? (await s.evaluate(val)).loss : NaN;
    return {
      losses: reports.map((r) => r.loss),
      params: await s.getParams(),
      reports,
      evalLoss,
    };
  } finally {
    await s.close();
  }
}

function single(
  model: ModelConfig,
  params: HostParams,
  optimizer: OptimizerConfig,
): Promise<Strategy> {
  const n = buildModel(model).blocks.length;
  return PipelineStrategy.create(
    {
      name: 'single',
      backend: 'wasm',
      model,
      ranges: [{ from: 0, to: n }],
      microBatches: 1,
      kind: backpropPipeline(1, 1, 'never', 'gpipe'),
      optimizer,
    },
    params,
  );
}

function l2l(
  model: ModelConfig,
  params: HostParams,
  optimizer: OptimizerConfig,
  m: number,
  stash: StashPlace,
  serverThreads = 1,
): Promise<Strategy> {
  return L2LStrategy.create(
    {
      backend: 'wasm',
      model,
      microBatches: m,
      optimizer,
      stash,
      serverThreads,
    },
    buildModel(model),
    params,
  );
}

function assertSame(got: Run, ref: Run, what: string): void {
  got.losses.forEach((l, i) =>
    assert.ok(
      Math.abs(l - ref.losses[i]) <= TOL,
      `${what}: step ${i} loss ${l} vs single ${ref.losses[i]}`,
    ),
  );
  const d = maxParamDiff(got.params, ref.params);
  assert.ok(d <= TOL, `${what}: parameters differ from single by ${d}`);
  assert.ok(
    Math.abs(got.evalLoss - ref.evalLoss) <= TOL,
    `${what}: validation ${got.evalLoss} vs single ${ref.evalLoss}`,
  );
}

test('relay schedule: layer by layer over all micro-batches, last layer fused, prefetch one ahead', () => {
  assert.equal(
    formatSchedule(relaySchedule(3, 2)),
    [
      '0L0LOAD 0L0F0 0L1PREF 0L0F1 0L0FREE 0L1LOAD 0L1F0 0L2PREF 0L1F1',
      '0L2LOAD 0L2B1 0L1PREF 0L2B0 0L2PUSH 0L2FREE 0L1LOAD 0L1B1 0L0PREF 0L1B0 0L1PUSH 0L1FREE',
      '0L0LOAD 0L0B1 0L0B0 0L0PUSH 0L0FREE 0STEP',
    ].join(' '),
  );
  const one = relaySchedule(1, 3)[0];
  assert.deepEqual(
    one.map((a) => a.op),
    [
      'load_layer',
      'layer_backward',
      'layer_backward',
      'layer_backward',
      'push_grads',
      'release_layer',
      'optimizer_step',
    ],
  );
});

// SGD with momentum is linear in the gradient (a wrong 1/M seed would show); clipping at norm 1
// is active on these steps, so the deferred updates of the parameter server are exercised.
const LM: CharLmConfig = {
  arch: 'charlm',
  layers: 2,
  dModel: 32,
  heads: 2,
  context: 16,
  vocab: ds.vocab.size,
};
const SGD_CLIP: OptimizerConfig = {
  ...defaultOptimizerConfig('sgd'),
  momentum: 0.9,
  clipNorm: 1,
};
const ADAMW_NOCLIP: OptimizerConfig = {
  ...defaultOptimizerConfig('adamw'),
  clipNorm: 0,
};

test('l2l equals single after 3 steps: stash on device and in host, M = 1 and 4, clipped SGD and unclipped AdamW', async () => {
  const params = initParams(buildModel(LM).blocks, 1);
  const batches = batchesOf(16, 8, 3);
  const val = validationBatches(ds, {
    batchSize: 8,
    context: 16,
    maxBatches: 2,
  });
  for (const [opt, lrScale, name] of [
    [SGD_CLIP, 100, 'sgd clip 1'],
    [ADAMW_NOCLIP, 1, 'adamw no clip'],
  ] as const) {
    const ref = await run(await single(LM, params, opt), batches, val, lrScale);
    assert.ok(
      maxParamDiff(ref.params, params) > 10 * TOL,
      'training moved the parameters beyond the tolerance',
    );
    const cases: Array<[number, StashPlace, number]> = [
      [1, 'device', 1],
      [4, 'host', 1],
      [4, 'device', 2],
    ];
    for (const [m, stash, threads] of cases) {
      const got = await run(
        await l2l(LM, params, opt, m, stash, threads),
        batches,
        val,
        lrScale,
      );
      assertSame(
        got,
        ref,
        `${name}, M=${m}, stash ${stash}, ${threads} optimizer thread(s)`,
      );
      for (const r of got.reports) {
        assert.equal(r.peakBytes.length, 1);
        assert.ok(r.peakBytes[0] > 0);
        const ops = r.traces[0].map((t) => t.op);
        assert.equal(
          ops.filter((o) => o === 'push_grads').length,
          4,
          'one gradient push per layer',
        );
      }
    }
  }
});

test('l2l device memory is constant in depth with the host stash (12 vs 3 blocks within 10%), while single grows', async () => {
  const cfg = (layers: number): CharLmConfig => ({
    arch: 'charlm',
    layers,
    dModel: 64,
    heads: 4,
    context: 32,
    vocab: ds.vocab.size,
  });
  const batches = batchesOf(32, 8, 2);
  const peak = async (s: Strategy) => {
    const r = await run(s, batches, [], 1);
    return Math.max(...r.reports.map((x) => x.peakBytes[0]));
  };
  const opt = defaultOptimizerConfig('adamw');
  const [shallow, deep] = [cfg(1), cfg(10)];
  assert.equal(buildModel(shallow).blocks.length, 3);
  assert.equal(buildModel(deep).blocks.length, 12);
  const l2l3 = await peak(
    await l2l(
      shallow,
      initParams(buildModel(shallow).blocks, 1),
      opt,
      2,
      'host',
    ),
  );
  const l2l12 = await peak(
    await l2l(deep, initParams(buildModel(deep).blocks, 1), opt, 2, 'host'),
  );
  const s3 = await peak(
    await single(shallow, initParams(buildModel(shallow).blocks, 1), opt),
  );
  const s12 = await peak(
    await single(deep, initParams(buildModel(deep).blocks, 1), opt),
  );
  assert.ok(
    Math.abs(l2l12 - l2l3) / l2l3 <= 0.1,
    `l2l peak: 12 blocks ${l2l12} B vs 3 blocks ${l2l3} B`,
  );
  assert.ok(
    s12 > 2 * s3,
    `single peak grows with depth: 12 blocks ${s12} B vs 3 blocks ${s3} B`,
  );
  assert.ok(
    l2l12 < s12 / 3,
    `l2l (${l2l12} B) holds a fraction of single's ${s12} B on 12 blocks`,
  );
});

test('a parameter-server thread that dies stops the run with its own error, not "worker was stopped"', async () => {
  const params = initParams(buildModel(LM).blocks, 1);
  const s = await l2l(LM, params, ADAMW_NOCLIP, 2, 'host');
  const batches = batchesOf(16, 8, 4);
  try {
    await s.trainStep(batches[0], 1e-3);
    const server = (
      s as unknown as {
        server: { workers: Array<{ terminate(): Promise<number> }> };
      }
    ).server;
    await server.workers[0].terminate();
    let error: Error | null = null;
    for (const b of batches.slice(1)) {
      try {
        await s.trainStep(b, 1e-3);
      } catch (e) {
        error = e as Error;
        break;
      }
    }
    assert.ok(error, 'training went on without its parameter server');
    assert.match(error.message, /optimizer thread 0/, error.message);
    await assert.rejects(s.getParams(), /optimizer thread 0/);
  } finally {
    await s.close();
  }
});
