import assert from 'node:assert/strict';
import { before, test } from 'node:test';
import { Worker } from 'node:worker_threads';
import { initBackend } from '../backend/index.js';
import { tf } from '../backend/tfjs.js';
import type { HostParams } from '../model/init.js';
import {
  clipScale,
  DeviceOptimizer,
  defaultOptimizerConfig,
  type OptimizerConfig,
  type OptimizerState,
} from '../optim/optimizer.js';
import { assertClose } from '../testing/assert-close.js';
import { toBf16 } from '../util/bf16.js';
import { LayerwiseError } from '../util/errors.js';
import { Rng } from '../util/rng.js';
import { hostUpdate, slotNames } from './host-optimizer.js';
import { ParameterServer } from './server.js';
import { blockLayers, ParamStore } from './store.js';

before(async () => {
  await initBackend('cpu');
});

const TOL = 1e-6;
const size = (s: number[]) => s.reduce((a, b) => a * b, 1);

// A 4-layer model: layer 1 has no parameters; layer 2 mixes ranks 1, 2 and 4.
const LAYERS = [['0.w', '0.b'], [], ['2.w', '2.g', '2.k'], ['3.w']];
const SHAPES: Record<string, number[]> = {
  '0.w': [6, 10],
  '0.b': [10],
  '2.w': [10, 12],
  '2.g': [12],
  '2.k': [2, 2, 3, 4],
  '3.w': [48, 3],
};
const KEYS = LAYERS.flat();

function initial(seed: number): HostParams {
  const rng = new Rng(seed);
  return new Map(
    KEYS.map((k) => [
      k,
      new Float32Array(size(SHAPES[k])).map(() => rng.normal()),
    ]),
  );
}

/** Seeded gradients of one step, per key. */
function gradsOf(rng: Rng, keys = KEYS): Map<string, Float32Array> {
  return new Map(
    keys.map((k) => [
      k,
      new Float32Array(size(SHAPES[k])).map(() => rng.normal() * 0.7),
    ]),
  );
}

function sumSq(gs: Iterable<Float32Array>): number {
  let s = 0;
  for (const g of gs) for (const x of g) s += x * x;
  return s;
}

/** The reference: DeviceOptimizer on the cpu backend. */
class Reference {
  readonly vars = new Map<string, tf.Variable>();
  readonly opt: DeviceOptimizer;
  constructor(params: HostParams, cfg: OptimizerConfig) {
    for (const [k, v] of params)
      this.vars.set(k, tf.variable(tf.tensor(v.slice(), SHAPES[k]), false));
    this.opt = new DeviceOptimizer(cfg);
  }
  /** One step; the clipping scale is computed from all gradients as the pipeline does. */
  step(grads: Map<string, Float32Array>, lr: number): number {
    const scale = clipScale(sumSq(grads.values()), this.opt.config.clipNorm);
    const gd = new Map(
      [...grads].map(([k, g]) => [k, tf.tensor(g, SHAPES[k])]),
    );
    this.opt.apply(this.vars, gd, lr, scale);
    for (const t of gd.values()) t.dispose();
    return scale;
  }
  param(k: string): Float32Array {
    return this.vars.get(k)!.dataSync() as Float32Array;
  }
  dispose(): void {
    this.opt.dispose();
    for (const v of this.vars.values()) v.dispose();
  }
}

const CONFIGS: Array<[string, OptimizerConfig]> = [
  [
    'sgd momentum',
    {
      ...defaultOptimizerConfig('sgd'),
      momentum: 0.9,
      weightDecay: 0.1,
      clipNorm: 0,
    },
  ],
  [
    'sgd plain',
    {
      ...defaultOptimizerConfig('sgd'),
      momentum: 0,
      weightDecay: 0.1,
      clipNorm: 0,
    },
  ],
  [
    'adamw',
    { ...defaultOptimizerConfig('adamw'), weightDecay: 0.1, clipNorm: 0 },
  ],
  [
    'adamw b0.8/0.99',
    {
      ...defaultOptimizerConfig('adamw'),
      beta1: 0.8,
      beta2: 0.99,
      epsilon: 1e-6,
      weightDecay: 0.05,
      clipNorm: 0,
    },
  ],
];

