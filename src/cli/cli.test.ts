/**
 * End-to-end tests of the `layerwise` command: bad input exits non-zero with a message that
 * names the problem and leaves no files; a resumed run reproduces an uninterrupted one; the
 * main job's pieces (train, checkpoint, sample) work together.
 */

import assert from 'node:assert/strict';
import {
  existsSync,
  mkdtempSync,
  readdirSync,
  readFileSync,
  rmSync,
  truncateSync,
  writeFileSync,
} from 'node:fs';
import { tmpdir } from 'node:os';
import { join } from 'node:path';
import { test } from 'node:test';
import { fileURLToPath } from 'node:url';
import { CLI, runCli } from '../testing/cli.js';
import { checkpointDir } from '../train/checkpoint-io.js';
import { readStepMetrics } from '../train/metrics.js';
import { parseSize } from '../util/size.js';

const TINY = [
  '--preset',
  'charlm-tiny',
  '--layers',
  '1',
  '--d-model',
  '32',
  '--heads',
  '2',
  '--context',
  '16',
  '--batch-size',
  '8',
  '--eval-batches',
  '1',
];

const run = (args: string[]) => runCli(args);

const tmp = mkdtempSync(join(tmpdir(), 'layerwise-cli-'));
process.on('exit', () => rmSync(tmp, { recursive: true, force: true }));

/**
 * A rejected `train`: exit 2, `message` on stderr, nothing written. With `budget` (bytes), the
 * message's `needs X` (in whichever binary unit the predicted peak takes: it differs between
 * backends) must exceed it.
 */
function expectBadInput(
  name: string,
  args: string[],
  message: RegExp,
  budget?: number,
): void {
  test(`bad input: ${name}`, () => {
    const out = join(tmp, `bad-${name.replace(/\W+/g, '-')}`);
    const r = run(['train', ...args, '--out', out]);
    assert.equal(r.code, 2, `exit code (stderr: ${r.err})`);
    assert.match(r.err, message);
    if (budget !== undefined) {
      const needs = parseSize(/needs ([\d.]+ [KMG]?i?B)/.exec(r.err)![1]!);
      assert.ok(needs > budget, `needs ${needs} B, over ${budget} B`);
    }
    assert.equal(existsSync(out), false, 'a rejected run must leave no files');
  });
}

expectBadInput(
  'balance that does not sum',
  [...TINY, '--strategy', 'gpipe', '--stages', '2', '--balance', '1,1'],
  /balance 1,1 sums to 2, but the model has 3 blocks/,
);
expectBadInput(
  'balance with an empty stage',
  [...TINY, '--strategy', 'gpipe', '--stages', '3', '--balance', '2,0,1'],
  /leaves a stage empty/,
);
expectBadInput(
  'more stages than blocks',
  [...TINY, '--strategy', 'gpipe', '--stages', '5'],
  /at most 3 stages/,
);
expectBadInput(
  'micro-batches that do not divide the batch',
  [...TINY, '--strategy', 'gpipe', '--stages', '2', '--micro-batches', '3'],
  /--micro-batches 3 must divide --batch-size 8/,
);
expectBadInput(
  'unknown preset',
  ['--preset', 'gpt5'],
  /unknown preset 'gpt5'; valid presets: charlm-tiny/,
);
expectBadInput(
  'unknown backend',
  [...TINY, '--backend', 'tpu'],
  /unknown backend 'tpu'; valid: wasm, cpu/,
);
expectBadInput(
  'unknown strategy',
  [...TINY, '--strategy', 'zero'],
  /unknown strategy 'zero'; valid: single, gpipe/,
);
expectBadInput(
  'missing data file',
  [...TINY, '--data', join(tmp, 'nope.txt')],
  /nope\.txt/,
);
expectBadInput(
  'preset on the wrong kind of data',
  ['--preset', 'mlp-mnist', '--data', 'moby-dick'],
  /trains on image data/,
);

