/**
 * The native backend against the cpu backend: every native kernel and its gradient equal the
 * cpu backend's within float32 tolerance on odd shapes (transposed and batched operands, batch
 * broadcasting, batch 1, sizes that are not multiples of 8 or 16, empty products), the kernels
 * it does not provide fall back to the cpu backend's, and the native host optimizer equals the
 * JS one. Skipped, saying why, where the addon is not built.
 */
import { test } from 'node:test';
import assert from 'node:assert/strict';
import { initBackend } from './index.js';
import { nativeAddon, nativeKernelNames, nativeUnavailable } from './native.js';
import { tf } from './tfjs.js';
import { hostUpdate } from '../param-server/host-optimizer.js';
import { defaultOptimizerConfig } from '../optim/optimizer.js';
import { Rng } from '../util/rng.js';

const skip = nativeAddon() ? false : `native backend unavailable: ${nativeUnavailable()}`;

function randomArray(n: number, seed: number): Float32Array {
  const rng = new Rng(seed);
  return Float32Array.from({ length: n }, () => rng.normal());
}

/** Runs `f` on fresh tensors of `shapes` on backend `name` and returns its outputs' values and shapes. */
async function on(name: string, shapes: number[][], f: (...xs: tf.Tensor[]) => tf.Tensor[]): Promise<Array<{ shape: number[]; values: Float32Array }>> {
  await initBackend(name);
  return tf.tidy(() => {
    const xs = shapes.map((s, i) => tf.tensor(randomArray(tf.util.sizeFromShape(s), 100 + i), s, 'float32'));
    return f(...xs).map((y) => ({ shape: y.shape, values: y.dataSync() as Float32Array }));
  });
}

async function assertSameAsCpu(what: string, shapes: number[][], f: (...xs: tf.Tensor[]) => tf.Tensor[], tol = 1e-4): Promise<void> {
  const cpu = await on('cpu', shapes, f);
  const native = await on('native', shapes, f);
  assert.equal(native.length, cpu.length);
  native.forEach((y, i) => {
    assert.deepEqual(y.shape, cpu[i]!.shape, `${what}: output ${i} shape`);
    // differences relative to the output's scale (sums of many float32 products round differently)
    const scale = Math.max(1, ...Array.from(cpu[i]!.values, Math.abs));
    let worst = 0;
    for (let j = 0; j < y.values.length; j++) {
      const d = Math.abs(y.values[j]! - cpu[i]!.values[j]!) / scale;
      if (!(d <= worst)) worst = d; // NaN-safe: a NaN difference becomes the worst
    }
    assert.ok(worst <= tol, `${what}: output ${i} differs from cpu by ${worst} of its scale ${scale}`);
  });
}

const MATMULS: Array<[string, number[], number[], boolean, boolean]> = [
  ['2-D', [5, 7], [7, 3], false, false],
  ['2-D, a transposed', [7, 5], [7, 3], true, false],
  ['2-D, b transposed', [5, 7], [3, 7], false, true],
  ['2-D, both transposed', [7, 5], [3, 7], true, true],
  ['batch 1', [1, 9, 17], [1, 17, 33], false, false],
  ['batched, same batch', [4, 9, 17], [4, 17, 13], false, false],
  ['batched, both transposed', [4, 17, 9], [4, 13, 17], true, true],
  ['batched a, shared b', [3, 6, 10, 17], [17, 19], false, false],
  ['batched a transposed, shared b', [3, 17, 10], [17, 19], true, false],
  ['shared a, batched b', [10, 17], [6, 17, 19], false, false],
  ['many small (attention-like)', [2, 4, 24, 8], [2, 4, 8, 24], false, false],
  ['wide (not a multiple of 16)', [33, 257], [129, 257], false, true],
];

for (const [name, sa, sb, tA, tB] of MATMULS) {
  test(`native matMul equals cpu: ${name}`, { skip }, async () => {
    await assertSameAsCpu(`matMul ${name}`, [sa, sb], (a, b) => [tf.matMul(a!, b!, tA, tB)]);
  });
}

test('native matMul gradients equal cpu, with broadcast batches', { skip }, async () => {
  for (const [name, sa, sb, tA, tB] of MATMULS) {
    await assertSameAsCpu(`d matMul ${name}`, [sa, sb], (a, b) => tf.grads((x, y) => tf.sum(tf.square(tf.matMul(x!, y!, tA, tB))))([a!, b!]));
  }
});

