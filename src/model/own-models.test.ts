/**
 * Users' own tf.layers models are reproducible and every strategy trains them as single does
 * (issue 34): the run's seed decides their initial weights (any initializer; a loaded model's
 * values are kept), and Dropout draws its mask per example from the seed, the step and the
 * example's place in the mini-batch, so a micro-batch of a pipeline, a relayed layer or a
 * replica draws what single draws for the same examples. Models: an MLP, a small CNN (conv2d,
 * maxPooling2d), and one with layerNormalization and dropout.
 */

import assert from 'node:assert/strict';
import { mkdtempSync, readFileSync, rmSync, writeFileSync } from 'node:fs';
import { tmpdir } from 'node:os';
import { join } from 'node:path';
import { test } from 'node:test';
import { initBackend } from '../backend/index.js';
import { bf16Support } from '../backend/names.js';
import { nativeAddon, nativeUnavailable } from '../backend/native.js';
import { resolveConfig, type TrainConfig } from '../config/config.js';
import { createStrategy } from '../strategies/index.js';
import { maxParamDiff } from '../testing/assert-close.js';
import { runCli } from '../testing/cli.js';
import { randomBatch } from '../testing/fixtures.js';
import { loadTestModel, testModelPath } from '../testing/test-models.js';
import { Rng } from '../util/rng.js';
import { initParams } from './init.js';
import { droppedBlocks } from './layer-drop.js';
import type { Model } from './model.js';

const fixture = testModelPath;
/** Issue 34's bars after 3 steps: fp32 against fp32 single, bf16 against bf16 single. */
const TOL = 1e-5;
const TOL_BF16 = 1e-3;
const LRS = [0.05, 0.05, 0.05];
const SEED = 5;

interface Run {
  losses: number[];
  stageLosses: number[][];
  params: Map<string, Float32Array>;
}

/**
 * Three training steps of `model` under the flags `o` on the same batches, each step submitted
 * with its index (so Dropout draws its noise) unless `noise` is false; with `layerDrop` P, the
 * blocks LayerDrop skips at each step.
 */
async function train(
  model: Model,
  o: Partial<TrainConfig>,
  opts: { noise?: boolean; layerDrop?: number } = {},
): Promise<Run> {
  const cfg = resolveConfig({
    model: 'x.js',
    data: 'mnist',
    backend: 'cpu',
    batchSize: 8,
    optimizer: 'sgd',
    clipNorm: 0,
    seed: SEED,
    ...o,
  });
  const s = await createStrategy(cfg, model, initParams(model.blocks, SEED));
  const rng = new Rng(7);
  try {
    const out: Run = { losses: [], stageLosses: [], params: new Map() };
    for (let step = 0; step < LRS.length; step++) {
      const dropped = opts.layerDrop
        ? droppedBlocks(
            { p: opts.layerDrop, schedule: 'constant', seed: SEED },
            step,
            model.blocks.length,
          )
        : [];
      const r = await s.submit(
        randomBatch(model, 8, rng),
        LRS[step]!,
        dropped,
        opts.noise === false ? undefined : step,
      ).done;
      out.losses.push(r.loss);
      out.stageLosses.push(r.stageLosses);
    }
    out.params = await s.getParams();
    return out;
  } finally {
    await s.close();
  }
}

function assertSame(what: string, r: Run, ref: Run, tol: number): void {
  r.losses.forEach((l, i) =>
    assert.ok(
      Math.abs(l - ref.losses[i]!) <= tol,
      `${what} step ${i}: loss ${l} vs single ${ref.losses[i]}`,
    ),
  );
  const d = maxParamDiff(r.params, ref.params);
  assert.ok(d <= tol, `${what}: parameters differ from single by ${d}`);
}