expectBadInput(
  'over --device-memory (single)',
  [...TINY, '--device-memory', '500kB'],
  /layerwise: error: device out of memory: needs [\d.]+ [KMG]?i?B, budget 488.3 KiB \(stage 0 of single, predicted\); try --strategy l2l, or --strategy gpipe with more --stages\n/,
  500e3,
);
expectBadInput(
  'over --device-memory (local)',
  [
    ...TINY,
    '--strategy',
    'local',
    '--stages',
    '2',
    '--micro-batches',
    '2',
    '--device-memory',
    '300kB',
  ],
  /device out of memory: needs [\d.]+ [KMG]?i?B, budget 293 KiB \(stage \d of local, predicted\); try --strategy l2l, more --stages, or more --micro-batches/,
  300e3,
);

expectBadInput(
  'over --device-memory (l2l)',
  [
    ...TINY,
    '--strategy',
    'l2l',
    '--stash',
    'device',
    '--device-memory',
    '10kB',
  ],
  /device out of memory: needs [\d.]+ [KMG]?i?B, budget 9.8 KiB \(stage 0 of l2l, predicted\); try a smaller --batch-size or more --micro-batches, or --stash host/,
  10e3,
);
expectBadInput(
  'l2l pipelined on a schedule with a split backward',
  [...TINY, '--strategy', 'l2l', '--stages', '2', '--schedule', 'zb-h1'],
  /--strategy l2l --stages 2 pipelines its relay on --schedule gpipe or 1f1b, not zb-h1/,
);
expectBadInput(
  'l2l on device processes',
  [...TINY, '--strategy', 'l2l', '--stages', '2', '--devices', 'process'],
  /--strategy l2l keeps its parameter server in memory it shares with its devices, worker threads; drop --devices process/,
);

test('a generous --device-memory trains normally and reports the predicted peaks beside the measured ones', () => {
  const out = join(tmp, 'budget-ok');
  const r = run([
    'train',
    ...TINY,
    '--strategy',
    'local',
    '--stages',
    '2',
    '--micro-batches',
    '2',
    '--steps',
    '2',
    '--eval-every',
    '0',
    '--device-memory',
    '1GB',
    '--out',
    out,
  ]);
  assert.equal(r.code, 0, r.err);
  const s = JSON.parse(readFileSync(join(out, 'summary.json'), 'utf8'));
  assert.equal(s.device_memory_budget, 1e9);
  assert.equal(s.predicted_peak_device_bytes.length, 2);
  s.predicted_peak_device_bytes.forEach((p: number, i: number) => {
    const measured = s.peak_device_bytes[i];
    assert.ok(measured > 0 && measured <= 1e9);
    assert.ok(
      Math.abs(p - measured) <= 0.15 * measured,
      `stage ${i}: predicted ${p}, measured ${measured}`,
    );
  });
  assert.equal(losses(out).length, 2);
});

test('bad input: malformed IDX data file', () => {
  const images = join(tmp, 'bad-images.idx');
  const labels = join(tmp, 'bad-labels.idx');
  writeFileSync(images, Buffer.from([1, 2, 3, 4, 5, 6, 7, 8]));
  writeFileSync(labels, Buffer.from([0, 0, 8, 1, 0, 0, 0, 1, 0]));
  const out = join(tmp, 'bad-idx');
  const r = run([
    'train',
    '--preset',
    'mlp-mnist',
    '--data',
    `idx:${images},${labels}`,
    '--out',
    out,
  ]);
  assert.equal(r.code, 2, r.err);
  assert.match(r.err, /bad-images\.idx/);
  assert.equal(existsSync(out), false);
});

function losses(dir: string): number[] {
  return readStepMetrics(dir).map((m) => m.loss);
}

const full = join(tmp, 'full');
const part = join(tmp, 'part');
// on wasm: the resumed run's summary reports the wasm heap (the default backend is native where it is built)
const common = [
  ...TINY,
  '--strategy',
  'gpipe',
  '--stages',
  '2',
  '--micro-batches',
  '2',
  '--lr',
  '0.01',
  '--warmup',
  '2',
  '--backend',
  'wasm',
];