test('hostUpdate equals DeviceOptimizer: sgd with and without momentum, adamw; ranks 1, 2, 4; scale != 1; 4 steps', async () => {
  for (const [name, cfg] of CONFIGS) {
    const p0 = initial(1);
    const ref = new Reference(p0, cfg);
    const host = new Map([...p0].map(([k, v]) => [k, v.slice()]));
    const slots = new Map(
      KEYS.map((k) => [
        k,
        Object.fromEntries(
          slotNames(cfg).map((s) => [s, new Float32Array(size(SHAPES[k]))]),
        ),
      ]),
    );
    const rng = new Rng(2);
    for (let t = 1; t <= 4; t++) {
      const g = gradsOf(rng);
      const lr = 0.05 * t;
      const scale = 0.6;
      const gd = new Map([...g].map(([k, v]) => [k, tf.tensor(v, SHAPES[k])]));
      ref.opt.apply(ref.vars, gd, lr, scale);
      for (const x of gd.values()) x.dispose();
      for (const k of KEYS)
        hostUpdate(
          cfg,
          SHAPES[k].length,
          host.get(k)!,
          g.get(k)!,
          slots.get(k)!,
          lr,
          scale,
          t,
        );
      for (const k of KEYS)
        assertClose(host.get(k)!, ref.param(k), `${name} step ${t} ${k}`, TOL);
    }
    const st = await ref.opt.getState();
    for (const k of KEYS)
      for (const s of slotNames(cfg))
        assertClose(
          slots.get(k)![s],
          st.slots[k][s],
          `${name} slot ${k}.${s}`,
          TOL,
        );
    ref.dispose();
  }
});

test('the comparison is sharp: a wrong rank (weight decay on a matrix skipped) or a wrong t is detected', () => {
  const cfg = CONFIGS[2][1];
  const p0 = initial(3);
  const ref = new Reference(p0, cfg);
  const g = gradsOf(new Rng(4), ['0.w']);
  ref.step(g, 0.1);
  const slots = { m: new Float32Array(60), v: new Float32Array(60) };
  const wrongRank = p0.get('0.w')!.slice();
  hostUpdate(cfg, 1, wrongRank, g.get('0.w')!, slots, 0.1, 1, 1);
  assert.throws(
    () => assertClose(wrongRank, ref.param('0.w'), 'rank 1 instead of 2', TOL),
    /max abs diff/,
  );
  const right = p0.get('0.w')!.slice();
  hostUpdate(
    cfg,
    2,
    right,
    g.get('0.w')!,
    { m: new Float32Array(60), v: new Float32Array(60) },
    0.1,
    1,
    1,
  );
  assertClose(right, ref.param('0.w'), 'rank 2', TOL);
  const wrongT = p0.get('0.w')!.slice();
  hostUpdate(
    cfg,
    2,
    wrongT,
    g.get('0.w')!,
    { m: new Float32Array(60), v: new Float32Array(60) },
    0.1,
    1,
    2,
  );
  assert.throws(
    () => assertClose(wrongT, ref.param('0.w'), 't = 2 instead of 1', TOL),
    /max abs diff/,
  );
  ref.dispose();
});

test('hostUpdate rejects mismatched lengths, missing slots and a step < 1 before changing anything', () => {
  const cfg = defaultOptimizerConfig('adamw');
  const p = new Float32Array([1, 2, 3]);
  assert.throws(
    () =>
      hostUpdate(
        cfg,
        1,
        p,
        new Float32Array(2),
        { m: new Float32Array(3), v: new Float32Array(3) },
        0.1,
        1,
        1,
      ),
    /gradient has 2 values, the parameter 3/,
  );
  assert.throws(
    () =>
      hostUpdate(
        cfg,
        1,
        p,
        new Float32Array(3),
        { m: new Float32Array(3) },
        0.1,
        1,
        1,
      ),
    /missing optimizer slot 'v'/,
  );
  assert.throws(
    () =>
      hostUpdate(
        cfg,
        1,
        p,
        new Float32Array(3),
        { m: new Float32Array(3), v: new Float32Array(4) },
        0.1,
        1,
        1,
      ),
    /slot 'v' has 4 values/,
  );
  assert.throws(
    () =>
      hostUpdate(
        cfg,
        1,
        p,
        new Float32Array(3),
        { m: new Float32Array(3), v: new Float32Array(3) },
        0.1,
        1,
        0,
      ),
    /1-based step/,
  );
  assert.throws(
    () =>
      hostUpdate(
        { ...defaultOptimizerConfig('sgd'), momentum: 0.5 },
        1,
        p,
        new Float32Array(3),
        {},
        0.1,
        1,
        1,
      ),
    /missing optimizer slot 'velocity'/,
  );
  assert.deepEqual([...p], [1, 2, 3]);
});

async function server(
  cfg: OptimizerConfig,
  threads: number,
  params = initial(5),
): Promise<ParameterServer> {
  return ParameterServer.create({
    params,
    layers: LAYERS,
    shapes: SHAPES,
    optimizer: cfg,
    threads,
  });
}

