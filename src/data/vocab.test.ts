import assert from 'node:assert/strict';
import { test } from 'node:test';
import { LayerwiseError } from '../util/errors.js';
import { Vocab } from './vocab.js';

test('fromText gives sorted unique code points and encode/decode round-trips', () => {
  const text = 'hello, wörld! 🐳 whale\n';
  const v = Vocab.fromText(text);
  const cps = v.chars.map((c) => c.codePointAt(0)!);
  assert.deepEqual(
    cps,
    [...cps].sort((a, b) => a - b),
  );
  assert.equal(new Set(v.chars).size, v.size);
  assert.ok(v.chars.includes('🐳'), 'astral characters are one entry');
  const ids = v.encode(text);
  assert.ok(ids instanceof Int32Array);
  assert.equal(ids.length, Array.from(text).length);
  assert.ok(ids.every((i) => i >= 0 && i < v.size));
  assert.equal(v.decode(ids), text);
});

test('toJSON/fromJSON round-trips through JSON text', () => {
  const v = Vocab.fromText('Call me Ishmael. ηο—🐳');
  const w = Vocab.fromJSON(JSON.parse(JSON.stringify(v)));
  assert.ok(w.equals(v));
  assert.deepEqual(w.encode('Ishmael 🐳'), v.encode('Ishmael 🐳'));
});

test('fromJSON rejects malformed input with LayerwiseError', () => {
  const bad: unknown[] = [
    null,
    'abc',
    ['a', 'b'],
    {},
    { kind: 'word', chars: ['a'] },
    { kind: 'char', chars: 'ab' },
    { kind: 'char', chars: [] },
    { kind: 'char', chars: ['a', 1] },
    { kind: 'char', chars: ['ab'] },
    { kind: 'char', chars: [''] },
    { kind: 'char', chars: ['a', 'a'] },
    { kind: 'char', chars: ['b', 'a'] },
  ];
  for (const j of bad)
    assert.throws(() => Vocab.fromJSON(j), LayerwiseError, JSON.stringify(j));
});

test('unknown characters and bad ids', () => {
  const v = Vocab.fromText('abc');
  assert.throws(
    () => v.encode('abz'),
    (e: unknown) =>
      e instanceof LayerwiseError && /"z".*position 2/.test(e.message),
  );
  assert.deepEqual(Array.from(v.encode('azb', 'skip')), [0, 1]);
  assert.equal(v.idOf('z'), -1);
  assert.equal(v.covers('cab'), true);
  assert.equal(v.covers('cabz'), false);
  assert.throws(() => v.decode([0, 3]), LayerwiseError);
  assert.throws(() => v.decode([-1]), LayerwiseError);
  assert.throws(() => v.decode([0.5]), LayerwiseError);
  assert.throws(() => Vocab.fromText(''), LayerwiseError);
});
