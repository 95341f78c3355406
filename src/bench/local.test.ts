import assert from 'node:assert/strict';
import { test } from 'node:test';
import { median } from './local.js';

test('median: the middle of an odd list, the mean of the middle two of an even one, unsorted input', () => {
  assert.equal(median([5, 1, 3]), 3);
  assert.equal(median([4, 1, 3, 2]), 2.5);
  assert.equal(median([7]), 7);
});

test('median: an empty list throws rather than returning NaN', () => {
  assert.throws(() => median([]), /empty/);
});
