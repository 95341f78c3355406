import assert from 'node:assert/strict';
import { test } from 'node:test';
import { PRECISIONS } from './names.js';
import {
  isNarrow,
  knownPolicy,
  narrowingTo,
  onlyNarrowPolicy,
  paramCopyFormat,
  policyOf,
  wideningFrom,
} from './precision.js';

test('wideningFrom inverts narrowingTo on values the format holds, and both refuse a format without a host conversion', () => {
  const f = new Float32Array([
    0,
    -0,
    1,
    -2.5,
    3.140625,
    65280,
    -(2 ** -130),
    Infinity,
  ]);
  const d = new Uint16Array(f.length);
  narrowingTo('bfloat16')(f, d);
  const back = new Float32Array(f.length);
  wideningFrom('bfloat16')(d, back);
  assert.deepEqual(back, f); // each value above is a bfloat16 value: nothing lost
  for (const format of ['float32', 'float16'] as const) {
    assert.throws(() => narrowingTo(format), /no host rounding to/);
    assert.throws(() => wideningFrom(format), /no host widening from/);
  }
});

test('knownPolicy names each precision and nothing else; paramCopyFormat refuses a policy storing float32 parameters', () => {
  for (const p of PRECISIONS) assert.equal(knownPolicy(p), policyOf(p));
  for (const other of ['bf32', '', undefined, 16])
    assert.equal(knownPolicy(other), undefined);
  for (const p of PRECISIONS) {
    const policy = policyOf(p);
    if (isNarrow(policy, 'params'))
      assert.equal(paramCopyFormat(policy), policy.storage.params);
    else
      assert.throws(
        () => paramCopyFormat(policy),
        /keeps no 2-byte parameter copies/,
      );
  }
});

test('onlyNarrowPolicy is the one precision storing some role in a 2-byte format', () => {
  const narrow = PRECISIONS.filter((p) =>
    (['params', 'activations', 'stash', 'wire'] as const).some((r) =>
      isNarrow(policyOf(p), r),
    ),
  );
  assert.equal(narrow.length, 1);
  assert.equal(onlyNarrowPolicy(), policyOf(narrow[0]!));
});
