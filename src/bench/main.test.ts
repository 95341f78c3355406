import assert from 'node:assert/strict';
import { spawnSync } from 'node:child_process';
import { mkdtempSync, readFileSync, rmSync, writeFileSync } from 'node:fs';
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
      ['webgpu-host', '--calls', 'many'],
      '--calls: must be an integer >= 1, got NaN',
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