const SCHEDULES: Array<[string, Partial<TrainConfig>]> = [
  [
    'gpipe K=2 M=4 fill-drain',
    { strategy: 'gpipe', stages: 2, microBatches: 4 },
  ],
  [
    'gpipe K=3 M=4 1f1b',
    {
      strategy: 'gpipe',
      stages: 3,
      microBatches: 4,
      schedule: '1f1b',
      remat: 'always',
    },
  ],
  [
    'gpipe K=2 M=8 zb-h1',
    { strategy: 'gpipe', stages: 2, microBatches: 8, schedule: 'zb-h1' },
  ],
  [
    'gpipe K=2 M=4 interleaved-1f1b V=2',
    {
      strategy: 'gpipe',
      stages: 2,
      microBatches: 4,
      schedule: 'interleaved-1f1b',
      virtualStages: 2,
      remat: 'never',
    },
  ],
  [
    'gpipe K=2 M=4 zbv',
    { strategy: 'gpipe', stages: 2, microBatches: 4, schedule: 'zbv' },
  ],
  [
    'gpipe K=2 M=4 dualpipev',
    { strategy: 'gpipe', stages: 2, microBatches: 4, schedule: 'dualpipev' },
  ],
  ['l2l K=1 M=2', { strategy: 'l2l', microBatches: 2 }],
  ['l2l K=2 M=4', { strategy: 'l2l', stages: 2, microBatches: 4 }],
  ['single, 2 replicas', { strategy: 'single', replicas: 2 }],
  [
    'gpipe K=2 M=2, 2 replicas',
    { strategy: 'gpipe', stages: 2, microBatches: 2, replicas: 2 },
  ],
];

for (const name of ['mlp', 'cnn', 'norm-dropout']) {
  test(`own model ${name}: every schedule, l2l K=1 and K=2 and replicas train as single within ${TOL} after 3 steps`, async () => {
    await initBackend('cpu');
    const model = await loadTestModel(name);
    const ref = await train(model, { strategy: 'single' });
    assert.ok(ref.losses.every(Number.isFinite), `single: ${ref.losses}`);
    for (const [what, o] of SCHEDULES) {
      // two stages per device need four blocks
      if (/interleaved|zbv|dualpipev/.test(what) && model.blocks.length < 4)
        continue;
      assertSame(what, await train(model, o), ref, TOL);
    }
  });
}

test('dropout draws per example: its noise changes training, single and every split of the batch draw the same masks, LayerDrop on top', async () => {
  await initBackend('cpu');
  const model = await loadTestModel('norm-dropout');
  const ref = await train(model, { strategy: 'single' });
  const quiet = await train(model, { strategy: 'single' }, { noise: false });
  assert.ok(
    Math.abs(ref.losses[0]! - quiet.losses[0]!) > 1e-4,
    `dropout is active in training: loss ${ref.losses[0]} with noise, ${quiet.losses[0]} without`,
  );
  const again = await train(model, { strategy: 'single' });
  assert.deepEqual(
    again.losses,
    ref.losses,
    'two runs with one seed draw the same masks, bit for bit',
  );

  const ld = await train(model, { strategy: 'single' }, { layerDrop: 0.5 });
  assert.ok(
    [0, 1, 2].some(
      (s) =>
        droppedBlocks({ p: 0.5, schedule: 'constant', seed: SEED }, s, 4)
          .length > 0,
    ),
    'the seed drops some block in 3 steps',
  );
  for (const [what, o] of [
    ['gpipe K=2 M=4', { strategy: 'gpipe', stages: 2, microBatches: 4 }],
    [
      'gpipe K=2 M=8 zbv',
      { strategy: 'gpipe', stages: 2, microBatches: 8, schedule: 'zbv' },
    ],
    ['l2l K=1 M=4', { strategy: 'l2l', microBatches: 4 }],
    ['l2l K=2 M=2', { strategy: 'l2l', stages: 2, microBatches: 2 }],
  ] as Array<[string, Partial<TrainConfig>]>)
    assertSame(
      `${what} with --layer-drop 0.5`,
      await train(model, o, { layerDrop: 0.5 }),
      ld,
      TOL,
    );
});

test('local parallelism on an own model with dropout: stage losses equal a second run of the same flags, bit for bit', async () => {
  await initBackend('cpu');
  const model = await loadTestModel('norm-dropout');
  const flags: Partial<TrainConfig> = {
    strategy: 'local',
    stages: 2,
    microBatches: 2,
    deterministic: true,
  };
  const a = await train(model, flags);
  const b = await train(model, flags);
  assert.deepEqual(b.stageLosses, a.stageLosses);
  assert.equal(maxParamDiff(a.params, b.params), 0);
  const quiet = await train(model, flags, { noise: false });
  assert.notDeepEqual(
    quiet.stageLosses,
    a.stageLosses,
    'the local stages draw dropout noise',
  );
});

