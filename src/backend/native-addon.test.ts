/**
 * The addon call recorder (native-addon.ts recordAddonCalls / replayAddonCalls), which the
 * kernels bench's --replay uses: what it records, that a replay recomputes the same outputs,
 * and that the addon is left as it was.
 */
import assert from 'node:assert/strict';
import { test } from 'node:test';
import {
  nativeAddon,
  nativeUnavailable,
  recordAddonCalls,
  replayAddonCalls,
} from './native-addon.js';

const skip = nativeAddon()
  ? false
  : `native backend unavailable: ${nativeUnavailable()}`;

test('recordAddonCalls records the computing calls in order (not the team settings), a replay recomputes their outputs, and the addon is restored, also after a throw', {
  skip,
}, () => {
  const lib = nativeAddon()!;
  const binary = lib.binary;
  const n = 1000;
  const a = Float32Array.from({ length: n }, (_, i) => i / 100);
  const b = Float32Array.from({ length: n }, (_, i) => 1 - i / 500);
  const sum = new Float32Array(n);
  const out = new Float32Array(n);
  const threads = lib.threads();
  const calls = recordAddonCalls(() => {
    lib.setThreads(threads); // the team's own: not recorded
    lib.binary(0, a, [n], b, [n], sum, [n]); // Add
    lib.gelu(sum, out);
  });
  assert.deepEqual(
    calls.map((c) => c.name),
    ['binary', 'gelu'],
  );
  assert.equal(calls[1]!.args[1], out, 'arrays by reference');
  assert.ok(
    calls.every((c) => Number.isFinite(c.ms) && c.ms >= 0),
    'each call with its wall ms',
  );
  assert.equal(lib.binary, binary, 'the addon restored');
  const want = Float32Array.from(out);
  assert.ok(want.some((v) => v !== 0));
  out.fill(0);
  sum.fill(0);
  replayAddonCalls(calls);
  assert.deepEqual(out, want);
  assert.throws(
    () =>
      recordAddonCalls(() => {
        throw new Error('boom');
      }),
    /boom/,
  );
  assert.equal(lib.binary, binary, 'restored after a throw');
});
