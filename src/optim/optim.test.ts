import assert from 'node:assert/strict';
import { before, test } from 'node:test';
import { tf } from '../backend/tfjs.js';
import { LayerwiseError } from '../util/errors.js';
import { Rng } from '../util/rng.js';
import { type LrSchedule, learningRate } from './lr.js';
import {
  clipScale,
  DeviceOptimizer,
  defaultOptimizerConfig,
  type OptimizerConfig,
} from './optimizer.js';

before(async () => {
  await tf.setBackend('cpu');
});

const SHAPES: Record<string, number[]> = { w: [3, 4], b: [4], k: [2, 2, 1, 3] };
const size = (s: number[]) => s.reduce((a, b) => a * b, 1);

/** Host float64 copies of the parameters and the device variables holding the same values. */
function makeParams(
  seed: number,
  names = Object.keys(SHAPES),
): { host: Map<string, Float64Array>; dev: Map<string, tf.Variable> } {
  const rng = new Rng(seed);
  const host = new Map<string, Float64Array>();
  const dev = new Map<string, tf.Variable>();
  for (const name of names) {
    const v = new Float32Array(size(SHAPES[name])).map(() => rng.normal());
    host.set(name, Float64Array.from(v));
    dev.set(name, tf.variable(tf.tensor(v, SHAPES[name]), false));
  }
  return { host, dev };
}

/** Seeded gradients for one step, as float32 (what the device sees). */
function makeGrads(rng: Rng, names: string[]): Map<string, Float32Array> {
  const g = new Map<string, Float32Array>();
  for (const name of names)
    g.set(
      name,
      new Float32Array(size(SHAPES[name])).map(() => rng.normal() * 0.5),
    );
  return g;
}

function toDevice(g: Map<string, Float32Array>): Map<string, tf.Tensor> {
  return new Map([...g].map(([k, v]) => [k, tf.tensor(v, SHAPES[k])]));
}

function dispose(m: Map<string, tf.Tensor>): void {
  for (const t of m.values()) t.dispose();
}

/** Float64 reference optimizer, written from the update rules in optimizer.ts's header. */
class RefOptimizer {
  t = 0;
  slots = new Map<string, Record<string, Float64Array>>();
  constructor(readonly c: OptimizerConfig) {}
  slot(name: string, key: string, n: number): Float64Array {
    const s = this.slots.get(name) ?? {};
    this.slots.set(name, s);
    return (s[key] ??= new Float64Array(n));
  }
  apply(
    params: Map<string, Float64Array>,
    grads: Map<string, Float32Array>,
    lr: number,
    scale: number,
  ): void {
    this.t++;
    const c = this.c;
    for (const [name, p] of params) {
      const g0 = grads.get(name);
      if (!g0) continue;
      const rank = SHAPES[name].length;
      if (c.kind === 'sgd') {
        const v = this.slot(name, 'velocity', p.length);
        for (let i = 0; i < p.length; i++) {
          const g = g0[i] * scale + c.weightDecay * p[i];
          if (c.momentum > 0) {
            v[i] = c.momentum * v[i] + g;
            p[i] -= lr * v[i];
          } else {
            p[i] -= lr * g;
          }
        }
      } else {
        const m = this.slot(name, 'm', p.length);
        const v = this.slot(name, 'v', p.length);
        for (let i = 0; i < p.length; i++) {
          const g = g0[i] * scale;
          m[i] = c.beta1 * m[i] + (1 - c.beta1) * g;
          v[i] = c.beta2 * v[i] + (1 - c.beta2) * g * g;
          const mhat = m[i] / (1 - c.beta1 ** this.t);
          const vhat = v[i] / (1 - c.beta2 ** this.t);
          let upd = mhat / (Math.sqrt(vhat) + c.epsilon);
          if (rank >= 2) upd += c.weightDecay * p[i];
          p[i] -= lr * upd;
        }
      }
    }
  }
}

