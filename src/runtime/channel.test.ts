import assert from 'node:assert/strict';
import { once } from 'node:events';
import { test } from 'node:test';
import {
  MessageChannel,
  type MessagePort,
  type TransferListItem,
} from 'node:worker_threads';
import {
  Channel,
  LinkLostError,
  type Message,
  type PortLike,
} from './channel.js';
import { isDeviceLoss, StageError } from './device.js';

/**
 * Runs `body` with two Channels over the two ends of a real MessageChannel, and closes both
 * ports afterwards (an open port with a 'message' listener keeps the process alive; unref()
 * instead would let the event loop end before pending messages are delivered).
 */
async function withPair(
  body: (
    a: Channel,
    b: Channel,
    pa: MessagePort,
    pb: MessagePort,
  ) => Promise<void>,
): Promise<void> {
  const { port1, port2 } = new MessageChannel();
  try {
    const a = new Channel(port1);
    const b = new Channel(port2);
    await within(LIMIT_MS, body(a, b, port1, port2));
  } finally {
    port1.close();
    port2.close();
  }
}

/** Time limit of one test body: a receive that never resolves fails the test instead of hanging. */
const LIMIT_MS = 5000;

/** `p`, or a rejection after `ms` milliseconds. */
async function within<T>(ms: number, p: Promise<T>): Promise<T> {
  let timer: NodeJS.Timeout | undefined;
  const timeout = new Promise<never>((_, reject) => {
    timer = setTimeout(
      () =>
        reject(
          new Error(`timed out after ${ms} ms (a receive never resolved)`),
        ),
      ms,
    );
  });
  try {
    return await Promise.race([p, timeout]);
  } finally {
    clearTimeout(timer);
  }
}

/**
 * Waits until every message `from` sent so far has been delivered to `to`: a port delivers in
 * send order, so once a sentinel sent last has arrived, all the earlier ones have too.
 */
async function flush(from: Channel, to: Channel): Promise<void> {
  from.send({ type: '__flush' });
  await to.recv('__flush');
}

/** Whether `p` has settled, after letting pending microtasks run. */
async function settled(p: Promise<unknown>): Promise<boolean> {
  let done = false;
  p.then(
    () => {
      done = true;
    },
    () => {
      done = true;
    },
  );
  await new Promise((r) => setImmediate(r));
  return done;
}

test('messages of one type arrive in FIFO order', async () => {
  await withPair(async (a, b) => {
    // Received as they arrive (recv waits for each).
    for (let i = 0; i < 20; i++) a.send({ type: 'x', i });
    for (let i = 0; i < 20; i++) assert.equal((await b.recv('x')).i, i);
    assert.equal(b.tryRecv('x'), null);
    // Received after all have arrived and are queued.
    for (let i = 0; i < 20; i++) a.send({ type: 'x', i });
    await flush(a, b);
    for (let i = 0; i < 10; i++) assert.equal((await b.recv('x')).i, i);
    for (let i = 10; i < 20; i++) assert.equal(b.tryRecv('x')?.i, i);
    assert.equal(b.tryRecv('x'), null);
  });
});

test('different types are queued independently', async () => {
  await withPair(async (a, b) => {
    a.send({ type: 'A', v: 1 });
    a.send({ type: 'A', v: 2 });
    a.send({ type: 'B', v: 10 });
    a.send({ type: 'A', v: 3 });
    a.send({ type: 'B', v: 20 });
    // Receiving the B messages first does not consume or reorder the A messages before them.
    assert.deepEqual(await b.recv('B'), { type: 'B', v: 10 });
    assert.deepEqual(await b.recv('B'), { type: 'B', v: 20 });
    assert.equal(b.tryRecv('B'), null);
    assert.deepEqual(
      [await b.recv('A'), await b.recv('A'), await b.recv('A')].map((m) => m.v),
      [1, 2, 3],
    );
    assert.equal(b.tryRecv('A'), null);
    // A pending recv of one type is not resolved by a message of another type.
    const pendingB = b.recv('B');
    a.send({ type: 'A', v: 4 });
    await flush(a, b);
    assert.equal(await settled(pendingB), false);
    assert.deepEqual(b.tryRecv('A'), { type: 'A', v: 4 });
    a.send({ type: 'B', v: 30 });
    assert.equal((await pendingB).v, 30);
  });
});