/** Pushes one step's gradients (copies: push takes ownership), layers in backward order. */
function pushStep(
  s: ParameterServer,
  g: Map<string, Float32Array>,
  lr: number,
  order = [3, 2, 1, 0],
): void {
  s.beginStep(lr);
  for (const l of order) {
    const rec = Object.fromEntries(
      LAYERS[l].filter((k) => g.has(k)).map((k) => [k, g.get(k)!.slice()]),
    );
    s.push(l, rec, sumSq(Object.values(rec)));
  }
}

for (const threads of [1, 2]) {
  for (const clipNorm of [0, 2]) {
    test(`ParameterServer (threads ${threads}, clipNorm ${clipNorm}) equals DeviceOptimizer over 3 steps; versions count updates`, async () => {
      for (const [name, base] of CONFIGS) {
        const cfg = { ...base, clipNorm };
        const p0 = initial(5);
        const ref = new Reference(p0, cfg);
        const s = await server(cfg, threads, p0);
        try {
          const rng = new Rng(6);
          let clipped = 0;
          for (let t = 1; t <= 3; t++) {
            const g = gradsOf(rng);
            if (ref.step(g, 0.03 * t) < 1) clipped++;
            pushStep(s, g, 0.03 * t);
            await s.idle();
            for (let l = 0; l < LAYERS.length; l++)
              assert.equal(
                s.store.version(l),
                t,
                `${name}: version of layer ${l} after step ${t}`,
              );
          }
          if (clipNorm > 0)
            assert.ok(clipped > 0, 'the test exercises clipping');
          const got = await s.getParams();
          assert.deepEqual([...got.keys()], KEYS);
          for (const k of KEYS)
            assertClose(got.get(k)!, ref.param(k), `${name} ${k}`, TOL);
          const spans = s.takeSpans();
          const parts = threads === 1 ? 3 : 5; // layer 0 splits in 2 with 2 threads, layer 2 in 2, layer 3 is one tensor
          assert.equal(spans.length, 3 * parts, `${name}: spans`);
          assert.equal(
            spans.reduce((a, x) => a + x.params, 0),
            3 * KEYS.reduce((a, k) => a + size(SHAPES[k]), 0),
          );
          assert.deepEqual(
            new Set(spans.map((x) => x.thread)),
            new Set(threads === 1 ? [0] : [0, 1]),
          );
          for (const x of spans)
            assert.ok(
              x.ms >= 0 && Math.abs(x.startedAt - Date.now()) < 60_000,
              'span times are epoch ms',
            );
          assert.deepEqual(s.takeSpans(), [], 'takeSpans empties');
        } finally {
          await s.close();
          ref.dispose();
        }
        assert.equal(s.runningThreads, 0, 'close ends the threads');
      }
    });
  }
}

test('push takes the gradients (transferred, not copied); a shared buffer is split correctly', async () => {
  const cfg = CONFIGS[0][1];
  const p0 = initial(7);
  const ref = new Reference(p0, cfg);
  const s = await server(cfg, 2, p0);
  try {
    const g = gradsOf(new Rng(8));
    ref.step(g, 0.1);
    s.beginStep(0.1);
    // layer 2's three gradients as views of one ArrayBuffer (as a device reply might carry them)
    const keys2 = LAYERS[2];
    const buf = new Float32Array(
      keys2.reduce((a, k) => a + size(SHAPES[k]), 0),
    );
    let off = 0;
    const rec2: Record<string, Float32Array> = {};
    for (const k of keys2) {
      buf.set(g.get(k)!, off);
      rec2[k] = buf.subarray(off, (off += size(SHAPES[k])));
    }
    const w3 = g.get('3.w')!.slice();
    s.push(3, { '3.w': w3 }, 0);
    s.push(2, rec2, 0);
    s.push(1, {}, 0);
    s.push(
      0,
      { '0.w': g.get('0.w')!.slice(), '0.b': g.get('0.b')!.slice() },
      0,
    );
    assert.equal(
      w3.length,
      0,
      'the gradient buffer was transferred (detached here)',
    );
    assert.equal(buf.length, 0, 'the shared gradient buffer was transferred');
    await s.idle();
    const got = await s.getParams();
    for (const k of KEYS) assertClose(got.get(k)!, ref.param(k), k, TOL);
  } finally {
    await s.close();
    ref.dispose();
  }
});

