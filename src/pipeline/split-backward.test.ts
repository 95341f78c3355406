import assert from 'node:assert/strict';
import { before, test } from 'node:test';
import { initBackend } from '../backend/index.js';
import { tf } from '../backend/tfjs.js';
import {
  assertSameGrads,
  disposeAll,
  GRAD_CASES,
  lossStage,
  maxAbsDiff,
  randn,
} from '../testing/grad-cases.js';
import { Rng } from '../util/rng.js';
import { backwardRecorded, recordForward } from './rematerialize.js';
import {
  backwardInput,
  backwardWeight,
  disposePending,
} from './split-backward.js';

before(async () => {
  await initBackend('cpu');
});

/** Kernels that multiply matrices (forward dense layers run _FusedMatMul, their gradients BatchMatMul). */
const PRODUCTS = ['BatchMatMul', '_FusedMatMul', 'MatMul'];

/**
 * Runs of the cpu backend's product kernels while `f` runs, counted at the kernels themselves
 * (tf.profile sees only the engine's runs, not a gradient's products on views, backend/dense.ts).
 */
function productsIn(f: () => tf.Tensor | tf.Tensor[] | null): number {
  let runs = 0;
  const originals = PRODUCTS.map((name) => tf.getKernel(name, 'cpu'));
  for (const k of originals) {
    if (!k) continue;
    tf.unregisterKernel(k.kernelName, 'cpu');
    tf.registerKernel({
      ...k,
      kernelFunc: (args) => {
        runs++;
        return k.kernelFunc(args);
      },
    });
  }
  try {
    f();
  } finally {
    for (const k of originals) {
      if (!k) continue;
      tf.unregisterKernel(k.kernelName, 'cpu');
      tf.registerKernel(k);
    }
  }
  return runs;
}

