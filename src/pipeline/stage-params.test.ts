import assert from 'node:assert/strict';
import { before, test } from 'node:test';
import { initBackend } from '../backend/index.js';
import { tf } from '../backend/tfjs.js';
import { GradAccumulator } from './stage-params.js';

before(async () => {
  await initBackend('cpu');
});

/** An accumulator holding one gradient per entry of `grads`. */
function holding(grads: number[][]): GradAccumulator {
  const acc = new GradAccumulator();
  acc.add(
    grads.map((_, i) => `g${i}`),
    grads.map((g) => tf.tensor1d(g)),
  );
  return acc;
}

test("a stage's sum of squares is the double sum of every gradient element's square", async () => {
  const acc = holding([
    [1, -2, 3],
    [0.5, 4],
  ]);
  assert.equal(await acc.sumSquares(), 1 + 4 + 9 + 0.25 + 16);
  acc.clear();
});

test('finite gradients whose float32 squares overflow give a finite sum of squares; a non-finite element gives a non-finite one', async () => {
  // 3e20 squared is 9e40, beyond float32 (3.4e38): the float32 sum is Infinity
  const huge = holding([[3e20, -4e20], [1]]);
  const s = await huge.sumSquares();
  assert.ok(Number.isFinite(s), `sum of squares ${s}`);
  assert.ok(
    Math.abs(s - 25e40) / 25e40 < 1e-6,
    `sum of squares ${s}, want 2.5e41`,
  );
  huge.clear();
  const inf = holding([[3e20, Number.POSITIVE_INFINITY], [1]]);
  assert.equal(await inf.sumSquares(), Number.POSITIVE_INFINITY);
  inf.clear();
  const nan = holding([[3e20, Number.NaN], [1]]);
  assert.ok(Number.isNaN(await nan.sumSquares()));
  nan.clear();
});

test('squaredSums then totalSquares give sumSquares; totalSquares refuses a count of sums that is not one a gradient', async () => {
  const acc = holding([[3, 4], [1e20], [2]]);
  const sums = acc.squaredSums()!;
  const values = (await sums.data()) as Float32Array;
  sums.dispose();
  assert.deepEqual(Array.from(values.slice(0, 1)), [25]);
  assert.equal(values[1], Infinity, "1e20's float32 square overflows");
  const total = await acc.totalSquares(values);
  assert.equal(total, await acc.sumSquares());
  assert.equal(total, 25 + Math.fround(1e20) ** 2 + 4);
  await assert.rejects(
    acc.totalSquares(values.subarray(0, 2)),
    /2 sums of squares for 3 gradients/,
  );
  acc.clear();
  assert.equal(new GradAccumulator().squaredSums(), null);
});