function assertClose(
  dev: Map<string, tf.Variable>,
  host: Map<string, Float64Array>,
  tol: number,
  what: string,
): void {
  for (const [name, v] of dev) {
    const got = v.dataSync();
    const want = host.get(name)!;
    let max = 0;
    for (let i = 0; i < want.length; i++)
      max = Math.max(max, Math.abs(got[i] - want[i]));
    assert.ok(max <= tol, `${what}: ${name} differs by ${max}`);
  }
}

/** Global clipping scale of a set of gradients, as the pipeline computes it. */
function scaleOf(grads: Map<string, Float32Array>, maxNorm: number): number {
  let ss = 0;
  for (const g of grads.values()) for (const x of g) ss += x * x;
  return clipScale(ss, maxNorm);
}

function runAgainstReference(
  config: OptimizerConfig,
  names: string[],
  steps: number,
  seed: number,
): void {
  const { host, dev } = makeParams(seed, names);
  const opt = new DeviceOptimizer(config);
  const ref = new RefOptimizer(config);
  const rng = new Rng(seed + 1);
  let clipped = 0;
  for (let t = 0; t < steps; t++) {
    const g = makeGrads(rng, names);
    const scale = scaleOf(g, config.clipNorm);
    if (scale < 1) clipped++;
    const lr = (0.05 * (1 + t)) / steps;
    const gd = toDevice(g);
    opt.apply(dev, gd, lr, scale);
    ref.apply(host, g, lr, scale);
    dispose(gd);
    assertClose(dev, host, 1e-5, `${config.kind} step ${t + 1}`);
  }
  if (config.clipNorm > 0)
    assert.ok(clipped > 0, 'the test exercises clipping');
  opt.dispose();
  for (const v of dev.values()) v.dispose();
}

test('SGD with momentum matches the float64 reference, with clipping', () => {
  const c: OptimizerConfig = {
    ...defaultOptimizerConfig('sgd'),
    momentum: 0.9,
    clipNorm: 1,
  };
  assert.equal(c.weightDecay, 0);
  runAgainstReference(c, ['w', 'b', 'k'], 5, 10);
});

test('SGD without momentum and with weight decay on a matrix matches the reference', () => {
  runAgainstReference(
    { ...defaultOptimizerConfig('sgd'), momentum: 0, clipNorm: 0 },
    ['w', 'b', 'k'],
    3,
    20,
  );
  runAgainstReference(
    {
      ...defaultOptimizerConfig('sgd'),
      momentum: 0.5,
      weightDecay: 0.1,
      clipNorm: 2,
    },
    ['w', 'k'],
    4,
    30,
  );
});

test('AdamW matches the float64 reference, with clipping and weight decay', () => {
  const c = defaultOptimizerConfig('adamw');
  assert.deepEqual(c, {
    kind: 'adamw',
    momentum: 0.9,
    beta1: 0.9,
    beta2: 0.95,
    epsilon: 1e-8,
    weightDecay: 0.01,
    clipNorm: 1,
  });
  runAgainstReference(c, ['w', 'b', 'k'], 6, 40);
  runAgainstReference(
    { ...c, weightDecay: 0.2, beta1: 0.8, beta2: 0.99, clipNorm: 0 },
    ['w', 'b', 'k'],
    4,
    50,
  );
});

test('AdamW weight decay applies only to rank >= 2 parameters', () => {
  const c: OptimizerConfig = {
    ...defaultOptimizerConfig('adamw'),
    weightDecay: 0.1,
  };
  const { dev } = makeParams(7);
  const before = new Map(
    [...dev].map(([k, v]) => [k, Float32Array.from(v.dataSync())]),
  );
  const opt = new DeviceOptimizer(c);
  const lr = 0.5;
  for (let t = 0; t < 3; t++) {
    // Zero gradients: the Adam part is 0 / (0 + epsilon) = 0, only decay moves parameters.
    const zeros = new Map(
      [...dev].map(([k, v]) => [k, tf.zerosLike(v) as tf.Tensor]),
    );
    opt.apply(dev, zeros, lr, 1);
    dispose(zeros);
  }
  const shrink = (1 - lr * c.weightDecay) ** 3;
  for (const [k, v] of dev) {
    const got = v.dataSync();
    const b0 = before.get(k)!;
    const factor = SHAPES[k].length >= 2 ? shrink : 1;
    for (let i = 0; i < b0.length; i++)
      assert.ok(
        Math.abs(got[i] - b0[i] * factor) < 1e-6,
        `${k}[${i}]: ${got[i]} vs ${b0[i] * factor}`,
      );
  }
  opt.dispose();
});

