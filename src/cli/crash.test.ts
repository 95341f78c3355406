/**
 * Crash safety of checkpoints (issue 25): a real `layerwise train` process kills itself
 * (SIGKILL) right after each file-system change of two consecutive saves, and is resumed each
 * time; every resume must end exactly like the uninterrupted run, leave no temporary or stale
 * checkpoint behind, and keep metrics.jsonl free of duplicates and gaps. A SIGTERM during a
 * save removes the save's temporary files at once. Runs of earlier versions (one plain
 * `checkpoint/` folder, perhaps with a `checkpoint.old-*` of an interrupted replacement) resume.
 */

import assert from 'node:assert/strict';
import {
  cpSync,
  mkdtempSync,
  readdirSync,
  readFileSync,
  renameSync,
  rmSync,
} from 'node:fs';
import { tmpdir } from 'node:os';
import { join } from 'node:path';
import { test } from 'node:test';
import { runCli } from '../testing/cli.js';

/** A tiny character model on one device: a process is about a second. */
const FLAGS = [
  'train',
  '--preset',
  'charlm-tiny',
  '--layers',
  '1',
  '--d-model',
  '16',
  '--heads',
  '2',
  '--context',
  '8',
  '--batch-size',
  '4',
  '--eval-batches',
  '1',
  '--strategy',
  'single',
  '--stages',
  '1',
  '--steps',
  '3',
  '--save-every',
  '1',
];

const run = runCli;

const tmp = mkdtempSync(join(tmpdir(), 'layerwise-crash-'));
process.on('exit', () => rmSync(tmp, { recursive: true, force: true }));

function finalLoss(out: string): number {
  return JSON.parse(readFileSync(join(out, 'summary.json'), 'utf8')).final_loss;
}

function metricSteps(out: string): number[] {
  return readFileSync(join(out, 'metrics.jsonl'), 'utf8')
    .split('\n')
    .filter((l) => l.trim() !== '')
    .map((l) => JSON.parse(l).step);
}

/** A finished run folder holds its outputs and exactly one checkpoint, the last step's. */
function assertClean(out: string, what: string): void {
  assert.deepEqual(
    readdirSync(out).sort(),
    ['checkpoints', 'metrics.jsonl', 'run.json', 'summary.json'],
    `${what}: run folder entries`,
  );
  assert.deepEqual(
    readdirSync(join(out, 'checkpoints')).sort(),
    ['latest.json', 'step-3'],
    `${what}: checkpoints`,
  );
  assert.deepEqual(metricSteps(out), [1, 2, 3], `${what}: metrics.jsonl steps`);
}

test('a run SIGKILLed after each file-system change of its three saves (the last one too) resumes exactly, leaving nothing behind', () => {
  const ref = join(tmp, 'reference');
  const first = run([...FLAGS, '--out', ref]);
  assert.equal(first.code, 0, first.err);
  assert.doesNotMatch(
    first.out + first.err,
    /TensorFlow\.js in Node\.js/,
    'no TF.js banner',
  );
  assertClean(ref, 'uninterrupted run');
  const reference = finalLoss(ref);
  const losses: Array<{ at: number; loss: number }> = [];
  let restarted = 0;
  let completed = 0;
  // saves at steps 1, 2 and 3: kill after every change of each (the loop ends once the last
  // save is complete: its pointer switched and step 2 removed)
  for (let at = 1; at < 100; at++) {
    const out = join(tmp, `kill-${at}`);
    const r = run([...FLAGS, '--out', out], {
      LAYERWISE_TEST_KILL_AFTER_FS_CHANGES: String(at),
    });
    assert.equal(r.signal, 'SIGKILL', `kill point ${at}: ${r.err}`);
    let last = false;
    try {
      last =
        readdirSync(join(out, 'checkpoints')).sort().join() ===
        'latest.json,step-3';
    } catch {
      // no checkpoints folder yet
    }
    let resumed = run(['train', '--resume', out]);
    let complete = false;
    if (resumed.code === 2 && /already reaches --steps 3/.test(resumed.err)) {
      // killed after the last checkpoint: the run is complete (the resume turns the pending
      // summary into summary.json), tidies the folder and says so
      assert.match(resumed.err, /the run is complete/, `kill point ${at}`);
      complete = true;
      completed++;
    } else if (resumed.code === 2) {
      // killed before the first checkpoint was complete: the error says so and gives the command
      const m =
        /holds no complete checkpoint yet .*start it again with: layerwise (.*)$/m.exec(
          resumed.err,
        );
      assert.ok(m, `kill point ${at}: ${resumed.err}`);
      resumed = run(m[1]!.split(' '));
      restarted++;
    }
    if (!complete)
      assert.equal(resumed.code, 0, `kill point ${at}: ${resumed.err}`);
    losses.push({ at, loss: finalLoss(out) });
    assertClean(out, `kill point ${at}`);
    if (last) break;
  }
  // three saves of (at least) a folder, three files, a rename and a pointer switch each
  assert.ok(losses.length >= 21, `${losses.length} kill points`);
  assert.ok(
    completed >= 1,
    'some kill points fall after the last checkpoint is in place',
  );
  assert.ok(
    restarted >= 1,
    'some kill points fall before the first complete checkpoint',
  );
  for (const { at, loss } of losses)
    assert.equal(loss, reference, `kill point ${at}: final loss`);
});