test('waitVersion resolves when the update lands, and at once when reached; the device view sees the update', async () => {
  const cfg = CONFIGS[2][1];
  const s = await server(cfg, 1);
  try {
    const before0 = s.store.param('0.w').slice();
    s.beginStep(0.1);
    let landed = false;
    const w = s.store.waitVersion(0, 1).then(() => (landed = true));
    await new Promise((r) => setTimeout(r, 20));
    assert.equal(landed, false, 'no update of layer 0 yet');
    s.push(3, { '3.w': new Float32Array(144).fill(1) }, 0);
    s.push(2, {}, 0);
    s.push(1, {}, 0);
    await new Promise((r) => setTimeout(r, 20));
    assert.equal(landed, false, 'other layers do not wake layer 0');
    s.push(
      0,
      {
        '0.w': new Float32Array(60).fill(1),
        '0.b': new Float32Array(10).fill(1),
      },
      0,
    );
    await w;
    assert.equal(s.store.version(0), 1);
    assert.notDeepEqual(
      s.store.param('0.w'),
      before0,
      'the update is visible once the version is',
    );
    await s.store.waitVersion(0, 1); // already reached
    await s.store.waitVersion(1, 0);
    await s.idle();
    assert.deepEqual(
      [0, 1, 2, 3].map((l) => s.store.version(l)),
      [1, 1, 1, 1],
    );
  } finally {
    await s.close();
  }
});

test('another thread attaches the layout, waits on a version and reads the updated parameter', async () => {
  const cfg = CONFIGS[0][1];
  const s = await server(cfg, 2);
  const storeUrl = new URL('./store.js', import.meta.url).href;
  const code = `
    const { parentPort, workerData } = require('node:worker_threads');
    import(${JSON.stringify(storeUrl)}).then(async ({ ParamStore }) => {
      const st = ParamStore.attach(workerData);
      parentPort.postMessage({ type: 'waiting' });
      await st.waitVersion(3, 1);
      parentPort.postMessage({ type: 'seen', values: Array.from(st.param('3.w').subarray(0, 4)) });
    });`;
  const dev = new Worker(code, { eval: true, workerData: s.layout });
  try {
    const msgs: Array<{ type: string; values?: number[] }> = [];
    const seen = new Promise<number[]>((resolve, reject) => {
      dev.on('error', reject);
      dev.on('exit', (code) =>
        reject(
          new Error(
            `the device thread exited (${code}) before seeing the update`,
          ),
        ),
      );
      dev.on('message', (m: { type: string; values?: number[] }) => {
        msgs.push(m);
        if (m.type === 'seen') resolve(m.values!);
      });
    });
    while (msgs.length === 0) await new Promise((r) => setTimeout(r, 5));
    const g = gradsOf(new Rng(9));
    pushStep(s, g, 0.5);
    const values = await seen;
    const want = s.store.param('3.w').subarray(0, 4);
    assert.deepEqual(values, Array.from(want));
  } finally {
    await dev.terminate();
    await s.close();
  }
});

test('with clipping, no layer is updated before every layer is pushed; then layers go in forward order', async () => {
  const cfg = { ...CONFIGS[2][1], clipNorm: 1 };
  const s = await server(cfg, 1);
  try {
    const before = new Map(KEYS.map((k) => [k, s.store.param(k).slice()]));
    const g = gradsOf(new Rng(10));
    s.beginStep(0.1);
    for (const l of [3, 2, 1]) {
      const rec = Object.fromEntries(
        LAYERS[l].map((k) => [k, g.get(k)!.slice()]),
      );
      s.push(l, rec, sumSq(Object.values(rec)));
    }
    let idle = false;
    const done = s.idle().then(() => (idle = true));
    await new Promise((r) => setTimeout(r, 50));
    assert.equal(idle, false, 'idle waits for the held layers');
    for (let l = 0; l < 4; l++)
      assert.equal(s.store.version(l), 0, `layer ${l} not updated yet`);
    for (const k of KEYS)
      assert.deepEqual(s.store.param(k), before.get(k), `${k} unchanged`);
    s.push(
      0,
      { '0.w': g.get('0.w')!.slice(), '0.b': g.get('0.b')!.slice() },
      sumSq([g.get('0.w')!, g.get('0.b')!]),
    );
    await done;
    const spans = s.takeSpans();
    assert.deepEqual(
      spans.map((x) => x.layer),
      [0, 2, 3],
      'forward order (layer 1 has no parameters)',
    );
    for (let i = 1; i < spans.length; i++)
      assert.ok(spans[i].startedAt >= spans[i - 1].startedAt);
    assert.deepEqual(
      [0, 1, 2, 3].map((l) => s.store.version(l)),
      [1, 1, 1, 1],
    );
  } finally {
    await s.close();
  }
});

