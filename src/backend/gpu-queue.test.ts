/**
 * The GPU queue seam (backend/gpu-queue.ts): makeResident uploads at once on webgpu (TF.js alone
 * would wait for the first kernel that reads the tensor) and is a no-op elsewhere; a submit
 * reports when the GPU finished; its counts carry the thread's CPU time. Skipped, saying why,
 * where no WebGPU adapter can be made (the CPU-time clock: where /proc/thread-self is not).
 */

import assert from 'node:assert/strict';
import { test } from 'node:test';
import { Worker } from 'node:worker_threads';
import { LayerwiseError } from '../util/errors.js';
import {
  gpuQueue,
  makeResident,
  setSubmitBatch,
  TFJS_SUBMIT_BATCH,
  threadCpuMs,
} from './gpu-queue.js';
import { initBackend } from './index.js';
import { tf } from './tfjs.js';
import { installDawn } from './webgpu.js';

let why: string | false = false;
try {
  await installDawn();
} catch (e) {
  why = `no WebGPU adapter here: ${(e as Error).message}`;
}

test('makeResident is a no-op without a GPU queue (cpu)', async () => {
  await initBackend('cpu');
  assert.equal(gpuQueue(), null);
  const t = tf.tensor([1, 2, 3]);
  assert.equal(makeResident([t]), false);
  t.dispose();
});

test("on webgpu, makeResident puts a new tensor's values in a GPU buffer at once, and they read back unchanged", {
  skip: why,
}, async () => {
  await initBackend('webgpu');
  const q = gpuQueue();
  assert.ok(q, 'webgpu has a GPU queue');
  const values = Float32Array.from({ length: 1000 }, (_, i) => i / 7);
  const t = tf.tensor(values, [10, 100]);
  assert.equal(
    q.isResident(t),
    false,
    'TF.js alone keeps the values on the host until first use',
  );
  assert.equal(makeResident([t]), true);
  assert.equal(q.isResident(t), true, 'uploaded by makeResident');
  values.fill(-1); // the host array may be reused at once: the values were copied
  const back = (await t.data()) as Float32Array;
  assert.equal(back[7], 1);
  assert.equal(back[999], Math.fround(999 / 7));
  // a submit of queued work reports its completion after the submit, without blocking
  q.begin();
  const y = tf.matMul(t, t, false, true);
  const s = q.submit();
  assert.ok(
    s.firstSubmitAt !== null && s.firstSubmitAt <= s.submittedAt,
    'the matMul was submitted within the action',
  );
  const done = await s.done;
  assert.ok(
    done >= s.submittedAt,
    `done ${done} before submit ${s.submittedAt}`,
  );
  y.dispose();
  t.dispose();
  await initBackend('cpu');
});

test("on webgpu with timestamp queries, a step's GPU busy time is positive, below the step's wall time, and grows with its work", {
  skip: why,
}, async (t) => {
  await initBackend('webgpu');
  const q = gpuQueue()!;
  if (!q.timesPasses) {
    t.skip('this adapter has no timestamp-query');
    return;
  }
  const a = tf.randomNormal([256, 256]);
  const busyOf = async (products: number) => {
    const t0 = performance.now();
    q.beginStep();
    let x = a;
    for (let i = 0; i < products; i++) {
      const y = tf.matMul(x, a);
      if (x !== a) x.dispose();
      x = y;
    }
    const busy = q.endStep();
    await x.data(); // the step's work has run
    const wall = (performance.now() - t0) / 1000;
    if (x !== a) x.dispose();
    return { busy: (await busy)?.seconds ?? null, wall };
  };
  await busyOf(1); // compiles the pipeline
  const one = await busyOf(2);
  const many = await busyOf(40);
  assert.ok(one.busy !== null && one.busy > 0, `busy ${one.busy} s`);
  assert.ok(one.busy <= one.wall, `busy ${one.busy} s over wall ${one.wall} s`);
  assert.ok(
    many.busy !== null && many.busy > one.busy,
    `40 products ${many.busy} s, 2 products ${one.busy} s`,
  );
  // nothing timed: null
  q.beginStep();
  assert.equal(await q.endStep(), null);
  a.dispose();
});

const noSchedstat =
  threadCpuMs() === undefined ? 'no /proc/thread-self/schedstat here' : false;

