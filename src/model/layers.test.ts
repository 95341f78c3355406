import assert from 'node:assert/strict';
import { test } from 'node:test';
import * as tf from '@tensorflow/tfjs-core';
import { causalMask } from '../backend/composed-kernels.js';
import { fusedDense } from '../backend/dense.js';
import { initBackend } from '../backend/index.js';
import { assertClose } from '../testing/assert-close.js';
import { engineRuns } from '../testing/engine-runs.js';
import {
  causalSelfAttention,
  dense,
  gelu,
  layerNorm,
  maskedSoftmax,
  softmaxCrossEntropy,
} from './layers.js';

function values(n: number, seed: number, scale = 1): Float32Array {
  let x = (seed * 2654435761) >>> 0;
  return Float32Array.from({ length: n }, () => {
    x = (Math.imul(x, 1664525) + 1013904223) >>> 0;
    return (x / 2 ** 31 - 1) * scale;
  });
}

/** The stock TF.js compositions these layers replaced (autodiff gradients). */
const reference = {
  layerNorm(
    x: tf.Tensor,
    g: tf.Tensor,
    b: tf.Tensor,
    epsilon = 1e-5,
  ): tf.Tensor {
    const axis = x.rank - 1;
    const mean = tf.mean(x, axis, true);
    const centered = tf.sub(x, mean);
    const variance = tf.mean(tf.square(centered), axis, true);
    return tf.add(
      tf.mul(tf.mul(centered, tf.rsqrt(tf.add(variance, epsilon))), g),
      b,
    );
  },
  gelu(x: tf.Tensor): tf.Tensor {
    const c = Math.sqrt(2 / Math.PI);
    const inner = tf.mul(tf.add(x, tf.mul(tf.pow(x, 3), 0.044715)), c);
    return tf.mul(tf.mul(x, 0.5), tf.add(tf.tanh(inner), 1));
  },
  maskedSoftmax(s: tf.Tensor, scale: number): tf.Tensor {
    return tf.softmax(
      tf.add(tf.mul(s, scale), causalMask(s.shape[s.rank - 1]!)),
      -1,
    );
  },
  attention(x: tf.Tensor, heads: number, ...w: tf.Tensor[]): tf.Tensor {
    const [B, T, D] = x.shape as [number, number, number];
    const dh = D / heads;
    const [wqkv, bqkv, wo, bo] = w as [
      tf.Tensor,
      tf.Tensor,
      tf.Tensor,
      tf.Tensor,
    ];
    const proj = (a: tf.Tensor, m: tf.Tensor, b: tf.Tensor, n: number) =>
      tf.reshape(
        tf.add(tf.matMul(tf.reshape(a, [-1, D]), m as tf.Tensor2D), b),
        [B, T, n],
      );
    const qkv = tf.reshape(proj(x, wqkv, bqkv, 3 * D), [B, T, 3, heads, dh]);
    const [q, k, v] = tf
      .unstack(tf.transpose(qkv, [2, 0, 3, 1, 4]), 0)
      .map((t) => tf.reshape(t, [B * heads, T, dh])) as [
      tf.Tensor,
      tf.Tensor,
      tf.Tensor,
    ];
    const p = reference.maskedSoftmax(
      tf.matMul(q, k, false, true),
      1 / Math.sqrt(dh),
    );
    const ctx = tf.transpose(
      tf.reshape(tf.matMul(p, v), [B, heads, T, dh]),
      [0, 2, 1, 3],
    );
    return proj(tf.reshape(ctx, [B, T, D]), wo, bo, D);
  },
  softmaxCrossEntropy(logits: tf.Tensor, labels: tf.Tensor): tf.Scalar {
    const v = logits.shape[logits.shape.length - 1]!;
    const oneHot = tf.oneHot(tf.reshape(labels, [-1]) as tf.Tensor1D, v);
    const logp = tf.logSoftmax(tf.reshape(logits, [-1, v]), -1);
    return tf.neg(tf.mean(tf.sum(tf.mul(oneHot, logp), -1))) as tf.Scalar;
  },
};

/** Value of f(xs) and gradients of sum(f(xs) * w) w.r.t. xs, read back. */
function valueAndGrads(
  f: (...xs: tf.Tensor[]) => tf.Tensor,
  xs: tf.Tensor[],
  seed: number,
): Float32Array[] {
  return tf.tidy(() => {
    const y = f(...xs);
    const w = tf.tensor(values(y.size, seed), y.shape);
    const gs = tf.grads((...a: tf.Tensor[]) => tf.sum(tf.mul(f(...a), w)))(xs);
    return [y, ...gs].map((t) => Float32Array.from(t.dataSync()));
  });
}

