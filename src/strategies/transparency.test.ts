/**
 * Transparency (as torchgpipe's test_transparency): a pipeline over K stages and M micro-batches,
 * with any re-materialization mode and schedule, trains exactly like one device on the whole
 * mini-batch (K = 1, M = 1, no re-materialization), on the wasm backend with worker stages.
 * Also: per-stage memory, and what happens when a stage fails.
 */

import assert from 'node:assert/strict';
import { test } from 'node:test';
import type { Batch } from '../data/batcher.js';
import { makeBatcher, validationBatches } from '../data/batcher.js';
import { paramCount } from '../model/block.js';
import { type HostParams, initParams } from '../model/init.js';
import {
  buildModel,
  type CharLmConfig,
  type MlpConfig,
  type ModelConfig,
} from '../model/model.js';
import {
  defaultOptimizerConfig,
  type OptimizerConfig,
} from '../optim/optimizer.js';
import { balanceByCost, stageRanges } from '../partition/balance.js';
import { StageError, type StageWorker } from '../runtime/device.js';
import {
  makeSchedule,
  placementOf,
  type RematMode,
  type ScheduleKind,
} from '../schedule/schedule.js';
import { maxParamDiff } from '../testing/assert-close.js';
import { tinyWhaleDataset } from '../testing/fixtures.js';
import { Rng } from '../util/rng.js';
import { backpropPipeline } from './gpipe.js';
import { PipelineStrategy } from './pipeline.js';
import type { StepReport } from './strategy.js';

const TOL = 1e-4;
/** Learning rates of the 3 steps, times a per-test factor. */
const LRS = [3e-3, 2e-3, 1e-3];
/**
 * The charlm runs use SGD with momentum: its update is linear in the gradient, so any error in
 * the accumulated gradients (e.g. a wrong 1/M loss seed) shows, where Adam would normalise a
 * constant factor away. Clipping at norm 1 is active on the first steps (gradient norms are
 * about 1.7, 1.2, 0.5 here), which checks the all-reduce of the stages' norms too.
 */
const LM_OPT: OptimizerConfig = {
  ...defaultOptimizerConfig('sgd'),
  momentum: 0.9,
  clipNorm: 1,
};
const LM_LR = 100;

// ---- one small text data set and charlm model, shared by every run ----
const ds = tinyWhaleDataset();
const LM: CharLmConfig = {
  arch: 'charlm',
  layers: 2,
  dModel: 32,
  heads: 2,
  context: 16,
  vocab: ds.vocab.size,
};
const lmModel = buildModel(LM);
const lmParams = initParams(lmModel.blocks, 1);
const lmBatches: Batch[] = (() => {
  const b = makeBatcher(ds, { batchSize: 8, context: 16, seed: 1 });
  return [b.next(), b.next(), b.next()];
})();
const lmVal = validationBatches(ds, {
  batchSize: 8,
  context: 16,
  maxBatches: 2,
});

// ---- a small image classifier on random images ----
const MLP: MlpConfig = {
  arch: 'mlp',
  inputShape: [4, 4, 1],
  hidden: [8, 8],
  classes: 3,
};
const mlpModel = buildModel(MLP);
const mlpParams = initParams(mlpModel.blocks, 2);
const imgBatches: Batch[] = (() => {
  const rng = new Rng(77);
  return LRS.map(() => ({
    x: new Float32Array(8 * 16).map(() => rng.next()),
    xShape: [8, 4, 4, 1],
    y: new Int32Array(8).map(() => rng.int(3)),
    yShape: [8],
    examples: 8,
    tokens: 8,
  }));
})();

interface RunConfig {
  k: number;
  m: number;
  remat: RematMode;
  schedule: ScheduleKind;
}
interface RunResult {
  losses: number[];
  params: HostParams;
  reports: StepReport[];
  evalLoss: number;
}

const label = (c: RunConfig) => `K=${c.k} M=${c.m} ${c.remat} ${c.schedule}`;

function workersOf(s: PipelineStrategy): StageWorker[] {
  return (s as unknown as { workers: StageWorker[] }).workers;
}

async function create(
  model: ModelConfig,
  params: HostParams,
  c: RunConfig,
  optimizer: OptimizerConfig,
): Promise<PipelineStrategy> {
  const built = buildModel(model);
  const placement = placementOf(c.schedule, c.k);
  const ranges = stageRanges(
    balanceByCost(built.blocks.map(paramCount), placement.length),
  );
  return PipelineStrategy.create(
    {
      name: label(c),
      backend: 'wasm',
      model,
      ranges,
      microBatches: c.m,
      kind: backpropPipeline(c.m, c.k, c.remat, c.schedule),
      placement,
      optimizer,
    },
    params,
  );
}