test("threadCpuMs counts the calling thread's CPU time: a worker's busy loop, not the main thread's wait", {
  skip: noSchedstat,
}, async () => {
  const url = new URL('./gpu-queue.js', import.meta.url).href;
  const w = new Worker(
    `import(${JSON.stringify(url)}).then(({ threadCpuMs }) => {
      const { parentPort } = require('node:worker_threads');
      const a = threadCpuMs();
      const t = Date.now();
      while (Date.now() - t < 150);
      parentPort.postMessage(threadCpuMs() - a);
    });`,
    { eval: true },
  );
  const main0 = threadCpuMs()!;
  const worker = await new Promise<number>((resolve, reject) => {
    w.once('message', resolve);
    w.once('error', reject);
  });
  const main = threadCpuMs()! - main0;
  await w.terminate();
  // 150 ms of wall time spinning: on a CPU most of it (the machine may be shared), never more
  assert.ok(worker > 20 && worker < 400, `worker thread ${worker} ms`);
  assert.ok(
    main < worker,
    `main thread ${main} ms while the worker spun ${worker} ms`,
  );
});

test('on webgpu the queue counts carry the thread CPU time, growing with the host work done between readings, and apart the CPU spent polling while a read waits', {
  skip: why || noSchedstat,
}, async () => {
  await initBackend('webgpu');
  const q = gpuQueue()!;
  const a = q.counts().hostMs!;
  const t = Date.now();
  while (Date.now() - t < 30);
  const b = q.counts().hostMs!;
  assert.ok(b - a > 0 && b - a < 200, `${b - a} ms of CPU over a 30 ms spin`);
  // a read waiting for the GPU: the thread's CPU meanwhile counts as polling, not as host work
  const x = tf.randomNormal([512, 512]);
  let y = x;
  for (let i = 0; i < 8; i++) y = tf.matMul(y, x);
  q.flush();
  const before = q.counts();
  const cpu0 = threadCpuMs()!;
  await y.data();
  const after = q.counts();
  const cpu = threadCpuMs()! - cpu0;
  const poll = after.pollMs! - before.pollMs!;
  const host = after.hostMs! - before.hostMs!;
  assert.ok(poll > 0, `polling ${poll} ms during the read`);
  // the clocks are read at slightly different moments: 2 ms, and 1% of a long wait (on a busy
  // machine a 500 ms read once differed by 4 ms)
  assert.ok(
    Math.abs(poll + host - cpu) < 2 + 0.01 * cpu,
    `polling ${poll} + host ${host} ms vs ${cpu} ms of CPU`,
  );
  assert.ok(host < poll + 2, `host ${host} ms during a read: little`);
  tf.dispose([x, y]);
});

test('LAYERWISE_WEBGPU_SUBMIT_BATCH: a bad value is refused naming the variable, a good one sets how many dispatches TF.js batches per submit', {
  skip: why,
}, async () => {
  await initBackend('webgpu');
  for (const bad of ['0', '-3', '2.5', 'many'])
    assert.throws(
      () => setSubmitBatch(bad),
      (e: Error) =>
        e instanceof LayerwiseError &&
        e.message.includes('LAYERWISE_WEBGPU_SUBMIT_BATCH') &&
        e.message.includes(`'${bad}'`),
    );
  const q = gpuQueue()!;
  const x = tf.tensor(
    Float32Array.from({ length: 64 }, (_, i) => i),
    [8, 8],
  );
  makeResident([x]);
  /** Submits while 40 element-wise kernels are queued and read once. */
  const submitsFor = async (batch: string) => {
    setSubmitBatch(batch);
    const before = q.counts().submits;
    let y = x;
    for (let i = 0; i < 40; i++) {
      const next = tf.relu(tf.add(y, 1));
      if (y !== x) y.dispose();
      y = next;
    }
    await y.data();
    y.dispose();
    return q.counts().submits - before;
  };
  try {
    const few = await submitsFor('1000');
    const many = await submitsFor('4');
    assert.ok(
      many >= few + 15,
      `80 dispatches: ${many} submits at 4 a submit, ${few} at 1000 a submit`,
    );
  } finally {
    setSubmitBatch(String(TFJS_SUBMIT_BATCH));
    x.dispose();
  }
});