test('a recv issued before the message arrives resolves when it arrives', async () => {
  await withPair(async (a, b) => {
    const p = b.recv('late');
    assert.equal(await settled(p), false);
    a.send({ type: 'late', payload: 'hello' });
    assert.deepEqual(await p, { type: 'late', payload: 'hello' });
    // Delivered to the waiter, not also queued.
    await flush(a, b);
    assert.equal(b.tryRecv('late'), null);
  });
});

test('a recv issued after the message arrived gets the queued one', async () => {
  await withPair(async (a, b) => {
    a.send({ type: 'early', payload: 42 });
    await flush(a, b);
    const p = b.recv('early');
    assert.equal(await settled(p), true);
    assert.equal((await p).payload, 42);
    assert.equal(b.tryRecv('early'), null);
  });
});

test('several pending recvs of one type resolve in order', async () => {
  await withPair(async (a, b) => {
    const ps = [b.recv('x'), b.recv('x'), b.recv('x'), b.recv('x')];
    const order: number[] = [];
    ps.forEach((p, k) => p.then(() => order.push(k)));
    for (let i = 0; i < 4; i++) a.send({ type: 'x', i });
    const got = await Promise.all(ps);
    assert.deepEqual(
      got.map((m) => m.i),
      [0, 1, 2, 3],
    );
    assert.deepEqual(order, [0, 1, 2, 3]);
  });
});

test('tryRecv returns null until a message has arrived, then the message, without waiting', async () => {
  await withPair(async (a, b) => {
    assert.equal(b.tryRecv('t'), null);
    a.send({ type: 't', n: 1 });
    a.send({ type: 't', n: 2 });
    // postMessage delivers asynchronously: nothing has arrived yet in this turn.
    assert.equal(b.tryRecv('t'), null);
    await flush(a, b);
    assert.equal(b.tryRecv('other'), null);
    assert.deepEqual(b.tryRecv('t'), { type: 't', n: 1 });
    assert.deepEqual(b.tryRecv('t'), { type: 't', n: 2 });
    assert.equal(b.tryRecv('t'), null);
  });
});

test('both ends of a channel can send and receive', async () => {
  await withPair(async (a, b) => {
    a.send({ type: 'ping', n: 1 });
    const ping = await b.recv('ping');
    b.send({ type: 'pong', n: (ping.n as number) + 1 });
    assert.equal((await a.recv('pong')).n, 2);
  });
});

test('fail rejects every pending recv, every later recv, and makes tryRecv throw', async () => {
  await withPair(async (a, b, _pa, pb) => {
    a.send({ type: 'q', n: 1 });
    await flush(a, b);
    const pending = [b.recv('x'), b.recv('x'), b.recv('y')];
    const err = new Error('peer died');
    const checks = pending.map((p) => assert.rejects(p, (e) => e === err));
    for (const p of pending) assert.equal(await settled(p), false);
    b.fail(err);
    // At once, not when some message arrives.
    for (const p of pending) assert.equal(await settled(p), true);
    await Promise.all(checks);
    // Later receives fail too (at once), even for a type that has a queued message.
    await assert.rejects(b.recv('q'), (e) => e === err);
    const later = b.recv('x');
    assert.equal(await settled(later), true);
    await assert.rejects(later, (e) => e === err);
    assert.throws(
      () => b.tryRecv('q'),
      (e) => e === err,
    );
    assert.throws(
      () => b.tryRecv('none'),
      (e) => e === err,
    );
    // Messages arriving after the failure do not resolve anything either.
    const arrived = once(pb, 'message');
    a.send({ type: 'x', n: 2 });
    await arrived;
    const after = b.recv('x');
    assert.equal(await settled(after), true);
    await assert.rejects(after, (e) => e === err);
    // The other end is unaffected.
    b.send({ type: 'still', ok: true });
    assert.equal((await a.recv('still')).ok, true);
  });
});

