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