test('parameters without a gradient are left alone; gradients are not disposed; no tensors leak', () => {
  const { dev } = makeParams(8);
  const wBefore = Float32Array.from(dev.get('w')!.dataSync());
  const opt = new DeviceOptimizer(defaultOptimizerConfig('adamw'));
  const rng = new Rng(9);
  const g = toDevice(makeGrads(rng, ['b', 'k']));
  opt.apply(dev, g, 0.1, 0.5);
  assert.deepEqual(Float32Array.from(dev.get('w')!.dataSync()), wBefore);
  for (const t of g.values()) assert.equal(t.isDisposed, false);
  const n = tf.memory().numTensors;
  for (let i = 0; i < 3; i++) opt.apply(dev, g, 0.1, 0.5);
  assert.equal(
    tf.memory().numTensors,
    n,
    'steady state: no new tensors per step',
  );
  dispose(g);
  const withSlots = tf.memory().numTensors;
  opt.dispose();
  assert.equal(
    tf.memory().numTensors,
    withSlots - 4,
    'dispose frees the m and v slots of b and k',
  );
  for (const v of dev.values()) v.dispose();
});

test('clipScale', () => {
  assert.equal(clipScale(16, 0), 1, 'maxNorm 0 disables clipping');
  assert.equal(clipScale(16, -1), 1);
  assert.equal(clipScale(1e12, 0), 1);
  assert.equal(clipScale(16, 1), 1 / (4 + 1e-6));
  assert.equal(clipScale(16, 2), 2 / (4 + 1e-6));
  assert.equal(clipScale(0.25, 1), 1, 'norm 0.5 < 1: no clipping');
  assert.equal(clipScale(0, 1), 1);
  assert.equal(clipScale(1, 1), 1 / (1 + 1e-6));
  // Scaled gradients have norm maxNorm (up to the 1e-6 guard).
  for (const [ss, max] of [
    [100, 1],
    [2.5, 0.3],
    [1e6, 5],
  ]) {
    assert.ok(
      Math.abs(Math.sqrt(ss) * clipScale(ss, max) - max) < 1e-5 * max,
      `ss=${ss} max=${max}`,
    );
  }
});

test('getState/setState round trip continues identically', async () => {
  for (const kind of ['adamw', 'sgd'] as const) {
    const c = { ...defaultOptimizerConfig(kind), weightDecay: 0.05 };
    const names = kind === 'sgd' ? ['w', 'k'] : ['w', 'b', 'k'];
    const a = makeParams(11, names).dev;
    const opt = new DeviceOptimizer(c);
    const rng = new Rng(12);
    const grads = Array.from({ length: 5 }, () => makeGrads(rng, names));
    for (let t = 0; t < 2; t++) {
      const g = toDevice(grads[t]);
      opt.apply(a, g, 0.03, scaleOf(grads[t], c.clipNorm));
      dispose(g);
    }
    const state = await opt.getState();
    assert.equal(state.step, 2);
    assert.deepEqual(Object.keys(state.slots).sort(), [...names].sort());
    for (const s of Object.values(state.slots))
      assert.deepEqual(
        Object.keys(s).sort(),
        kind === 'sgd' ? ['velocity'] : ['m', 'v'],
      );
    // A second optimizer on a copy of the parameters, restored from the state.
    const b = new Map(
      [...a].map(([k, v]) => [k, tf.variable(v.clone(), false)]),
    );
    const opt2 = new DeviceOptimizer(c);
    opt2.setState(state, b);
    const snapshot = structuredClone(state);
    for (let t = 2; t < 5; t++) {
      const scale = scaleOf(grads[t], c.clipNorm);
      const g = toDevice(grads[t]);
      opt.apply(a, g, 0.03, scale);
      opt2.apply(b, g, 0.03, scale);
      dispose(g);
    }
    for (const [k, v] of a)
      assert.deepEqual(b.get(k)!.dataSync(), v.dataSync(), `${kind} ${k}`);
    assert.deepEqual(
      state,
      snapshot,
      'getState returned copies: later steps do not change them',
    );
    assert.equal((await opt.getState()).step, 5);
    opt.dispose();
    opt2.dispose();
    for (const v of [...a.values(), ...b.values()]) v.dispose();
  }
});