test('buffers in the transfer list move to the receiver', async () => {
  await withPair(async (a, b) => {
    const moved = new Float32Array([1.5, -2, 3.25, 4]);
    const copied = new Int32Array([7, 8, 9]);
    a.send({ type: 'data', moved, copied }, [moved.buffer]);
    // The sender's transferred buffer is detached; the untransferred one is kept.
    assert.equal(moved.buffer.byteLength, 0);
    assert.equal(moved.length, 0);
    assert.equal(copied.buffer.byteLength, 12);
    const m = await b.recv<
      Message & { moved: Float32Array; copied: Int32Array }
    >('data');
    assert.ok(m.moved instanceof Float32Array);
    assert.deepEqual(Array.from(m.moved), [1.5, -2, 3.25, 4]);
    assert.ok(m.copied instanceof Int32Array);
    assert.deepEqual(Array.from(m.copied), [7, 8, 9]);
    // The untransferred one arrived as a copy.
    m.copied[0] = 100;
    assert.equal(copied[0], 7);
  });
});

/** A pair of in-process fake ports: postMessage calls the peer's listeners synchronously. */
function fakePair(): {
  pa: PortLike & {
    sent: Array<[unknown, readonly TransferListItem[] | undefined]>;
  };
  pb: PortLike;
} {
  type Fake = PortLike & {
    listeners: Array<(v: unknown) => void>;
    peer?: Fake;
    sent: Array<[unknown, readonly TransferListItem[] | undefined]>;
  };
  const make = (): Fake => {
    const f: Fake = {
      listeners: [],
      sent: [],
      postMessage(value, transfer) {
        f.sent.push([value, transfer]);
        for (const l of f.peer!.listeners) l(value);
      },
      on(event, listener) {
        assert.equal(event, 'message');
        f.listeners.push(listener);
        return f;
      },
    };
    return f;
  };
  const pa = make();
  const pb = make();
  pa.peer = pb;
  pb.peer = pa;
  return { pa, pb };
}

test('a Channel works over any PortLike (postMessage + on("message"))', async () => {
  const { pa, pb } = fakePair();
  const a = new Channel(pa);
  const b = new Channel(pb);
  // send passes the message and the transfer list to postMessage.
  const buf = new ArrayBuffer(8);
  a.send({ type: 'x', i: 0 }, [buf]);
  assert.equal(pa.sent.length, 1);
  assert.deepEqual(pa.sent[0][0], { type: 'x', i: 0 });
  assert.deepEqual(pa.sent[0][1], [buf]);
  a.send({ type: 'y', i: 1 });
  assert.deepEqual(pa.sent[1][1], []);
  // This fake delivers synchronously, so the message is queued at once.
  a.send({ type: 'x', i: 2 });
  assert.deepEqual(b.tryRecv('x'), { type: 'x', i: 0 });
  assert.equal((await b.recv('x')).i, 2);
  assert.equal((await b.recv('y')).i, 1);
  // A pending recv resolves when the matching message is delivered.
  const p = b.recv('z');
  a.send({ type: 'w' });
  assert.equal(await settled(p), false);
  a.send({ type: 'z', v: 'ok' });
  assert.equal((await p).v, 'ok');
  assert.deepEqual(b.tryRecv('w'), { type: 'w' });
  // And the other way round.
  b.send({ type: 'back', v: 3 });
  assert.equal(a.tryRecv('back')?.v, 3);
});

test('a link lost between two devices counts as a lost device (restartable), an error a stage raised does not', async () => {
  // the stage's channel to its neighbour fails with LinkLostError; the stage reports the
  // error's name, and the device handle raises a StageError carrying it as causeName
  await withPair(async (a) => {
    const pending = a.recv('act');
    a.fail(new LinkLostError('the link to the next replica was lost: x'));
    const e = await pending.then(
      () => assert.fail('recv resolved on a failed channel'),
      (x: Error) => x,
    );
    assert.equal(e.name, 'LinkLostError');
    assert.ok(isDeviceLoss(new StageError(1, e.message, e.name)));
  });
  assert.ok(isDeviceLoss(new StageError(0, 'worker exited with code 1')));
  assert.ok(!isDeviceLoss(new StageError(0, 'bad shape', 'Error')));
  assert.ok(!isDeviceLoss(new StageError(0, 'oom', 'DeviceOutOfMemoryError')));
  assert.ok(!isDeviceLoss(new Error('the link to the next stage was lost')));
});
