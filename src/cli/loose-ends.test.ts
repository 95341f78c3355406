/**
 * Loose ends of issue 34, end to end through the CLI:
 *
 * 1. A run killed while it writes its first `run.json` (its lock files and the temporary file
 *    of that write left behind) is recognised by `--resume` as a run that stopped before its
 *    first save, which prints the command that starts it again (or, when the temporary file
 *    is empty, says the command was not saved and what to run instead).
 * 4. Ctrl-C on a `--devices process,process` run (SIGINT to the terminal's whole process
 *    group) exits 130 with one line naming the resume command, releases the run folder's
 *    lock and leaves no device process behind; so does a run on threads.
 */

import assert from 'node:assert/strict';
import { execFileSync, spawn } from 'node:child_process';
import {
  existsSync,
  mkdtempSync,
  readdirSync,
  rmSync,
  writeFileSync,
} from 'node:fs';
import { tmpdir } from 'node:os';
import { join } from 'node:path';
import { test } from 'node:test';
import { CLI, runCli } from '../testing/cli.js';

const tmp = mkdtempSync(join(tmpdir(), 'layerwise-loose-'));
process.on('exit', () => rmSync(tmp, { recursive: true, force: true }));

/** A tiny character model on one device: a process is about a second. */
const QUICK = [
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
  '2',
  '--backend',
  'cpu',
];

/** Kills a fresh run of QUICK into `out` inside the write of its run.json (before the rename). */
function killWritingRunJson(out: string): string {
  const r = runCli([...QUICK, '--out', out], {
    LAYERWISE_TEST_KILL_WRITING: 'run.json',
  });
  assert.equal(r.signal, 'SIGKILL', r.err);
  const names = readdirSync(out).sort();
  const tmpFile = names.find((n) => n.startsWith('run.json.tmp-'));
  // what the kill left: the lock of the dead run and the unrenamed run.json, nothing else
  assert.deepEqual(
    names,
    ['.lock', '.lock-owner.json', tmpFile],
    'the folder a kill inside the run.json write leaves',
  );
  return join(out, tmpFile!);
}

test('--resume of a run killed while it wrote its first run.json prints the command that starts it again, which does', () => {
  const out = join(tmp, 'killed-in-run-json');
  killWritingRunJson(out);
  const resumed = runCli(['train', '--resume', out]);
  assert.equal(resumed.code, 2, resumed.err);
  const m =
    /holds no complete checkpoint yet \(the run stopped before its first save finished\); start it again with: layerwise (.*)$/m.exec(
      resumed.err,
    );
  assert.ok(m, resumed.err);
  assert.ok(m[1]!.endsWith(`--out ${out} --overwrite`), m[1]);
  const again = runCli(m[1]!.split(' '));
  assert.equal(again.code, 0, again.err);
  assert.ok(existsSync(join(out, 'summary.json')));
  assert.equal(existsSync(join(out, '.lock-owner.json')), false);
});

test('--resume of a run killed in the middle of writing run.json says its command was not saved and what to run; that command works', () => {
  const out = join(tmp, 'killed-mid-run-json');
  const tmpFile = killWritingRunJson(out);
  // a kill between the temporary file's creation and its contents leaves it empty (the real kill
  // above came after the write; the file is emptied by hand to stand for the earlier instant)
  writeFileSync(tmpFile, '');
  const resumed = runCli(['train', '--resume', out]);
  assert.equal(resumed.code, 2, resumed.err);
  assert.match(
    resumed.err,
    /holds no complete checkpoint yet \(the run stopped before its first save finished\); its command was not saved: run your original 'layerwise train' command again with the same --out/,
  );
  assert.doesNotMatch(resumed.err, /holds no layerwise checkpoint/);
  assert.equal(resumed.err.trim().split('\n').length, 1, resumed.err);
  // as the message says: the original command, the same --out
  const again = runCli([...QUICK, '--out', out]);
  assert.equal(again.code, 0, again.err);
  // with only the dead run's lock left (killed before the temporary file existed), the same
  const early = join(tmp, 'killed-before-run-json');
  killWritingRunJson(early);
  for (const n of readdirSync(early))
    if (n.startsWith('run.json.tmp-')) rmSync(join(early, n));
  const r = runCli(['train', '--resume', early]);
  assert.equal(r.code, 2, r.err);
  assert.match(r.err, /its command was not saved/);
});

