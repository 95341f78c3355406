/**
 * The CLI's error path, table-driven: bad command lines and bad files exit with status 2 and one
 * line naming the problem (never a stack trace), before any work, leaving --out uncreated; a
 * run folder in use is refused, a stale lock is taken over; a numeric fault names its stage,
 * block and micro-batch and leaves the last checkpoint intact; an internal failure prints one
 * line and writes its full report to error.txt (--debug prints it).
 */

import assert from 'node:assert/strict';
import { spawnSync } from 'node:child_process';
import { createHash } from 'node:crypto';
import {
  chmodSync,
  existsSync,
  mkdirSync,
  mkdtempSync,
  readdirSync,
  readFileSync,
  rmSync,
  statSync,
  utimesSync,
  writeFileSync,
} from 'node:fs';
import { hostname, tmpdir } from 'node:os';
import { join } from 'node:path';
import { test } from 'node:test';
import { fileURLToPath } from 'node:url';
import { runCli } from '../testing/cli.js';
import { checkpointDir } from '../train/checkpoint-io.js';

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
const STACK = /\n\s+at /;

/** The CLI without the user's LAYERWISE_TOKEN (the same cases wherever the tests run), `extra` laid over. */
const run = (args: string[], extra: Record<string, string> = {}) =>
  runCli(args, { LAYERWISE_TOKEN: undefined, ...extra });

/** The lines layerwise (or commander) printed on stderr, without TF.js's banner. */
function errorLines(err: string): string[] {
  return err
    .split('\n')
    .filter(
      (l) =>
        l.trim() !== '' &&
        !/^={5,}$/.test(l) &&
        !l.startsWith('Hi, looks like you are running TensorFlow.js'),
    );
}

const tmp = mkdtempSync(join(tmpdir(), 'layerwise-bad-'));
process.on('exit', () => rmSync(tmp, { recursive: true, force: true }));
const f = (name: string, content: string | Uint8Array) => {
  const p = join(tmp, name);
  writeFileSync(p, content);
  return p;
};
const d = (name: string) => {
  const p = join(tmp, name);
  mkdirSync(p, { recursive: true });
  return p;
};

const aFile = f('a-file.txt', 'not a folder\n');
const emptyText = f('empty.txt', '');
const tinyText = f('tiny.txt', 'hello');
const ragged = f('ragged.jsonl', '{"x":[1,2],"y":1}\n{"x":[1],"y":0}\n');
const badJson = f('bad.jsonl', '{"x":[1,2],"y":1}\nnot json\n');
const badNpy = f('bad.npy', 'garbage');
const badIdx = f('bad-images.idx', Buffer.from([1, 2, 3, 4, 5, 6, 7, 8]));
const syntax = f('syntax.mjs', 'export default {{;\n');
const notModel = f('number.mjs', 'export default 42;\n');
const aFolder = d('a-folder');
const emptyRun = d('empty-run');
const badMetaRun = d('bad-meta-run/checkpoint');
writeFileSync(
  join(badMetaRun, 'meta.json'),
  '{"format": "layerwise-checkpoint",',
);
const otherFormat = d('other-format/checkpoint');
writeFileSync(
  join(otherFormat, 'meta.json'),
  JSON.stringify({ format: 'safetensors', version: 1 }),
);
const BAD_OUTPUT = fileURLToPath(
  new URL('../testing/models/bad-wrong-output.js', import.meta.url),
);

interface Case {
  name: string;
  /** The command line after `layerwise` (`train` cases get --out appended unless they give one). */
  args: string[];
  message: RegExp;
  /** Whether `--out <fresh folder>` is appended and must not exist afterwards (train only). */
  out?: boolean;
}

const train = (name: string, args: string[], message: RegExp): Case => ({
  name,
  args: ['train', ...args],
  message,
  out: true,
});

