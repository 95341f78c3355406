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

const bench = fileURLToPath(new URL('./main.js', import.meta.url));

test('a bench given a bad flag value exits 2 with one line naming it, no stack trace', () => {
  for (const [args, names] of [
    [['cores', '--kinds', 'nope'], "--kinds: unknown 'nope'"],
    [['gpu', '--configs', 'bogus'], "--configs: no configuration 'bogus'"],
    [['matmul-tiles', '--tilings', 't64,t999'], "--tilings: unknown 't999'"],
    [['matmul-tiles', '--shapes', '8x8'], "--shapes: '8x8' is not MxKxN"],
    [
      ['param-server', '--params', '100'],
      '--params must be a positive multiple of 8192',
    ],
  ] as const) {
    const r = spawnSync(process.execPath, [bench, ...args], {
      encoding: 'utf8',
    });
    assert.equal(r.status, 2, `${args.join(' ')}: ${r.stderr}`);
    assert.match(r.stderr, new RegExp(`^bench: ${names}`));
    assert.doesNotMatch(r.stderr, /\n\s+at /, 'no stack trace');
  }
});

test('a bench whose --out is a file (or under one) stops before running, naming the file', () => {
  const dir = mkdtempSync(join(tmpdir(), 'bench-out-'));
  const file = join(dir, 'results');
  writeFileSync(file, 'not a folder');
  try {
    for (const out of [file, join(file, 'sub')]) {
      const r = spawnSync(
        process.execPath,
        [bench, 'kernels', '--steps', '1', '--out', out],
        { encoding: 'utf8' },
      );
      assert.notEqual(r.status, 0, r.stderr);
      assert.match(r.stderr, /is a file, not a folder/);
      assert.ok(r.stderr.includes(file), r.stderr);
      assert.doesNotMatch(r.stderr, /\n\s+at /, 'no stack trace');
      assert.equal(readFileSync(file, 'utf8'), 'not a folder');
    }
  } finally {
    rmSync(dir, { recursive: true, force: true });
  }
});

test('--warmup takes a whole number, 0 or more: anything else stops the bench naming the value', () => {
  for (const [command, value] of [
    ['kernels', '-1'],
    ['kernels', 'some'],
    ['cores', '1.5'],
  ]) {
    const r = spawnSync(
      process.execPath,
      [bench, command!, `--warmup=${value}`, '--steps', '1'],
      { encoding: 'utf8' },
    );
    assert.notEqual(r.status, 0, `${command} --warmup ${value}: ${r.stderr}`);
    assert.match(r.stderr, /--warmup <n>/);
    assert.ok(r.stderr.includes(`got '${value}'`), r.stderr);
    assert.doesNotMatch(r.stderr, /\n\s+at /, 'no stack trace');
  }
});

test("a bench's numeric flag given what it cannot run exits 2 naming the flag and the value, before anything is written", () => {
  const dir = mkdtempSync(join(tmpdir(), 'bench-flags-'));
  const out = join(dir, 'results');
  try {
    for (const [command, flag, value] of [
      ['kernels', '--steps', 'abc'], // was NaN steps, a results file of NaN and exit 0
      ['kernels', '--steps', '1e3'],
      ['kernels', '--batch-size', '0'],
      ['kernels', '--threads', '1,x'],
      ['gpipe', '--micro-batches', '1,x'], // was 'micro-batch size ... got NaN'
      ['l2l-pipeline', '--blocks', '4,x'], // was a stack trace
      ['l2l', '--blocks', 'x'], // was '--layers must be an integer >= 1, got NaN'
      ['webgpu', '--sizes', '256,0'], // was a stack trace
      ['cores', '--budget-s', '-5'],
      ['gpu', '--warmup', '1.5'],
      ['layer-drop', '--p', '1'],
      ['l2l-max', '--clip-norm', '-1'],
      ['webgpu-host', '--calls', 'many'],
      ['param-server', '--steps', '2.5'],
    ] as const) {
      const r = spawnSync(
        process.execPath,
        [bench, command, flag, value, '--out', out],
        { encoding: 'utf8' },
      );
      const what = `${command} ${flag} ${value}`;
      assert.equal(r.status, 2, `${what}: ${r.stderr}`);
      assert.ok(
        r.stderr.includes(`'${flag} <`),
        `${what} names the flag: ${r.stderr}`,
      );
      assert.ok(
        r.stderr.includes(`got '${value.split(',').pop()}'`),
        `${what} names the value: ${r.stderr}`,
      );
      assert.doesNotMatch(r.stderr, /\n\s+at /, 'no stack trace');
      assert.equal(existsSync(out), false, `${what} wrote nothing`);
    }
  } finally {
    rmSync(dir, { recursive: true, force: true });
  }
});
