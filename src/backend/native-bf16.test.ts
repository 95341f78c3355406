/**
 * bf16 compute on the native backend: the conversion rounds to nearest even as the scalar
 * reference does; bf16 products equal the float32 product of the bf16-rounded operands (float32
 * accumulation) and the float32 product within bf16's tolerance, for transposed, batched and
 * broadcast operands; parameters are converted once per version and a changed or freed
 * parameter is never read from a stale copy; backends without bf16 refuse it. Skipped, saying
 * why, where the addon is not built or the CPU has no avx512_bf16/AMX. On any CPU with the addon:
 * with oneDNN held to AVX2 (no bf16 instructions), bf16 still runs, emulated, gives the same
 * numbers and says so.
 */

import assert from 'node:assert/strict';
import { spawnSync } from 'node:child_process';
import { test } from 'node:test';
import { causalSelfAttention } from '../model/layers.js';
import { randomArray } from '../testing/backend-compare.js';
import { withThreadsRestored } from '../testing/native-threads.js';
import { LayerwiseError } from '../util/errors.js';
import { initBackend } from './index.js';
import { roundTensor } from './low-precision.js';
import { deviceBytes } from './memory.js';
import { bf16Support } from './names.js';
import type { NativeBackend } from './native.js';
import { nativeAddon, nativeUnavailable } from './native.js';
import { recordAddonCalls } from './native-addon.js';
import { tf } from './tfjs.js';

const skip = !nativeAddon()
  ? `native backend unavailable: ${nativeUnavailable()}`
  : !bf16Support().nativeBf16
    ? `this CPU has no avx512_bf16 or AMX (${bf16Support().note})`
    : false;

/** Round-to-nearest-even float32 -> bf16 -> float32, the reference for the native conversion. */
function roundBf16(x: number): number {
  const f = new Float32Array([x]);
  const u = new Uint32Array(f.buffer);
  const v = u[0]!;
  if ((v & 0x7fffffff) > 0x7f800000) return Number.NaN;
  u[0] = ((v + 0x7fff + ((v >>> 16) & 1)) >>> 16) << 16;
  return f[0]!;
}

/** bf16 rounding of every element (reference). */
const rounded = (a: Float32Array) => a.map(roundBf16);

/** max |a - b| / max |b|. */
function relErr(a: Float32Array, b: Float32Array): number {
  let e = 0;
  let m = 0;
  for (let i = 0; i < a.length; i++) {
    e = Math.max(e, Math.abs(a[i]! - b[i]!));
    m = Math.max(m, Math.abs(b[i]!));
  }
  return e / m;
}

const backend = () => tf.backend() as NativeBackend;

test('toBf16 rounds to nearest even like the scalar reference; fromBf16 widens exactly', {
  skip,
}, () => {
  const lib = nativeAddon()!;
  const special = [
    1,
    1.00390625,
    1.01171875,
    -2.5,
    Math.PI,
    65504,
    3.4e38,
    -0,
    0,
    Number.POSITIVE_INFINITY,
    Number.NEGATIVE_INFINITY,
    Number.NaN,
  ];
  // 1000 random values and the specials: the vector loop and its scalar tail both run
  const src = new Float32Array(1000 + special.length);
  src.set(randomArray(1000, 3).map((v) => v * 100));
  src.set(special, 1000);
  const bf = new Uint16Array(src.length);
  lib.toBf16(src, bf);
  const back = new Float32Array(src.length);
  lib.fromBf16(bf, back);
  for (let i = 0; i < src.length; i++) {
    const want = roundBf16(src[i]!);
    if (Number.isNaN(want)) assert.ok(Number.isNaN(back[i]!), `NaN at ${i}`);
    else assert.equal(back[i], want, `element ${i}: ${src[i]}`);
  }
  assert.throws(() => lib.toBf16(src, new Uint16Array(3)), RangeError);
});