test("the seed decides an own model's initial weights: one seed draws the same, another draws others, with the initializer's distribution; set weights are kept", async () => {
  await initBackend('cpu');
  const model = await loadTestModel('mlp');
  const a = initParams(model.blocks, 1);
  const b = initParams(model.blocks, 1);
  const c = initParams(model.blocks, 2);
  assert.equal(maxParamDiff(a, b), 0);
  assert.ok(maxParamDiff(a, c) > 1e-3, 'another seed, other weights');
  // dense 16 -> 10, TF.js's default glorotNormal: a normal of std sqrt(2 / (16 + 10)) truncated at 2 std
  const kernel = a.get('1.kernel')!;
  const std = Math.sqrt(2 / (16 + 10));
  const mean = kernel.reduce((s, v) => s + v, 0) / kernel.length;
  const sd = Math.sqrt(
    kernel.reduce((s, v) => s + (v - mean) ** 2, 0) / kernel.length,
  );
  assert.ok(Math.abs(sd / std - 1) < 0.2, `std ${sd}, glorotNormal's ${std}`);
  assert.ok(
    kernel.every((v) => Math.abs(v) <= (2 * std) / 0.87962566103423978),
    'truncated at 2 std',
  );
  assert.ok(
    a.get('1.bias')!.every((v) => v === 0),
    'zeros stay zeros',
  );
  const pre = await loadTestModel('pretrained');
  const p = initParams(pre.blocks, 3);
  const first = p.get('0.kernel')!;
  assert.deepEqual(
    [...first.slice(0, 3)].map((v) => Math.round(v * 1e6) / 1e6),
    [0.01, 0.02, 0.03],
    'a model whose weights were set keeps them',
  );
});

const bf16Skip = !nativeAddon()
  ? `native backend unavailable: ${nativeUnavailable()}`
  : !bf16Support().nativeBf16
    ? `this CPU has no avx512_bf16 or AMX (${bf16Support().note})`
    : false;

test(`own models at --precision bf16: gpipe K=2 (1f1b, zbv) and l2l K=2 equal single bf16 within ${TOL_BF16}`, {
  skip: bf16Skip,
}, async () => {
  for (const name of ['mlp', 'norm-dropout']) {
    const model = await loadTestModel(name);
    const bf = { backend: 'native', precision: 'bf16' } as Partial<TrainConfig>;
    const ref = await train(model, { strategy: 'single', ...bf });
    for (const [what, o] of [
      [
        'gpipe K=2 M=4 1f1b',
        { strategy: 'gpipe', stages: 2, microBatches: 4, schedule: '1f1b' },
      ],
      [
        'gpipe K=2 M=4 zbv',
        { strategy: 'gpipe', stages: 2, microBatches: 4, schedule: 'zbv' },
      ],
      ['l2l K=2 M=2', { strategy: 'l2l', stages: 2, microBatches: 2 }],
    ] as Array<[string, Partial<TrainConfig>]>)
      assertSame(
        `${name} bf16 ${what}`,
        await train(model, { ...o, ...bf }),
        ref,
        TOL_BF16,
      );
  }
});

/** The losses of each step of `layerwise train` on the MNIST MLP a new user writes, in a process of its own. */
function cliLosses(out: string, flags: string[]): number[] {
  const r = runCli([
    'train',
    '--model',
    fixture('mnist-mlp'),
    '--data',
    'mnist',
    '--steps',
    '3',
    '--seed',
    '1',
    '--batch-size',
    '16',
    '--eval-batches',
    '1',
    '--backend',
    'cpu',
    '--out',
    out,
    ...flags,
  ]);
  assert.equal(r.code, 0, r.err);
  return readFileSync(join(out, 'metrics.jsonl'), 'utf8')
    .trim()
    .split('\n')
    .map((l) => JSON.parse(l).loss as number);
}