const CASES: Case[] = [
  // devices
  train(
    'other hosts without LAYERWISE_TOKEN',
    [
      ...TINY,
      '--strategy',
      'gpipe',
      '--stages',
      '2',
      '--devices',
      '127.0.0.1:1,127.0.0.1:1',
    ],
    /--devices names other hosts but LAYERWISE_TOKEN is not set/,
  ),
  train(
    'a --devices entry that is no device',
    [
      ...TINY,
      '--strategy',
      'gpipe',
      '--stages',
      '2',
      '--devices',
      'gpu0,thread',
    ],
    /--devices entry 'gpu0' is not thread, process or HOST:PORT/,
  ),
  train(
    'l2l on process devices',
    [...TINY, '--strategy', 'l2l', '--devices', 'process'],
    /--strategy l2l keeps its parameter server in memory it shares with its device/,
  ),
  // flags
  train('no model', ['--steps', '2'], /--preset or --model is required/),
  train('unknown option', [...TINY, '--bogus'], /unknown option '--bogus'/),
  train(
    'steps not an integer',
    [...TINY, '--steps', 'abc'],
    /--steps.*must be an integer/,
  ),
  train(
    'seed not an integer',
    [...TINY, '--seed', '1.5'],
    /--seed.*must be an integer/,
  ),
  train('lr not a number', [...TINY, '--lr', 'fast'], /--lr.*must be a number/),
  train(
    'bf16 on wasm',
    [...TINY, '--backend', 'wasm', '--precision', 'bf16'],
    /--precision bf16 needs --backend native.*use --precision fp32, --backend native, or on webgpu --precision f16/,
  ),
  train(
    'unknown precision',
    [...TINY, '--backend', 'wasm', '--precision', 'fp8'],
    /unknown precision 'fp8'; valid: fp32, bf16, f16/,
  ),
  train(
    'lr zero',
    [...TINY, '--lr', '0'],
    /--lr must be a positive number, got 0/,
  ),
  train(
    'steps zero',
    [...TINY, '--steps', '0'],
    /--steps must be an integer >= 1, got 0/,
  ),
  train(
    'batch size zero',
    [...TINY, '--batch-size', '0'],
    /--batch-size must be an integer >= 1, got 0/,
  ),
  train(
    'stages zero',
    [...TINY, '--strategy', 'gpipe', '--stages', '0'],
    /--stages must be an integer >= 1, got 0/,
  ),
  train(
    'negative warmup',
    [...TINY, '--warmup=-1'],
    /--warmup must be an integer >= 0, got -1/,
  ),
  train(
    'negative clip norm',
    [...TINY, '--clip-norm=-1'],
    /--clip-norm must be >= 0/,
  ),
  train(
    'eval batches zero',
    [...TINY, '--eval-batches', '0'],
    /--eval-batches must be an integer >= 1/,
  ),
  train(
    'context zero',
    [...TINY, '--context', '0'],
    /--context must be an integer >= 1/,
  ),
  train(
    'unknown optimizer',
    [...TINY, '--optimizer', 'lion'],
    /unknown optimizer 'lion'; valid: sgd, adamw/,
  ),
  train(
    'unknown decay',
    [...TINY, '--decay', 'linear'],
    /unknown decay 'linear'; valid: constant, cosine/,
  ),
  train(
    'unknown re-materialization',
    [...TINY, '--checkpoint', 'sometimes'],
    /unknown checkpoint mode 'sometimes'/,
  ),
  train(
    'unknown schedule',
    [...TINY, '--schedule', 'zigzag'],
    /unknown schedule 'zigzag'/,
  ),
  train(
    'unknown stash place',
    [...TINY, '--strategy', 'l2l', '--stash', 'disk'],
    /unknown stash place 'disk'/,
  ),
  train(
    'unknown balance kind',
    [...TINY, '--strategy', 'gpipe', '--stages', '2', '--balance', 'fast'],
    /--balance 'fast' must be comma-separated block counts.*flops, params, time, memory/,
  ),
  train(
    'balance with the wrong number of stages',
    [...TINY, '--strategy', 'gpipe', '--stages', '2', '--balance', '1,1,1'],
    /balance 1,1,1 has 3 entries but --stages is 2/,
  ),
  train('bad device memory size', [...TINY, '--device-memory', 'lots'], /lots/),
  train(
    'overlap without local',
    [...TINY, '--strategy', 'gpipe', '--stages', '2', '--overlap', '1'],
    /--overlap applies to --strategy local only/,
  ),
  train(
    'single on several stages',
    [...TINY, '--strategy', 'single', '--stages', '2'],
    /--strategy single runs on one device; drop --stages 2/,
  ),
  train(
    'model and preset',
    ['--preset', 'charlm-tiny', '--model', BAD_OUTPUT, '--data', 'mnist'],
    /--model and --preset charlm-tiny both name a model; give one/,
  ),
  train(
    'unknown loss',
    ['--model', BAD_OUTPUT, '--data', 'mnist', '--loss', 'hinge'],
    /unknown loss 'hinge'/,
  ),
  train(
    'preset on text for images',
    ['--preset', 'cnn-mnist', '--data', 'moby-dick'],
    /preset cnn-mnist trains on image data but --data moby-dick is text data/,
  ),
  // paths: --out, --trace
  {
    name: '--out is an existing file',
    args: ['train', ...TINY, '--out', aFile],
    message: /--out .*a-file\.txt is an existing file, not a folder/,
  },
  {
    name: '--out under a file',
    args: ['train', ...TINY, '--out', join(aFile, 'run')],
    message:
      /--out .*a-file\.txt\/run cannot be created: .*a-file\.txt is a file, not a folder/,
  },
  train(
    '--trace in a missing folder',
    [...TINY, '--trace', join(tmp, 'no-such-folder', 'trace.json')],
    /--trace .*trace\.json: its folder .*no-such-folder does not exist/,
  ),
  train(
    '--trace is a folder',
    [...TINY, '--trace', aFolder],
    /--trace .*a-folder is a folder; give a file path/,
  ),
  // paths: data files
  train(
    'missing text file',
    [...TINY, '--data', join(tmp, 'nope.txt')],
    /nope\.txt/,
  ),
  train(
    'data is a folder',
    [...TINY, '--data', aFolder],
    /a-folder" is a directory; give a file inside it/,
  ),
  train(
    'empty text file',
    [...TINY, '--data', emptyText],
    /empty\.txt" is empty/,
  ),
  train(
    'text too short for a validation batch',
    [...TINY, '--data', tinyText],
    /the text .*tiny\.txt \(5 characters\) is too short: .* --context 16 .*give a smaller --context or --batch-size, or a longer text/,
  ),
  train(
    'text too short with --batch-size 1: the fix is the context or the text',
    [...TINY, '--data', tinyText, '--batch-size', '1'],
    /the text .*tiny\.txt \(5 characters\) is too short: .*1 windows of --context 16 \(17 characters\); give a smaller --context, or a longer text/,
  ),
  train(
    'ragged JSON lines',
    ['--preset', 'mlp-mnist', '--data', ragged],
    /ragged\.jsonl line 2: x has shape \[1\] but line 1's x has shape \[2\]/,
  ),
  train(
    'malformed JSON lines',
    ['--preset', 'mlp-mnist', '--data', badJson],
    /bad\.jsonl line 2 is not valid JSON/,
  ),
  train(
    'malformed .npy',
    ['--preset', 'mlp-mnist', '--data', `npy:${badNpy},${badNpy}`],
    /bad\.npy does not start with the magic string/,
  ),
  train(
    'malformed IDX',
    ['--preset', 'mlp-mnist', '--data', `idx:${badIdx},${badIdx}`],
    /bad-images\.idx/,
  ),
  train(
    'missing IDX file',
    [
      '--preset',
      'mlp-mnist',
      '--data',
      `idx:${join(tmp, 'none.idx')},${join(tmp, 'none.idx')}`,
    ],
    /none\.idx does not exist/,
  ),
  // paths: model modules
  train(
    'model module with a syntax error',
    ['--model', syntax, '--data', 'mnist'],
    /syntax\.mjs/,
  ),
  train(
    'model module that exports no model',
    ['--model', notModel, '--data', 'mnist'],
    /number\.mjs/,
  ),
  // paths: --resume
  {
    name: '--resume a missing folder',
    args: ['train', '--resume', join(tmp, 'no-run')],
    message: /run folder .*no-run does not exist/,
  },
  {
    name: '--resume a file',
    args: ['train', '--resume', aFile],
    message: /a-file\.txt is a file, not a run folder/,
  },
  {
    name: '--resume an empty folder',
    args: ['train', '--resume', emptyRun],
    message: /empty-run holds no layerwise checkpoint/,
  },
  {
    name: '--resume a malformed meta.json',
    args: ['train', '--resume', join(tmp, 'bad-meta-run')],
    message: /meta\.json is not valid JSON/,
  },
  {
    name: '--resume another format',
    args: ['train', '--resume', join(tmp, 'other-format')],
    message: /meta\.json format is "safetensors"/,
  },
  // other commands
  {
    name: 'sample from a missing checkpoint',
    args: ['sample', '--checkpoint', join(tmp, 'no-run')],
    message: /does not exist/,
  },
  {
    name: 'export a missing run',
    args: ['export', '--run', join(tmp, 'no-run'), '--out', join(tmp, 'exp')],
    message: /does not exist/,
  },
  {
    name: 'plan with --stages 0',
    args: [
      'plan',
      '--preset',
      'charlm-tiny',
      '--stages',
      '0',
      '--batch-size',
      '8',
    ],
    message: /--stages must be an integer >= 1, got 0/,
  },
];