test("the bf16-only kernels write what rounding the float32 kernels' outputs gives, their inputs held as float32 or as bf16", {
  skip,
}, () => {
  const lib = nativeAddon()!;
  const bf16Of = (a: Float32Array) => {
    const r = new Uint16Array(a.length);
    lib.toBf16(a, r);
    return r;
  };
  const widened = (a: Uint16Array) => {
    const r = new Float32Array(a.length);
    lib.fromBf16(a, r);
    return r;
  };
  // inputs exactly bf16 values, given either way: the results must not depend on the way
  const held = (a: Float32Array) => {
    const bf = bf16Of(a);
    return { f32: widened(bf), bf };
  };
  const n = 70_001; // above one thread's share, not a multiple of the chunks
  const x = held(randomArray(n, 31).map((v) => v * 4));
  const dy = held(randomArray(n, 32));
  const ref = new Float32Array(n);
  lib.gelu(x.f32, ref);
  for (const input of [x.f32, x.bf]) {
    const out = new Uint16Array(n);
    lib.geluToBf16(input, out);
    assert.deepEqual(out, bf16Of(ref), 'geluToBf16');
  }
  lib.geluGrad(x.f32, dy.f32, ref);
  for (const [a, b] of [
    [x.f32, dy.bf],
    [x.bf, dy.f32],
    [x.bf, dy.bf],
  ] as const) {
    const out = new Uint16Array(n);
    lib.geluGradToBf16(a, b, out);
    assert.deepEqual(out, bf16Of(ref), 'geluGradToBf16');
  }
  const sum = new Float32Array(n);
  lib.binary(0, x.f32, [n], dy.f32, [n], sum, [n]);
  const got = new Float32Array(n);
  lib.binarySameShape(0, x.bf, dy.f32, got);
  assert.deepEqual(got, sum, 'binarySameShape');
  const [rows, cols] = [301, 96];
  const xs = held(randomArray(rows * cols, 33));
  const g = randomArray(cols, 34);
  const b = randomArray(cols, 35);
  const [y, xhat, rstd] = [
    new Float32Array(rows * cols),
    new Float32Array(rows * cols),
    new Float32Array(rows),
  ];
  lib.layerNorm(xs.f32, g, b, y, xhat, rstd, rows, cols, 1e-5);
  const [yBf, xhatBf, rstd2] = [
    new Uint16Array(rows * cols),
    new Uint16Array(rows * cols),
    new Float32Array(rows),
  ];
  lib.layerNormToBf16(xs.bf, g, b, yBf, xhatBf, rstd2, rows, cols, 1e-5);
  assert.deepEqual(yBf, bf16Of(y), 'layerNormToBf16: y');
  assert.deepEqual(xhatBf, bf16Of(xhat), 'layerNormToBf16: xhat');
  assert.deepEqual(rstd2, rstd, 'layerNormToBf16: rstd');
  const d = held(randomArray(rows * cols, 36));
  const grads = () =>
    [rows * cols, cols, cols].map((l) => new Float32Array(l)) as [
      Float32Array,
      Float32Array,
      Float32Array,
    ];
  const want = grads();
  const xh = held(xhat);
  lib.layerNormGrad(d.f32, xh.f32, rstd, g, ...want, rows, cols);
  const have = grads();
  lib.layerNormGradAny(d.bf, xh.bf, rstd, g, ...have, rows, cols);
  assert.deepEqual(have, want, 'layerNormGradAny');
  const colSums = [new Float32Array(cols), new Float32Array(cols)];
  lib.reduceOuter(0, d.f32, colSums[0]!, rows, cols);
  lib.reduceOuter(0, d.bf, colSums[1]!, rows, cols);
  assert.deepEqual(colSums[1], colSums[0], 'reduceOuter over bf16 values');
  // attention: inputs given as float32 or as bf16 give the same bits (the products read bf16
  // either way); against the float32 kernels on the same (bf16-exact) inputs, the outputs are
  // within what rounding P and the score gradients to bf16 moves them
  // (T 150: the causal products by blocks of 64 rows, the last one partial)
  for (const [B, T, H, dh] of [
    [2, 16, 2, 8],
    [1, 150, 2, 8],
  ] as const) {
    const qkv = held(randomArray(B * T * 3 * H * dh, 37));
    const dctx = held(randomArray(B * T * H * dh, 38));
    const runs = [qkv.f32, qkv.bf].map((q, i) => {
      const [ctxBf, pBf] = [
        new Uint16Array(B * T * H * dh),
        new Uint16Array(B * H * T * T),
      ];
      lib.causalAttentionToBf16(q, pBf, B, T, H, dh, 0.35, ctxBf);
      const dqkvBf = new Uint16Array(q.length);
      const d = i === 0 ? dctx.f32 : dctx.bf;
      const pIn = i === 0 ? widened(pBf) : pBf;
      lib.causalAttentionGradToBf16(d, q, pIn, B, T, H, dh, 0.35, dqkvBf);
      return { ctxBf, pBf, dqkvBf };
    });
    assert.deepEqual(runs[0], runs[1], 'attention: float32 or bf16 inputs');
    const ctx = new Float32Array(B * T * H * dh);
    const p = new Float32Array(B * H * T * T);
    lib.causalAttention(qkv.f32, ctx, p, B, T, H, dh, 0.35);
    const dqkv = new Float32Array(qkv.f32.length);
    lib.causalAttentionGrad(dctx.f32, qkv.f32, p, dqkv, B, T, H, dh, 0.35);
    const { ctxBf, pBf, dqkvBf } = runs[1]!;
    for (const [got, want, what, tol] of [
      [ctxBf, ctx, 'ctx', 2 ** -7],
      [pBf, p, 'P', 2 ** -8],
      [dqkvBf, dqkv, 'dqkv', 2 ** -6],
    ] as const) {
      const scale = Math.max(...want.map(Math.abs));
      const have = widened(got);
      const worst = Math.max(...want.map((v, j) => Math.abs(v - have[j]!)));
      assert.ok(
        worst <= tol * scale,
        `causal attention (bf16) ${what}: ${worst} of ${scale}`,
      );
    }
  }
  // a product with its bias, written as bf16: the float32 product plus the bias, rounded
  const [m, k, nn] = [37, 70, 45];
  const a = held(randomArray(m * k, 39));
  const w = held(randomArray(k * nn, 40));
  const bias = randomArray(nn, 41);
  const c = new Float32Array(m * nn);
  lib.matmulBf16(a.bf, w.bf, c, 1, 0, 0, m, nn, k, false, false);
  for (let r = 0; r < m; r++)
    for (let j = 0; j < nn; j++) c[r * nn + j]! += bias[j]!;
  const cBf = new Uint16Array(m * nn);
  lib.matmulBf16To(a.bf, w.f32, cBf, bias, 1, 0, 0, m, nn, k, false, false);
  const diff = widened(cBf).map(
    (v, i) => Math.abs(v - c[i]!) / (Math.abs(c[i]!) + 1e-3),
  );
  assert.ok(
    Math.max(...diff) <= 2 ** -8,
    `matmulBf16To: within one bf16 rounding (${Math.max(...diff)})`,
  );
  assert.throws(() => lib.geluToBf16(x.f32, new Uint16Array(3)), RangeError);
});

