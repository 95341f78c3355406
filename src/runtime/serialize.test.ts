import assert from 'node:assert/strict';
import { before, test } from 'node:test';
import { MessageChannel } from 'node:worker_threads';
import { tf } from '../backend/tfjs.js';
import type { HostTensor } from '../data/microbatch.js';
import { Channel, type Message } from './channel.js';
import { copyWire, fromWire, toWire, transferables } from './serialize.js';

before(async () => {
  assert.ok(await tf.setBackend('cpu'));
});

/** The bytes of a typed array, to compare values bit for bit (NaN, -0). */
const bytes = (a: Float32Array | Int32Array) =>
  Array.from(new Uint8Array(a.buffer, a.byteOffset, a.byteLength));

/** Runs `body` with two Channels over a MessageChannel, within 5 s, and closes the ports after. */
async function withChannels(
  body: (a: Channel, b: Channel) => Promise<void>,
): Promise<void> {
  const { port1, port2 } = new MessageChannel();
  let timer: NodeJS.Timeout | undefined;
  try {
    const timeout = new Promise<never>((_, reject) => {
      timer = setTimeout(
        () => reject(new Error('timed out (a receive never resolved)')),
        5000,
      );
    });
    await Promise.race([body(new Channel(port1), new Channel(port2)), timeout]);
  } finally {
    clearTimeout(timer);
    port1.close();
    port2.close();
  }
}

const FLOATS = [
  0,
  -0,
  1,
  -1.5,
  0.1,
  1e-40,
  3.4028234663852886e38,
  -Infinity,
  Infinity,
  NaN,
  Math.PI,
  -7.25,
];
const INTS = [
  0, 1, -1, 2147483647, -2147483648, 123456789, -42, 7, 8, 9, 10, 11,
];

test('toWire copies a float32 tensor exactly and disposes it', async () => {
  const n0 = tf.memory().numTensors;
  const src = new Float32Array(FLOATS);
  const t = tf.tensor(src, [3, 2, 2], 'float32');
  const w = await toWire(t);
  assert.equal(t.isDisposed, true);
  assert.equal(tf.memory().numTensors, n0);
  assert.deepEqual(w.shape, [3, 2, 2]);
  assert.equal(w.dtype, 'float32');
  assert.ok(w.data instanceof Float32Array);
  assert.equal(w.data.length, 12);
  assert.deepEqual(bytes(w.data), bytes(new Float32Array(FLOATS)));
  // Its own buffer holding exactly the elements (what gets transferred).
  assert.equal(w.data.byteOffset, 0);
  assert.equal(w.data.buffer.byteLength, 12 * 4);
});

test('toWire copies an int32 tensor exactly and disposes it', async () => {
  const n0 = tf.memory().numTensors;
  const t = tf.tensor(new Int32Array(INTS), [4, 3], 'int32');
  const w = await toWire(t);
  assert.equal(t.isDisposed, true);
  assert.equal(tf.memory().numTensors, n0);
  assert.deepEqual(w.shape, [4, 3]);
  assert.equal(w.dtype, 'int32');
  assert.ok(w.data instanceof Int32Array);
  assert.deepEqual(Array.from(w.data), INTS);
  assert.equal(w.data.buffer.byteLength, 12 * 4);
});

test('toWire of a computed tensor gives its values', async () => {
  const n0 = tf.memory().numTensors;
  const a = tf.tensor([
    [1, 2, 3],
    [4, 5, 6],
  ]);
  const w = await toWire(tf.transpose(a));
  a.dispose();
  assert.equal(tf.memory().numTensors, n0);
  assert.deepEqual(w.shape, [3, 2]);
  assert.deepEqual(Array.from(w.data), [1, 4, 2, 5, 3, 6]);
});

test('the wire data is a fresh copy, not storage another tensor or array shares', async () => {
  // On cpu, a tensor made from a typed array keeps that array as its storage, and reshape
  // shares it: toWire must not hand out (and let a transfer detach) that storage.
  const src = new Float32Array([1, 2, 3, 4, 5, 6]);
  const t = tf.tensor(src, [2, 3]);
  const t2 = tf.reshape(t, [6]);
  const w = await toWire(t);
  assert.equal(t.isDisposed, true);
  assert.equal(t2.isDisposed, false);
  assert.notEqual(w.data.buffer, src.buffer);
  w.data.fill(-9);
  assert.deepEqual(Array.from(src), [1, 2, 3, 4, 5, 6]);
  assert.deepEqual(Array.from(t2.dataSync()), [1, 2, 3, 4, 5, 6]);
  // Transferring the wire buffer away leaves the other tensor intact too.
  const { port1, port2 } = new MessageChannel();
  try {
    port1.postMessage(w.data, [w.data.buffer as ArrayBuffer]);
    assert.equal(w.data.byteLength, 0);
  } finally {
    port1.close();
    port2.close();
  }
  assert.deepEqual(Array.from(t2.dataSync()), [1, 2, 3, 4, 5, 6]);
  assert.equal(src.byteLength, 24);
  t2.dispose();
});

