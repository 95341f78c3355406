/**
 * Comparing a backend's results with the cpu backend's, for the backend tests (native,
 * native convolution, webgpu): the same random inputs on both, differences measured relative
 * to the output's scale (sums of many float32 products round differently on each).
 */
import assert from 'node:assert/strict';
import { initBackend } from '../backend/index.js';
import { tf } from '../backend/tfjs.js';
import { Rng } from '../util/rng.js';
import { scaledDifference } from '../util/stats.js';

/** n standard-normal float32 values from `seed`. */
export function randomArray(n: number, seed: number): Float32Array {
  const rng = new Rng(seed);
  return Float32Array.from({ length: n }, () => rng.normal());
}

/** Runs `f` on fresh random tensors of `shapes` on backend `name` and returns its outputs' values and shapes. */
export async function onBackend(
  name: string,
  shapes: number[][],
  f: (...xs: tf.Tensor[]) => tf.Tensor[],
): Promise<Array<{ shape: number[]; values: Float32Array }>> {
  await initBackend(name);
  return tf.tidy(() => {
    const xs = shapes.map((s, i) =>
      tf.tensor(randomArray(tf.util.sizeFromShape(s), 100 + i), s, 'float32'),
    );
    return f(...xs).map((y) => ({
      shape: y.shape,
      values: y.dataSync() as Float32Array,
    }));
  });
}

// the tests' measure of a difference, shared with the benches (util/stats.ts)
export { scaledDifference };

/**
 * Asserts that `f` on `backend` gives the cpu backend's outputs (shapes equal, values within
 * `tol` of their scale). `nonEmpty`: also that no output is empty.
 */
export async function assertSameAsCpu(
  backend: string,
  what: string,
  shapes: number[][],
  f: (...xs: tf.Tensor[]) => tf.Tensor[],
  opts: { tol?: number; nonEmpty?: boolean } = {},
): Promise<void> {
  const tol = opts.tol ?? 1e-4;
  const cpu = await onBackend('cpu', shapes, f);
  const got = await onBackend(backend, shapes, f);
  assert.equal(got.length, cpu.length);
  got.forEach((y, i) => {
    assert.deepEqual(y.shape, cpu[i]!.shape, `${what}: output ${i} shape`);
    if (opts.nonEmpty)
      assert.ok(y.values.length > 0, `${what}: output ${i} is empty`);
    const { worst, scale } = scaledDifference(y.values, cpu[i]!.values);
    assert.ok(
      worst <= tol,
      `${what}: output ${i} differs from cpu by ${worst} of its scale ${scale}`,
    );
  });
}