test('a resumed run reproduces the losses of an uninterrupted one', () => {
  const a = run([
    'train',
    ...common,
    '--steps',
    '6',
    '--out',
    full,
    '--trace',
    join(full, 'trace.json'),
  ]);
  assert.equal(a.code, 0, a.err);
  assert.doesNotMatch(
    a.out + a.err,
    /TensorFlow\.js in Node\.js/,
    'no TF.js banner',
  );
  // one bubble: the idle percentages printed are summary.json's
  const bubble = JSON.parse(readFileSync(join(full, 'summary.json'), 'utf8'))
    .bubble as number[];
  const printed = [...a.out.matchAll(/idle \(bubble\) ([\d.]+)%/g)].map((m) =>
    Number(m[1]),
  );
  assert.equal(printed.length, bubble.length);
  printed.forEach((p, i) =>
    assert.equal(p.toFixed(1), (100 * bubble[i]!).toFixed(1), `stage ${i}`),
  );
  const b = run(['train', ...common, '--steps', '3', '--out', part]);
  assert.equal(b.code, 0, b.err);
  // continue to 6 steps, on another partition (single device): checkpoints are partition-free
  const c = run([
    'train',
    '--resume',
    part,
    '--steps',
    '6',
    '--strategy',
    'single',
    '--stages',
    '1',
  ]);
  assert.equal(c.code, 0, c.err);
  assert.match(c.out, /resuming at step 3/);
  const la = losses(full);
  const lc = losses(part);
  assert.equal(lc.length, 6);
  for (let i = 0; i < 6; i++)
    assert.ok(
      Math.abs(la[i] - lc[i]) <= 1e-4,
      `step ${i + 1}: ${la[i]} vs ${lc[i]}`,
    );
  const summary = JSON.parse(readFileSync(join(part, 'summary.json'), 'utf8'));
  assert.equal(summary.steps, 6);
  assert.ok(
    Math.abs(summary.initial_loss - la[0]) <= 1e-4,
    'initial loss carried across the resume',
  );
  assert.ok(summary.final_loss < summary.initial_loss);
});

test("a zbv run (two stages per device) resumes exactly: each device takes back its stages' parameters and optimizer state", () => {
  const args = [
    ...TINY,
    '--layers',
    '2', // 4 blocks for 4 stages
    '--lr',
    '0.01',
    '--backend',
    'wasm',
  ];
  const ref = join(tmp, 'zbv-ref');
  const resumed = join(tmp, 'zbv-resumed');
  const zbv = [
    '--strategy',
    'gpipe',
    '--stages',
    '2',
    '--micro-batches',
    '4',
    '--schedule',
    'zbv',
  ];
  let r = run(['train', ...args, '--steps', '6', '--out', ref]);
  assert.equal(r.code, 0, r.err);
  r = run(['train', ...args, ...zbv, '--steps', '3', '--out', resumed]);
  assert.equal(r.code, 0, r.err);
  r = run(['train', '--resume', resumed, '--steps', '6']);
  assert.equal(r.code, 0, r.err);
  assert.match(r.out, /resuming at step 3/);
  assert.match(r.out, /schedule zbv/);
  const want = losses(ref);
  const got = losses(resumed);
  assert.equal(got.length, 6);
  got.forEach((l, i) =>
    assert.ok(
      Math.abs(l - want[i]!) <= 1e-4,
      `step ${i + 1}: zbv resumed ${l} vs single ${want[i]}`,
    ),
  );
  const summary = JSON.parse(
    readFileSync(join(resumed, 'summary.json'), 'utf8'),
  );
  assert.equal(summary.devices, 2);
  assert.equal(summary.stages, 4);
});