test('a SIGTERM during a save removes its temporary files at once; the previous checkpoint stays the latest and resumes', () => {
  const ref = join(tmp, 'term-ref');
  assert.equal(run([...FLAGS, '--out', ref]).code, 0);
  // the 10th change is inside the second save (the first has 8: 2 folders, 3 files, a rename, the pointer's 2)
  const out = join(tmp, 'term');
  const r = run([...FLAGS, '--out', out], {
    LAYERWISE_TEST_KILL_AFTER_FS_CHANGES: '10',
    LAYERWISE_TEST_KILL_SIGNAL: 'SIGTERM',
  });
  assert.equal(r.code, 143, r.err);
  assert.deepEqual(readdirSync(join(out, 'checkpoints')).sort(), [
    'latest.json',
    'step-1',
  ]);
  const resumed = run(['train', '--resume', out]);
  assert.equal(resumed.code, 0, resumed.err);
  assert.equal(finalLoss(out), finalLoss(ref));
  assertClean(out, 'after SIGTERM');
});

test("an earlier version's run folder (checkpoint/, or a crash between its two renames) still resumes", () => {
  const ref = join(tmp, 'old-ref');
  assert.equal(run([...FLAGS, '--out', ref]).code, 0);
  const part = join(tmp, 'old-part');
  assert.equal(
    run([
      ...FLAGS.slice(0, -4),
      '--steps',
      '1',
      '--save-every',
      '1',
      '--out',
      part,
    ]).code,
    0,
  );
  // rewrite as the old layout: checkpoint/ only ...
  const old = join(tmp, 'old-layout');
  cpSync(part, old, { recursive: true });
  renameSync(join(old, 'checkpoints', 'step-1'), join(old, 'checkpoint'));
  rmSync(join(old, 'checkpoints'), { recursive: true });
  // ... and killed between its renames: only checkpoint.old-* and checkpoint.tmp-* (partial)
  const crashed = join(tmp, 'old-crashed');
  cpSync(old, crashed, { recursive: true });
  renameSync(join(crashed, 'checkpoint'), join(crashed, 'checkpoint.old-1-2'));
  cpSync(
    join(crashed, 'checkpoint.old-1-2'),
    join(crashed, 'checkpoint.tmp-1-3'),
    { recursive: true },
  );
  rmSync(join(crashed, 'checkpoint.tmp-1-3', 'meta.json'));
  for (const dir of [old, crashed]) {
    const r = run(['train', '--resume', dir, '--steps', '3', '--out', dir]);
    assert.equal(r.code, 0, r.err);
    assert.match(r.out, /resuming at step 1/);
    assert.equal(finalLoss(dir), finalLoss(ref), dir);
    assertClean(dir, dir);
  }
});