async function train(
  model: ModelConfig,
  params: HostParams,
  batches: Batch[],
  val: Batch[],
  c: RunConfig,
  optimizer: OptimizerConfig,
  lrScale = 1,
): Promise<RunResult> {
  const s = await create(model, params, c, optimizer);
  try {
    const reports: StepReport[] = [];
    for (let i = 0; i < batches.length; i++)
      reports.push(await s.trainStep(batches[i], LRS[i] * lrScale));
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

/** Runs the tasks with at most `limit` at a time (worker start-up is CPU-bound). */
async function pool<T>(
  tasks: Array<() => Promise<T>>,
  limit: number,
): Promise<T[]> {
  const out = new Array<T>(tasks.length);
  let next = 0;
  const lane = async () => {
    while (next < tasks.length) {
      const i = next++;
      out[i] = await tasks[i]();
    }
  };
  await Promise.all(
    Array.from({ length: Math.min(limit, tasks.length) }, lane),
  );
  return out;
}

function assertTransparent(got: RunResult, ref: RunResult, what: string): void {
  assert.equal(got.losses.length, ref.losses.length);
  got.losses.forEach((l, i) => {
    assert.ok(Number.isFinite(l), `${what}: step ${i} loss ${l}`);
    assert.ok(
      Math.abs(l - ref.losses[i]) <= TOL,
      `${what}: step ${i} loss ${l} vs single ${ref.losses[i]}`,
    );
  });
  const d = maxParamDiff(got.params, ref.params);
  assert.ok(d <= TOL, `${what}: final parameters differ by ${d}`);
  if (Number.isFinite(ref.evalLoss))
    assert.ok(
      Math.abs(got.evalLoss - ref.evalLoss) <= TOL,
      `${what}: eval ${got.evalLoss} vs ${ref.evalLoss}`,
    );
}

const SINGLE: RunConfig = { k: 1, m: 1, remat: 'never', schedule: 'gpipe' };
const LM_CONFIGS: RunConfig[] = [];
for (const k of [2, 3]) {
  for (const m of [1, 4]) {
    for (const remat of ['always', 'except_last', 'never'] as const) {
      // With M = 1 the only micro-batch is the last one: 'except_last' is the very same schedule
      // as 'never' (asserted below), so that run is not repeated (worker start-up is slow).
      if (m === 1 && remat === 'except_last') continue;
      LM_CONFIGS.push({ k, m, remat, schedule: 'gpipe' });
    }
  }
}
const ONE_F_ONE_B: RunConfig = { k: 3, m: 4, remat: 'never', schedule: '1f1b' };
/** Zero-bubble ZB-H1 (split backward), keeping activations, and re-materializing every backward. */
const ZB_H1: RunConfig[] = [
  { k: 3, m: 4, remat: 'never', schedule: 'zb-h1' },
  { k: 2, m: 4, remat: 'always', schedule: 'zb-h1' },
];
/** Two stages per device: interleaved 1F1B (V = 2), the V-shape ZBV and DualPipeV, K = 2, M = 8 (issue 22's bar). */
const VIRTUAL: RunConfig[] = [
  { k: 2, m: 8, remat: 'never', schedule: 'interleaved-1f1b' },
  { k: 2, m: 8, remat: 'except_last', schedule: 'zbv' },
  { k: 2, m: 8, remat: 'always', schedule: 'dualpipev' },
];

let lmRuns: Promise<Map<string, RunResult>> | undefined;
/** Every charlm run, started once and shared by the tests below. */
function lmResults(): Promise<Map<string, RunResult>> {
  lmRuns ??= (async () => {
    const configs = [SINGLE, ...LM_CONFIGS, ONE_F_ONE_B, ...ZB_H1, ...VIRTUAL];
    const results = await pool(
      configs.map(
        (c) => () => train(LM, lmParams, lmBatches, lmVal, c, LM_OPT, LM_LR),
      ),
      2,
    );
    return new Map(configs.map((c, i) => [label(c), results[i]]));
  })();
  return lmRuns;
}

test('charlm: gpipe with K = 2, 3, M = 1, 4 and every checkpoint mode, 1f1b, zb-h1, and two stages per device (interleaved-1f1b, zbv, dualpipev at K = 2, M = 8), train like a single device', async () => {
  for (const k of [2, 3])
    assert.deepEqual(
      makeSchedule('gpipe', 1, k, 'except_last'),
      makeSchedule('gpipe', 1, k, 'never'),
    );
  const runs = await lmResults();
  const ref = runs.get(label(SINGLE))!;
  // The comparison is meaningful: training moved the parameters well beyond the tolerance.
  const moved = maxParamDiff(ref.params, lmParams);
  assert.ok(
    moved > 10 * TOL,
    `single-device training changed the parameters by ${moved}`,
  );
  assert.ok(ref.losses.every((l) => l > 0 && Number.isFinite(l)));
  for (const c of [...LM_CONFIGS, ONE_F_ONE_B, ...ZB_H1, ...VIRTUAL]) {
    const r = runs.get(label(c))!;
    assertTransparent(r, ref, label(c));
    for (const rep of r.reports) {
      assert.equal(
        rep.peakBytes.length,
        c.k,
        `${label(c)}: one peak per stage`,
      );
      assert.equal(rep.traces.length, c.k);
      assert.equal(rep.stageSeconds.length, c.k);
      assert.ok(
        rep.bubble.every((b) => b >= 0 && b <= 1),
        `${label(c)}: bubble ${rep.bubble}`,
      );
      // Every stage ran forward and backward of each micro-batch once (zb-h1: its input and
      // weight parts on every stage but the first)
      const placement = placementOf(c.schedule, c.k);
      rep.traces.forEach((tr, d) => {
        for (let s = 0; s < placement.length; s++) {
          if (placement[s] !== d) continue;
          const split =
            c.schedule === 'zbv' || (c.schedule === 'zb-h1' && s > 0);
          const count = (label: string) =>
            tr.filter((t) => t.stage === s && t.label === label).length;
          const what = `${label(c)} device ${d} stage ${s}`;
          assert.equal(count('forward'), c.m, what);
          if (c.schedule === 'dualpipev') {
            // full backwards, and split ones at the end
            assert.equal(
              count('backward') + count('backward_input'),
              c.m,
              what,
            );
            assert.equal(count('backward_weight'), count('backward_input'));
          } else {
            assert.equal(count('backward'), split ? 0 : c.m, what);
            assert.equal(count('backward_input'), split ? c.m : 0, what);
            assert.equal(count('backward_weight'), split ? c.m : 0, what);
          }
          // re-materialized backwards also show their recompute as a span of its own
          const recomputed =
            c.remat === 'always'
              ? c.m
              : c.remat === 'except_last'
                ? c.m - 1
                : 0;
          assert.equal(count('recompute'), recomputed, what);
        }
      });
    }
  }
});

test('charlm: every stage of K = 2 peaks below the single device; re-materialization lowers the peak', async () => {
  const runs = await lmResults();
  const single = runs.get(label(SINGLE))!.reports.map((r) => r.peakBytes[0]);
  assert.ok(single.every((p) => p > 0));
  for (const c of LM_CONFIGS.filter((x) => x.k === 2)) {
    runs.get(label(c))!.reports.forEach((rep, step) => {
      rep.peakBytes.forEach((p, s) =>
        assert.ok(
          p > 0 && p < single[step],
          `${label(c)} step ${step} stage ${s}: ${p} >= single ${single[step]}`,
        ),
      );
    });
  }
  // With M = 4, keeping only stage inputs ('always') holds less than keeping every micro-batch's
  // activations ('never'); 'except_last' keeps one micro-batch, never more than 'never'.
  for (const k of [2, 3]) {
    const peak = (remat: RematMode, schedule: ScheduleKind = 'gpipe') =>
      runs
        .get(label({ k, m: 4, remat, schedule }))!
        .reports.map((r) => r.peakBytes);
    const always = peak('always');
    const except = peak('except_last');
    const never = peak('never');
    never.forEach((stages, step) =>
      stages.forEach((p, s) => {
        assert.ok(
          always[step][s] < p,
          `K=${k} step ${step} stage ${s}: always ${always[step][s]} >= never ${p}`,
        );
        assert.ok(
          except[step][s] <= p,
          `K=${k} step ${step} stage ${s}: except_last ${except[step][s]} > never ${p}`,
        );
      }),
    );
  }
  // 1F1B keeps at most K - s micro-batches in flight instead of M = 4: less memory, same result.
  const g = runs
    .get(label({ ...ONE_F_ONE_B, schedule: 'gpipe' }))!
    .reports.map((r) => r.peakBytes);
  const o = runs.get(label(ONE_F_ONE_B))!.reports.map((r) => r.peakBytes);
  // ZB-H1 holds 1F1B's in-flight micro-batches, and after each I only what its W reads
  const z = runs.get(label(ZB_H1[0]!))!.reports.map((r) => r.peakBytes);
  // (per stage never more; where a stage's peak is its optimizer step rather than its
  // activations, equal: the backward frees each tape as it goes, pipeline/tape.ts)
  const total = (stages: number[]) => stages.reduce((a, b) => a + b, 0);
  g.forEach((stages, step) => {
    stages.forEach((p, s) => {
      assert.ok(
        o[step][s] <= p,
        `1f1b step ${step} stage ${s}: ${o[step][s]} > gpipe ${p}`,
      );
      assert.ok(
        z[step][s] <= p,
        `zb-h1 step ${step} stage ${s}: ${z[step][s]} > gpipe ${p}`,
      );
    });
    assert.ok(
      total(o[step]) < total(stages),
      `1f1b step ${step}: [${o[step]}] vs gpipe [${stages}]`,
    );
    assert.ok(
      total(z[step]) < total(stages),
      `zb-h1 step ${step}: [${z[step]}] vs gpipe [${stages}]`,
    );
  });
});

test('mlp image classifier: K = 2, M = 2 trains like a single device (AdamW)', async () => {
  const opt = defaultOptimizerConfig('adamw');
  const c: RunConfig = { k: 2, m: 2, remat: 'except_last', schedule: 'gpipe' };
  const [ref, got] = await Promise.all([
    train(MLP, mlpParams, imgBatches, [], SINGLE, opt, 10),
    train(MLP, mlpParams, imgBatches, [], c, opt, 10),
  ]);
  const moved = maxParamDiff(ref.params, mlpParams);
  assert.ok(moved > 10 * TOL, `training changed the parameters by ${moved}`);
  assertTransparent(got, ref, `mlp ${label(c)}`);
});

/** Waits for every worker of `s` to exit, failing after `ms`. */
async function allExited(s: PipelineStrategy, ms: number): Promise<number[]> {
  let timer: NodeJS.Timeout | undefined;
  const timeout = new Promise<never>((_, reject) => {
    timer = setTimeout(
      () => reject(new Error(`workers still running after ${ms} ms`)),
      ms,
    );
  });
  try {
    return await Promise.race([
      Promise.all(workersOf(s).map((w) => w.exited)),
      timeout,
    ]);
  } finally {
    clearTimeout(timer);
  }
}

/** A strategy that was stopped by a failing stage (reused by the last test). */
let failed: PipelineStrategy | undefined;

async function checkFailure(
  bad: Batch,
  stage: number,
  what: RegExp,
  failing: RegExp,
): Promise<void> {
  const s = await create(
    LM,
    lmParams,
    { k: 2, m: 2, remat: 'except_last', schedule: 'gpipe' },
    LM_OPT,
  );
  // The strategy works before the failure.
  const ok = await s.trainStep(lmBatches[0], LRS[0]);
  assert.ok(Number.isFinite(ok.loss));
  await assert.rejects(s.trainStep(bad, LRS[1]), (e: unknown) => {
    assert.ok(e instanceof StageError, `a StageError, got ${String(e)}`);
    assert.equal(e.stage, stage);
    assert.match(e.message, new RegExp(`^stage ${stage}: `));
    assert.match(e.message, what);
    // the error shows the stage's schedule with the failing action marked
    assert.match(
      e.schedule ?? '',
      new RegExp(`^schedule of device ${stage}, action \\d+ of \\d+:`),
    );
    assert.match(e.schedule ?? '', failing);
    return true;
  });
  // The strategy stopped every worker: their threads exit, and close stays safe to call.
  const codes = await allExited(s, 10_000);
  assert.equal(codes.length, 2);
  await s.close();
  await s.close();
  failed = s;
}

test('a failing first stage rejects trainStep naming stage 0 and stops every worker', async () => {
  // A token id past the vocabulary: the embedding's gather fails on stage 0 while stage 1 waits.
  const x = lmBatches[1].x.slice();
  x[5] = LM.vocab;
  await checkFailure(
    { ...lmBatches[1], x },
    0,
    /index value/,
    /\n {2}0F\d {2}<-- ERROR HERE/,
  );
});

test('a failing last stage rejects trainStep naming stage 1 and stops every worker', async () => {
  // Labels for 17 tokens per example with a context of 16: the loss fails on the last stage
  // while stage 0 waits for the gradient.
  const b = lmBatches[1];
  const y = new Int32Array(8 * 17);
  await checkFailure(
    { ...b, y, yShape: [8, 17], tokens: 8 * 17 },
    1,
    /broadcast|shape/i,
    /\n {2}1Fk?\d {2}<-- ERROR HERE/,
  );
});

test('calls on a closed strategy reject instead of waiting forever', async () => {
  const s =
    failed ??
    (await create(
      LM,
      lmParams,
      { k: 2, m: 1, remat: 'never', schedule: 'gpipe' },
      defaultOptimizerConfig('adamw'),
    ));
  await s.close();
  let timer: NodeJS.Timeout | undefined;
  const hung = new Promise<string>((resolve) => {
    timer = setTimeout(() => resolve('still pending after 2 s'), 2000);
  });
  const outcome = await Promise.race([
    s.getParams().then(
      () => 'resolved',
      (e: Error) => `rejected: ${e.message}`,
    ),
    hung,
  ]);
  clearTimeout(timer);
  assert.match(outcome, /^rejected/);
});