test('l2l resumes a gpipe checkpoint and continues exactly like the uninterrupted gpipe run', () => {
  const part2 = join(tmp, 'part-l2l');
  const b = run(['train', ...common, '--steps', '3', '--out', part2]);
  assert.equal(b.code, 0, b.err);
  const c = run([
    'train',
    '--resume',
    part2,
    '--steps',
    '6',
    '--strategy',
    'l2l',
    '--stages',
    '1',
    '--micro-batches',
    '2',
    '--trace',
    join(part2, 'trace.json'),
  ]);
  assert.equal(c.code, 0, c.err);
  const la = losses(full);
  const lc = losses(part2);
  assert.equal(lc.length, 6);
  for (let i = 0; i < 6; i++)
    assert.ok(
      Math.abs(la[i] - lc[i]) <= 1e-4,
      `step ${i + 1}: gpipe ${la[i]} vs gpipe then l2l ${lc[i]}`,
    );
  // peak device bytes from the engine and, on wasm, the heap size read from the backend
  const summary = JSON.parse(readFileSync(join(part2, 'summary.json'), 'utf8'));
  assert.equal(summary.strategy, 'l2l');
  assert.ok(
    summary.peak_device_bytes[0] > 0 && summary.wasm_heap_bytes[0] >= 2 ** 20,
    JSON.stringify(summary),
  );
  // the l2l trace: the device's compute, its parameter transfers and the parameter server's
  // optimizer thread each have a track, and spans on one track never overlap
  const trace = JSON.parse(readFileSync(join(part2, 'trace.json'), 'utf8')) as {
    traceEvents: Array<{
      ph: string;
      tid: number;
      ts: number;
      dur: number;
      name: string;
      cat: string;
      args: { name?: string };
    }>;
  };
  const names = trace.traceEvents
    .filter((e) => e.ph === 'M')
    .map((e) => e.args.name)
    .sort();
  assert.deepEqual(names, ['PS thread 0', 'device', 'transfers']);
  const spans = trace.traceEvents.filter((e) => e.ph === 'X');
  for (const tid of [0, 1, 2]) {
    const mine = spans.filter((e) => e.tid === tid).sort((x, y) => x.ts - y.ts);
    assert.ok(mine.length > 0, `track ${tid} has spans`);
    for (let i = 1; i < mine.length; i++)
      assert.ok(
        mine[i].ts >= mine[i - 1].ts + mine[i - 1].dur - 1,
        `track ${tid}: ${mine[i - 1].name} overlaps ${mine[i].name}`,
      );
  }
  // 3 steps of a 3-block model: every block's gradient pushed and updated once per step; each
  // layer but the last runs forward per micro-batch, every layer backward per micro-batch
  assert.equal(spans.filter((e) => e.cat === 'push_grads').length, 9);
  assert.equal(
    spans.filter((e) => e.tid === 2 && e.cat === 'server_update').length,
    9,
  );
  assert.equal(
    spans.filter((e) => e.cat === 'layer_forward').length,
    3 * 2 * 2,
  );
  assert.equal(
    spans.filter((e) => e.cat === 'layer_backward').length,
    3 * 3 * 2,
  );
});

test('resume refuses a checkpoint of another model and a corrupt checkpoint, writing nothing', () => {
  const mismatch = run([
    'train',
    '--resume',
    full,
    '--steps',
    '8',
    '--d-model',
    '64',
  ]);
  assert.equal(mismatch.code, 2, mismatch.err);
  assert.match(mismatch.err, /trained with dModel = 32, not 64/);
  const before = readdirSync(full).sort();
  const ck = join(checkpointDir(full), 'params.bin');
  truncateSync(ck, 100);
  const corrupt = run(['train', '--resume', full, '--steps', '8']);
  assert.equal(corrupt.code, 2, corrupt.err);
  assert.match(corrupt.err, /params\.bin has 100 bytes/);
  assert.deepEqual(
    readdirSync(full).sort(),
    before,
    'nothing added next to the run',
  );
  writeFileSync(
    join(checkpointDir(full), 'meta.json'),
    '{"format": "layerwise-checkpoint", "version": 1,',
  );
  const malformed = run(['sample', '--checkpoint', full]);
  assert.equal(malformed.code, 2, malformed.err);
  assert.match(malformed.err, /meta\.json is not valid JSON/);
});

test('sample with an empty --prompt starts from a line break instead of failing', () => {
  const r = run([
    'sample',
    '--checkpoint',
    part,
    '--prompt',
    '',
    '--length',
    '20',
  ]);
  assert.equal(r.code, 0, r.err);
  assert.equal([...r.out.slice(0, -1)].length, 20, JSON.stringify(r.out));
});

test('sample generates text from a trained character model', () => {
  const r = run([
    'sample',
    '--checkpoint',
    part,
    '--prompt',
    'The whale',
    '--length',
    '40',
  ]);
  assert.equal(r.code, 0, r.err);
  assert.ok(r.out.startsWith('The whale'));
  assert.ok(r.out.trimEnd().length >= 'The whale'.length + 30);
  const bad = run(['sample', '--checkpoint', part, '--prompt', '\u{1F40B}']);
  assert.equal(bad.code, 2);
  assert.match(bad.err, /never saw/);
});

