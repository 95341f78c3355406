/**
 * PendingReads: a step's device values read at once, the float32 ones in one readback.
 */
import assert from 'node:assert/strict';
import { before, test } from 'node:test';
import { initBackend } from '../backend/index.js';
import { tf } from '../backend/tfjs.js';
import { PendingReads } from './pending-reads.js';

before(async () => {
  await initBackend('cpu');
});

for (const join of [true, false])
  test(`flush hands every pending tensor its own values in the order asked, ${join ? 'float32 ones read together (one buffer)' : 'each read on its own (a host backend, the default on cpu)'} and others alone, and frees them all`, async () => {
    const before = tf.memory().numTensors;
    const reads = join ? new PendingReads(true) : new PendingReads();
    const got: Array<[string, number[], string]> = [];
    const buffers = new Set<ArrayBufferLike>();
    const keep =
      (name: string) => (v: Float32Array | Int32Array | Uint8Array) => {
        got.push([name, Array.from(v), v.constructor.name]);
        if (v instanceof Float32Array) buffers.add(v.buffer);
      };
    reads.scalar(tf.scalar(2.5), (v) => got.push(['loss', [v], 'number']));
    reads.read(tf.tensor1d([7, 8, 9], 'int32'), keep('labels'));
    reads.read(tf.tensor2d([1, -2, 3, 0.25], [2, 2]), keep('probe'));
    reads.read(tf.tensor1d([true, false], 'bool'), keep('mask'));
    reads.read(tf.tensor1d([Number.NaN, Infinity, -0]), keep('sums'));
    await reads.flush();
    assert.deepEqual(got, [
      ['loss', [2.5], 'number'],
      ['labels', [7, 8, 9], 'Int32Array'],
      ['probe', [1, -2, 3, 0.25], 'Float32Array'],
      ['mask', [1, 0], 'Uint8Array'],
      ['sums', [Number.NaN, Infinity, -0], 'Float32Array'],
    ]);
    assert.equal(
      buffers.size,
      join ? 1 : 2,
      'the float32 reads share one buffer exactly when joined',
    );
    assert.equal(tf.memory().numTensors, before, 'every read tensor freed');
    // nothing pending: nothing read; one float32 tensor: read as it is
    await reads.flush();
    reads.read(tf.tensor1d([4, 5]), keep('one'));
    await reads.flush();
    assert.deepEqual(got.at(-1), ['one', [4, 5], 'Float32Array']);
    assert.equal(tf.memory().numTensors, before);
  });