const CASES: Array<[string, number[], number[], boolean, boolean]> = [
  ['2-D', [37, 70], [70, 45], false, false],
  ['a transposed', [70, 37], [70, 45], true, false],
  ['b transposed', [37, 70], [45, 70], false, true],
  ['both transposed', [70, 37], [45, 70], true, true],
  ['batched a, shared b (a dense layer)', [3, 33, 64], [64, 48], false, false],
  ['batched, same batch', [4, 17, 40], [4, 40, 13], false, false],
  ['shared a, batched b', [17, 40], [5, 40, 19], false, false],
  ['batched, a transposed', [4, 40, 17], [4, 40, 13], true, false],
];

for (const [what, sa, sb, tA, tB] of CASES) {
  test(`bf16 matMul (${what}) is the float32 product of bf16-rounded operands, within bf16 tolerance of fp32`, {
    skip,
  }, async () => {
    await initBackend('native', { precision: 'bf16' });
    const av = randomArray(tf.util.sizeFromShape(sa), 7);
    const bv = randomArray(tf.util.sizeFromShape(sb), 8);
    const run = (a: Float32Array, b: Float32Array) =>
      tf.tidy(
        () =>
          tf
            .matMul(tf.tensor(a, sa), tf.tensor(b, sb), tA, tB)
            .dataSync() as Float32Array,
      );
    const bf16 = run(av, bv);
    await initBackend('native', { precision: 'fp32' });
    const exact = run(av, bv);
    const ofRounded = run(rounded(av), rounded(bv));
    // float32 accumulation: only the summation order differs from the fp32 product of the
    // rounded operands (bf16 sums would be off by ~1e-3)
    assert.ok(
      relErr(bf16, ofRounded) < 1e-5,
      `vs rounded operands: ${relErr(bf16, ofRounded)}`,
    );
    // bf16's 8-bit mantissa: a relative error of about 2^-9 per operand
    const e = relErr(bf16, exact);
    assert.ok(e < 2e-2, `vs fp32: ${e}`);
    assert.ok(
      e > 1e-7,
      'the bf16 product equals the fp32 one: bf16 did not run',
    );
  });
}

test("bf16 products reusing activations' conversions (their shadows) read each operand, never a recycled buffer", {
  skip,
}, async () => {
  await initBackend('native', { precision: 'bf16' });
  const vals = [31, 32, 33, 34].map((seed) => randomArray(24 * 24, seed));
  const ts = vals.map((v) => tf.tensor(v, [24, 24]));
  // (a, b) then (a, c): a's shadow read again; then (d, a), (b, d)
  const order: Array<[number, number]> = [
    [0, 1],
    [0, 2],
    [3, 0],
    [1, 3],
    [0, 1],
  ];
  const got = order.map(
    ([i, j]) =>
      tf.tidy(() => tf.matMul(ts[i]!, ts[j]!).dataSync()) as Float32Array,
  );
  await initBackend('native', { precision: 'fp32' });
  order.forEach(([i, j], n) => {
    const want = tf.tidy(
      () =>
        tf
          .matMul(
            tf.tensor(rounded(vals[i]!), [24, 24]),
            tf.tensor(rounded(vals[j]!), [24, 24]),
          )
          .dataSync() as Float32Array,
    );
    assert.ok(
      relErr(got[n]!, want) < 1e-5,
      `product ${n} (${i}, ${j}): ${relErr(got[n]!, want)}`,
    );
  });
  for (const t of ts) t.dispose();
});

