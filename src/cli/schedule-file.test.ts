/**
 * `layerwise train --schedule-file F.csv` (issue 22, item 4): a schedule printed by
 * `layerwise schedule --format csv` (PyTorch pipelining's compute-only CSV) trains exactly as
 * the named schedule, and PyTorch's own ZBV schedule (two stages per device) trains as single; a
 * bad file (an action missing, two actions swapped into a deadlock, another device or
 * micro-batch count) exits 2 with the offending action
 * and, for the file's own faults, the grid marked `<-- ERROR HERE`, and writes nothing.
 */
import assert from 'node:assert/strict';
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
import { runCli } from '../testing/cli.js';

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

const run = (args: string[]) => runCli(args);

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

/**
 * PyTorch pipelining's ScheduleZBVZeroBubble for 2 ranks and 4 micro-batches as its `_dump_csv`
 * writes `pipeline_order` (rank 1 starts with one empty slot): the V-shape, stages 0 and 3 on
 * device 0, stages 1 and 2 on device 1, the backward split into I and W.
 */
const PYTORCH_ZBV_2X4 = [
  '0F0,0F1,0F2,3F0,3I0,3W0,3F1,3I1,3W1,0F3,0I0,0W0,3F2,3I2,3W2,0I1,0W1,3F3,3I3,3W3,0I2,0W2,0I3,0W3',
  ',1F0,2F0,1F1,2F1,2I0,2W0,1F2,1I0,1W0,2F2,2I1,2W1,1F3,1I1,1W1,2F3,2I2,2W2,1I2,2I3,1I3,1W2,2W3,1W3',
].join('\n');

test("PyTorch's ZBV schedule (V-shape, split backward) runs from its CSV and trains like single; the named zbv is the same schedule", () => {
  const file = join(tmp, 'zbv.csv');
  writeFileSync(file, `${PYTORCH_ZBV_2X4}\n`);
  const single = join(tmp, 'zbv-single');
  const fromFile = join(tmp, 'zbv-file');
  const named = join(tmp, 'zbv-named');
  let r = run([
    ...TRAIN.map((a) => (a === 'gpipe' ? 'single' : a)).filter(
      (_a, i, all) =>
        !['--stages', '--micro-batches'].includes(all[i]!) &&
        !['--stages', '--micro-batches'].includes(all[i - 1]!),
    ),
    '--out',
    single,
  ]);
  assert.equal(r.code, 0, r.err);
  r = run([...TRAIN, '--schedule-file', file, '--out', fromFile]);
  assert.equal(r.code, 0, r.err);
  r = run([...TRAIN, '--schedule', 'zbv', '--out', named]);
  assert.equal(r.code, 0, r.err);
  const ref = losses(single);
  assert.equal(ref.length, 3);
  for (const [what, got] of [
    ['file', losses(fromFile)],
    ['named', losses(named)],
  ] as const)
    got.forEach((l, i) =>
      assert.ok(
        Math.abs(l - ref[i]!) <= 1e-5,
        `${what} step ${i}: ${l} vs single ${ref[i]}`,
      ),
    );
  const summary = JSON.parse(readFileSync(join(named, 'summary.json'), 'utf8'));
  assert.equal(summary.stages, 4);
  assert.equal(summary.devices, 2);
  assert.equal(summary.virtual_stages, 2);
  assert.equal(summary.schedule, 'zbv');
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
      name: 'other devices',
      csv: '0F0,1F0,1B0,0B0\n',
      args: ['--micro-batches', '1'],
      err: /has 1 devices \(rows\) and the run 2; pass --stages 1/,
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