test("parts: with beginStep(lr, 3) a layer's gradient comes in 3 pushes that the server sums (clipping from the sum's norm); a fourth part is refused", async () => {
  for (const clipNorm of [0, 2]) {
    const cfg = { ...CONFIGS[2][1], clipNorm };
    const p0 = initial(5);
    const ref = new Reference(p0, cfg);
    const s = await server(cfg, 2, p0);
    try {
      const rng = new Rng(8);
      let clipped = 0;
      for (let t = 1; t <= 2; t++) {
        // three parts per key; the reference steps on their float32 sum, added in push order
        const parts = [gradsOf(rng), gradsOf(rng), gradsOf(rng)];
        const sum = new Map(
          KEYS.map((k) => {
            const g = parts[0]!.get(k)!.slice();
            for (const q of parts.slice(1))
              g.forEach((_, i) => (g[i]! += q.get(k)![i]!));
            return [k, g];
          }),
        );
        if (ref.step(sum, 0.03 * t) < 1) clipped++;
        s.beginStep(0.03 * t, 3);
        for (const l of [3, 2, 1, 0])
          for (const q of parts) {
            const rec = Object.fromEntries(
              LAYERS[l]!.map((k) => [k, q.get(k)!.slice()]),
            );
            s.push(l, rec, -1); // a part's own sum of squares is not used
          }
        await s.idle();
        for (let l = 0; l < LAYERS.length; l++)
          assert.equal(s.store.version(l), t, `layer ${l} step ${t}`);
      }
      if (clipNorm > 0) assert.ok(clipped > 0, 'the test exercises clipping');
      const got = await s.getParams();
      for (const k of KEYS)
        assertClose(got.get(k)!, ref.param(k), `clip ${clipNorm} ${k}`, TOL);
      s.beginStep(0.1, 2);
      s.push(1, {}, 0);
      s.push(1, {}, 0);
      assert.throws(() => s.push(1, {}, 0), /layer 1 was already pushed/);
      s.push(3, { '3.w': new Float32Array(144) }, 0);
      assert.throws(
        () => s.push(3, { '3.w': new Float32Array(12) }, 0),
        /gradient '3\.w' of layer 3: a part of 12 elements after one of 144/,
      );
      assert.throws(
        () => s.beginStep(0.1, 0),
        /positive integer number of pushes/,
      );
    } finally {
      await s.close();
      ref.dispose();
    }
  }
});

test("loss scaling (f16): scaled gradients are unscaled in the update; an overflowing step updates nothing (not even AdamW's step count), halves the scale and still moves every version on", async () => {
  const cfg = { ...CONFIGS[2][1], clipNorm: 2 };
  const p0 = initial(5);
  const ref = new Reference(p0, cfg);
  const s = await ParameterServer.create({
    params: p0,
    layers: LAYERS,
    shapes: SHAPES,
    optimizer: cfg,
    threads: 1,
    lossScale: 1024,
  });
  try {
    const rng = new Rng(9);
    const g = gradsOf(rng);
    // step 1 overflows: an infinite element in layer 2
    s.beginStep(0.05);
    assert.equal(s.lossScale, 1024);
    for (const l of [3, 2, 1, 0]) {
      const rec = Object.fromEntries(
        LAYERS[l]!.map((k) => {
          const v = g.get(k)!.map((x) => x * 1024);
          if (l === 2 && k === '2.w') v[3] = Number.POSITIVE_INFINITY;
          return [k, v];
        }),
      );
      s.push(l, rec, 0);
    }
    await s.idle();
    assert.deepEqual(s.lastLossScale, {
      scale: 1024,
      skipped: true,
      overflows: 1,
    });
    assert.equal(s.lossScale, 512);
    for (let l = 0; l < LAYERS.length; l++) assert.equal(s.store.version(l), 1);
    const same = await s.getParams();
    for (const k of KEYS)
      assertClose(same.get(k)!, p0.get(k)!, `skipped ${k}`, 0);
    assert.equal((await s.getOptimizerState()).step, 0, 'no AdamW step');
    // step 2: the gradients scaled by 512 give the reference's update on the unscaled ones
    ref.step(g, 0.05);
    s.beginStep(0.05);
    for (const l of [3, 2, 1, 0])
      s.push(
        l,
        Object.fromEntries(
          LAYERS[l]!.map((k) => [k, g.get(k)!.map((x) => x * 512)]),
        ),
        0,
      );
    await s.idle();
    assert.deepEqual(s.lastLossScale, {
      scale: 512,
      skipped: false,
      overflows: 1,
    });
    const got = await s.getParams();
    for (const k of KEYS) assertClose(got.get(k)!, ref.param(k), k, TOL);
    assert.equal((await s.getOptimizerState()).step, 1);
    assert.deepEqual(s.lossScaleState(), {
      scale: 512,
      goodSteps: 1,
      overflows: 1,
    });
  } finally {
    await s.close();
    ref.dispose();
  }
});