test('a freed activation gives its bf16 shadow buffer back, and the next conversion into it never reads the old values', {
  skip,
}, async () => {
  await initBackend('native', { precision: 'bf16' });
  const n = 256; // 128 KiB of bf16: large enough to be reused
  const [va, vb, vc] = [41, 42, 43].map((seed) => randomArray(n * n, seed));
  const b = tf.tensor(vb!, [n, n]);
  const a = tf.tensor(va!, [n, n]);
  const ab = tf.tidy(() => tf.matMul(a, b).dataSync()) as Float32Array;
  a.dispose(); // its shadow's buffer goes back
  const c = tf.tensor(vc!, [n, n]);
  const cb = tf.tidy(() => tf.matMul(c, b).dataSync()) as Float32Array;
  await initBackend('native', { precision: 'fp32' });
  const ref = (v: Float32Array) =>
    tf.tidy(
      () =>
        tf
          .matMul(
            tf.tensor(rounded(v), [n, n]),
            tf.tensor(rounded(vb!), [n, n]),
          )
          .dataSync() as Float32Array,
    );
  assert.ok(relErr(ab, ref(va!)) < 1e-5, 'a b');
  assert.ok(relErr(cb, ref(vc!)) < 1e-5, `c b: ${relErr(cb, ref(vc!))}`);
  tf.dispose([b, c]);
});

test('bf16 fused dense (bias) and its gradients stay within bf16 tolerance of fp32', {
  skip,
}, async () => {
  const x = randomArray(8 * 5 * 32, 11);
  const w = randomArray(32 * 24, 12);
  const b = randomArray(24, 13);
  const run = async (precision: 'fp32' | 'bf16') => {
    await initBackend('native', { precision });
    return tf.tidy(() => {
      const xs = [
        tf.tensor(x, [40, 32]),
        tf.tensor(w, [32, 24]),
        tf.tensor(b, [24]),
      ];
      const f = (xt: tf.Tensor, wt: tf.Tensor, bt: tf.Tensor) =>
        tf.sum(
          tf.square(
            tf.fused.matMul({
              a: xt as tf.Tensor2D,
              b: wt as tf.Tensor2D,
              bias: bt,
            }),
          ),
        );
      const grads = tf.grads(f as (...t: tf.Tensor[]) => tf.Tensor)(xs);
      return grads.map((g) => g.dataSync() as Float32Array);
    });
  };
  const ref = await run('fp32');
  const got = await run('bf16');
  for (let i = 0; i < ref.length; i++) {
    const e = relErr(got[i]!, ref[i]!);
    assert.ok(e < 3e-2 && e > 0, `gradient ${i}: relative error ${e}`);
  }
});

test('bf16 causal attention (kernel and gradient) stays within bf16 tolerance of fp32', {
  skip,
}, async () => {
  const [B, T, D, H] = [3, 19, 48, 4]; // T and dh (12) not multiples of 16
  const x = randomArray(B * T * D, 21);
  const w = [
    randomArray(D * 3 * D, 22).map((v) => v * 0.2),
    randomArray(3 * D, 23),
    randomArray(D * D, 24).map((v) => v * 0.2),
    randomArray(D, 25),
  ];
  const run = async (precision: 'fp32' | 'bf16') => {
    await initBackend('native', { precision });
    return tf.tidy(() => {
      const xs = [
        tf.tensor(x, [B, T, D]),
        tf.tensor(w[0]!, [D, 3 * D]),
        tf.tensor(w[1]!, [3 * D]),
        tf.tensor(w[2]!, [D, D]),
        tf.tensor(w[3]!, [D]),
      ];
      const f = (
        xt: tf.Tensor,
        a: tf.Tensor,
        b: tf.Tensor,
        c: tf.Tensor,
        d: tf.Tensor,
      ) => tf.sum(tf.square(causalSelfAttention(xt, H, a, b, c, d)));
      const { value, grads } = tf.valueAndGrads(
        f as (...t: tf.Tensor[]) => tf.Tensor,
      )(xs);
      return [value, ...grads].map((g) => g.dataSync() as Float32Array);
    });
  };
  const ref = await run('fp32');
  const got = await run('bf16');
  for (let i = 0; i < ref.length; i++) {
    const e = relErr(got[i]!, ref[i]!);
    assert.ok(e < 3e-2 && e > 0, `output ${i}: relative error ${e}`);
  }
});

