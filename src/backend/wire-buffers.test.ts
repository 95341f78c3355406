/**
 * The arrays that carry activations and gradients between stages are recycled: a received
 * array, once its tensor is gone, carries the next send of its length; never one a tensor still
 * holds, a reader has, a view into a larger buffer, or a captured step's recording reads.
 */

import assert from 'node:assert/strict';
import { test } from 'node:test';
import { MessageChannel, receiveMessageOnPort } from 'node:worker_threads';
import { copyOfValues, fromReceivedWire } from '../runtime/serialize.js';
import { initBackend } from './index.js';
import type { NativeBackend } from './native.js';
import { nativeAddon, nativeUnavailable } from './native.js';
import { tf } from './tfjs.js';
import { WireBuffers } from './wire-buffers.js';

test('a received array is handed out for a send once no tensor holds it, not before', () => {
  const wire = new WireBuffers(1 << 20);
  const sent = wire.takeF32(100);
  assert.deepEqual(wire.stats, { reused: 0, allocated: 1 });
  const received = new Float32Array(100); // as if it had come from another thread
  wire.adopt(received);
  wire.hold(received); // the received tensor
  wire.hold(received); // a second tensor on the same array (a kernel returned its input)
  wire.release(received);
  assert.notEqual(wire.takeF32(100), received, 'still held by one tensor');
  wire.release(received);
  assert.equal(wire.freeBytes, 400);
  assert.equal(wire.takeF32(100), received);
  assert.deepEqual(wire.stats, { reused: 1, allocated: 2 });
  assert.notEqual(sent, received);
});

test('an array a reader has, or a view into a larger buffer, is never recycled; the free arrays are bounded', () => {
  const wire = new WireBuffers(1000);
  for (const how of ['read', 'view'] as const) {
    const a = new Float32Array(50);
    wire.adopt(a);
    wire.hold(a);
    if (how === 'read') wire.disown(a);
    else wire.hold(a.subarray(0, 10)); // a tensor on a view into it (the cpu backend's Slice)
    wire.release(a);
    assert.equal(wire.freeBytes, 0, how);
  }
  const part = new Float32Array(new ArrayBuffer(800), 0, 100); // spans half its memory
  wire.adopt(part);
  wire.hold(part);
  wire.release(part);
  wire.recycle(part);
  assert.equal(wire.freeBytes, 0, 'a view is not taken');
  wire.recycle(new Uint16Array(300)); // 600 bytes
  wire.recycle(new Float32Array(200)); // 800 bytes: within its own kind's bound
  wire.recycle(new Float32Array(200)); // past it: dropped
  assert.equal(wire.freeBytes, 1400);
  assert.equal(wire.takeU16(300).length, 300);
  assert.deepEqual(wire.stats, { reused: 1, allocated: 0 });
});

test('native: a received activation, once disposed, carries the next send; values exact; a read one is never reused', {
  skip: nativeAddon()
    ? false
    : `native backend unavailable: ${nativeUnavailable()}`,
}, async () => {
  await initBackend('native');
  const wire = (tf.backend() as NativeBackend).wire;
  const { port1, port2 } = new MessageChannel();
  try {
    /** Sends t's values from port1 (transferred, as runtime/stage-host.ts does) and takes them at port2. */
    const roundTrip = async (t: tf.Tensor): Promise<Float32Array> => {
      const data = (await copyOfValues(t)) as Float32Array;
      port1.postMessage(data, [data.buffer as ArrayBuffer]);
      assert.equal(data.byteLength, 0, 'transferred, not copied');
      return receiveMessageOnPort(port2)!.message as Float32Array;
    };
    const n = 4096;
    const x = tf.tensor(
      Float32Array.from({ length: n }, (_, i) => Math.sin(i) * 1e3),
      [4, 1024],
    );
    const first = fromReceivedWire({
      shape: [4, 1024],
      dtype: 'float32',
      data: await roundTrip(x),
    });
    assert.deepEqual(first.dataSync(), x.dataSync());
    // that read gave the array to a caller: it must never carry a send
    first.dispose();
    const free0 = wire.freeBytes;
    const second = fromReceivedWire({
      shape: [4, 1024],
      dtype: 'float32',
      data: await roundTrip(x),
    });
    assert.equal(wire.freeBytes, free0, 'the array read was not recycled');
    const y = tf.mul(second, 2); // a kernel reads it
    second.dispose();
    assert.equal(wire.freeBytes, free0 + 4 * n, 'free once its tensor is gone');
    const reusedBefore = wire.stats.reused;
    const back = await roundTrip(y);
    assert.equal(wire.stats.reused, reusedBefore + 1, 'the send took it');
    assert.equal(wire.freeBytes, free0);
    const expected = (x.dataSync() as Float32Array).map((v) => v * 2);
    assert.deepEqual(back, expected);
    tf.dispose([x, y]);
  } finally {
    port1.close();
    port2.close();
  }
});