for (const [name, make] of GRAD_CASES) {
  test(`${name}: input part (I) then weight part (W) equal tf.grads, and free everything`, () => {
    const rng = new Rng(11);
    const { f, xs } = make(rng);
    const params = xs.slice(0, -1);
    const x = xs[xs.length - 1]!;
    const dy = tf.tidy(() => randn(f(...xs).shape, rng));
    const ref = tf.grads(f)(xs, dy);

    const n0 = tf.memory().numTensors;
    const rec = recordForward(() => f(...params, x));
    const { dx, pending } = backwardInput(rec, x, params, dy, true);
    assert.ok(dx, 'I returns the input gradient');
    assert.ok(maxAbsDiff(dx, ref[ref.length - 1]!) <= 1e-6, `${name}: dx`);
    assert.equal(rec.y.isDisposed, true, 'I frees the output');
    assert.ok(pending.deferred.length > 0, 'I leaves weight work for W');
    // the tape's activations stay alive until W
    assert.ok(tf.memory().numTensors > n0 + 1, 'activations are kept for W');
    const grads = backwardWeight(pending, params);
    assertSameGrads(grads, ref.slice(0, -1), `${name} W`);
    disposeAll([...grads, dx]);
    assert.equal(tf.memory().numTensors, n0, `${name}: I + W leave no tensors`);

    // first stage: no input gradient wanted, every gradient is W's
    const rec1 = recordForward(() => f(...params, x));
    const first = backwardInput(rec1, x, params, dy, false);
    assert.equal(first.dx, null);
    const grads1 = backwardWeight(first.pending, params);
    assertSameGrads(grads1, ref.slice(0, -1), `${name} W (no input gradient)`);
    disposeAll(grads1);
    assert.equal(tf.memory().numTensors, n0);

    // a last stage: scalar loss, scalar seed
    const { lossFn, labels } = lossStage(f, x.shape[0]!);
    const seed = tf.scalar(0.25);
    const refLoss = tf.grads(lossFn)(xs, seed);
    const n1 = tf.memory().numTensors;
    const recL = recordForward(() => lossFn(...params, x));
    const last = backwardInput(recL, x, params, seed, true);
    assert.ok(maxAbsDiff(last.dx!, refLoss[refLoss.length - 1]!) <= 1e-6);
    const gradsL = backwardWeight(last.pending, params);
    assertSameGrads(gradsL, refLoss.slice(0, -1), `${name} loss W`);
    disposeAll([...gradsL, last.dx!]);
    assert.equal(
      tf.memory().numTensors,
      n1,
      `${name}: loss I + W leave no tensors`,
    );
    disposeAll([...ref, ...refLoss, ...xs, dy, labels, seed]);
  });

  test(`${name}: I and W interleave across micro-batches (ZB-H1's order), disposePending frees an unfinished one`, () => {
    const rng = new Rng(12);
    const { f, xs } = make(rng);
    const params = xs.slice(0, -1);
    const x = xs[xs.length - 1]!;
    const inputs = [
      x,
      tf.tidy(() => tf.mul(x, -0.5)),
      tf.tidy(() => tf.add(x, 0.3)),
    ];
    const dys = inputs.map(() => tf.tidy(() => randn(f(...xs).shape, rng)));
    const refs = inputs.map((inp, i) => tf.grads(f)([...params, inp], dys[i]!));
    const n0 = tf.memory().numTensors;
    const recs = inputs.map((inp) => recordForward(() => f(...params, inp)));
    // I0, I1, W0, I2, W1; micro-batch 2's W never runs (a reset)
    const i0 = backwardInput(recs[0]!, inputs[0]!, params, dys[0]!, true);
    const i1 = backwardInput(recs[1]!, inputs[1]!, params, dys[1]!, true);
    const w0 = backwardWeight(i0.pending, params);
    const i2 = backwardInput(recs[2]!, inputs[2]!, params, dys[2]!, true);
    const w1 = backwardWeight(i1.pending, params);
    assertSameGrads(w0, refs[0]!.slice(0, -1), `${name} W0`);
    assertSameGrads(w1, refs[1]!.slice(0, -1), `${name} W1`);
    [i0, i1, i2].forEach((r, j) =>
      assert.ok(maxAbsDiff(r.dx!, refs[j]!.at(-1)!) <= 1e-6, `${name} dx${j}`),
    );
    disposePending(i2.pending);
    disposeAll([...w0, ...w1, i0.dx!, i1.dx!, i2.dx!]);
    assert.equal(tf.memory().numTensors, n0, `${name}: nothing left`);
    disposeAll([...refs.flat(), ...dys, ...inputs, ...params]);
  });

  test(`${name}: I and W split one backward's matrix products, none run twice`, () => {
    const rng = new Rng(13);
    const { f, xs } = make(rng);
    const params = xs.slice(0, -1);
    const x = xs[xs.length - 1]!;
    const dy = tf.tidy(() => randn(f(...xs).shape, rng));
    const full = (() => {
      const rec = recordForward(() => f(...xs));
      let grads: tf.Tensor[] = [];
      const n = productsIn(() => (grads = backwardRecorded(rec, xs, dy)));
      disposeAll(grads);
      return n;
    })();
    const rec = recordForward(() => f(...params, x));
    let pending: ReturnType<typeof backwardInput>['pending'] | undefined;
    let dx: tf.Tensor | null = null;
    const inI = productsIn(() => {
      const r = backwardInput(rec, x, params, dy, true);
      pending = r.pending;
      dx = r.dx;
      return dx;
    });
    let grads: tf.Tensor[] = [];
    const inW = productsIn(() => (grads = backwardWeight(pending!, params)));
    assert.ok(full > 0, 'the backward multiplies matrices');
    assert.ok(inI > 0, `I computes input gradients (dy W^T): ${inI}`);
    assert.ok(inW > 0, `W computes weight gradients (x^T dy): ${inW}`);
    assert.equal(
      inI + inW,
      full,
      `I (${inI}) + W (${inW}) = one backward (${full})`,
    );
    disposeAll([...grads, dx!, ...xs, dy]);
  });
}
