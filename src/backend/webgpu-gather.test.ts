/**
 * The embedding's kernels on webgpu (backend/webgpu-gather.ts): tf.gather of rows and its
 * gradient (the scatter-add into the table, repeated indices included) equal the cpu backend
 * within 1e-4 of their scale, the gradient is the same bit for bit from run to run, the sum takes
 * two dispatches, an identity transpose none, and the cases the kernels do not take (another
 * axis, ids outside the segments) still equal cpu. Skipped, saying why, where no WebGPU adapter
 * can be made.
 */

import assert from 'node:assert/strict';
import { test } from 'node:test';
import { randomArray, scaledDifference } from '../testing/backend-compare.js';
import { gpuQueue } from './gpu-queue.js';
import { initBackend } from './index.js';
import { tf } from './tfjs.js';
import { installDawn } from './webgpu.js';

let why: string | false = false;
try {
  await installDawn();
} catch (e) {
  why = `no WebGPU adapter here: ${(e as Error).message}`;
}

/** Ids [n] in [lo, hi), repeating (a small vocabulary over many positions), from `seed`. */
const ids = (n: number, lo: number, hi: number, seed: number) =>
  Int32Array.from(randomArray(n, seed), (r, i) => {
    const k = Math.floor(Math.abs(r) * 1000 + i * 7) % (hi - lo);
    return lo + k;
  });

/** A case on the current backend: its outputs. */
type Case = { name: string; f: () => tf.Tensor[] };

/** Embedding table [vocab, ...inner] gathered at ids [b, t], and d/dtable of sum(gathered * w). */
const embedding = (vocab: number, inner: number[], b: number, t: number) => ({
  name: `gather [${vocab}, ${inner}] at [${b}, ${t}] and its gradient`,
  f: () => {
    const shape = [vocab, ...inner];
    const table = tf.tensor(
      randomArray(tf.util.sizeFromShape(shape), 1),
      shape,
    );
    const x = tf.tensor(ids(b * t, 0, vocab, 2), [b, t], 'int32');
    const outShape = [b, t, ...inner];
    const w = tf.tensor(
      randomArray(tf.util.sizeFromShape(outShape), 3),
      outShape,
    );
    const y = tf.gather(table, x);
    const g = tf.grad((p: tf.Tensor) => tf.sum(tf.mul(tf.gather(p, x), w)))(
      table,
    );
    return [y, g];
  },
});

/** UnsortedSegmentSum of [n, cols] rows by ids in [lo, hi) into `segments` (ids outside add to nothing). */
const segmentSum = (
  n: number,
  cols: number,
  segments: number,
  lo: number,
  hi: number,
) => ({
  name: `segment sum of [${n}, ${cols}] into ${segments} (ids ${lo}..${hi - 1})`,
  f: () => [
    tf.unsortedSegmentSum(
      tf.tensor(randomArray(n * cols, 4), [n, cols]),
      tf.tensor1d(ids(n, lo, hi, 5), 'int32'),
      segments,
    ),
  ],
});

const CASES: Case[] = [
  embedding(37, [19], 3, 41),
  embedding(5, [2, 3], 2, 9), // inner of rank 2
  embedding(300, [1], 1, 7), // most rows never gathered: zero gradient rows
  segmentSum(70, 3, 11, -2, 14), // ids outside [0, 11) are dropped, as on cpu
  segmentSum(1, 1, 1, 0, 1),
  {
    name: 'gather along axis 1 (the stock kernel)',
    f: () => [
      tf.gather(
        tf.tensor(randomArray(24, 6), [2, 3, 4]),
        tf.tensor1d([2, 0, 2], 'int32'),
        1,
      ),
    ],
  },
];

async function results(c: Case) {
  const outs = tf.tidy(c.f);
  const values = (await Promise.all(
    outs.map((t) => t.data()),
  )) as Float32Array[];
  const shapes = outs.map((t) => t.shape);
  tf.dispose(outs);
  return { values, shapes };
}

test('the embedding gather and its gradient on webgpu equal cpu within 1e-4, repeated indices included', {
  skip: why,
}, async () => {
  for (const c of CASES) {
    await initBackend('cpu');
    const cpu = await results(c);
    await initBackend('webgpu');
    const gpu = await results(c);
    const again = await results(c);
    assert.deepEqual(gpu.shapes, cpu.shapes, `${c.name}: shapes`);
    gpu.values.forEach((v, i) => {
      const { worst, scale } = scaledDifference(v, cpu.values[i]!);
      assert.ok(
        worst <= 1e-4,
        `${c.name}: output ${i} differs from cpu by ${worst} of ${scale}`,
      );
      assert.deepEqual(again.values[i], v, `${c.name}: output ${i} varies`);
    });
  }
  await initBackend('cpu');
});

test('on webgpu the segment sum is two dispatches and an identity transpose none', {
  skip: why,
}, async () => {
  await initBackend('webgpu');
  const x = tf.tensor(randomArray(4096 * 8, 7), [4096, 8]);
  const segmentIds = tf.tensor1d(ids(4096, 0, 256, 8), 'int32');
  gpuQueue()?.makeResident([x, segmentIds]);
  const count = (f: () => tf.Tensor) => {
    const before = gpuQueue()!.counts().dispatches;
    const y = f();
    const n = gpuQueue()!.counts().dispatches - before;
    y.dispose();
    return n;
  };
  assert.equal(
    count(() => tf.unsortedSegmentSum(x, segmentIds, 256)),
    2,
  );
  assert.equal(
    count(() => tf.transpose(x, [0, 1])),
    0,
  );
  assert.equal(
    count(() => tf.transpose(x, [1, 0])),
    1,
    'a real transpose',
  );
  tf.dispose([x, segmentIds]);
  await initBackend('cpu');
});
