import assert from 'node:assert/strict';
import { before, test } from 'node:test';
import { initBackend } from '../backend/index.js';
import { backwardBytesProbe, deviceBytes } from '../backend/memory.js';
import { tf } from '../backend/tfjs.js';
import { initParams } from '../model/init.js';
import { decoderBlock } from '../model/transformer.js';
import {
  assertSameGrads,
  disposeAll,
  GRAD_CASES,
  lossStage,
  maxAbsDiff,
  randn,
} from '../testing/grad-cases.js';
import { Rng } from '../util/rng.js';
import {
  backwardRecompute,
  backwardRecorded,
  disposeRecorded,
  recordForward,
} from './rematerialize.js';

before(async () => {
  await initBackend('cpu');
});

for (const [name, make] of GRAD_CASES) {
  test(`${name}: recorded and recomputed backward equal tf.grads, and free everything`, () => {
    const rng = new Rng(1);
    const { f, xs } = make(rng);
    const dy = tf.tidy(() => randn(f(...xs).shape, rng));
    const ref = tf.grads(f)(xs, dy);

    const n0 = tf.memory().numTensors;
    const b0 = tf.memory().numBytes;
    const rec = recordForward(() => f(...xs));
    // The output is the forward's value, and activations stay alive for the backward.
    const yRef = tf.tidy(() => f(...xs));
    assert.ok(maxAbsDiff(rec.y, yRef) === 0, 'recorded forward output');
    yRef.dispose();
    assert.ok(rec.tape.length > 0, 'the tape has nodes');
    assert.ok(tf.memory().numTensors > n0 + 1, 'activations are kept');
    const recorded = backwardRecorded(rec, xs, dy);
    assertSameGrads(recorded, ref, `${name} recorded`);
    disposeAll(recorded);
    assert.equal(
      tf.memory().numTensors,
      n0,
      `${name}: recorded backward leaves no tensors`,
    );
    assert.equal(tf.memory().numBytes, b0);
    assert.equal(rec.y.isDisposed, true);

    const recomputed = backwardRecompute(f, xs, dy);
    assertSameGrads(recomputed, ref, `${name} recompute`);
    disposeAll(recomputed);
    assert.equal(
      tf.memory().numTensors,
      n0,
      `${name}: recompute leaves no tensors`,
    );

    // A scalar loss with a scalar seed, as on the last stage (dL/dloss = 1/M).
    const { lossFn, labels } = lossStage(f, xs[xs.length - 1].shape[0]!);
    const seed = tf.scalar(0.25);
    const refLoss = tf.grads(lossFn)(xs, seed);
    const n1 = tf.memory().numTensors;
    const recLoss = recordForward(() => lossFn(...xs));
    assert.equal(recLoss.y.rank, 0);
    const gotLoss = backwardRecorded(recLoss, xs, seed);
    assertSameGrads(gotLoss, refLoss, `${name} loss recorded`);
    const reLoss = backwardRecompute(lossFn, xs, seed);
    assertSameGrads(reLoss, refLoss, `${name} loss recompute`);
    disposeAll([...gotLoss, ...reLoss]);
    assert.equal(
      tf.memory().numTensors,
      n1,
      `${name}: loss backward leaves no tensors`,
    );

    disposeAll([...ref, ...refLoss, ...xs, dy, labels, seed]);
  });

  test(`${name}: disposeRecorded frees everything`, () => {
    const rng = new Rng(2);
    const { f, xs } = make(rng);
    const n0 = tf.memory().numTensors;
    const b0 = tf.memory().numBytes;
    const rec = recordForward(() => f(...xs));
    assert.ok(tf.memory().numTensors > n0 + 1);
    disposeRecorded(rec);
    assert.equal(tf.memory().numTensors, n0);
    assert.equal(tf.memory().numBytes, b0);
    assert.equal(rec.y.isDisposed, true);
    assert.deepEqual(rec.tape, []);
    disposeAll(xs);
  });

  test(`${name}: several pending recorded forwards, backward in reverse order, mixed with recompute`, () => {
    // GPipe with --checkpoint never keeps M forwards alive, then backpropagates last first;
    // except_last mixes one recorded micro-batch with recomputed ones.
    const rng = new Rng(3);
    const { f, xs } = make(rng);
    const params = xs.slice(0, -1);
    const x = xs[xs.length - 1];
    const inputs = [
      x,
      tf.tidy(() => tf.mul(x, -0.5)),
      tf.tidy(() => tf.add(x, 0.3)),
    ];
    const dys = inputs.map(() =>
      tf.tidy(() => randn(f(...params, x).shape, rng)),
    );
    const refs = inputs.map((inp, i) => tf.grads(f)([...params, inp], dys[i]));
    const n0 = tf.memory().numTensors;
    const recs = inputs
      .slice(0, 2)
      .map((inp) => recordForward(() => f(...params, inp)));
    // Micro-batch 2 recomputes while 0 and 1 are pending.
    const g2 = backwardRecompute(f, [...params, inputs[2]], dys[2]);
    assertSameGrads(g2, refs[2], `${name} mb 2 (recompute)`);
    const g1 = backwardRecorded(recs[1], [...params, inputs[1]], dys[1]);
    assertSameGrads(g1, refs[1], `${name} mb 1 (recorded)`);
    const g0 = backwardRecorded(recs[0], [...params, inputs[0]], dys[0]);
    assertSameGrads(g0, refs[0], `${name} mb 0 (recorded)`);
    disposeAll([...g0, ...g1, ...g2]);
    assert.equal(tf.memory().numTensors, n0);
    disposeAll([...refs.flat(), ...dys, ...inputs, ...params]);
  });
}