test('fromWire(toWire(t)) round-trips float32 and int32 tensors', async () => {
  const n0 = tf.memory().numTensors;
  for (const [values, shape, dtype] of [
    [FLOATS, [2, 6], 'float32'],
    [FLOATS, [2, 3, 2], 'float32'],
    [INTS, [12], 'int32'],
    [INTS, [1, 4, 3, 1], 'int32'],
  ] as Array<[number[], number[], 'float32' | 'int32']>) {
    const expected =
      dtype === 'int32' ? new Int32Array(values) : new Float32Array(values);
    const back = fromWire(await toWire(tf.tensor(values, shape, dtype)));
    const what = `${dtype} [${shape}]`;
    assert.deepEqual(back.shape, shape, what);
    assert.equal(back.dtype, dtype, what);
    const got = back.dataSync() as Float32Array | Int32Array;
    assert.equal(got.constructor, expected.constructor, what);
    assert.deepEqual(bytes(got), bytes(expected), what);
    back.dispose();
  }
  assert.equal(tf.memory().numTensors, n0);
});

test('a scalar round-trips', async () => {
  for (const [v, dtype] of [
    [3.5, 'float32'],
    [-17, 'int32'],
  ] as Array<[number, 'float32' | 'int32']>) {
    const w = await toWire(tf.scalar(v, dtype));
    assert.deepEqual(w.shape, []);
    assert.equal(w.dtype, dtype);
    assert.equal(w.data.length, 1);
    assert.equal(w.data[0], v);
    const back = fromWire(w);
    assert.equal(back.rank, 0);
    assert.equal(back.dtype, dtype);
    assert.equal(back.dataSync()[0], v);
    back.dispose();
  }
});

test('an empty tensor (shape [0, 3]) round-trips', async () => {
  for (const dtype of ['float32', 'int32'] as const) {
    const w = await toWire(tf.zeros([0, 3], dtype));
    assert.deepEqual(w.shape, [0, 3]);
    assert.equal(w.dtype, dtype);
    assert.equal(w.data.length, 0);
    assert.ok(
      w.data instanceof (dtype === 'int32' ? Int32Array : Float32Array),
    );
    const back = fromWire(w);
    assert.deepEqual(back.shape, [0, 3]);
    assert.equal(back.dtype, dtype);
    assert.equal(back.size, 0);
    back.dispose();
  }
});

test('fromWire makes a tensor of the wire shape and dtype', () => {
  const w: HostTensor = {
    shape: [2, 2],
    dtype: 'int32',
    data: new Int32Array([5, 6, 7, 8]),
  };
  const t = fromWire(w);
  assert.deepEqual(t.shape, [2, 2]);
  assert.equal(t.dtype, 'int32');
  assert.deepEqual(t.arraySync(), [
    [5, 6],
    [7, 8],
  ]);
  t.dispose();
});

test('transferables lists each buffer once, in order, and skips undefined', () => {
  const w = (
    data: Float32Array | Int32Array,
    shape = [data.length],
  ): HostTensor => ({
    shape,
    dtype: data instanceof Int32Array ? 'int32' : 'float32',
    data,
  });
  const a = w(new Float32Array([1, 2]));
  const b = w(new Int32Array([3]));
  const shared = new ArrayBuffer(16);
  const c1 = w(new Float32Array(shared, 0, 2));
  const c2 = w(new Float32Array(shared, 8, 2));
  assert.deepEqual(transferables([]), []);
  assert.deepEqual(transferables([undefined, undefined]), []);
  const list = transferables([a, undefined, c1, b, c2, a, undefined]);
  assert.equal(list.length, 3);
  assert.equal(list[0], a.data.buffer);
  assert.equal(list[1], shared);
  assert.equal(list[2], b.data.buffer);
  // Works on any iterable (e.g. a generator).
  function* gen() {
    yield b;
    yield undefined;
    yield b;
  }
  const g = transferables(gen());
  assert.equal(g.length, 1);
  assert.equal(g[0], b.data.buffer);
});