test('--trace writes a Chrome trace whose spans never overlap within a stage, and an SVG timeline', () => {
  const trace = JSON.parse(readFileSync(join(full, 'trace.json'), 'utf8')) as {
    traceEvents: Array<{
      ph: string;
      tid: number;
      ts: number;
      dur: number;
      name: string;
      cat: string;
    }>;
  };
  const spans = trace.traceEvents.filter((e) => e.ph === 'X');
  const stages = [...new Set(spans.map((e) => e.tid))].sort();
  assert.deepEqual(stages, [0, 1]);
  for (const stage of stages) {
    const mine = spans
      .filter((e) => e.tid === stage)
      .sort((a, b) => a.ts - b.ts);
    // 6 steps x 2 micro-batches: every forward and backward is there
    assert.equal(mine.filter((e) => e.cat === 'forward').length, 12);
    assert.equal(mine.filter((e) => e.cat === 'backward').length, 12);
    assert.equal(mine.filter((e) => e.cat === 'optimizer_step').length, 6);
    for (let i = 1; i < mine.length; i++) {
      // 1 us slack: timestamps are rounded to microseconds
      assert.ok(
        mine[i].ts >= mine[i - 1].ts + mine[i - 1].dur - 1,
        `stage ${stage}: ${mine[i - 1].name} overlaps ${mine[i].name}`,
      );
    }
  }
  const names = trace.traceEvents
    .filter((e) => e.ph === 'M')
    .map((e) => (e as unknown as { args: { name: string } }).args.name);
  assert.deepEqual(names.sort(), ['stage 0', 'stage 1']);
  const svg = readFileSync(join(full, 'trace.svg'), 'utf8');
  assert.match(svg, /^<svg /);
  assert.match(svg, />stage 1</);
});

const EXAMPLE = fileURLToPath(
  new URL('../../examples/mnist-cnn.mjs', import.meta.url),
);
const BAD_OUTPUT = fileURLToPath(
  new URL('../testing/models/bad-wrong-output.js', import.meta.url),
);

test('a user model module trains with gpipe and l2l from the CLI, reports accuracy, and exports for plain TF.js', () => {
  const quick = [
    '--data',
    'mnist',
    '--batch-size',
    '8',
    '--eval-batches',
    '2',
    '--steps',
    '3',
    '--backend',
    'wasm',
  ];
  const out = join(tmp, 'user-gpipe');
  const a = run([
    'train',
    '--model',
    EXAMPLE,
    ...quick,
    '--strategy',
    'gpipe',
    '--stages',
    '2',
    '--micro-batches',
    '2',
    '--out',
    out,
  ]);
  assert.equal(a.code, 0, a.err);
  assert.match(a.out, /model .*mnist-cnn\.mjs: 4 blocks/);
  const s = JSON.parse(readFileSync(join(out, 'summary.json'), 'utf8'));
  assert.ok(
    s.val_accuracy >= 0 && s.val_accuracy <= 1,
    `val_accuracy ${s.val_accuracy}`,
  );
  const lines = readFileSync(join(out, 'metrics.jsonl'), 'utf8')
    .trim()
    .split('\n')
    .map((l) => JSON.parse(l));
  assert.ok(
    lines.some((l) => typeof l.val_accuracy === 'number'),
    'metrics.jsonl reports validation accuracy',
  );
  const b = run([
    'train',
    '--model',
    EXAMPLE,
    ...quick,
    '--strategy',
    'l2l',
    '--micro-batches',
    '2',
    '--out',
    join(tmp, 'user-l2l'),
  ]);
  assert.equal(b.code, 0, b.err);
  const exp = join(tmp, 'user-export');
  const e = run(['export', '--run', out, '--out', exp]);
  assert.equal(e.code, 0, e.err);
  assert.match(e.out, /as layers-model/);
  const json = JSON.parse(readFileSync(join(exp, 'model.json'), 'utf8'));
  assert.equal(json.format, 'layers-model');
  assert.deepEqual(json.weightsManifest[0].paths, ['weights.bin']);
  // a preset classifier reports accuracy too
  const c = run([
    'train',
    '--preset',
    'cnn-mnist',
    ...quick,
    '--out',
    join(tmp, 'cnn'),
  ]);
  assert.equal(c.code, 0, c.err);
  assert.match(c.out, /accuracy \d+(\.\d)?%/);
});