test('recordForward refuses to run inside a gradient computation and leaves the engine usable', () => {
  const x = tf.scalar(3);
  assert.throws(
    () => tf.grads((a: tf.Tensor) => recordForward(() => tf.mul(a, a)).y)([x]),
    /inside a gradient computation/,
  );
  const engine = tf.engine() as unknown as {
    state: { activeTape: unknown; gradientDepth: number };
  };
  assert.equal(engine.state.gradientDepth, 0);
  // A failing forward leaves the tape off, and later gradients are right.
  assert.throws(
    () =>
      recordForward(() => {
        throw new Error('boom');
      }),
    /boom/,
  );
  assert.equal(engine.state.activeTape, null);
  assert.equal(engine.state.gradientDepth, 0);
  const [g] = tf.grads((a: tf.Tensor) => tf.mul(a, a))([x]);
  assert.equal(g.dataSync()[0], 6);
  g.dispose();
  x.dispose();
});

test('a recorded backward frees the tape and the intermediate gradients as it goes: when it reaches the input, a block holds little more than its gradients (tf.grads holds the whole tape and every gradient)', () => {
  const block = decoderBlock('d', 32, 2, 16);
  const values = initParams([block], 1);
  const ps = block.params.map((s) =>
    tf.tensor(values.get(`0.${s.name}`)!, s.shape),
  );
  const x = randn([8, 16, 32], new Rng(2));
  // an identity on the input whose gradient notes the device's bytes: the backward's last op
  const { probe, bytes: probed } = backwardBytesProbe();
  const f = (...a: tf.Tensor[]) => {
    const p: Record<string, tf.Tensor> = {};
    block.params.forEach((s, i) => (p[s.name] = a[i]!));
    return block.forward(p, probe(a[a.length - 1]!));
  };
  const xs = [...ps, x];
  const dy = tf.tidy(() => tf.onesLike(f(...xs)));
  const gradBytes = xs.reduce((s, t) => s + 4 * t.size, 0);

  const b0 = deviceBytes();
  const rec = recordForward(() => f(...xs));
  const kept = deviceBytes() - b0;
  const ours = backwardRecorded(rec, xs, dy);
  const oursHeld = probed() - b0;
  const b1 = deviceBytes();
  const ref = tf.grads(f)(xs, dy);
  const refHeld = probed() - b1;
  assertSameGrads(ours, ref, 'decoder block');
  assert.ok(
    kept > 4 * gradBytes,
    `the tape (${kept} B) outweighs the gradients`,
  );
  assert.ok(
    oursHeld < 2 * gradBytes,
    `held at the input: ${oursHeld} B, the gradients ${gradBytes} B, the tape ${kept} B`,
  );
  assert.ok(refHeld >= kept, `tf.grads held ${refHeld} B, the tape ${kept} B`);
  disposeAll([...ours, ...ref, ...xs, dy]);
});

test('a recorded forward does not keep what is saved only for its shape (a residual branch, a sum): the same gradients, fewer bytes', () => {
  const rng = new Rng(5);
  const x = randn([16, 8], rng);
  const w = randn([8, 8], rng);
  // m = x w is saved by Add only (its gradient reads shapes), s = m + x by Sum only
  const f = (a: tf.Tensor, input: tf.Tensor) =>
    tf.sum(tf.add(tf.matMul(input, a), input));
  const ref = tf.grads(f)([w, x]);
  const b0 = deviceBytes();
  const rec = recordForward(() => f(w, x));
  const kept = deviceBytes() - b0;
  assert.ok(
    kept < 4 * 16 * 8,
    `kept ${kept} B: neither m nor s (${4 * 16 * 8} B each), the scalar output only`,
  );
  const got = backwardRecorded(rec, [w, x], tf.scalar(1));
  assertSameGrads(got, ref, 'residual sum');
  disposeAll([...got, ...ref, x, w]);
});