test('a transferables list is accepted by postMessage when wire tensors share a buffer', async () => {
  const shared = new ArrayBuffer(16);
  const w1: HostTensor = {
    shape: [2],
    dtype: 'float32',
    data: new Float32Array(shared, 0, 2),
  };
  const w2: HostTensor = {
    shape: [2],
    dtype: 'float32',
    data: new Float32Array(shared, 8, 2),
  };
  w1.data.set([1, 2]);
  w2.data.set([3, 4]);
  await withChannels(async (a, b) => {
    // Listing a buffer twice is an error for postMessage: the dedup is needed.
    assert.throws(() => a.send({ type: 'bad', w1, w2 }, [shared, shared]));
    assert.equal(shared.byteLength, 16);
    a.send({ type: 't', w1, w2 }, transferables([w1, w2]));
    assert.equal(shared.byteLength, 0);
    const m = await b.recv<Message & { w1: HostTensor; w2: HostTensor }>('t');
    assert.deepEqual(Array.from(m.w1.data), [1, 2]);
    assert.deepEqual(Array.from(m.w2.data), [3, 4]);
    // They still share one buffer on the receiving side.
    assert.equal(m.w1.data.buffer, m.w2.data.buffer);
    assert.equal(b.tryRecv('bad'), null);
  });
});

test('copyWire gives an independent copy with its own buffer', () => {
  const big = new Float32Array([0, 0, 1.5, 2.5, 3.5, 0]);
  const w: HostTensor = {
    shape: [3, 1],
    dtype: 'float32',
    data: big.subarray(2, 5),
  };
  const c = copyWire(w);
  assert.deepEqual(c.shape, [3, 1]);
  assert.equal(c.dtype, 'float32');
  assert.ok(c.data instanceof Float32Array);
  assert.deepEqual(Array.from(c.data), [1.5, 2.5, 3.5]);
  assert.notEqual(c.data.buffer, w.data.buffer);
  assert.notEqual(c.shape, w.shape);
  // Only the elements are copied, into a buffer of its own.
  assert.equal(c.data.byteOffset, 0);
  assert.equal(c.data.buffer.byteLength, 12);
  // Changing one does not change the other.
  c.data[0] = -1;
  c.shape[0] = 99;
  assert.equal(w.data[0], 1.5);
  assert.deepEqual(w.shape, [3, 1]);
  w.data[1] = -2;
  assert.equal(c.data[1], 2.5);
  // int32 keeps its type.
  const ci = copyWire({
    shape: [2],
    dtype: 'int32',
    data: new Int32Array([4, -5]),
  });
  assert.ok(ci.data instanceof Int32Array);
  assert.equal(ci.dtype, 'int32');
  assert.deepEqual(Array.from(ci.data), [4, -5]);
});

test('a copy survives transferring the original away', async () => {
  const w = await toWire(tf.tensor([1, 2, 3, 4], [2, 2]));
  const c = copyWire(w);
  await withChannels(async (a, b) => {
    a.send({ type: 'w', tensor: w }, transferables([w]));
    assert.equal(w.data.byteLength, 0);
    assert.deepEqual(Array.from(c.data), [1, 2, 3, 4]);
    // The copy can be sent (transferred) separately.
    a.send({ type: 'w', tensor: c }, transferables([c]));
    assert.equal(c.data.byteLength, 0);
    for (let i = 0; i < 2; i++) {
      const m = await b.recv<Message & { tensor: HostTensor }>('w');
      assert.deepEqual(Array.from(m.tensor.data), [1, 2, 3, 4]);
    }
  });
});

test('a wire tensor sent through a MessageChannel arrives intact and detaches the sender buffer', async () => {
  await withChannels(async (a, b) => {
    const n0 = tf.memory().numTensors;
    for (const [values, shape, dtype] of [
      [FLOATS, [3, 4], 'float32'],
      [INTS, [2, 2, 3], 'int32'],
    ] as Array<[number[], number[], 'float32' | 'int32']>) {
      const expected =
        dtype === 'int32' ? new Int32Array(values) : new Float32Array(values);
      const w = await toWire(tf.tensor(values, shape, dtype));
      const sent = w.data.buffer;
      // As runtime/worker.ts sends activations and gradients.
      a.send({ type: 'act', mb: 3, tensor: w }, transferables([w]));
      assert.equal(sent.byteLength, 0);
      assert.equal(w.data.length, 0);
      const m = await b.recv<Message & { mb: number; tensor: HostTensor }>(
        'act',
      );
      assert.equal(m.mb, 3);
      assert.deepEqual(m.tensor.shape, shape);
      assert.equal(m.tensor.dtype, dtype);
      assert.equal(m.tensor.data.constructor, expected.constructor);
      assert.deepEqual(bytes(m.tensor.data), bytes(expected));
      const t = fromWire(m.tensor);
      assert.deepEqual(t.shape, shape);
      assert.equal(t.dtype, dtype);
      assert.deepEqual(
        bytes(t.dataSync() as Float32Array | Int32Array),
        bytes(expected),
      );
      t.dispose();
    }
    assert.equal(tf.memory().numTensors, n0);
  });
});
