import assert from 'node:assert/strict';
import { test } from 'node:test';
import { consecutiveRuns } from './runs.js';

test('consecutiveRuns packs consecutive items up to the limit, an oversized item alone', () => {
  assert.deepEqual(consecutiveRuns([3, 4, 2, 5, 1], 7), [
    [0, 2],
    [2, 4],
    [4, 5],
  ]);
  assert.deepEqual(consecutiveRuns([2, 9, 1, 1], 7), [
    [0, 1],
    [1, 2],
    [2, 4],
  ]);
  assert.deepEqual(consecutiveRuns([9], 7), [[0, 1]]);
  assert.deepEqual(consecutiveRuns([], 7), []);
});
