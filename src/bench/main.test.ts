import assert from 'node:assert/strict';
import { spawnSync } from 'node:child_process';
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
