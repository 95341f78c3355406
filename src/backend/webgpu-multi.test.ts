/**
 * The multi-tensor AdamW on webgpu with its moments in flat tensors (optim/optimizer.ts
 * FlatMoments, backend/webgpu-multi.ts adamwMulti): a stage's steps (sums of squares of the
 * gradients, then the update) give the cpu backend's composed parameters and state, a
 * checkpoint's state saved and restored in the middle included, and a steady step copies each
 * gradient once (into the sums' scratch) and each parameter once (out), no moments. Skipped,
 * saying why, where no WebGPU adapter can be made.
 */

import assert from 'node:assert/strict';
import { test } from 'node:test';
import { DeviceOptimizer, defaultOptimizerConfig } from '../optim/optimizer.js';
import { randomArray, scaledDifference } from '../testing/backend-compare.js';
import { gpuQueue } from './gpu-queue.js';
import { initBackend } from './index.js';
import { SUM_SQUARES_KERNEL } from './kernel-names.js';
import { tf } from './tfjs.js';
import { installDawn } from './webgpu.js';

let why: string | false = false;
try {
  await installDawn();
} catch (e) {
  why = `no WebGPU adapter here: ${(e as Error).message}`;
}

const SHAPES: Record<string, number[]> = {
  w: [7, 9],
  b: [70],
  w2: [3, 5],
  g: [1],
};

/**
 * Four AdamW steps over SHAPES' parameters (decayed matrices and undecayed vectors interleaved;
 * the gradients in another order than the parameters, as a stage's backward makes them), each
 * step's gradients summed (SUM_SQUARES_KERNEL) before the update; after step 2 the state is
 * saved and restored into a new optimizer. Returns the parameters, the final state's arrays,
 * and the buffer copies of step 4 (webgpu; the gradients made resident first).
 */
async function steps() {
  const config = { ...defaultOptimizerConfig('adamw'), weightDecay: 0.01 };
  let opt = new DeviceOptimizer(config);
  const params = new Map(
    Object.entries(SHAPES).map(([k, s], i) => [
      k,
      tf.variable(tf.tensor(randomArray(tf.util.sizeFromShape(s), i + 1), s)),
    ]),
  );
  let copies = 0;
  for (let step = 0; step < 4; step++) {
    const grads = new Map(
      ['b', 'w2', 'g', 'w'].map((k, i) => {
        const s = SHAPES[k]!;
        const n = tf.util.sizeFromShape(s);
        return [k, tf.tensor(randomArray(n, 10 + 4 * step + i), s)] as const;
      }),
    );
    gpuQueue()?.makeResident([...grads.values()]);
    const before = gpuQueue()?.counts().copies ?? 0;
    const sums = tf
      .engine()
      .runKernel(SUM_SQUARES_KERNEL, [
        ...grads.values(),
      ] as unknown as tf.NamedTensorMap) as tf.Tensor;
    opt.apply(params, grads, 0.05 / (step + 1), step === 1 ? 0.5 : 1);
    copies = (gpuQueue()?.counts().copies ?? 0) - before;
    await sums.data();
    tf.dispose([sums, ...grads.values()]);
    if (step === 1) {
      const saved = await opt.getState();
      opt.dispose();
      opt = new DeviceOptimizer(config);
      opt.setState(saved, params);
    }
  }
  const state = await opt.getState();
  const out = (await Promise.all(
    [...params.values()].map((p) => p.data()),
  )) as Float32Array[];
  for (const slots of Object.values(state.slots))
    out.push(...Object.values(slots));
  opt.dispose();
  tf.dispose([...params.values()]);
  return { out, names: Object.keys(state.slots), copies };
}