const close = (
  x: ArrayLike<number>,
  y: ArrayLike<number>,
  what: string,
  tol = 2e-5,
) => assertClose(x, y, what, tol);

interface Case {
  name: string;
  ours: (...xs: tf.Tensor[]) => tf.Tensor;
  ref: (...xs: tf.Tensor[]) => tf.Tensor;
  inputs: () => tf.Tensor[];
}

const labels = () =>
  tf.tensor(
    Int32Array.from(values(2 * 5, 4), (v) => Math.floor((v + 1) * 3.5)),
    [2, 5],
    'int32',
  );
const cases: Case[] = [
  {
    name: 'layerNorm',
    ours: (x, g, b) => layerNorm(x!, g!, b!),
    ref: (x, g, b) => reference.layerNorm(x!, g!, b!),
    inputs: () => [
      tf.tensor(values(2 * 3 * 16, 1, 3), [2, 3, 16]),
      tf.tensor(values(16, 2), [16]),
      tf.tensor(values(16, 3), [16]),
    ],
  },
  {
    name: 'gelu',
    ours: (x) => gelu(x!),
    ref: (x) => reference.gelu(x!),
    inputs: () => [tf.tensor(values(3 * 40, 5, 4), [3, 40])],
  },
  {
    name: 'maskedSoftmax',
    ours: (s) => maskedSoftmax(s!, 0.3),
    ref: (s) => reference.maskedSoftmax(s!, 0.3),
    inputs: () => [tf.tensor(values(3 * 6 * 6, 6, 5), [3, 6, 6])],
  },
  {
    name: 'causalSelfAttention',
    ours: (x, ...w) => causalSelfAttention(x!, 2, w[0]!, w[1]!, w[2]!, w[3]!),
    ref: (x, ...w) => reference.attention(x!, 2, ...w),
    inputs: () => [
      tf.tensor(values(2 * 5 * 8, 41), [2, 5, 8]),
      tf.tensor(values(8 * 24, 42, 0.5), [8, 24]),
      tf.tensor(values(24, 43), [24]),
      tf.tensor(values(8 * 8, 44, 0.5), [8, 8]),
      tf.tensor(values(8, 45), [8]),
    ],
  },
  {
    name: 'softmaxCrossEntropy',
    ours: (l) => softmaxCrossEntropy(l!, labels()),
    ref: (l) => reference.softmaxCrossEntropy(l!, labels()),
    inputs: () => [tf.tensor(values(2 * 5 * 7, 7, 3), [2, 5, 7])],
  },
];

test('custom-gradient layers match the stock TF.js compositions on cpu and wasm (values and gradients)', async () => {
  await initBackend('cpu');
  const expected = cases.map((c, i) =>
    valueAndGrads(c.ref, c.inputs(), 10 + i),
  );
  for (const backend of ['cpu', 'wasm']) {
    await initBackend(backend);
    cases.forEach((c, i) => {
      const got = valueAndGrads(c.ours, c.inputs(), 10 + i);
      got.forEach((g, j) =>
        close(
          g,
          expected[i]![j]!,
          `${backend} ${c.name} ${j === 0 ? 'value' : `grad ${j - 1}`}`,
        ),
      );
    });
  }
});

test('custom-gradient layers match central finite differences (float64 reference on cpu)', async () => {
  await initBackend('cpu');
  cases.forEach((c, i) => {
    const xs = c.inputs();
    const grads = valueAndGrads(c.ours, xs, 20 + i).slice(1);
    const y0 = c.ours(...xs);
    const w = values(y0.size, 20 + i);
    y0.dispose();
    const objective = (vals: Float32Array[]) =>
      tf.tidy(() => {
        const y = c
          .ours(...vals.map((v, k) => tf.tensor(v, xs[k]!.shape)))
          .dataSync();
        let s = 0;
        for (let q = 0; q < y.length; q++) s += y[q]! * w[q]!;
        return s;
      });
    xs.forEach((x, k) => {
      const base = xs.map((t) => Float32Array.from(t.dataSync()));
      const h = 1e-2;
      for (let q = 0; q < x.size; q += Math.max(1, Math.floor(x.size / 12))) {
        const orig = base[k]![q]!;
        base[k]![q] = orig + h;
        const up = objective(base);
        base[k]![q] = orig - h;
        const down = objective(base);
        base[k]![q] = orig;
        const fd = (up - down) / (2 * h);
        const g = grads[k]![q]!;
        assert.ok(
          Math.abs(fd - g) <= 2e-3 * (1 + Math.abs(fd)),
          `${c.name} input ${k} [${q}]: fd ${fd} vs grad ${g}`,
        );
      }
    });
    xs.forEach((t) => t.dispose());
  });
});

