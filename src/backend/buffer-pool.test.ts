import assert from 'node:assert/strict';
import { test } from 'node:test';
import { BufferPool } from './buffer-pool.js';

test('a buffer comes back from the pool only after the last tensor holding it lets go', () => {
  const pool = new BufferPool(1 << 30, 0);
  const a = pool.take(1000);
  pool.hold(a);
  pool.hold(a); // two tensors share the array (a kernel returned its input's values)
  pool.release(a);
  assert.notEqual(pool.take(1000), a, 'still held by one tensor');
  pool.release(a);
  assert.equal(pool.pooledBytes, 4000);
  assert.equal(pool.take(1000), a, 'reused once free');
  assert.equal(pool.stats.reused, 1);
  assert.equal(pool.pooledBytes, 0);
});

test('a view into a pooled buffer, or a buffer handed to a caller, is never reused', () => {
  const pool = new BufferPool(1 << 30, 0);
  const a = pool.take(100);
  pool.hold(a);
  pool.hold(a.subarray(10, 20)); // the cpu backend's Slice stores a view as another tensor's values
  pool.release(a);
  assert.equal(pool.pooledBytes, 0);
  assert.notEqual(pool.take(100), a);
  const b = pool.take(100);
  pool.hold(b);
  pool.disown(b); // dataSync gave it to a caller
  pool.release(b);
  assert.equal(pool.pooledBytes, 0);
  const user = new Float32Array(100); // arrays the pool did not hand out are never taken
  pool.hold(user);
  pool.release(user);
  assert.equal(pool.pooledBytes, 0);
});

test('the free list keeps at most its capacity; small arrays are not pooled; takeZeroed zeroes a reused buffer', () => {
  const pool = new BufferPool(4000, 400);
  const [a, b] = [pool.take(1000), pool.take(1000)];
  for (const x of [a, b]) {
    pool.hold(x);
    x.fill(7);
  }
  pool.release(a);
  pool.release(b); // over the 4000-byte capacity: dropped
  assert.equal(pool.pooledBytes, 4000);
  const z = pool.takeZeroed(1000);
  assert.equal(z, a);
  assert.ok(z.every((v) => v === 0));
  const small = pool.take(10);
  pool.hold(small);
  pool.release(small);
  assert.notEqual(pool.take(10), small);
  pool.clear();
  assert.equal(pool.pooledBytes, 0);
});

test('free buffers are handed out first-made first, whatever order they were freed in: a step that asks as the step before gets its arrays; claimed ones never come back', () => {
  const pool = new BufferPool(1 << 20, 0);
  const made = [pool.take(100), pool.take(100), pool.take(100), pool.take(8)];
  const [a, b, c, small] = made;
  for (const x of made) pool.hold(x);
  for (const x of [c, small, a, b]) pool.release(x);
  assert.deepEqual(
    [pool.take(100), pool.take(100), pool.take(100)],
    [a, b, c],
    'a, b, c in the order they were made',
  );
  assert.equal(pool.take(8), small, 'small arrays pooled too (minBytes 0)');
  for (const x of [b, a]) {
    pool.hold(x);
    pool.release(x);
  }
  pool.claim(new Set([a!.buffer]));
  assert.equal(pool.take(100), b, 'a claimed off the free list');
  pool.hold(a);
  pool.release(a);
  assert.equal(pool.pooledBytes, 0, 'nor put back when released');
});