expectBadInput(
  'a model module that does not exist',
  ['--model', 'no-such-model.js', '--data', 'mnist'],
  /model module no-such-model\.js does not exist/,
);
expectBadInput(
  'a model module whose output does not fit the data',
  ['--model', BAD_OUTPUT, '--data', 'mnist'],
  /outputs \[2, 2\] for a batch of 2, but loss softmax-cross-entropy on mnist needs \[2, C\] scores with C >= 10 classes/,
);
expectBadInput(
  'a model module without --data',
  ['--model', BAD_OUTPUT],
  /--data is required with --model/,
);

test('a user regression model trains on a JSON-lines data set (mean squared error from compile()), and its loss falls', () => {
  const data = join(tmp, 'regression.jsonl');
  const rows: string[] = [];
  for (let i = 0; i < 200; i++) {
    const x = [
      Math.sin(i),
      Math.cos(i * 0.7),
      (i % 7) / 7,
      ((i * 13) % 11) / 11,
    ];
    rows.push(JSON.stringify({ x, y: 0.5 * x[0]! - x[1]! + 0.25 * x[2]! }));
  }
  writeFileSync(data, `${rows.join('\n')}\n`);
  const model = fileURLToPath(
    new URL('../testing/models/regression.js', import.meta.url),
  );
  const out = join(tmp, 'regression');
  const r = run([
    'train',
    '--model',
    model,
    '--data',
    data,
    '--strategy',
    'gpipe',
    '--stages',
    '2',
    '--micro-batches',
    '2',
    '--batch-size',
    '16',
    '--steps',
    '40',
    '--lr',
    '0.01',
    '--warmup',
    '0',
    '--eval-batches',
    '1',
    '--backend',
    'wasm',
    '--out',
    out,
  ]);
  assert.equal(r.code, 0, r.err);
  const s = JSON.parse(readFileSync(join(out, 'summary.json'), 'utf8'));
  assert.ok(
    s.final_loss < 0.5 * s.initial_loss,
    `mse ${s.initial_loss} -> ${s.final_loss}`,
  );
  assert.equal(s.val_accuracy, undefined, 'no accuracy for a regression');
});

/** Runs the CLI in the background; once metrics.jsonl of `out` has `after` steps, SIGKILLs one of its device processes. */
async function runAndKillDevice(
  args: string[],
  out: string,
  after: number,
): Promise<{
  code: number | null;
  out: string;
  err: string;
  killedAfterS: number;
}> {
  const { spawn, execFileSync } = await import('node:child_process');
  const child = spawn(process.execPath, [CLI, ...args], {
    stdio: ['ignore', 'pipe', 'pipe'],
  });
  let stdout = '';
  let stderr = '';
  child.stdout.on('data', (d) => (stdout += d));
  child.stderr.on('data', (d) => (stderr += d));
  const exited = new Promise<number | null>((r) =>
    child.on('exit', (c) => r(c)),
  );
  let killedAt = 0;
  const devices = () => {
    try {
      return execFileSync(
        'pgrep',
        ['-P', String(child.pid), '-f', 'device-process.js'],
        { encoding: 'utf8' },
      )
        .split('\n')
        .filter(Boolean)
        .map(Number);
    } catch {
      return []; // none (yet)
    }
  };
  for (let i = 0; i < 3000 && killedAt === 0 && child.exitCode === null; i++) {
    await new Promise((r) => setTimeout(r, 20));
    const path = join(out, 'metrics.jsonl');
    if (
      existsSync(path) &&
      readFileSync(path, 'utf8').trim().split('\n').length >= after
    ) {
      const pids = devices();
      if (pids.length === 0) continue;
      process.kill(pids[pids.length - 1]!, 'SIGKILL');
      killedAt = performance.now();
    }
  }
  assert.ok(killedAt > 0, 'a device was killed while the run was training');
  const code = await exited;
  return {
    code,
    out: stdout,
    err: stderr,
    killedAfterS: (performance.now() - killedAt) / 1000,
  };
}