test('causal self-attention: wasm values and gradients match cpu', async () => {
  const [B, T, D, H] = [2, 5, 8, 2];
  const mk = () => [
    tf.tensor(values(B * T * D, 31), [B, T, D]),
    tf.tensor(values(D * 3 * D, 32, 0.5), [D, 3 * D]),
    tf.tensor(values(3 * D, 33), [3 * D]),
    tf.tensor(values(D * D, 34, 0.5), [D, D]),
    tf.tensor(values(D, 35), [D]),
  ];
  const f = (
    x?: tf.Tensor,
    a?: tf.Tensor,
    b?: tf.Tensor,
    c?: tf.Tensor,
    d?: tf.Tensor,
  ) => causalSelfAttention(x!, H, a!, b!, c!, d!);
  await initBackend('cpu');
  const cpu = valueAndGrads(f, mk(), 40);
  await initBackend('wasm');
  const wasm = valueAndGrads(f, mk(), 40);
  wasm.forEach((g, j) => close(g, cpu[j]!, `attention ${j}`, 1e-4));
});

test("dense on [B, T, Din] with a bias: the stock composition's values and gradients, as one kernel run forward and none of Reshape either way", async () => {
  await initBackend('cpu');
  const x = tf.tensor3d(values(2 * 3 * 5, 1), [2, 3, 5]);
  const w = tf.tensor2d(values(5 * 4, 2), [5, 4]);
  const b = tf.tensor1d(values(4, 3));
  const dy = tf.tensor3d(values(2 * 3 * 4, 4), [2, 3, 4]);
  const { result: got, runs } = engineRuns(() =>
    tf.grads((x, w, b) => dense(x!, w!, b!))([x, w, b], dy),
  );
  const stock = (x: tf.Tensor, w: tf.Tensor, b: tf.Tensor) =>
    tf.add(tf.reshape(tf.matMul(tf.reshape(x, [6, 5]), w), [2, 3, 4]), b);
  const want = tf.grads((x, w, b) => stock(x!, w!, b!))([x, w, b], dy);
  got.forEach((g, i) => {
    assert.deepEqual(g.shape, [x, w, b][i]!.shape);
    assertClose(g.dataSync(), want[i]!.dataSync(), `gradient ${i}`, 1e-5);
  });
  assertClose(
    dense(x, w, b).dataSync(),
    stock(x, w, b).dataSync(),
    'dense',
    1e-5,
  );
  // the forward's one op; its gradient's products and sum run on views, not through the engine
  assert.deepEqual([...runs], [['LayerwiseDense', 1]]);
});

for (const backend of ['cpu', 'native']) {
  test(`dense with a bias (${backend}): bit for bit the reshaped _FusedMatMul's output and gradients, on one tape node`, async (t) => {
    try {
      await initBackend(backend);
    } catch {
      t.skip(`no ${backend} backend here`);
      return;
    }
    const x = tf.tensor3d(values(4 * 8 * 24, 5), [4, 8, 24]);
    const w = tf.tensor2d(values(24 * 40, 6, 0.2), [24, 40]);
    const b = tf.tensor1d(values(40, 7));
    const dy = tf.tensor3d(values(4 * 8 * 40, 8), [4, 8, 40]);
    const f = (op: (x: tf.Tensor, w: tf.Tensor, b: tf.Tensor) => tf.Tensor) =>
      tf.grads((x, w, b) => op(x!, w!, b!))([x, w, b], dy);
    const [got, want] = [f(dense), f(fusedDense)];
    got.forEach((g, i) =>
      assert.deepEqual(g.dataSync(), want[i]!.dataSync(), `gradient ${i}`),
    );
    assert.deepEqual(dense(x, w, b).dataSync(), fusedDense(x, w, b).dataSync());
    const engine = tf.engine() as unknown as {
      startTape(): void;
      endTape(): void;
      state: { activeTape: { kernelName: string; saved?: tf.Tensor[] }[] };
    };
    engine.startTape();
    const tape = engine.state.activeTape;
    try {
      tf.dispose(dense(x, w, b));
    } finally {
      engine.endTape();
    }
    // where the reshaped product recorded Reshape, Reshape, _FusedMatMul, Reshape
    assert.deepEqual(
      tape.map((n) => n.kernelName),
      ['LayerwiseDense'],
    );
    tf.dispose([
      x,
      w,
      b,
      dy,
      ...got,
      ...want,
      ...tape.flatMap((n) => n.saved ?? []),
    ]);
  });
}