test('protocol errors: push before beginStep, twice, a foreign key, an incomplete step', async () => {
  const s = await server(CONFIGS[0][1], 1);
  try {
    assert.throws(() => s.push(0, {}, 0), /before beginStep/);
    s.beginStep(0.1);
    assert.throws(() => s.push(4, {}, 0), /layer 4 is out of range/);
    assert.throws(
      () => s.push(0, { '3.w': new Float32Array(144) }, 0),
      /'3\.w' pushed for layer 0/,
    );
    s.push(1, {}, 0);
    assert.throws(() => s.push(1, {}, 0), /already pushed/);
    assert.throws(
      () => s.beginStep(0.1),
      /step 1 is incomplete: layers 0, 2, 3/,
    );
    assert.throws(() => s.beginStep(NaN), /finite/);
  } finally {
    await s.close();
  }
});

test('OptimizerState: {step 0, slots {}} at first; round trip between servers continues identically', async () => {
  for (const [name, cfg] of CONFIGS) {
    const a = await server(cfg, 2);
    let b: ParameterServer | undefined;
    try {
      assert.deepEqual(await a.getOptimizerState(), { step: 0, slots: {} });
      const rng = new Rng(11);
      for (let t = 1; t <= 2; t++) {
        pushStep(a, gradsOf(rng), 0.1);
        await a.idle();
      }
      const st = await a.getOptimizerState();
      assert.equal(st.step, 2);
      assert.deepEqual(
        Object.keys(st.slots),
        slotNames(cfg).length ? KEYS : [],
        `${name}: slots`,
      );
      b = await server(cfg, 1, await a.getParams());
      await b.setOptimizerState(st);
      assert.deepEqual(await b.getOptimizerState(), st, `${name}: round trip`);
      const g = gradsOf(rng);
      pushStep(a, g, 0.2);
      pushStep(b, g, 0.2);
      const [pa, pb] = [await a.getParams(), await b.getParams()];
      for (const k of KEYS)
        assert.deepEqual(pb.get(k), pa.get(k), `${name}: ${k} after resuming`);
    } finally {
      await a.close();
      await b?.close();
    }
  }
});

test('OptimizerState interchange with DeviceOptimizer, both ways; keys without gradients get no slots', async () => {
  for (const [name, base] of CONFIGS) {
    const cfg = { ...base, clipNorm: 1.5 };
    const p0 = initial(12);
    const ref = new Reference(p0, cfg);
    const rng = new Rng(13);
    // device: 2 steps, '2.g' never has a gradient
    const partial = () =>
      new Map([...gradsOf(rng)].filter(([k]) => k !== '2.g'));
    ref.step(partial(), 0.1);
    ref.step(partial(), 0.1);
    const devState = await ref.opt.getState();
    const devParams = new Map(KEYS.map((k) => [k, ref.param(k).slice()]));
    const s = await server(cfg, 2, devParams);
    try {
      await s.setOptimizerState(devState);
      const g3 = partial();
      ref.step(g3, 0.07);
      pushStep(s, g3, 0.07);
      const got = await s.getParams();
      for (const k of KEYS)
        assertClose(
          got.get(k)!,
          ref.param(k),
          `${name}: device -> server ${k}`,
          TOL,
        );
      // server -> device
      const st = await s.getOptimizerState();
      assert.equal(st.step, 3);
      assert.ok(
        !('2.g' in st.slots),
        'no slots for a key that never had a gradient',
      );
      assert.deepEqual(
        Object.keys(st.slots).sort(),
        Object.keys((await ref.opt.getState()).slots).sort(),
      );
      const ref2 = new Reference(got, cfg);
      ref2.opt.setState(st, ref2.vars);
      const g4 = partial();
      ref.step(g4, 0.05);
      ref2.step(g4, 0.05);
      for (const k of KEYS)
        assertClose(
          ref2.param(k),
          ref.param(k),
          `${name}: server -> device ${k}`,
          TOL,
        );
      ref2.dispose();
    } finally {
      await s.close();
      ref.dispose();
    }
  }
});

