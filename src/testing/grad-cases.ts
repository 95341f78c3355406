/**
 * Test helper: small differentiable functions with their inputs (a two-layer MLP, one charlm
 * decoder block) and gradient comparisons, for the tests of the recorded, recomputed and split
 * backwards (pipeline/rematerialize.test.ts, pipeline/split-backward.test.ts).
 */
import assert from 'node:assert/strict';
import { tf } from '../backend/tfjs.js';
import { initParams } from '../model/init.js';
import { dense, softmaxCrossEntropy } from '../model/layers.js';
import { decoderBlock } from '../model/transformer.js';
import type { Rng } from '../util/rng.js';

export type Fn = (...xs: tf.Tensor[]) => tf.Tensor;

export function randn(shape: number[], rng: Rng, std = 1): tf.Tensor {
  const n = shape.reduce((a, b) => a * b, 1);
  return tf.tensor(
    new Float32Array(n).map(() => rng.normal() * std),
    shape,
  );
}

/** A small two-layer MLP on [B, 5] inputs, output [B, 3]; params w1 [5, 7], b1 [7], w2 [7, 3], b2 [3]. */
export function mlp(rng: Rng): { f: Fn; xs: tf.Tensor[] } {
  const xs = [
    randn([5, 7], rng, 0.5),
    randn([7], rng, 0.1),
    randn([7, 3], rng, 0.5),
    randn([3], rng, 0.1),
    randn([4, 5], rng),
  ];
  const f: Fn = (w1, b1, w2, b2, x) => dense(tf.tanh(dense(x, w1, b1)), w2, b2);
  return { f, xs };
}

/** The charlm decoder block (d 8, 2 heads) on [2, 4, 8] inputs: its 12 parameters, then x. */
export function decoder(rng: Rng): { f: Fn; xs: tf.Tensor[] } {
  const block = decoderBlock('decoder0', 8, 2, 2);
  const values = initParams([block], 3);
  // Non-trivial layer-norm gains and biases so that every parameter gets a distinct gradient.
  const params = block.params.map((spec) => {
    const v = values.get(`0.${spec.name}`)!;
    const t = tf.tensor(v, spec.shape);
    if (spec.init.kind === 'normal') return t;
    const out = tf.add(t, randn(spec.shape, rng, 0.1));
    t.dispose();
    return out;
  });
  const x = randn([2, 4, 8], rng);
  const f: Fn = (...args) => {
    const p: Record<string, tf.Tensor> = {};
    block.params.forEach((spec, i) => (p[spec.name] = args[i]));
    return block.forward(p, args[block.params.length]);
  };
  return { f, xs: [...params, x] };
}

export function maxAbsDiff(a: tf.Tensor, b: tf.Tensor): number {
  assert.deepEqual(a.shape, b.shape);
  const x = a.dataSync();
  const y = b.dataSync();
  let m = 0;
  for (let i = 0; i < x.length; i++) m = Math.max(m, Math.abs(x[i] - y[i]));
  return m;
}

export function assertSameGrads(
  got: tf.Tensor[],
  want: tf.Tensor[],
  what: string,
  tol = 1e-6,
): void {
  assert.equal(got.length, want.length, what);
  got.forEach((g, i) => {
    const d = maxAbsDiff(g, want[i]);
    assert.ok(d <= tol, `${what}: gradient ${i} differs by ${d}`);
  });
  // The gradients are not all zero (the comparison means something).
  assert.ok(
    want.some((w) => tf.tidy(() => tf.max(tf.abs(w)).dataSync()[0]) > 1e-4),
    `${what}: all gradients vanish`,
  );
}

export const disposeAll = (ts: tf.Tensor[]) => ts.forEach((t) => t.dispose());

/**
 * `f` turned into a last stage's scalar loss: the mean softmax cross-entropy of the first 3
 * outputs of each of the `n` rows of f's output against labels i mod 3 ([n] int32, returned
 * to be disposed by the caller).
 */
export function lossStage(f: Fn, n: number): { lossFn: Fn; labels: tf.Tensor } {
  const labels = tf.tensor1d(
    Array.from({ length: n }, (_, i) => i % 3),
    'int32',
  );
  const lossFn: Fn = (...a) => {
    const out = f(...a);
    const flat = tf.reshape(out, [out.shape[0]!, -1]);
    return softmaxCrossEntropy(tf.slice(flat, [0, 0], [-1, 3]), labels);
  };
  return { lossFn, labels };
}

export const GRAD_CASES = [
  ['mlp', mlp],
  ['decoder block', decoder],
] as const;