test('setState copies the arrays it is given', async () => {
  const { dev } = makeParams(14, ['w']);
  const opt = new DeviceOptimizer(defaultOptimizerConfig('sgd'));
  const state = {
    step: 1,
    slots: { w: { velocity: new Float32Array(12).fill(1) } },
  };
  opt.setState(state, dev);
  state.slots.w.velocity.fill(100);
  const got = (await opt.getState()).slots.w.velocity;
  opt.dispose();
  for (const v of dev.values()) v.dispose();
  assert.deepEqual(got, new Float32Array(12).fill(1));
});

test('setState rejects unknown parameters and wrong sizes', () => {
  const { dev } = makeParams(13, ['w', 'b']);
  const opt = new DeviceOptimizer(defaultOptimizerConfig('adamw'));
  assert.throws(
    () =>
      opt.setState(
        { step: 1, slots: { nope: { m: new Float32Array(4) } } },
        dev,
      ),
    (e: unknown) => e instanceof LayerwiseError && /'nope'/.test(e.message),
  );
  assert.throws(
    () =>
      opt.setState({ step: 1, slots: { w: { m: new Float32Array(5) } } }, dev),
    (e: unknown) =>
      e instanceof LayerwiseError &&
      /'w\.m' has 5 values, parameter has 12/.test(e.message),
  );
  assert.throws(
    () => defaultOptimizerConfig('lion' as never),
    (e: unknown) =>
      e instanceof LayerwiseError && /unknown optimizer 'lion'/.test(e.message),
  );
  opt.dispose();
  for (const v of dev.values()) v.dispose();
});

test('learningRate: linear warm-up, constant, cosine endpoints', () => {
  const s: LrSchedule = {
    lr: 0.1,
    warmup: 4,
    decay: 'cosine',
    totalSteps: 14,
    minRatio: 0.1,
  };
  const near = (a: number, b: number, what: string) =>
    assert.ok(Math.abs(a - b) < 1e-12, `${what}: ${a} vs ${b}`);
  // Warm-up: lr * (step + 1) / warmup, reaching lr at the last warm-up step.
  near(learningRate(0, s), 0.025, 'step 0');
  near(learningRate(1, s), 0.05, 'step 1');
  near(learningRate(3, s), 0.1, 'last warm-up step');
  // Cosine: starts at lr right after warm-up, lr * (min + (1 - min) / 2) halfway, min * lr at the end and after.
  near(learningRate(4, s), 0.1, 'cosine start');
  near(learningRate(9, s), 0.1 * (0.1 + 0.9 * 0.5), 'cosine middle');
  near(learningRate(14, s), 0.01, 'cosine end');
  near(learningRate(100, s), 0.01, 'after the end');
  for (let t = 4; t < 14; t++)
    assert.ok(
      learningRate(t + 1, s) < learningRate(t, s),
      `decreasing at ${t}`,
    );
  // Constant decay.
  const c: LrSchedule = { ...s, decay: 'constant' };
  near(learningRate(0, c), 0.025, 'constant warm-up');
  for (const t of [4, 14, 1000]) near(learningRate(t, c), 0.1, `constant ${t}`);
  // No warm-up.
  near(learningRate(0, { ...s, warmup: 0 }), 0.1, 'no warm-up, cosine start');
  near(learningRate(14, { ...s, warmup: 0 }), 0.01, 'no warm-up, cosine end');
  near(learningRate(0, { ...c, warmup: 0 }), 0.1, 'no warm-up, constant');
  for (const lr of [0, -1, NaN])
    assert.throws(
      () => learningRate(0, { ...s, lr }),
      (e: unknown) =>
        e instanceof LayerwiseError && /--lr must be positive/.test(e.message),
    );
});