test('setOptimizerState rejects a bad state with a LayerwiseError and changes nothing', async () => {
  const cfg = CONFIGS[2][1];
  const s = await server(cfg, 1);
  try {
    pushStep(s, gradsOf(new Rng(14)), 0.1);
    const good = await s.getOptimizerState();
    const bad = (st: OptimizerState, re: RegExp) =>
      assert.rejects(
        s.setOptimizerState(st),
        (e: Error) => e instanceof LayerwiseError && re.test(e.message),
      );
    await bad(
      { step: 1, slots: { ...good.slots, '9.x': { m: new Float32Array(1) } } },
      /'9\.x', which this model does not have/,
    );
    await bad(
      {
        step: 1,
        slots: { '0.b': { m: new Float32Array(9), v: new Float32Array(10) } },
      },
      /'0\.b\.m' has 9 values, parameter has 10/,
    );
    await bad(
      { step: 1, slots: { '0.b': { velocity: new Float32Array(10) } } },
      /'0\.b\.velocity' is not a slot of adamw/,
    );
    await bad({ step: -1, slots: {} }, /non-negative integer/);
    assert.deepEqual(await s.getOptimizerState(), good, 'unchanged');
  } finally {
    await s.close();
  }
});

test('ParamStore.create and ParameterServer.create reject bad input with a LayerwiseError naming the key', async () => {
  const cfg = CONFIGS[2][1];
  const p = initial(15);
  const isLw = (re: RegExp) => (e: Error) =>
    e instanceof LayerwiseError && re.test(e.message);
  assert.throws(
    () => ParamStore.create(p, [...LAYERS, ['4.w']], cfg, SHAPES),
    isLw(/'4\.w', which the parameters do not have/),
  );
  assert.throws(
    () => ParamStore.create(p, LAYERS, cfg, { ...SHAPES, '0.b': [11] }),
    isLw(/'0\.b' has 10 values, its shape \[11\] needs 11/),
  );
  assert.throws(
    () => ParamStore.create(p, [['0.w'], ['0.b', '0.w']], cfg, SHAPES),
    isLw(/'0\.w' appears in more than one layer/),
  );
  assert.throws(
    () => ParamStore.create(p, LAYERS.slice(0, 3), cfg, SHAPES),
    isLw(/'3\.w' belongs to no layer/),
  );
  await assert.rejects(
    ParameterServer.create({
      params: p,
      layers: LAYERS,
      shapes: SHAPES,
      optimizer: cfg,
      threads: 0,
    }),
    isLw(/threads/),
  );
  // the store copies the values in and its views alias shared memory
  const st = ParamStore.create(p, LAYERS, cfg, SHAPES);
  assert.deepEqual(st.param('2.k'), p.get('2.k'));
  assert.ok(st.param('2.k').buffer instanceof SharedArrayBuffer);
  assert.deepEqual(Object.keys(st.slots('2.k')), ['m', 'v']);
  ParamStore.attach(st.layout).param('2.k')[0] = 42;
  assert.equal(st.param('2.k')[0], 42);
  assert.notEqual(p.get('2.k')![0], 42);
  // adopt: whole SharedArrayBuffers are taken over, other arrays copied
  const shared = new Map(
    [...p].map(([k, v]) => {
      const a = new Float32Array(new SharedArrayBuffer(v.byteLength));
      a.set(v);
      return [k, k === '0.b' ? v : a];
    }),
  );
  const adopted = ParamStore.create(shared, LAYERS, cfg, SHAPES, {
    adopt: true,
  });
  assert.equal(
    adopted.param('2.k').buffer,
    shared.get('2.k')!.buffer,
    'adopted without a copy',
  );
  assert.notEqual(
    adopted.param('0.b').buffer,
    shared.get('0.b')!.buffer,
    'a non-shared array is copied',
  );
  assert.notEqual(
    ParamStore.create(shared, LAYERS, cfg, SHAPES).param('2.k').buffer,
    shared.get('2.k')!.buffer,
    'copied without adopt',
  );
  assert.deepEqual(
    blockLayers([
      {
        name: 'a',
        params: [{ name: 'w', shape: [2, 3], init: { kind: 'zeros' } }],
      },
      { name: 'b', params: [] },
    ] as never),
    { layers: [['0.w'], []], shapes: { '0.w': [2, 3] } },
  );
});

test('a failing optimizer worker makes idle() reject naming the key, wakes version waiters, and does not hang', async () => {
  const s = await server(CONFIGS[2][1], 2);
  try {
    const before = s.store.param('0.w').slice();
    s.beginStep(0.1);
    const waiting = s.store.waitVersion(0, 1);
    s.push(3, { '3.w': new Float32Array(144) }, 0);
    s.push(2, {}, 0);
    s.push(1, {}, 0);
    s.push(0, { '0.w': new Float32Array(59), '0.b': new Float32Array(10) }, 0);
    await assert.rejects(
      s.idle(),
      /gradient of '0\.w' \(layer 0\) has 59 values, the parameter has 60 \(shape \[6,10\]\)/,
    );
    await assert.rejects(waiting, /layer 0 will not reach version 1.*failed/);
    await assert.rejects(s.getParams(), /'0\.w'/);
    assert.throws(() => s.beginStep(0.1), /'0\.w'/);
    assert.deepEqual(
      s.store.param('0.w'),
      before,
      'the bad part changed nothing',
    );
  } finally {
    await s.close();
    await s.close(); // safe twice
  }
  assert.equal(s.runningThreads, 0);
  assert.throws(() => s.beginStep(0.1), /closed/);
});

