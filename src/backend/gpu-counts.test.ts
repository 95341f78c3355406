import assert from 'node:assert/strict';
import { test } from 'node:test';
import { gpuCountsSince, sumGpuCounts } from './gpu-counts.js';

const at = (n: number, host?: [number, number]) => ({
  dispatches: 100 * n,
  submits: 10 * n,
  readbacks: 2 * n,
  copies: 5 * n,
  ...(host ? { hostMs: host[0], pollMs: host[1] } : {}),
});

test("a step's GPU counts are the difference of two readings, with host ms only where both readings have them", () => {
  assert.deepEqual(gpuCountsSince(at(1, [4, 1]), at(3, [10, 4])), {
    dispatches: 200,
    submits: 20,
    readbacks: 4,
    copies: 10,
    hostMs: 6,
    pollMs: 3,
  });
  assert.deepEqual(gpuCountsSince(at(1), at(3, [10, 4])), {
    dispatches: 200,
    submits: 20,
    readbacks: 4,
    copies: 10,
  });
});

test('GPU counts sum over devices or steps, with host ms only where every one has it; none sum to zeros', () => {
  assert.deepEqual(sumGpuCounts([at(1, [4, 1]), at(2, [6, 2])]), {
    dispatches: 300,
    submits: 30,
    readbacks: 6,
    copies: 15,
    hostMs: 10,
    pollMs: 3,
  });
  const partial = sumGpuCounts([at(1, [4, 1]), at(2)]);
  assert.equal(partial.dispatches, 300);
  assert.equal(
    partial.hostMs,
    undefined,
    'a total that left one out would mislead',
  );
  assert.deepEqual(sumGpuCounts([]), {
    dispatches: 0,
    submits: 0,
    readbacks: 0,
    copies: 0,
    hostMs: 0,
    pollMs: 0,
  });
});