test('a device process killed mid-run (with --layer-drop) stops it naming the stage, --resume continues exactly, and --max-restarts resumes by itself (also with 2 replicas)', async () => {
  // long enough steps (tens of ms) that the kill lands mid-run
  const base = [
    '--preset',
    'charlm-tiny',
    '--layers',
    '2',
    '--d-model',
    '64',
    '--heads',
    '2',
    '--context',
    '32',
    '--batch-size',
    '16',
    '--eval-batches',
    '1',
    '--strategy',
    'gpipe',
    '--stages',
    '2',
    '--micro-batches',
    '2',
    '--lr',
    '0.01',
    '--warmup',
    '2',
    '--backend',
    'wasm',
    '--steps',
    '40',
    '--save-every',
    '10',
    '--eval-every',
    '0',
    // dynamic architectures on: the resumed steps must draw the same blocks to skip
    '--layer-drop',
    '0.5',
  ];
  const ref = join(tmp, 'kill-ref');
  assert.equal(run(['train', ...base, '--out', ref]).code, 0);
  const want = losses(ref);
  const dropped = readStepMetrics(ref).map((m) => m.dropped_blocks ?? []);
  assert.ok(
    dropped.slice(15).some((d) => d.length > 0),
    'steps after the kill skip blocks',
  );
  // killed: the run stops within seconds with the stage named; the last checkpoint (step 10) survives
  const a = join(tmp, 'kill-a');
  const r = await runAndKillDevice(
    ['train', ...base, '--devices', 'process', '--out', a],
    a,
    15,
  );
  // no restart left: a user-facing error (exit 2) with the command that resumes, no error.txt
  assert.equal(r.code, 2, r.err);
  assert.match(r.err, /stage 1: device process \d+ at 127\.0\.0\.1:\d+/);
  assert.match(r.err, /resume it with: layerwise train --resume .*kill-a/);
  assert.doesNotMatch(r.err, /internal error/);
  assert.equal(existsSync(join(a, 'error.txt')), false);
  // a report left by an earlier failure is stale once a resume succeeds
  writeFileSync(join(a, 'error.txt'), 'layerwise internal error (earlier)\n');
  assert.ok(
    r.killedAfterS < 10,
    `stopped ${r.killedAfterS.toFixed(1)} s after the kill`,
  );
  const c = run(['train', '--resume', a, '--steps', '40']);
  assert.equal(c.code, 0, c.err);
  assert.equal(
    existsSync(join(a, 'error.txt')),
    false,
    'stale error.txt removed',
  );
  losses(a).forEach((l, i) =>
    assert.ok(
      Math.abs(l - want[i]!) <= 1e-4,
      `resumed step ${i + 1}: ${l} vs ${want[i]}`,
    ),
  );
  // --max-restarts: the same kill, and the run finishes by itself with the same losses
  const b = join(tmp, 'kill-b');
  const s = await runAndKillDevice(
    [
      'train',
      ...base,
      '--devices',
      'process',
      '--max-restarts',
      '1',
      '--out',
      b,
    ],
    b,
    15,
  );
  assert.equal(s.code, 0, s.err);
  assert.match(
    s.out,
    /restarting the devices from the checkpoint in .*kill-b \(restart 1 of 1\)/,
  );
  const lb = losses(b);
  assert.equal(lb.length, 40);
  lb.forEach((l, i) =>
    assert.ok(
      Math.abs(l - want[i]!) <= 1e-4,
      `restarted step ${i + 1}: ${l} vs ${want[i]}`,
    ),
  );
  // with 2 data-parallel replicas (4 device processes): the same, and the losses of the
  // uninterrupted replicas run over threads (whose sums differ from one pipeline's in order)
  const repRef = join(tmp, 'kill-replicas-ref');
  assert.equal(
    run(['train', ...base, '--replicas', '2', '--out', repRef]).code,
    0,
  );
  const wantRep = losses(repRef);
  const rep = join(tmp, 'kill-replicas');
  const t = await runAndKillDevice(
    [
      'train',
      ...base,
      '--replicas',
      '2',
      '--devices',
      'process',
      '--max-restarts',
      '1',
      '--out',
      rep,
    ],
    rep,
    15,
  );
  assert.equal(t.code, 0, t.err);
  assert.match(t.out, /restart 1 of 1/);
  const lr = losses(rep);
  assert.equal(lr.length, 40);
  lr.forEach((l, i) =>
    assert.ok(
      Math.abs(l - wantRep[i]!) <= 1e-4,
      `replicas, restarted step ${i + 1}: ${l} vs ${wantRep[i]}`,
    ),
  );
});