assert.ok(CASES.length >= 30);

for (const c of CASES) {
  test(`bad input (table): ${c.name}`, () => {
    const out = join(tmp, `out-${c.name.replace(/\W+/g, '-')}`);
    const r = run(c.out ? [...c.args, '--out', out] : c.args);
    assert.equal(r.code, 2, `exit code (stderr: ${r.err})`);
    assert.match(r.err, c.message);
    assert.doesNotMatch(r.err, STACK, 'no stack trace');
    const lines = errorLines(r.err);
    assert.equal(lines.length, 1, `one line: ${JSON.stringify(lines)}`);
    if (c.out)
      assert.equal(
        existsSync(out),
        false,
        'a rejected run must leave no files',
      );
  });
}

test('bad input: an --out in a folder this process cannot write', () => {
  const root = process.getuid?.() === 0;
  // root may write anywhere chmod allows nothing: /proc/1 refuses even root
  const parent = root ? '/proc/1' : d('read-only');
  if (!root) chmodSync(parent, 0o555);
  const r = run(['train', ...TINY, '--out', join(parent, 'run')]);
  assert.equal(r.code, 2, r.err);
  assert.match(
    r.err,
    /cannot be created: .* is not writable \(permission denied\)/,
  );
  assert.doesNotMatch(r.err, STACK);
});