test('bf16 convolution (forward, both gradients) stays within bf16 tolerance of fp32', {
  skip,
}, async () => {
  const x = randomArray(2 * 9 * 11 * 5, 41);
  const w = randomArray(3 * 3 * 5 * 7, 42);
  const b = randomArray(7, 43);
  const run = async (precision: 'fp32' | 'bf16') => {
    await initBackend('native', { precision });
    return tf.tidy(() => {
      const xs = [
        tf.tensor(x, [2, 9, 11, 5]),
        tf.tensor(w, [3, 3, 5, 7]),
        tf.tensor(b, [7]),
      ];
      const f = (xt: tf.Tensor, wt: tf.Tensor, bt: tf.Tensor) =>
        tf.sum(
          tf.square(
            tf.fused.conv2d({
              x: xt as tf.Tensor4D,
              filter: wt as tf.Tensor4D,
              strides: [2, 1],
              pad: 'same',
              bias: bt,
              activation: 'relu',
            }),
          ),
        );
      const { value, grads } = tf.valueAndGrads(
        f as (...t: tf.Tensor[]) => tf.Tensor,
      )(xs);
      return [value, ...grads].map((g) => g.dataSync() as Float32Array);
    });
  };
  const ref = await run('fp32');
  const got = await run('bf16');
  for (let i = 0; i < ref.length; i++) {
    const e = relErr(got[i]!, ref[i]!);
    assert.ok(e < 3e-2 && e > 0, `output ${i}: relative error ${e}`);
  }
});

test('a parameter is converted once per version, and a changed or freed one is never read stale', {
  skip,
}, async () => {
  await initBackend('native', { precision: 'bf16' });
  const x = tf.tensor(randomArray(16 * 24, 5), [16, 24]);
  const w1 = randomArray(24 * 8, 6);
  const w2 = randomArray(24 * 8, 7);
  const product = (w: tf.Tensor) =>
    tf.tidy(() => tf.matMul(x, w).dataSync() as Float32Array);
  // references: the products with plain (non-parameter) tensors, converted per product, their
  // float32 outputs rounded as a product with a parameter holds its output (bf16 values)
  const want1 = rounded(product(tf.tensor(w1, [24, 8])));
  const want2 = rounded(product(tf.tensor(w2, [24, 8])));
  assert.ok(
    relErr(want1, want2) > 0.1,
    'the two weights must give different products',
  );

  const be = backend();
  const before = be.bf16ParamConversions;
  const [t1, t2] = [tf.tensor(w1, [24, 8]), tf.tensor(w2, [24, 8])];
  const v = tf.variable(t1);
  t1.dispose(); // the variable holds the data
  const bytesBefore = deviceBytes();
  for (let i = 0; i < 3; i++) assert.deepEqual(product(v), want1, `read ${i}`);
  assert.equal(
    be.bf16ParamConversions - before,
    1,
    'three products, one conversion',
  );
  assert.equal(be.bf16ParamBytes(), 2 * 24 * 8);
  assert.equal(
    deviceBytes() - bytesBefore,
    2 * 24 * 8,
    'the bf16 copy counts as device bytes',
  );

  // a new version: the cached copy of w1 must not be used
  v.assign(t2);
  t2.dispose();
  assert.deepEqual(product(v), want2, 'stale bf16 copy after assign');
  assert.equal(be.bf16ParamConversions - before, 2);

  // a freed parameter's buffer goes back to the pool and may hold the next tensor's values
  v.dispose();
  const t3 = tf.tensor(w1, [24, 8]);
  const v3 = tf.variable(t3);
  t3.dispose();
  assert.deepEqual(product(v3), want1, 'stale bf16 copy of a freed parameter');
  v3.dispose();
  x.dispose();
  assert.equal(
    be.bf16ParamBytes(),
    0,
    'copies of freed parameters are dropped',
  );
  // w1's and w2's f32 data (both alive at bytesBefore) and x are gone too, and with x its bf16
  // shadow (made by the first product, alive at bytesBefore)
  assert.equal(
    deviceBytes(),
    bytesBefore - 2 * 4 * 24 * 8 - 4 * 16 * 24 - 2 * 16 * 24,
  );
});

test('--precision bf16 on a backend without bf16 kernels is refused, naming the fix', async () => {
  await assert.rejects(
    initBackend('cpu', { precision: 'bf16' }),
    (e: Error) =>
      e instanceof LayerwiseError &&
      /--backend native/.test(e.message) &&
      /fp32/.test(e.message),
  );
  await assert.rejects(
    initBackend('cpu', { precision: 'fp8' as 'bf16' }),
    /unknown precision 'fp8'/,
  );
});

