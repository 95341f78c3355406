/**
 * backend/saved-tensors.ts: on cpu, wasm and native (where its addon is built), a tensor the
 * engine saves for the backward (a registered gradient's inputs, a customGrad's `save`) shares
 * the original's data with no Identity kernel run and no tape node; the saved handle keeps the
 * data alive after the original is disposed; gradients are unchanged; and once everything is
 * disposed no tensor or data buffer is left.
 */
import assert from 'node:assert/strict';
import { test } from 'node:test';
import { gelu } from '../model/layers.js';
import { tapeEngine } from '../pipeline/tape.js';
import { initBackend } from './index.js';
import { nativeAddon, nativeUnavailable } from './native.js';
import { tf } from './tfjs.js';

for (const backend of ['cpu', 'wasm', 'native'] as const)
  test(`${backend}: saved tensors share their data, with no Identity kernel or tape node`, {
    skip:
      backend === 'native' && !nativeAddon()
        ? `native backend unavailable: ${nativeUnavailable()}`
        : false,
  }, async () => {
    await initBackend(backend);
    const tensors0 = tf.memory().numTensors;
    const buffers0 = tf.engine().backend.numDataIds();
    const x = tf.tensor2d([0.5, -1, 2, 3], [2, 2]);
    const w = tf.tensor2d([1, 2, -3, 0.25], [2, 2]);
    const eng = tapeEngine();
    eng.startTape();
    let tape: { kernelName: string; saved?: tf.Tensor[] }[] = [];
    let y: tf.Tensor | undefined;
    let h: tf.Tensor | undefined;
    const kernels = (
      await tf.profile(() => {
        h = tf.matMul(x, w); // BatchMatMul saves a and b
        y = gelu(h); // a customGrad: saves h
        tape = [...(eng.state.activeTape ?? [])];
        return [];
      })
    ).kernelNames;
    eng.endTape();
    assert.ok(!kernels.includes('Identity'), `kernels run: ${kernels}`);
    assert.ok(
      tape.every((n) => n.kernelName !== 'Identity'),
      `tape: ${tape.map((n) => n.kernelName)}`,
    );
    const product = tape.find((n) => n.kernelName === 'BatchMatMul')!;
    const saved = product.saved!;
    assert.equal(saved.length, 2);
    // the saved a is a new handle on x's own data, which outlives x
    assert.notEqual(saved[0]!.id, x.id);
    assert.equal(saved[0]!.dataId, x.dataId);
    const want = await x.data();
    x.dispose();
    assert.deepEqual(await saved[0]!.data(), want);
    // everything freed: no tensor or data buffer left
    for (const n of tape) n.saved?.forEach((t) => t.dispose());
    tf.dispose([w, h!, y!]);
    assert.equal(tf.memory().numTensors, tensors0, 'tensors');
    assert.equal(tf.engine().backend.numDataIds(), buffers0, 'data buffers');
  });

test('cpu: gradients through saved tensors equal finite differences', async () => {
  await initBackend('cpu');
  const x = tf.tensor1d([0.3, -0.7, 1.1]);
  const w = tf.tensor2d([0.5, -0.2, 0.1, 0.4, -0.3, 0.2], [3, 2]);
  const f = (x: tf.Tensor, w: tf.Tensor) =>
    tf.sum(gelu(tf.matMul(tf.reshape(x, [1, 3]), w)));
  const [dx] = tf.grads((x: tf.Tensor) => f(x, w))([x]);
  const got = await dx!.data();
  const xs = await x.data();
  for (let i = 0; i < 3; i++) {
    const h = 1e-2;
    const at = (d: number) => {
      const v = Float32Array.from(xs);
      v[i]! += d;
      return f(tf.tensor1d(v), w).dataSync()[0]!;
    };
    const fd = (at(h) - at(-h)) / (2 * h);
    assert.ok(Math.abs(fd - got[i]!) < 1e-3, `dx[${i}]: ${got[i]} vs ${fd}`);
  }
});