const quick = [
  ...TINY,
  '--steps',
  '1',
  '--eval-every',
  '0',
  '--backend',
  'wasm',
];

test('a run folder in use by a live run is refused, naming it and the process; the folder is left as it was', () => {
  const out = d('locked');
  mkdirSync(join(out, '.lock'));
  writeFileSync(
    join(out, '.lock-owner.json'),
    JSON.stringify({
      pid: process.pid,
      host: hostname(),
      started: '2026-01-01T00:00:00.000Z',
    }),
  );
  const before = readdirSync(out).sort();
  const r = run(['train', ...quick, '--out', out]);
  assert.equal(r.code, 2, r.err);
  assert.match(
    r.err,
    new RegExp(
      `run folder .*locked is in use by another layerwise run \\(process ${process.pid} on ${hostname()}, started 2026-01-01T00:00:00.000Z\\); wait for it to finish, stop it, or give another --out`,
    ),
  );
  assert.doesNotMatch(r.err, STACK);
  assert.deepEqual(readdirSync(out).sort(), before, 'nothing written');
});

test('the lock of a killed run is taken over: its pid is gone, or its lock is stale', () => {
  const dead = spawnSync(
    process.execPath,
    ['-e', 'process.stdout.write(String(process.pid))'],
    { encoding: 'utf8' },
  );
  const out = d('killed');
  mkdirSync(join(out, '.lock'));
  writeFileSync(
    join(out, '.lock-owner.json'),
    JSON.stringify({
      pid: Number(dead.stdout),
      host: hostname(),
      started: '2026-01-01T00:00:00.000Z',
    }),
  );
  const r = run(['train', ...quick, '--out', out]);
  assert.equal(r.code, 0, r.err);
  assert.ok(existsSync(join(checkpointDir(out), 'meta.json')));
  assert.equal(existsSync(join(out, '.lock')), false, 'released at the end');
  // no owner file, but a lock nobody has refreshed for a minute
  const stale = d('stale');
  mkdirSync(join(stale, '.lock'));
  const old = new Date(Date.now() - 60_000);
  utimesSync(join(stale, '.lock'), old, old);
  const s = run(['train', ...quick, '--out', stale]);
  assert.equal(s.code, 0, s.err);
});

/** SHA-256 of every file under `dir`, by relative path. */
function treeHashes(dir: string): Record<string, string> {
  return Object.fromEntries(
    (readdirSync(dir, { recursive: true }) as string[])
      .filter((n) => statSync(join(dir, n)).isFile())
      .sort()
      .map((n) => [
        n,
        createHash('sha256')
          .update(readFileSync(join(dir, n)))
          .digest('hex'),
      ]),
  );
}