/** The run folder's entries a stopped run must not leave: its lock and temporary files. */
function leftovers(out: string): string[] {
  const bad = (n: string) =>
    n === '.lock' || n === '.lock-owner.json' || n.includes('.tmp-');
  return [
    ...readdirSync(out).filter(bad),
    ...readdirSync(join(out, 'checkpoints')).filter(bad),
  ];
}

function alive(pid: number): boolean {
  try {
    process.kill(pid, 0);
    return true;
  } catch {
    return false;
  }
}

/**
 * Starts a gpipe K=2 run on `devices` in its own process group, as a shell starts a command
 * in the terminal, and sends SIGINT to the whole group (a Ctrl-C) once step 4's line is out
 * (step 2's checkpoint is saved by then). Returns the exit and the device processes it had.
 */
async function ctrlC(
  devices: string,
  out: string,
): Promise<{ code: number | null; err: string; devicePids: number[] }> {
  const child = spawn(
    process.execPath,
    [
      CLI,
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
      '16',
      '--batch-size',
      '8',
      '--eval-batches',
      '1',
      '--strategy',
      'gpipe',
      '--stages',
      '2',
      '--micro-batches',
      '2',
      '--steps',
      '5000',
      '--eval-every',
      '2',
      '--save-every',
      '2',
      '--backend',
      'cpu',
      '--devices',
      devices,
      '--out',
      out,
    ],
    { detached: true, stdio: ['ignore', 'pipe', 'pipe'] },
  );
  let stdout = '';
  let err = '';
  child.stderr.on('data', (d) => (err += d));
  const exited = new Promise<number | null>((r) =>
    child.on('exit', (c) => r(c)),
  );
  let devicePids: number[] = [];
  await new Promise<void>((resolve) => {
    child.stdout.on('data', (d) => {
      stdout += d;
      if (child.exitCode !== null || !/^step 4\//m.test(stdout)) return;
      try {
        devicePids = execFileSync(
          'pgrep',
          ['-P', String(child.pid), '-f', 'device-process.js'],
          { encoding: 'utf8' },
        )
          .split('\n')
          .filter(Boolean)
          .map(Number);
      } catch {
        // none: thread devices
      }
      process.kill(-child.pid!, 'SIGINT');
      resolve();
    });
    child.on('exit', () => resolve());
  });
  const code = await exited;
  return { code, err, devicePids };
}

for (const devices of ['process,process', 'thread,thread']) {
  test(`Ctrl-C on a --devices ${devices} run exits 130 naming the resume command, with its lock released`, async () => {
    const out = join(tmp, `ctrl-c-${devices.replace(',', '-')}`);
    const r = await ctrlC(devices, out);
    assert.equal(r.code, 130, r.err);
    assert.match(
      r.err,
      new RegExp(
        `^layerwise: stopped by Ctrl-C \\(SIGINT\\); continue the run with 'layerwise train --resume ${out}'$`,
        'm',
      ),
    );
    assert.equal(r.err.trim().split('\n').length, 1, r.err);
    assert.deepEqual(leftovers(out), [], 'no lock or temporary file left');
    if (devices.startsWith('process')) {
      assert.equal(r.devicePids.length, 2, 'two device processes ran');
      for (let i = 0; i < 100 && r.devicePids.some(alive); i++)
        await new Promise((s) => setTimeout(s, 20));
      assert.deepEqual(r.devicePids.filter(alive), [], 'no device left');
    }
    // and the run continues from its checkpoint as the line says
    const resumed = runCli(['train', '--resume', out, '--steps', '6']);
    assert.equal(resumed.code, 0, resumed.err);
  });
}