test('native matMul broadcasts batch axes in full ([2,1] with [3] gives [2,3]), as explicit tiling does', { skip }, async () => {
  // the stock cpu kernel does not broadcast this case, so the reference tiles the operands first
  const ref = await on('cpu', [[2, 1, 5, 7], [3, 7, 6]], (a, b) => [tf.matMul(tf.broadcastTo(a!, [2, 3, 5, 7]), tf.broadcastTo(b!, [2, 3, 7, 6]))]);
  const native = await on('native', [[2, 1, 5, 7], [3, 7, 6]], (a, b) => [tf.matMul(a!, b!)]);
  assert.deepEqual(native[0]!.shape, [2, 3, 5, 6]);
  native[0]!.values.forEach((v, i) => assert.ok(Math.abs(v - ref[0]!.values[i]!) <= 1e-4, `element ${i}: ${v} vs ${ref[0]!.values[i]}`));
});

test('native fused matMul (bias, relu) equals cpu; empty products give empty or zero outputs', { skip }, async () => {
  await assertSameAsCpu('fused matMul', [[6, 11], [11, 5], [5]], (a, b, bias) => [tf.fused.matMul({ a: a!, b: b!, bias, activation: 'relu' })]);
  await assertSameAsCpu('fused matMul transposed, no bias', [[11, 6], [5, 11]], (a, b) => [tf.fused.matMul({ a: a!, b: b!, transposeA: true, transposeB: true })]);
  await assertSameAsCpu('k = 0', [[4, 0], [0, 3]], (a, b) => [tf.matMul(a!, b!)]);
  await assertSameAsCpu('m = 0', [[2, 0, 5], [2, 5, 3]], (a, b) => [tf.matMul(a!, b!)]);
});

test('kernels the addon does not provide fall back to the cpu backend\'s (softmax, layer-norm pieces, gather, segment sum)', { skip }, async () => {
  assert.deepEqual(nativeKernelNames().sort(), ['BatchMatMul', '_FusedMatMul']);
  await assertSameAsCpu('softmax, moments, gelu-like', [[3, 5, 16]], (x) => {
    const m = tf.moments(x!, -1, true);
    return [tf.softmax(x!), m.mean, m.variance, tf.mul(x!, tf.sigmoid(tf.mul(x!, 1.702)))];
  });
  await initBackend('native');
  const idx = tf.tensor1d([2, 0, 2], 'int32');
  const g = tf.gather(tf.tensor2d([[1, 2], [3, 4], [5, 6]]), idx);
  assert.deepEqual(Array.from(g.dataSync()), [5, 6, 1, 2, 5, 6]);
  const s = tf.unsortedSegmentSum(tf.tensor1d([1, 2, 3]), idx, 3);
  assert.deepEqual(Array.from(s.dataSync()), [2, 0, 4]);
  tf.dispose([idx, g, s]);
});

test('native host AdamW and SGD equal the JS host optimizer within 1e-6', { skip }, () => {
  const lib = nativeAddon()!;
  const n = 100_003; // above the threading threshold, not a multiple of the vector width
  for (const step of [1, 2, 7]) {
    const adam = { ...defaultOptimizerConfig('adamw'), weightDecay: 0.1 };
    const p = randomArray(n, 1), g = randomArray(n, 2), m = randomArray(n, 3).map(Math.abs), v = randomArray(n, 4).map(Math.abs);
    const [p2, m2, v2] = [p.slice(), m.slice(), v.slice()];
    hostUpdate(adam, 2, p, g, { m, v }, 1e-2, 0.5, step);
    lib.adamw(p2, g, m2, v2, 1e-2, adam.beta1, adam.beta2, adam.epsilon, adam.weightDecay, step, 0.5);
    for (const [js, nat, what] of [[p, p2, 'p'], [m, m2, 'm'], [v, v2, 'v']] as const) {
      let worst = 0;
      for (let i = 0; i < n; i++) worst = Math.max(worst, Math.abs(js[i]! - nat[i]!) / Math.max(1, Math.abs(js[i]!)));
      assert.ok(worst <= 1e-6, `AdamW step ${step}: ${what} differs by ${worst}`);
    }
  }
  const sgd = { ...defaultOptimizerConfig('sgd'), weightDecay: 0.01 };
  const p = randomArray(n, 5), g = randomArray(n, 6), vel = randomArray(n, 7);
  const [p2, vel2] = [p.slice(), vel.slice()];
  hostUpdate(sgd, 2, p, g, { velocity: vel }, 0.1, 1, 1);
  lib.sgd(p2, g, vel2, 0.1, sgd.momentum, sgd.weightDecay, 1);
  for (let i = 0; i < n; i++) assert.ok(Math.abs(p[i]! - p2[i]!) <= 1e-6 * Math.max(1, Math.abs(p[i]!)), `SGD p[${i}]`);
  assert.throws(() => lib.adamw(p2, g.subarray(1), vel2, vel2, 0.1, 0.9, 0.99, 1e-8, 0, 1, 1), /length/);
});