function hashes(dir: string): Record<string, string> {
  return Object.fromEntries(
    readdirSync(dir)
      .sort()
      .map((n) => [
        n,
        createHash('sha256')
          .update(readFileSync(join(dir, n)))
          .digest('hex'),
      ]),
  );
}

test('a numeric fault mid-run names the stage, block and micro-batch, updates nothing, and leaves the last checkpoint intact and loadable', () => {
  const out = join(tmp, 'fault');
  const common = [
    ...TINY,
    '--strategy',
    'gpipe',
    '--stages',
    '2',
    '--micro-batches',
    '2',
    '--eval-every',
    '0',
    '--backend',
    'wasm',
  ];
  const a = run([
    'train',
    ...common,
    '--steps',
    '2',
    '--lr',
    '0.01',
    '--out',
    out,
  ]);
  assert.equal(a.code, 0, a.err);
  const ck = checkpointDir(out);
  const before = hashes(ck);
  const metricsBefore = readFileSync(join(out, 'metrics.jsonl'), 'utf8');
  // an absurd learning rate: the first update is finite but huge, the next forward overflows
  const b = run(['train', '--resume', out, '--steps', '10', '--lr', '1e6']);
  assert.equal(b.code, 2, b.err);
  assert.match(
    b.err,
    /layerwise: error: non-finite value at step \d+: the (output|loss|gradient|input).* (of )?block \d+ \(\w+\) on stage \d, micro-batch \d.*; nothing was updated with it; the checkpoint of step 2 in .*checkpoints\/step-2 is intact; lower --lr \(now 1000000\)/,
  );
  assert.doesNotMatch(b.err, STACK);
  assert.equal(errorLines(b.err).length, 1, b.err);
  assert.deepEqual(hashes(ck), before, 'the checkpoint is unchanged');
  assert.equal(
    existsSync(join(out, 'error.txt')),
    false,
    'a user error writes no internal report',
  );
  assert.ok(
    readFileSync(join(out, 'metrics.jsonl'), 'utf8').startsWith(
      metricsBefore.trim(),
    ),
  );
  // and it still loads: resuming with a sane learning rate trains on
  const c = run(['train', '--resume', out, '--steps', '3', '--lr', '0.01']);
  assert.equal(c.code, 0, c.err);
  assert.match(c.out, /resuming at step 2/);
});

test('the divergence guard warns once when the loss jumps far above its running median', () => {
  const out = join(tmp, 'diverge');
  const r = run([
    'train',
    '--preset',
    'charlm-tiny',
    '--strategy',
    'gpipe',
    '--stages',
    '2',
    '--micro-batches',
    '2',
    '--lr',
    '30',
    '--steps',
    '8',
    '--eval-every',
    '0',
    '--out',
    out,
  ]);
  assert.ok(r.code === 0 || r.code === 2, r.err);
  const warnings = r.err
    .split('\n')
    .filter((l) => l.startsWith('layerwise: warning:'));
  assert.equal(warnings.length, 1, r.err);
  assert.match(
    warnings[0]!,
    /loss [\d.e+]+ at step \d+ is more than 10x its running median [\d.e+]+: training may be diverging; consider a lower --lr \(now 30\)/,
  );
  assert.doesNotMatch(r.err, STACK);
});

test('an internal failure prints one line and where its full report is (error.txt; --debug prints the stack)', () => {
  const broken = fileURLToPath(
    new URL('../testing/models/bad-forward-throws.js', import.meta.url),
  );
  const out = join(tmp, 'internal');
  const args = [
    'train',
    '--model',
    broken,
    '--data',
    'mnist',
    '--batch-size',
    '8',
    '--eval-batches',
    '1',
    '--steps',
    '1',
    '--backend',
    'wasm',
    '--out',
    out,
  ];
  const r = run(args);
  assert.equal(r.code, 1, r.err);
  const lines = errorLines(r.err);
  assert.equal(lines.length, 1, r.err);
  assert.match(
    lines[0]!,
    new RegExp(
      `^layerwise: internal error: stage 0: this block is broken on purpose; full report in ${out}/error\\.txt \\(or rerun with --debug\\)$`,
    ),
  );
  assert.doesNotMatch(r.err, STACK);
  const report = readFileSync(join(out, 'error.txt'), 'utf8');
  assert.match(report, /this block is broken on purpose/);
  assert.match(report, STACK, 'the report has the stack');
  assert.match(report, /<-- ERROR HERE/, "and the failing stage's schedule");
  const dbg = run([...args, '--debug']);
  assert.equal(dbg.code, 1, dbg.err);
  assert.match(dbg.err, STACK, '--debug prints the stack');
});

