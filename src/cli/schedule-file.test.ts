/**
 * `layerwise train --schedule-file F.csv` (issue 22, item 4): a schedule printed by
 * `layerwise schedule --format csv` (PyTorch pipelining's compute-only CSV) trains exactly as
 * the named schedule; a bad file (an action missing, two actions swapped into a deadlock,
 * several stages on one device, another micro-batch count) exits 2 with the offending action
 * and, for the file's own faults, the grid marked `<-- ERROR HERE`, and writes nothing.
 */
import assert from 'node:assert/strict';
import { spawnSync } from 'node:child_process';
import {
  existsSync,
  mkdtempSync,
  readFileSync,
  rmSync,
  writeFileSync,
} from 'node:fs';
import { tmpdir } from 'node:os';
import { join } from 'node:path';
import { test } from 'node:test';
import { fileURLToPath } from 'node:url';

const CLI = fileURLToPath(new URL('./main.js', import.meta.url));
/** A tiny character model in 2 stages of 2 blocks, 4 micro-batches (a run is about 2 s). */
const TRAIN = [
  'train',
  '--preset',
  'charlm-tiny',
  '--layers',
  '2',
  '--d-model',
  '16',
  '--heads',
  '2',
  '--context',
  '8',
  '--batch-size',
  '8',
  '--eval-batches',
  '1',
  '--strategy',
  'gpipe',
  '--stages',
  '2',
  '--micro-batches',
  '4',
  '--steps',
  '3',
  '--backend',
  'cpu',
];

function run(args: string[]): {
  code: number | null;
  out: string;
  err: string;
} {
  const r = spawnSync(process.execPath, [CLI, ...args], {
    encoding: 'utf8',
    timeout: 120_000,
  });
  return { code: r.status, out: r.stdout, err: r.stderr };
}

const tmp = mkdtempSync(join(tmpdir(), 'layerwise-schedule-file-'));
process.on('exit', () => rmSync(tmp, { recursive: true, force: true }));

function losses(out: string): number[] {
  return readFileSync(join(out, 'metrics.jsonl'), 'utf8')
    .split('\n')
    .filter((l) => l.trim() !== '')
    .map((l) => JSON.parse(l).loss);
}

/** 1F1B at K=2, M=4 as `layerwise schedule --format csv` prints it. */
function oneFOneBCsv(): string {
  const r = run([
    'schedule',
    '--schedule',
    '1f1b',
    '--stages',
    '2',
    '--micro-batches',
    '4',
    '--format',
    'csv',
  ]);
  assert.equal(r.code, 0, r.err);
  return r.out;
}

test('a schedule printed as CSV and run with --schedule-file trains exactly as the named schedule', () => {
  const file = join(tmp, '1f1b.csv');
  writeFileSync(file, oneFOneBCsv());
  const named = join(tmp, 'named');
  const fromFile = join(tmp, 'from-file');
  let r = run([...TRAIN, '--schedule', '1f1b', '--out', named]);
  assert.equal(r.code, 0, r.err);
  r = run([...TRAIN, '--schedule-file', file, '--out', fromFile]);
  assert.equal(r.code, 0, r.err);
  assert.match(r.out, /schedule file .*1f1b\.csv/);
  assert.deepEqual(losses(fromFile), losses(named));
  const summary = JSON.parse(
    readFileSync(join(fromFile, 'summary.json'), 'utf8'),
  );
  assert.equal(summary.schedule, `file ${file}`);
});

test('a bad schedule file exits 2 naming the action, with the grid marked <-- ERROR HERE, and writes nothing', () => {
  const rows = oneFOneBCsv().trimEnd().split('\n');
  const cases: Array<{
    name: string;
    csv: string;
    args?: string[];
    err: RegExp;
  }> = [
    {
      name: 'missing',
      // stage 1's last backward dropped
      csv: `${rows[0]}\n${rows[1]!.replace('1B3', '')}\n`,
      err: /action 1B3 on device 1: missing: [\s\S]*\n {2}device 1: .*<-- ERROR HERE \(1B3\)/,
    },
    {
      name: 'deadlock',
      // stage 0 waits for micro-batch 1's gradient while stage 1 sends micro-batch 0's first
      csv: `${rows[0]!.replace('0B0', 'X').replace('0B1', '0B0').replace('X', '0B1')}\n${rows[1]}\n`,
      err: /action 0B1 on device 0: [\s\S]*\n {2}device 0: .*<-- ERROR HERE \(0B1\)/,
    },
    {
      name: 'two stages on one device',
      csv: '0F0,1F0,1B0,0B0\n',
      args: ['--micro-batches', '1'],
      err: /several stages on one device .* do not run here yet/,
    },
    {
      name: 'other micro-batches',
      csv: `${rows.join('\n')}\n`,
      args: ['--micro-batches', '2'],
      err: /has 4 micro-batches and the run 2; pass --micro-batches 4/,
    },
  ];
  for (const c of cases) {
    const file = join(tmp, `${c.name}.csv`);
    writeFileSync(file, c.csv);
    const out = join(tmp, `bad-${c.name}`);
    const r = run([
      ...TRAIN,
      ...(c.args ?? []),
      '--schedule-file',
      file,
      '--out',
      out,
    ]);
    assert.equal(r.code, 2, `${c.name}: ${r.err}`);
    assert.match(r.err, c.err, c.name);
    assert.doesNotMatch(r.err, /internal error/, c.name);
    assert.ok(!existsSync(out), `${c.name}: ${out} was written`);
  }
  const r = run([
    ...TRAIN.map((a) => (a === 'gpipe' ? 'local' : a)),
    '--schedule-file',
    join(tmp, 'missing.csv'),
    '--out',
    join(tmp, 'bad-local'),
  ]);
  assert.equal(r.code, 2);
  assert.match(r.err, /--schedule-file .* needs --strategy gpipe, not local/);
});
