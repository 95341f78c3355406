import assert from 'node:assert/strict';
import { test } from 'node:test';
import { LayerwiseError } from '../util/errors.js';
import { type HostArray, splitMicroBatches } from './microbatch.js';

function host(shape: number[], int: boolean): HostArray {
  const n = shape.reduce((a, b) => a * b, 1);
  const data = int ? new Int32Array(n) : new Float32Array(n);
  for (let i = 0; i < n; i++) data[i] = int ? i * 7 - 3 : i * 0.5 - 1.25;
  return { data, shape };
}

test('split shapes, dtypes and contents', () => {
  for (const [shape, int] of [
    [[8, 16], true],
    [[6, 2, 3, 1], false],
    [[4], true],
    [[12, 5], false],
  ] as Array<[number[], boolean]>) {
    const t = host(shape, int);
    const n = shape[0];
    const per = t.data.length / n;
    for (let m = 1; m <= n; m++) {
      if (n % m !== 0) continue;
      const parts = splitMicroBatches(t, m);
      assert.equal(parts.length, m);
      parts.forEach((p, i) => {
        const what = `shape [${shape}] m=${m} part ${i}`;
        assert.deepEqual(p.shape, [n / m, ...shape.slice(1)], what);
        assert.equal(p.dtype, int ? 'int32' : 'float32', what);
        assert.equal(p.data.constructor, t.data.constructor, what);
        assert.equal(p.data.length, (n / m) * per, what);
        // Row r of part i is row i * (n / m) + r of the input.
        for (let r = 0; r < n / m; r++) {
          for (let c = 0; c < per; c++)
            assert.equal(
              p.data[r * per + c],
              t.data[(i * (n / m) + r) * per + c],
              `${what} row ${r}`,
            );
        }
      });
    }
  }
});

test('concatenating the parts gives back the input', () => {
  for (const int of [true, false]) {
    const t = host([12, 3, 2], int);
    for (const m of [1, 2, 3, 4, 6, 12]) {
      const parts = splitMicroBatches(t, m);
      const joined = int
        ? new Int32Array(t.data.length)
        : new Float32Array(t.data.length);
      let off = 0;
      for (const p of parts) {
        joined.set(p.data, off);
        off += p.data.length;
      }
      assert.equal(off, t.data.length);
      assert.deepEqual(joined, t.data, `m=${m}`);
    }
  }
});

test('parts are copies with their own buffers (safe to transfer)', () => {
  const t = host([4, 2], false);
  const before = Float32Array.from(t.data);
  const parts = splitMicroBatches(t, 2);
  assert.notEqual(parts[0].data.buffer, t.data.buffer);
  assert.notEqual(parts[0].data.buffer, parts[1].data.buffer);
  assert.equal(parts[0].data.byteOffset, 0);
  assert.equal(parts[0].data.byteLength, parts[0].data.buffer.byteLength);
  parts[0].data.fill(99);
  assert.deepEqual(t.data, before);
});

test('a micro-batch count that does not divide the batch throws LayerwiseError naming the batch size', () => {
  const t = host([10, 4], true);
  for (const m of [3, 4, 7, 11, 20]) {
    assert.throws(
      () => splitMicroBatches(t, m),
      (e: unknown) =>
        e instanceof LayerwiseError &&
        e.message.includes('batch size 10') &&
        e.message.includes(`--micro-batches ${m}`),
      `m=${m}`,
    );
  }
  for (const m of [0, -2, 2.5, NaN]) {
    assert.throws(
      () => splitMicroBatches(t, m),
      (e: unknown) =>
        e instanceof LayerwiseError && e.message.includes('batch size 10'),
      `m=${m}`,
    );
  }
});