test("a checkpoint whose parameters are not its model's (another version of the preset) is refused by --resume, sample and export, naming the parameter", () => {
  const out = join(tmp, 'misfit');
  const r = run(['train', ...quick, '--out', out]);
  assert.equal(r.code, 0, r.err);
  // the same checkpoint as an earlier layout of the model would have written it: a block index moved
  const metaPath = join(checkpointDir(out), 'meta.json');
  const meta = JSON.parse(readFileSync(metaPath, 'utf8')) as {
    params: Array<{ key: string }>;
  };
  const moved = meta.params[meta.params.length - 1]!;
  const was = moved.key;
  moved.key = `9${was}`;
  writeFileSync(metaPath, JSON.stringify(meta));
  const before = hashes(checkpointDir(out));
  for (const args of [
    ['train', '--resume', out, '--steps', '10'],
    ['sample', '--checkpoint', out, '--length', '5'],
    ['export', '--run', out, '--out', join(tmp, 'misfit-export')],
  ]) {
    const b = run(args);
    assert.equal(b.code, 2, `${args[0]}: ${b.err}`);
    const lines = errorLines(b.err);
    assert.equal(lines.length, 1, `${args[0]}: one line: ${b.err}`);
    assert.match(
      lines[0]!,
      new RegExp(
        `checkpoint .*misfit.* does not fit its model: parameter ${was.replace('.', '\\.')} \\(\\w+\\) is missing\\. It was written for a different model .*start a new run`,
      ),
    );
    assert.doesNotMatch(b.err, STACK);
  }
  assert.deepEqual(
    hashes(checkpointDir(out)),
    before,
    'the checkpoint is untouched',
  );
  assert.equal(
    existsSync(join(tmp, 'misfit-export')),
    false,
    'nothing exported',
  );
});

test('an unreachable host mixed with a device process is a user error naming the host (exit 2), leaving nothing', () => {
  for (const devices of ['127.0.0.1:1,process', 'process,127.0.0.1:1']) {
    const out = join(tmp, `mixed-${devices.replace(/\W+/g, '-')}`);
    const r = run(
      [
        'train',
        ...TINY,
        '--strategy',
        'gpipe',
        '--stages',
        '2',
        '--devices',
        devices,
        '--out',
        out,
      ],
      { LAYERWISE_TOKEN: 'a-token' },
    );
    assert.equal(r.code, 2, `${devices}: ${r.err}`);
    assert.match(
      r.err,
      /refused the run: no layerwise worker answers at 127\.0\.0\.1:1; start one there/,
    );
    assert.doesNotMatch(r.err, /internal error|UNAVAILABLE/);
    assert.equal(existsSync(out), false, 'nothing written');
  }
});

test('train into the --out of an earlier run refuses (exit 2, naming --resume and --overwrite) and touches nothing; --overwrite starts over', () => {
  const out = join(tmp, 'taken');
  assert.equal(run(['train', ...TINY, '--steps', '2', '--out', out]).code, 0);
  const before = treeHashes(out);
  const r = run(['train', ...TINY, '--steps', '1', '--out', out]);
  assert.equal(r.code, 2, r.err);
  assert.match(
    r.err,
    /--out .*taken already holds a run; continue it with 'layerwise train --resume .*taken', start it over with --overwrite/,
  );
  assert.deepEqual(treeHashes(out), before, 'the earlier run is untouched');
  const o = run([
    'train',
    ...TINY,
    '--steps',
    '1',
    '--out',
    out,
    '--overwrite',
  ]);
  assert.equal(o.code, 0, o.err);
  const steps = readFileSync(join(out, 'metrics.jsonl'), 'utf8')
    .trim()
    .split('\n')
    .map((l) => JSON.parse(l).step);
  assert.deepEqual(steps, [1], 'a new run');
  assert.equal(
    JSON.parse(readFileSync(join(checkpointDir(out), 'meta.json'), 'utf8'))
      .step,
    1,
  );
});
