/**
 * The GPU queue seam (backend/gpu-queue.ts): makeResident uploads at once on webgpu (TF.js alone
 * would wait for the first kernel that reads the tensor) and is a no-op elsewhere; a submit
 * reports when the GPU finished. Skipped, saying why, where no WebGPU adapter can be made.
 */

import assert from 'node:assert/strict';
import { test } from 'node:test';
import { gpuQueue, makeResident } from './gpu-queue.js';
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