test('without bf16 instructions (oneDNN held to AVX2), bf16 runs emulated, gives the same numbers (products and attention) and says so', {
  skip: nativeAddon()
    ? false
    : `native backend unavailable: ${nativeUnavailable()}`,
}, () => {
  // ONEDNN_MAX_CPU_ISA is read when oneDNN starts: a child process
  const here = new URL('.', import.meta.url).href;
  const script = `
    const { initBackend } = await import('${here}index.js');
    const { bf16Support } = await import('${here}names.js');
    const tf = await import('@tensorflow/tfjs-core');
    const info = bf16Support();
    const a = Float32Array.from({ length: 37 * 70 }, (_, i) => Math.sin(i) * 3);
    const b = Float32Array.from({ length: 70 * 45 }, (_, i) => Math.cos(i * 0.7));
    const round = (x) => { const f = new Float32Array([x]); const u = new Uint32Array(f.buffer);
      u[0] = ((u[0] + 0x7fff + ((u[0] >>> 16) & 1)) >>> 16) << 16; return f[0]; };
    const prod = (x, y) => tf.tidy(() => tf.matMul(tf.tensor(x, [37, 70]), tf.tensor(y, [70, 45])).dataSync());
    await initBackend('native', { precision: 'bf16' });
    const got = prod(a, b);
    await initBackend('native', { precision: 'fp32' });
    const want = prod(a.map(round), b.map(round));
    let e = 0; for (let i = 0; i < got.length; i++) e = Math.max(e, Math.abs(got[i] - want[i]));
    const { nativeAddon } = await import('${here}native.js');
    const att = ${attention.toString()};
    console.log(JSON.stringify({ info, e, attention: att(nativeAddon()) }));
  `;
  const r = spawnSync(process.execPath, ['--input-type=module', '-e', script], {
    encoding: 'utf8',
    env: { ...process.env, ONEDNN_MAX_CPU_ISA: 'AVX2' },
    cwd: new URL('../..', import.meta.url).pathname,
  });
  assert.equal(r.status, 0, r.stderr);
  const line = r.stdout.trim().split('\n').pop()!;
  const { info, e } = JSON.parse(line) as {
    info: { nativeBf16: boolean; isa: string; note: string };
    e: number;
  };
  assert.equal(info.isa, 'avx2');
  assert.equal(info.nativeBf16, false);
  assert.match(info.note, /emulated/);
  assert.ok(e < 1e-4, `emulated bf16 vs fp32 of rounded operands: ${e}`);
  // attention's per-head products, emulated there, against this process's (bf16 products where
  // the CPU has them): the same up to summation order, so within a bf16 rounding of the outputs
  // (equal here, on avx512_core_bf16)
  const there = (JSON.parse(line) as { attention: number[][] }).attention;
  attention(nativeAddon()!).forEach((want, i) => {
    const scale = Math.max(...want.map(Math.abs));
    const worst = Math.max(...want.map((v, j) => Math.abs(v - there[i]![j]!)));
    assert.ok(
      worst <= scale * 2 ** -7,
      `attention output ${i}: ${worst} of ${scale}`,
    );
  });
});

/** ctx, P and dqkv of the bf16 attention kernels on fixed inputs (also run in a child process: self-contained). */
function attention(lib: {
  toBf16(x: Float32Array, out: Uint16Array): void;
  fromBf16(x: Uint16Array, out: Float32Array): void;
  causalAttentionToBf16(...a: unknown[]): void;
  causalAttentionGradToBf16(...a: unknown[]): void;
}): number[][] {
  const [B, T, H, dh] = [2, 16, 2, 8];
  const n = B * T * 3 * H * dh;
  const bf = (f: (i: number) => number, len: number) => {
    const out = new Uint16Array(len);
    lib.toBf16(
      Float32Array.from({ length: len }, (_, i) => f(i)),
      out,
    );
    return out;
  };
  const wide = (x: Uint16Array) => {
    const out = new Float32Array(x.length);
    lib.fromBf16(x, out);
    return Array.from(out);
  };
  const qkv = bf((i) => Math.sin(i * 0.37), n);
  const [ctx, p] = [
    new Uint16Array(B * T * H * dh),
    new Uint16Array(B * H * T * T),
  ];
  lib.causalAttentionToBf16(qkv, p, B, T, H, dh, 0.35, ctx);
  const dctx = bf((i) => Math.cos(i * 0.11), B * T * H * dh);
  const dqkv = new Uint16Array(n);
  lib.causalAttentionGradToBf16(dctx, qkv, p, B, T, H, dh, 0.35, dqkv);
  return [wide(ctx), wide(p), wide(dqkv)];
}

