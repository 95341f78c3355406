import assert from 'node:assert/strict';
import { test } from 'node:test';
import * as tf from '@tensorflow/tfjs-core';
import { initBackend } from './index.js';

/** Deterministic values in [-1, 1) (LCG). */
function values(n: number, seed: number): Float32Array {
  let x = (seed * 2654435761) >>> 0;
  return Float32Array.from({ length: n }, () => {
    x = (Math.imul(x, 1664525) + 1013904223) >>> 0;
    return x / 2 ** 31 - 1;
  });
}

async function both(
  f: () => tf.Tensor | tf.Tensor[],
): Promise<[Float32Array[], Float32Array[]]> {
  const run = async (name: string) => {
    await initBackend(name);
    const outs = tf.tidy(() => {
      const r = f();
      return (Array.isArray(r) ? r : [r]).map((t) =>
        Float32Array.from(t.dataSync()),
      );
    });
    return outs;
  };
  return [await run('wasm'), await run('cpu')];
}

const size = (s: number[]) => s.reduce((a, b) => a * b, 1);

test('wasm Transpose, Slice and Unpack are bit-exact against cpu (ranks 1-5, unit and odd dims)', async () => {
  const cases: [number[], number[]][] = [
    [[7], [0]],
    [
      [5, 3],
      [1, 0],
    ],
    [
      [70, 45],
      [1, 0],
    ],
    [
      [4, 37, 33],
      [0, 2, 1],
    ],
    [
      [3, 5, 7],
      [2, 0, 1],
    ],
    [
      [2, 9, 3, 4, 6],
      [2, 0, 3, 1, 4],
    ],
    [
      [3, 2, 4, 9, 6],
      [1, 3, 0, 2, 4],
    ],
    [
      [2, 3, 4, 5],
      [0, 2, 1, 3],
    ],
    [
      [2, 1, 5, 1, 3],
      [4, 3, 2, 1, 0],
    ],
    [
      [6, 1, 35],
      [2, 1, 0],
    ],
    [
      [2, 3, 4, 5],
      [3, 2, 1, 0],
    ],
  ];
  for (const [shape, perm] of cases) {
    const v = values(size(shape), shape.length + perm[0]!);
    const [w, c] = await both(() => tf.transpose(tf.tensor(v, shape), perm));
    assert.deepEqual(w[0], c[0], `transpose ${shape} ${perm}`);
    const [wi, ci] = await both(() =>
      tf.transpose(
        tf.tensor(
          Int32Array.from(v, (x) => Math.round(x * 1e6)),
          shape,
          'int32',
        ),
        perm,
      ),
    );
    assert.deepEqual(wi[0], ci[0], `int32 transpose ${shape} ${perm}`);
  }
  const x = values(4 * 5 * 6 * 7, 3);
  for (const [begin, sz] of [
    [
      [0, 0, 0, 0],
      [4, 5, 6, 7],
    ],
    [
      [1, 0, 0, 0],
      [2, 5, 6, 7],
    ],
    [
      [1, 2, 3, 1],
      [3, 2, 3, 6],
    ],
    [
      [0, 4, 0, 2],
      [4, 1, 6, 1],
    ],
  ] as const) {
    const [w, c] = await both(() =>
      tf.slice(tf.tensor(x, [4, 5, 6, 7]), [...begin], [...sz]),
    );
    assert.deepEqual(w[0], c[0], `slice ${begin} ${sz}`);
  }
  for (const axis of [0, 1, 3]) {
    const [w, c] = await both(() =>
      tf.unstack(tf.tensor(x, [4, 5, 6, 7]), axis),
    );
    assert.deepEqual(w, c, `unstack axis ${axis}`);
  }
});

test('wasm Sum over leading, middle and trailing axes matches cpu; Identity shares data safely', async () => {
  const shape = [6, 5, 7, 3];
  const x = values(size(shape), 9);
  for (const axis of [
    [0],
    [0, 1],
    [0, 1, 2],
    [1],
    [1, 2],
    [0, 2],
    [3],
    [2, 3],
    [0, 3],
    [0, 1, 2, 3],
  ]) {
    for (const keepDims of [false, true]) {
      const [w, c] = await both(() =>
        tf.sum(tf.tensor(x, shape), axis, keepDims),
      );
      assert.equal(w[0]!.length, c[0]!.length);
      for (let i = 0; i < c[0]!.length; i++)
        assert.ok(
          Math.abs(w[0]![i]! - c[0]![i]!) < 1e-5,
          `sum ${axis} ${keepDims}`,
        );
    }
  }
  await initBackend('wasm');
  const a = tf.tensor(x, shape);
  const b = tf.clone(a);
  a.dispose();
  assert.deepEqual(b.dataSync(), x);
  const c = tf.add(b, 1);
  b.dispose();
  assert.ok(Math.abs(c.dataSync()[0]! - (x[0]! + 1)) < 1e-6);
  c.dispose();
});