test('close() rejects pending idle() and version waiters', async () => {
  const s = await server({ ...CONFIGS[2][1], clipNorm: 1 }, 1);
  s.beginStep(0.1);
  s.push(3, { '3.w': new Float32Array(144) }, 0);
  const idle = assert.rejects(s.idle(), /parameter server was closed/);
  const waiting = assert.rejects(
    s.store.waitVersion(3, 1),
    /layer 3 will not reach version 1 \(at 0\): the parameter server was closed/,
  );
  await s.close();
  await idle;
  await waiting;
  await assert.rejects(s.idle(), /closed/);
  assert.throws(() => s.push(2, {}, 0), /closed/);
  assert.equal(s.runningThreads, 0);
});

test('bf16 copies (issue 23 item 4): the masters stay float32, each update rewrites the copy of the same version', async () => {
  const low = new Set(['0.w', '2.w', '3.w']);
  const s = await ParameterServer.create({
    params: initial(5),
    layers: LAYERS,
    shapes: SHAPES,
    optimizer: CONFIGS[0]![1],
    threads: 2,
    lowPrecision: low,
  });
  try {
    const rng = new Rng(9);
    for (let step = 0; step < 2; step++) {
      pushStep(s, gradsOf(rng), 0.05);
      await s.idle();
      for (const k of KEYS) {
        const master = s.store.param(k);
        const copy = s.store.low(k);
        assert.ok(master instanceof Float32Array, `${k}: master is float32`);
        assert.equal(master.buffer.byteLength, 4 * size(SHAPES[k]!));
        if (!low.has(k)) {
          assert.equal(copy, undefined, `${k} has no bf16 copy`);
          continue;
        }
        assert.ok(copy instanceof Uint16Array, `${k}: a bf16 copy`);
        const want = new Uint16Array(master.length);
        toBf16(master, want);
        assert.deepEqual(copy, want, `${k}: the copy is of this update`);
        // the masters keep float32's low bits: they are not bf16 values themselves
        const bits = new Uint32Array(
          master.buffer,
          master.byteOffset,
          master.length,
        );
        assert.ok(
          bits.some((b) => (b & 0xffff) !== 0),
          `${k}: master rounded to bf16`,
        );
      }
    }
  } finally {
    await s.close();
  }
});

test("the store's 2-byte copies take the run's policy's parameter format: bfloat16 under bf16 and by default, refused under a policy storing float32", () => {
  const cfg = CONFIGS[0]![1];
  const low = new Set(['0.w', '3.w']);
  for (const precision of ['bf16', undefined] as const) {
    const st = ParamStore.create(initial(3), LAYERS, cfg, SHAPES, {
      lowPrecision: low,
      precision,
    });
    assert.equal(st.layout.lowFormat, 'bfloat16', `precision ${precision}`);
    const copy = st.low('3.w')!;
    assert.equal(copy.byteLength, 2 * size(SHAPES['3.w']!));
    const want = new Uint16Array(copy.length);
    toBf16(st.param('3.w'), want);
    assert.deepEqual(copy, want, 'filled from the masters');
  }
  assert.equal(
    ParamStore.create(initial(3), LAYERS, cfg, SHAPES).layout.lowFormat,
    undefined,
    'no copies, no format',
  );
  for (const precision of ['fp32', 'f16'] as const)
    assert.throws(
      () =>
        ParamStore.create(initial(3), LAYERS, cfg, SHAPES, {
          lowPrecision: low,
          precision,
        }),
      new RegExp(`precision '${precision}' keeps no 2-byte parameter copies`),
    );
});

test('toBf16 rounds to nearest, ties to even, and keeps NaN a NaN', () => {
  const f = new Float32Array([
    1,
    1 + 2 ** -8,
    1 + 3 * 2 ** -8,
    -2.5,
    Infinity,
    NaN,
  ]);
  const b = new Uint16Array(f.length);
  toBf16(f, b);
  const back = new Float32Array(
    new Uint32Array([...b].map((x) => x << 16)).buffer,
  );
  assert.deepEqual([...back.slice(0, 5)], [1, 1, 1 + 2 ** -6, -2.5, Infinity]);
  assert.ok(Number.isNaN(back[5]));
});