test("fromBf16: a bf16-only tensor holds 2 bytes per element, is the products' bf16 operand, widens exactly on a float32 read and frees all it counted", {
  skip,
}, async () => {
  await initBackend('native', { precision: 'bf16' });
  const [m, k, n] = [8, 64, 32];
  const w = new Float32Array(randomArray(k * n, 7));
  const bf = new Uint16Array(w.length);
  nativeAddon()!.toBf16(w, bf);
  const x = tf.tensor2d(randomArray(m * k, 8), [m, k]);
  // the reference: a float32 weight of the rounded values (its product, run first, also sizes
  // the backend's recycled activation buffers, which stay)
  const ref = tf.tensor2d(rounded(w), [k, n]);
  const yRef = tf.matMul(x, ref);
  const start = deviceBytes();
  const t = backend().fromBf16(bf.slice(), [k, n]);
  assert.equal(deviceBytes() - start, 2 * k * n, '2 bytes per element');
  // the product reads the bf16 values as they are: the same as a float32 weight in a bf16 run,
  // and holds its output as bf16 values too (a product with a parameter, as autocast's Linear)
  const y = tf.matMul(x, t);
  assert.equal(deviceBytes() - start, 2 * k * n + 2 * m * n, 'not widened');
  assert.deepEqual(
    await y.data(),
    rounded((await yRef.data()) as Float32Array),
  );
  // a float32 read widens once (exact), 4 bytes per element more
  assert.deepEqual(await t.data(), rounded(w));
  assert.equal(deviceBytes() - start, 6 * k * n + 6 * m * n);
  t.dispose();
  y.dispose();
  assert.equal(deviceBytes(), start, 'every byte counted is freed');
  for (const a of [x, ref, yRef]) a.dispose();
});

test('disposing a bf16-only tensor never read as float32 widens nothing (no addon call, no bytes)', {
  skip,
}, async () => {
  await initBackend('native', { precision: 'bf16' });
  const n = 4096;
  const bf = new Uint16Array(n);
  nativeAddon()!.toBf16(new Float32Array(randomArray(n, 9)), bf);
  const x = tf.tensor2d(randomArray(8 * 64, 10), [8, 64]);
  const w = backend().fromBf16(bf, [64, 64]);
  const y = tf.matMul(x, w); // a bf16 output (held as its bf16 values only)
  const start = deviceBytes();
  const calls = recordAddonCalls(() => {
    w.dispose();
    y.dispose();
  });
  assert.deepEqual(
    calls.map((c) => c.name),
    [],
    'disposal calls no kernel',
  );
  assert.equal(
    start - deviceBytes(),
    2 * 64 * 64 + 2 * 8 * 64,
    'their 2 bytes per element freed',
  );
  x.dispose();
});

test('the bf16 rounding of a tensor held as bf16 is that tensor: the same values and data, no new bytes, freed once both go', {
  skip,
}, async () => {
  await initBackend('native', { precision: 'bf16' });
  const w = randomArray(4096, 21);
  const bf = new Uint16Array(w.length);
  nativeAddon()!.toBf16(w, bf);
  const start = deviceBytes();
  const t = backend().activationFromBf16(bf.slice(), [64, 64]);
  const r = roundTensor(t);
  assert.equal(r.dataId, t.dataId, 'the rounding shares the held data');
  assert.equal(deviceBytes() - start, 2 * w.length, 'no new bytes');
  t.dispose();
  assert.deepEqual(
    await r.data(),
    rounded(w),
    'the rounded values, readable after x is freed',
  );
  r.dispose();
  assert.equal(deviceBytes(), start, 'every byte counted is freed');
  // a float32 input is rounded into bf16 values of its own
  const f = tf.tensor2d(w, [64, 64]);
  const g = roundTensor(f);
  assert.notEqual(g.dataId, f.dataId);
  assert.deepEqual(await g.data(), rounded(w));
  tf.dispose([f, g]);
});

