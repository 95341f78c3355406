/**
 * What a run leaves in its --out folder when it fails or is killed (issue 34, loose ends 2 and
 * 3): a fresh run that fails on the user's input before its first checkpoint leaves nothing
 * (so its corrected command runs on the same --out), whatever the strategy; and summary.json is
 * written last, after the final checkpoint, so a run killed during that save never leaves a
 * summary beside an older checkpoint, and its resume completes the run.
 */
import assert from 'node:assert/strict';
import {
  existsSync,
  mkdirSync,
  mkdtempSync,
  readdirSync,
  readFileSync,
  rmSync,
} from 'node:fs';
import { tmpdir } from 'node:os';
import { join } from 'node:path';
import { after, test } from 'node:test';
import { runCli } from '../testing/cli.js';

const tmp = mkdtempSync(join(tmpdir(), 'layerwise-outputs-'));
after(() => rmSync(tmp, { recursive: true, force: true }));

/** The command: charlm-tiny on Moby-Dick at an absurd learning rate (step 2 overflows on native, step 3 on wasm). */
const DIVERGING = [
  'train',
  '--preset',
  'charlm-tiny',
  '--data',
  'moby-dick',
  '--steps',
  '30',
  '--lr',
  '1e6',
];

test('a fresh run whose loss turns non-finite before its first checkpoint leaves nothing (single as gpipe); the corrected command runs on the same --out', () => {
  for (const [strategy, more, folder] of [
    ['single', [], 'new'],
    ['gpipe', ['--stages', '2', '--micro-batches', '2'], 'new'],
    ['single', [], 'existing'],
  ] as const) {
    const what = `${strategy}, ${folder} folder`;
    const out = join(tmp, `fault-${strategy}-${folder}`);
    if (folder === 'existing') mkdirSync(out);
    const args = [...DIVERGING, '--strategy', strategy, ...more, '--out', out];
    const r = runCli(args);
    assert.equal(r.code, 2, `${what}: ${r.err}`);
    assert.match(
      r.err,
      /layerwise: error: non-finite value at step \d+: .*no checkpoint was saved yet; lower --lr \(now 1000000\)/,
      what,
    );
    if (folder === 'new') assert.equal(existsSync(out), false, what);
    else assert.deepEqual(readdirSync(out), [], what);
    const corrected = args.map((a, i) =>
      args[i - 1] === '--lr' ? '0.003' : args[i - 1] === '--steps' ? '2' : a,
    );
    const fixed = runCli([...corrected, '--eval-batches', '1']);
    assert.equal(fixed.code, 0, `${what}, corrected: ${fixed.err}`);
  }
});

/** A tiny character model on one device: 3 steps, checkpoints after steps 2 and 3. */
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
  '--steps',
  '3',
  '--save-every',
  '2',
];

/** File-system changes of a run's first save (see checkpoint-io.ts's test-only fault injection). */
const FIRST_SAVE_CHANGES = 8;

function readJson(path: string): Record<string, unknown> | undefined {
  try {
    return JSON.parse(readFileSync(path, 'utf8')) as Record<string, unknown>;
  } catch {
    return undefined;
  }
}

test('summary.json is written after the final checkpoint: a run killed anywhere in its final save never leaves a summary beside an older checkpoint, and its resume writes the summary', () => {
  const ref = join(tmp, 'reference');
  const r = runCli([...FLAGS, '--out', ref]);
  assert.equal(r.code, 0, r.err);
  const reference = readJson(join(ref, 'summary.json'))!;
  const resumedAt = new Map<'inside' | 'after', number>();
  // kill after each file-system change of the final save (step 3's) and just after it; the
  // first save (step 2's) makes 8 (2 folders, 3 files, a rename, the pointer's 2), as
  // crash.test.ts counts, so kill point 9 finds it complete
  for (let at = FIRST_SAVE_CHANGES + 1; ; at++) {
    const out = join(tmp, `kill-${at}`);
    const k = runCli([...FLAGS, '--out', out], {
      LAYERWISE_TEST_KILL_AFTER_FS_CHANGES: String(at),
    });
    if (k.signal !== 'SIGKILL') {
      assert.equal(k.code, 0, k.err); // past the last change: the run completed
      break;
    }
    const pointer = readJson(join(out, 'checkpoints', 'latest.json'));
    if (at === FIRST_SAVE_CHANGES + 1)
      assert.equal(pointer?.step, 2, 'the first save is complete by then');
    const summary = readJson(join(out, 'summary.json'));
    if (summary)
      assert.ok(
        pointer !== undefined &&
          (summary.steps as number) <= (pointer.step as number),
        `kill point ${at}: summary.json of ${summary.steps} steps beside the checkpoint ${JSON.stringify(pointer)}`,
      );
    // resume where the final save was cut: once before its pointer switch, once after it
    const finalSave = existsSync(join(out, 'checkpoints'))
      ? readdirSync(join(out, 'checkpoints')).some((n) =>
          n.startsWith('step-3'),
        )
      : false;
    const where =
      pointer?.step === 3 ? 'after' : finalSave ? 'inside' : undefined;
    if (where === undefined || resumedAt.has(where)) continue;
    resumedAt.set(where, at);
    const final = where === 'after';
    const resumed = runCli(['train', '--resume', out]);
    if (final) {
      // trained to the end: the resume completes the summary and says the run is complete
      assert.equal(resumed.code, 2, `kill point ${at}: ${resumed.err}`);
      assert.match(
        resumed.err,
        /already reaches --steps 3 \(the run is complete/,
      );
    } else assert.equal(resumed.code, 0, `kill point ${at}: ${resumed.err}`);
    const done = readJson(join(out, 'summary.json'));
    assert.ok(done, `kill point ${at}: no summary.json after the resume`);
    assert.equal(done.steps, 3);
    assert.equal(done.final_loss, reference.final_loss, `kill point ${at}`);
    assert.deepEqual(
      readdirSync(out).sort(),
      ['checkpoints', 'metrics.jsonl', 'run.json', 'summary.json'],
      `kill point ${at}`,
    );
  }
  assert.deepEqual(
    [...resumedAt.keys()].sort(),
    ['after', 'inside'],
    'kill points inside and after the final save',
  );
});