test('AdamW with flat moments on webgpu equals the composed update on cpu, through a checkpoint, and copies only parameters out and gradients in', {
  skip: why,
}, async () => {
  await initBackend('cpu');
  const cpu = await steps();
  await initBackend('webgpu');
  tf.tidy(() => tf.add(tf.scalar(1), 1)); // the queue exists before the count
  const gpu = await steps();
  await initBackend('cpu');
  assert.deepEqual(gpu.names, cpu.names, 'the state in the parameters order');
  assert.equal(gpu.out.length, cpu.out.length);
  gpu.out.forEach((v, i) => {
    const { worst } = scaledDifference(v, cpu.out[i]!);
    assert.ok(worst <= 1e-6, `array ${i} differs from cpu by ${worst}`);
  });
  // a steady step: 4 gradients copied into the sums' scratch (AdamW finds them there), 4
  // parameters copied out of AdamW's (which holds them for the next step); moments none
  const n = Object.keys(SHAPES).length;
  assert.equal(gpu.copies, 2 * n, `copies in a steady step: ${gpu.copies}`);
});

/**
 * Two AdamW steps over w [7, 9] and b [70] with a clone of b kept from before the second, the
 * parameters and the optimizer's state read between them (as a checkpoint reads them). Returns
 * the values of w, b, the clone and the moments after the second, and (webgpu) whether w, b and
 * the flat moments kept their data (dataId) through it.
 */
async function inPlaceSteps() {
  const opt = new DeviceOptimizer(defaultOptimizerConfig('adamw'));
  const params = new Map(
    [
      ['w', [7, 9]],
      ['b', [70]],
    ].map(([k, s], i) => [
      k as string,
      tf.variable(
        tf.tensor(
          randomArray(tf.util.sizeFromShape(s as number[]), i + 1),
          s as number[],
        ),
      ),
    ]),
  );
  const grads = (step: number) =>
    new Map(
      [...params].map(([k, p], i) => [
        k,
        tf.tensor(randomArray(p.size, 20 + 2 * step + i), p.shape),
      ]),
    );
  const flat = () =>
    (opt as unknown as { flat: Array<{ m: tf.Variable; v: tf.Variable }> })
      .flat;
  const g1 = grads(1);
  opt.apply(params, g1, 0.05, 1);
  // read between the updates, as a checkpoint does: TF.js keeps what it read on the host
  await Promise.all([...params.values()].map((p) => p.data()));
  await opt.getState();
  const kept = tf.clone(params.get('b')!); // shares b's data where the backend can
  const before = [
    params.get('w')!,
    params.get('b')!,
    ...(flat()[0] ? [flat()[0]!.m, flat()[0]!.v] : []),
  ].map((t) => t.dataId);
  const g2 = grads(2);
  opt.apply(params, g2, 0.05, 1);
  const after = [
    params.get('w')!,
    params.get('b')!,
    ...(flat()[0] ? [flat()[0]!.m, flat()[0]!.v] : []),
  ].map((t) => t.dataId);
  const state = await opt.getState();
  const values = (await Promise.all(
    [params.get('w')!, params.get('b')!, kept].map((t) => t.data()),
  )) as Float32Array[];
  for (const slots of Object.values(state.slots))
    values.push(...Object.values(slots));
  const same = after.map((id, i) => id === before[i]);
  tf.dispose([...g1.values(), ...g2.values(), kept, ...params.values()]);
  opt.dispose();
  return { values, same };
}

test('AdamW on webgpu updates a parameter and the moments in place where nothing else holds them, and writes a new tensor where a kept tensor shares a parameter, which keeps its old values', {
  skip: why,
}, async () => {
  await initBackend('cpu');
  const cpu = await inPlaceSteps();
  await initBackend('webgpu');
  const gpu = await inPlaceSteps();
  await initBackend('cpu');
  gpu.values.forEach((v, i) => {
    const { worst } = scaledDifference(v, cpu.values[i]!);
    assert.ok(
      worst <= 1e-6,
      `array ${i} (w, b, the clone, the moments) differs from cpu by ${worst}`,
    );
  });
  assert.deepEqual(
    gpu.same,
    [true, false, true, true],
    'w, b, m, v kept their data: w and the moments updated in place, b (shared with the clone) not',
  );
});