test('a recorded forward keeps its saved activations as bf16: half their bytes until the backward, the same gradients as tf.grads', {
  skip,
}, async () => {
  await initBackend('native', { precision: 'bf16' });
  const { recordForward, backwardRecorded } = await import(
    '../pipeline/rematerialize.js'
  );
  // y = relu(x W1) W2: x is the caller's; h = relu(x W1) [64, 128] is saved by the second
  // product, relu's input x W1 by relu (a product with a parameter: held as bf16 from the start)
  const x = tf.tensor(randomArray(64 * 32, 11), [64, 32]);
  const w1 = tf.variable(tf.tensor(randomArray(32 * 128, 12), [32, 128]));
  const w2 = tf.variable(tf.tensor(randomArray(128 * 16, 13), [128, 16]));
  const f = (a: tf.Tensor, b: tf.Tensor, input: tf.Tensor) =>
    tf.matMul(tf.relu(tf.matMul(input, a)), b);
  const dy = tf.tensor(randomArray(64 * 16, 14), [64, 16]);
  const ref = tf.grads(f)([w1, w2, x], dy);
  // once first, so that the backend's conversion buffers have grown to these sizes
  tf.dispose(
    backwardRecorded(
      recordForward(() => f(w1, w2, x)),
      [w1, w2, x],
      dy,
    ),
  );
  const b0 = deviceBytes();
  const rec = recordForward(() => f(w1, w2, x));
  const kept = deviceBytes() - b0;
  // kept: the output [64, 16] (a product with a parameter: bf16), relu's input and h as bf16
  const h = 64 * 128;
  const got = backwardRecorded(rec, [w1, w2, x], dy);
  for (let i = 0; i < 3; i++)
    assert.deepEqual(
      got[i]!.dataSync(),
      ref[i]!.dataSync(),
      `gradient ${i}: the same products of the same bf16 operands`,
    );
  assert.ok(
    kept <= 2 * 64 * 16 + 2 * h + 2 * h,
    `kept ${kept} B: the saved activations are bf16`,
  );
  assert.ok(kept >= 2 * h + 2 * h, `kept ${kept} B`);
  tf.dispose([...got, ...ref, x, w1, w2, dy]);
});

test('softmaxCrossEntropy reads bf16 logits as held: the loss and probabilities of their widened float32 values, bit for bit, at 1 and 2 threads', {
  skip,
}, () => {
  const lib = nativeAddon()!;
  const [rows, classes] = [1001, 89]; // above the parallel threshold, rows not a multiple of the team
  const bf = new Uint16Array(rows * classes);
  lib.toBf16(
    randomArray(rows * classes, 41).map((v) => v * 6),
    bf,
  );
  const f32 = new Float32Array(bf.length);
  lib.fromBf16(bf, f32);
  // a label outside [0, classes) adds no loss
  const labels = Int32Array.from({ length: rows }, (_, r) =>
    r === 7 ? -1 : (r * 37) % classes,
  );
  withThreadsRestored(lib, () => {
    for (const team of [1, 2]) {
      lib.setThreads(team);
      const [want, got] = [
        new Float32Array(f32.length),
        new Float32Array(f32.length),
      ];
      const lossF32 = lib.softmaxCrossEntropy(f32, labels, want, rows, classes);
      const lossBf = lib.softmaxCrossEntropy(bf, labels, got, rows, classes);
      assert.ok(Number.isFinite(lossF32) && lossF32 > 0, `loss ${lossF32}`);
      assert.equal(lossBf, lossF32, `loss at ${team} threads`);
      assert.deepEqual(got, want, `probabilities at ${team} threads`);
    }
  });
});

test('bf16 attention gives the same bits at 1 and 2 threads, its (batch, head) pairs spread over the team or run one after another', {
  skip,
}, () => {
  const lib = nativeAddon()!;
  const dh = 12;
  withThreadsRestored(lib, () => {
    // 2 pairs: fewer than two a member at 2 threads, so each pair's products use the whole team;
    // 12 pairs: spread, each member's products single-threaded; T 19 (not a multiple of 16),
    // and 150 (the causal products by blocks of 64 rows)
    for (const [B, H, T] of [
      [1, 2, 19],
      [3, 4, 19],
      [1, 2, 150],
    ] as const) {
      const qkv = new Uint16Array(B * T * 3 * H * dh);
      lib.toBf16(randomArray(qkv.length, 51), qkv);
      const dctx = new Uint16Array(B * T * H * dh);
      lib.toBf16(randomArray(dctx.length, 52), dctx);
      const at = (team: number) => {
        lib.setThreads(team);
        const ctx = new Uint16Array(dctx.length);
        const p = new Uint16Array(B * H * T * T);
        const dqkv = new Uint16Array(qkv.length);
        lib.causalAttentionToBf16(qkv, p, B, T, H, dh, 0.3, ctx);
        lib.causalAttentionGradToBf16(dctx, qkv, p, B, T, H, dh, 0.3, dqkv);
        return { ctx, p, dqkv };
      };
      const one = at(1);
      assert.ok(
        one.dqkv.some((v) => v !== 0),
        `B ${B}, H ${H}: the gradient is not all zeros`,
      );
      assert.deepEqual(at(2), one, `B ${B}, H ${H}: 2 threads against 1`);
    }
  });
});