test('the CLI on an own model: two runs with one --seed equal bit for bit; gpipe K=2 and l2l K=2, each in its own process, equal single', () => {
  const tmp = mkdtempSync(join(tmpdir(), 'layerwise-own-'));
  try {
    const a = cliLosses(join(tmp, 'a'), ['--strategy', 'single']);
    const b = cliLosses(join(tmp, 'b'), ['--strategy', 'single']);
    assert.deepEqual(b, a, 'the seed decides the initial weights');
    const other = cliLosses(join(tmp, 'c'), [
      '--strategy',
      'single',
      '--seed',
      '2',
    ]);
    assert.notDeepEqual(other, a, 'another seed, another start');
    for (const flags of [
      ['--strategy', 'gpipe', '--stages', '2', '--micro-batches', '4'],
      ['--strategy', 'l2l', '--stages', '2', '--micro-batches', '2'],
    ]) {
      const l = cliLosses(join(tmp, flags.join('')), flags);
      l.forEach((v, i) =>
        assert.ok(
          Math.abs(v - a[i]!) <= TOL,
          `${flags.join(' ')} step ${i + 1}: ${v} vs single ${a[i]}`,
        ),
      );
    }
  } finally {
    rmSync(tmp, { recursive: true, force: true });
  }
});

test('an own model with dropout, killed mid-run and resumed, ends exactly as the uninterrupted run', () => {
  const tmp = mkdtempSync(join(tmpdir(), 'layerwise-own-resume-'));
  try {
    // 96 training and 32 validation examples of 8 features, 3 classes
    const data = join(tmp, 'data.jsonl');
    const lines: string[] = [];
    for (let i = 0; i < 128; i++) {
      const x = Array.from(
        { length: 8 },
        (_, j) => ((i * 7 + j * 13) % 17) / 17,
      );
      lines.push(
        JSON.stringify({ x, y: i % 3, ...(i >= 96 ? { split: 'val' } : {}) }),
      );
    }
    writeFileSync(data, `${lines.join('\n')}\n`);
    const flags = (out: string) => [
      'train',
      '--model',
      fixture('norm-dropout'),
      '--data',
      data,
      '--strategy',
      'gpipe',
      '--stages',
      '2',
      '--micro-batches',
      '2',
      '--batch-size',
      '8',
      '--steps',
      '5',
      '--save-every',
      '1',
      '--eval-batches',
      '1',
      '--backend',
      'cpu',
      '--out',
      out,
    ];
    const whole = join(tmp, 'whole');
    const a = runCli(flags(whole));
    assert.equal(a.code, 0, a.err);
    const cut = join(tmp, 'cut');
    // killed (SIGKILL) right after the 9th file-system change of its saves: during step 2's or 3's
    const k = runCli(flags(cut), { LAYERWISE_TEST_KILL_AFTER_FS_CHANGES: '9' });
    assert.equal(k.signal, 'SIGKILL', `the run was killed: ${k.code} ${k.err}`);
    const r = runCli(['train', '--resume', cut]);
    assert.equal(r.code, 0, r.err);
    const losses = (out: string) =>
      readFileSync(join(out, 'metrics.jsonl'), 'utf8')
        .trim()
        .split('\n')
        .map((l) => JSON.parse(l).loss as number);
    assert.deepEqual(losses(cut), losses(whole));
  } finally {
    rmSync(tmp, { recursive: true, force: true });
  }
});

test('a layer whose noise layerwise does not draw per example (alphaDropout) is named in the run output as running in inference mode', () => {
  const tmp = mkdtempSync(join(tmpdir(), 'layerwise-own-alpha-'));
  try {
    const data = join(tmp, 'data.jsonl');
    const lines = Array.from({ length: 48 }, (_, i) =>
      JSON.stringify({
        x: [i % 5, i % 3, i % 2, 1].map((v) => v / 4),
        y: i % 3,
        ...(i >= 40 ? { split: 'val' } : {}),
      }),
    );
    writeFileSync(data, `${lines.join('\n')}\n`);
    const r = runCli([
      'train',
      '--model',
      fixture('alpha-dropout'),
      '--data',
      data,
      '--steps',
      '1',
      '--batch-size',
      '8',
      '--eval-batches',
      '1',
      '--backend',
      'cpu',
      '--out',
      join(tmp, 'run'),
    ]);
    assert.equal(r.code, 0, r.err);
    assert.match(
      r.out,
      /note: layer "noisy" \(AlphaDropout\) runs in inference mode, without noise/,
    );
  } finally {
    rmSync(tmp, { recursive: true, force: true });
  }
});
