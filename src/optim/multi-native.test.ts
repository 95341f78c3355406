/**
 * The multi-tensor AdamW (kernel-names.ts ADAMW_MULTI_KERNEL) on the native backend, through
 * DeviceOptimizer: the optimizer keeps AdamW's moments flat, in parts of at most the kernel's
 * `elementsPerCall` elements (native: 2^22), and must give the parameters the per-parameter
 * fused kernel (ADAMW_KERNEL) gives, bit for bit, across parts whose decayed prefix is cut, and
 * across a getState/setState round trip (checkpoints). Skipped where the addon is not built.
 */
import assert from 'node:assert/strict';
import { test } from 'node:test';
import { initBackend } from '../backend/index.js';
import { ADAMW_MULTI_KERNEL } from '../backend/kernel-names.js';
import { nativeAddon, nativeUnavailable } from '../backend/native.js';
import { tf } from '../backend/tfjs.js';
import { Rng } from '../util/rng.js';
import { DeviceOptimizer, defaultOptimizerConfig } from './optimizer.js';

const skip = nativeAddon()
  ? false
  : `native backend unavailable: ${nativeUnavailable()}`;

/**
 * The parameters' shapes: big alone over `perCall` elements (the kernel's elementsPerCall), the
 * rest under it together: two parts, the first all decayed, the second a prefix.
 */
const shapesFor = (perCall: number): Record<string, number[]> => ({
  b: [1000],
  big: [Math.ceil(perCall / 1000) + 100, 1000],
  w: [300, 1000],
  k: [3, 500],
});

const fill = (rng: Rng, shape: number[]) =>
  tf.tensor(
    Float32Array.from({ length: shape.reduce((a, b) => a * b, 1) }, () =>
      rng.normal(),
    ),
    shape,
  );

/** Parameters (seeded) of `shapes`, and gradients for `steps` steps (seeded), on the current backend. */
function problem(shapes: Record<string, number[]>, steps: number) {
  const rng = new Rng(5);
  const params = new Map(
    Object.entries(shapes).map(([n, s]) => [n, tf.variable(fill(rng, s))]),
  );
  const grads = Array.from(
    { length: steps },
    () => new Map(Object.entries(shapes).map(([n, s]) => [n, fill(rng, s)])),
  );
  return { params, grads };
}

const config = { ...defaultOptimizerConfig('adamw'), weightDecay: 0.1 };

test('native AdamW in flat parts of at most elementsPerCall equals the per-parameter kernel bit for bit, and survives getState/setState', {
  skip,
}, async () => {
  await initBackend('native');
  const kernel = tf.getKernel(ADAMW_MULTI_KERNEL, 'native') as
    | (tf.KernelConfig & { elementsPerCall?: number })
    | undefined;
  assert.ok(kernel, 'native registers the multi-tensor AdamW');
  const perCall = kernel.elementsPerCall!;
  assert.ok(300 * 1000 + 2500 < perCall, 'w, k and b fit one call');
  const shapes = shapesFor(perCall);
  // multi-tensor, with a checkpoint round trip after step 2
  const a = problem(shapes, 4);
  let opt = new DeviceOptimizer(config);
  for (let t = 0; t < 4; t++) {
    if (t === 2) {
      const state = await opt.getState();
      opt.dispose();
      opt = new DeviceOptimizer(config);
      opt.setState(state, a.params);
    }
    opt.apply(a.params, a.grads[t]!, 0.01, 0.5);
  }
  // per parameter: the multi-tensor kernel unregistered for the run
  tf.unregisterKernel(ADAMW_MULTI_KERNEL, 'native');
  const b = problem(shapes, 4);
  const ref = new DeviceOptimizer(config);
  try {
    for (let t = 0; t < 4; t++) ref.apply(b.params, b.grads[t]!, 0.01, 0.5);
  } finally {
    tf.registerKernel(kernel);
  }
  for (const name of Object.keys(shapes))
    assert.deepEqual(
      a.params.get(name)!.dataSync(),
      b.params.get(name)!.dataSync(),
      name,
    );
  const [sa, sb] = [await opt.getState(), await ref.getState()];
  assert.deepEqual(Object.keys(sa.slots).sort(), Object.keys(sb.slots).sort());
  for (const name of Object.keys(shapes))
    for (const k of ['m', 'v'])
      assert.deepEqual(sa.slots[name]![k], sb.slots[name]![k], `${name}.${k}`);
  for (const x of [opt, ref]) x.dispose();
  for (const p of [a, b]) {
    for (const v of p.params.values()) v.dispose();
    for (const g of p.grads) for (const t of g.values()) t.dispose();
  }
});

test('native AdamW updates a parameter and its moments in place where nothing else holds them (its bf16 copy too), and out of place where a clone does; a read before the update keeps its values', {
  skip,
}, async () => {
  await initBackend('native', { precision: 'bf16' });
  const shapes = { w: [64, 32], b: [32] };
  const a = problem(shapes, 2);
  const opt = new DeviceOptimizer(config);
  try {
    opt.apply(a.params, a.grads[0]!, 0.01, 1); // moments made
    const w = a.params.get('w')!;
    const b = a.params.get('b')!;
    // a product reads w: its bf16 copy is made now and kept for its data
    tf.tidy(() => tf.matMul(tf.ones([2, 64]), w).dataSync());
    const backend = tf.backend() as unknown as {
      data: { get(id: object): { values: Float32Array } };
      parameterCopyOf(t: tf.TensorInfo): Uint16Array | null;
    };
    const copy = backend.parameterCopyOf(w);
    assert.ok(copy, 'w has a bf16 copy');
    const [wId, wValues] = [w.dataId, backend.data.get(w.dataId).values];
    const read = w.dataSync(); // a reader's values: a copy, not the array AdamW updates
    const before = Float32Array.from(read);
    const held = tf.clone(b); // shares b's data: b is updated out of place
    const bId = b.dataId;
    const heldBefore = held.dataSync().slice();
    opt.apply(a.params, a.grads[1]!, 0.01, 1);
    assert.equal(w.dataId, wId, 'w keeps its data');
    assert.equal(backend.data.get(w.dataId).values, wValues, 'and its array');
    assert.notDeepEqual(backend.data.get(w.dataId).values, before, 'updated');
    assert.equal(
      backend.parameterCopyOf(w),
      copy,
      'its bf16 copy rewritten in place',
    );
    const widened = new Float32Array(
      Uint32Array.from(copy!, (h) => h << 16).buffer,
    );
    const now = w.dataSync();
    assert.ok(
      widened.every(
        (v, i) => Math.abs(v - now[i]!) <= Math.abs(now[i]!) * 2 ** -8,
      ),
      'the copy holds the updated values rounded to bf16',
    );
    assert.ok(
      widened.some(
        (v, i) => Math.abs(v - before[i]!) > Math.abs(before[i]!) * 2 ** -8,
      ),
      'not the old ones',
    );
    assert.deepEqual(read, before, 'a read before the update keeps its values');
    assert.notEqual(b.dataId, bId, 'b, shared with a clone, gets new data');
    assert.deepEqual(
      held.dataSync(),
      heldBefore,
      'the clone keeps the old values',
    );
    held.dispose();
  } finally {
    opt.dispose();
    for (const v of a.params.values()) v.dispose();
    for (const g of a.grads) for (const t of g.values()) t.dispose();
  }
});
