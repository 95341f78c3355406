/**
 * `--precision f16` kernels in f16 arithmetic on webgpu (issue 36 item 5): where the adapter has
 * shader-f16 (Mesa's lavapipe does), the device is made with it and GELU and its gradient
 * compute their sigmoid factor and slope in WGSL's f16 (backend/wgsl/elementwise.ts), layer
 * norm's forward its normalisation (f32 sums; wgsl/multi.ts), the softmax cross-entropy and the
 * causal softmax their exps (and their gradients probs - onehot and y * scale; wgsl/rows.ts,
 * elementwise.ts), and flash attention takes f16 product operands and f16 exps
 * (wgsl-attention/), storage staying float32. Checked against the cpu backend's f16 numerics
 * (its f32 kernels on inputs rounded to f16 by webgpu-f16.ts's rounding where the kernel rounds
 * its input) within bounds derived from f16's precision (its unit roundoff, one ulp per WGSL
 * conversion or operation, WGSL's 3 + 2|x| ulps for exp), and a 3-step charlm-tiny run against
 * the f16 path with f32 element-wise kernels (LAYERWISE_WEBGPU_KERNELS=tfjs; the cpu backend
 * refuses f16). Each f16 test also checks that its results are not the f32 kernels' (the f16
 * program ran). Skipped, saying why, where no adapter with shader-f16 can be made.
 */
import assert from 'node:assert/strict';
import { mkdtempSync, rmSync } from 'node:fs';
import { tmpdir } from 'node:os';
import { join } from 'node:path';
import { test } from 'node:test';
import { randomArray } from '../testing/backend-compare.js';
import { runCli } from '../testing/cli.js';
import { noShaderF16 } from '../testing/webgpu.js';
import { readStepMetrics } from '../train/metrics.js';
import { initBackend } from './index.js';
import {
  CAUSAL_ATTENTION_GRAD_KERNEL,
  CAUSAL_ATTENTION_KERNEL,
  CAUSAL_SOFTMAX_GRAD_KERNEL,
  CAUSAL_SOFTMAX_KERNEL,
  FLASH_ATTENTION_GRAD_KERNEL,
  FLASH_ATTENTION_KERNEL,
  GELU_GRAD_KERNEL,
  GELU_KERNEL,
  LAYER_NORM_KERNEL,
  SOFTMAX_CROSS_ENTROPY_GRAD_KERNEL,
  SOFTMAX_CROSS_ENTROPY_KERNEL,
} from './kernel-names.js';
import { tf } from './tfjs.js';

const why = await noShaderF16();

/** f16's unit roundoff: half the gap between 1 and the next f16 (10 fraction bits). */
const U16 = 2 ** -11;
/**
 * The sigmoid factor's bound, absolute (it lies in [0, 1]): about ten f16 operations, each
 * within a unit roundoff or, for exp, WGSL's 3 + 2|u| ulps of exp(-|u|) (<= 1, and |u| e^-|u|
 * <= 1/e), rounded up to 16 U16 (2^-7).
 */
const SIGMOID_BOUND = 16 * U16;

/**
 * The losses' bound after 3 steps, relative: one f16 unit roundoff (U16, 4.9e-4) of the loss,
 * i.e. the two runs agree to the loss's own f16 precision. The f16 kernels move activations by a
 * few U16 (the kernel tests' bounds), which products then round to f16 in both runs, and AdamW's
 * m / sqrt(v) amplifies the differences of parameters with small gradients; a wrong kernel (a
 * wrong constant or term) moves the loss by far more. Measured on lavapipe: 1.1e-4 absolute
 * (0.05 U16 relative at losses near 4.3; 5.7e-5 with f16 GELU and layer norm alone); the f16
 * path against fp32: 2e-6.
 */
const TRAIN_TOLERANCE = U16;

const run = (
  name: string,
  inputs: tf.NamedTensorMap,
  attrs: tf.NamedAttrMap = {},
) => tf.engine().runKernel(name, inputs, attrs) as tf.Tensor;

/** GELU's du/dx factor x (C1 + 3 C2 x^2) at x (f64), which scales the slope's error. */
const duOf = (x: number) => {
  const c1 = 2 * Math.sqrt(2 / Math.PI);
  return Math.abs(x * (c1 + 3 * c1 * 0.044715 * x * x));
};

/** Inputs: normal * 4 (the sigmoid's whole curve) and far values on both sides, 1,000 (not a multiple of 64). */
function inputs(): { x: Float32Array; dy: Float32Array } {
  const x = randomArray(1000, 7).map((v) => v * 4);
  x.set([-1e5, -40, -16.5, -16, 16, 16.5, 40, 1e5, 0, -0], 0);
  return { x, dy: randomArray(1000, 8) };
}

test('webgpu f16: GELU and its gradient compute in f16 and equal the cpu backend on f16-rounded inputs within f16 bounds', {
  skip: why,
}, async () => {
  await initBackend('webgpu', { precision: 'f16' });
  // after initBackend: TF.js's webgpu package needs navigator.gpu when it is imported
  const { roundF16 } = await import('./webgpu-f16.js');
  const { f16Arithmetic, useF16Arithmetic } = await import(
    './webgpu-kernels.js'
  );
  assert.ok(f16Arithmetic(tf.backend()), 'the device was made with shader-f16');
  const { x, dy } = inputs();
  const xt = tf.tensor1d(x);
  const dyt = tf.tensor1d(dy);
  const x16 = await roundF16(xt).data();
  const y = await run(GELU_KERNEL, { x: xt }).data();
  const dx = await run(GELU_GRAD_KERNEL, { x: xt, dy: dyt }).data();
  useF16Arithmetic(false);
  const y32 = await run(GELU_KERNEL, { x: xt }).data();
  useF16Arithmetic(true);
  await tf.setBackend('cpu');
  // x beyond f16's range (65504) is taken as stored, the f32 kernel's value (rounding it would
  // give +-Infinity and NaN = -Infinity * 0)
  const xr = x16.map((v, i) => (Number.isFinite(v) ? v : x[i]!));
  const ref = await run(GELU_KERNEL, { x: tf.tensor1d(xr) }).data();
  const dref = await run(GELU_GRAD_KERNEL, {
    x: tf.tensor1d(xr),
    dy: tf.tensor1d(dy),
  }).data();
  let worstY = 0;
  let worstDx = 0;
  let differs = 0;
  for (let i = 0; i < x.length; i++) {
    // y = x s: |x| times the factor's bound, plus x's own rounding (f32 x against f16 x)
    const tolY = Math.abs(x[i]!) * (SIGMOID_BOUND + U16);
    const dY = Math.abs(y[i]! - ref[i]!);
    assert.ok(dY <= tolY, `gelu(${x[i]}): ${y[i]} vs ${ref[i]}`);
    worstY = Math.max(worstY, dY / Math.max(Math.abs(x[i]!), 1e-30));
    // slope = s + du (s - s^2): the factor's bound times (1 + 2|du|), times |dy|
    const du = duOf(Math.min(Math.abs(xr[i]!), 16));
    const tolDx = Math.abs(dy[i]!) * SIGMOID_BOUND * (1 + 2 * du);
    const dD = Math.abs(dx[i]! - dref[i]!);
    assert.ok(dD <= tolDx, `gelu'(${x[i]}) * ${dy[i]}: ${dx[i]} vs ${dref[i]}`);
    worstDx = Math.max(worstDx, dD / Math.abs(dy[i]!) / (1 + 2 * du));
    if (y[i] !== y32[i]) differs++;
  }
  // the f16 program ran: its results are not the f32 kernel's
  assert.ok(
    differs > x.length / 4,
    `${differs} of ${x.length} differ from f32`,
  );
  console.log(
    `f16 GELU: worst |y - ref| / |x| ${(worstY / U16).toFixed(2)} U16, worst slope error ${(worstDx / U16).toFixed(2)} U16 (bound ${SIGMOID_BOUND / U16})`,
  );
});

/** Layer norm [y, xhat, rstd] of x [37, 100] (rows and a width no workgroup divides), g, b [100]. */
async function layerNormOn(
  backend: string,
  x: Float32Array,
  g: Float32Array,
  b: Float32Array,
) {
  await tf.setBackend(backend);
  const out = tf
    .engine()
    .runKernel(
      LAYER_NORM_KERNEL,
      { x: tf.tensor2d(x, [37, 100]), g: tf.tensor1d(g), b: tf.tensor1d(b) },
      { epsilon: 1e-5 },
    ) as tf.Tensor[];
  return Promise.all(out.map((t) => t.data()));
}

test('webgpu f16: layer norm normalises in f16 (f32 sums) and equals the cpu backend within f16 bounds', {
  skip: why,
}, async () => {
  await initBackend('webgpu', { precision: 'f16' });
  const { useF16Arithmetic } = await import('./webgpu-kernels.js');
  const x = randomArray(3700, 11).map((v) => v * 3 + 0.5);
  const g = randomArray(100, 12);
  const b = randomArray(100, 13);
  const [y, xhat, rstd] = await layerNormOn('webgpu', x, g, b);
  useF16Arithmetic(false);
  const [y32] = await layerNormOn('webgpu', x, g, b);
  useF16Arithmetic(true);
  // the kernel reads x as stored (float32) and sums in f32: the reference is cpu's on x itself
  const [ry, rxhat, rrstd] = await layerNormOn('cpu', x, g, b);
  let differs = 0;
  for (let i = 0; i < x.length; i++) {
    const c = i % 100;
    // xhat: (x - mean) and rstd taken to f16, their product rounded: 3 U16, and 1e-6 for f32's
    // sums in another order
    const a = Math.abs(rxhat![i]!);
    assert.ok(
      Math.abs(xhat![i]! - rxhat![i]!) <= 3 * U16 * a + 1e-6,
      `xhat[${i}]: ${xhat![i]} vs ${rxhat![i]}`,
    );
    // y = xhat g + b: xhat's 3 U16, g's rounding and the product's (2 U16) on |xhat g|, b's
    // rounding and the sum's on |b| and |y|
    const tolY =
      U16 * (5 * a * Math.abs(g[c]!) + Math.abs(b[c]!) + Math.abs(ry![i]!)) +
      1e-6;
    assert.ok(
      Math.abs(y![i]! - ry![i]!) <= tolY,
      `y[${i}]: ${y![i]} vs ${ry![i]}`,
    );
    if (y![i] !== y32![i]) differs++;
  }
  rstd!.forEach((r, i) =>
    assert.ok(Math.abs(r - rrstd![i]!) <= 1e-5 * Math.abs(rrstd![i]!)),
  );
  assert.ok(
    differs > x.length / 4,
    `${differs} of ${x.length} differ from f32`,
  );
});

/**
 * One f16 ulp at |v| (f64): 2^(e - 10) for |v| in [2^e, 2^(e+1)), 2^-24 among the subnormals.
 * WGSL's conversions, + - * of f16 round to one of the two neighbours: within one ulp.
 */
const ulp16 = (v: number): number =>
  Math.abs(v) < 2 ** -14
    ? 2 ** -24
    : 2 ** (Math.floor(Math.log2(Math.abs(v))) - 10);

/**
 * The error bound of the kernels' f16 exp of a <= 0 (expH, wgsl/elementwise.ts), absolute: the
 * argument's conversion (one ulp of a, 2^-10 |a| relative, moving exp(a) by as much relative)
 * and WGSL's 3 + 2|a| ulps of exp in f16. Below -32 the kernel's clamp to -32, whose exp is
 * taken instead (0 in f16).
 */
const expErr = (a: number): number => {
  const ac = Math.max(a, -32);
  const e = Math.exp(ac);
  return (
    (3 + 2 * Math.abs(ac)) * ulp16(e) +
    2 ** -10 * Math.abs(ac) * e +
    (e - Math.exp(a))
  );
};

/**
 * A softmax row's sum S = sum exp(a_j) (a_j = s_j - max, f64) and the relative bound delta of
 * the kernels' f16 sum against it: sum expErr(a_j) / S (the f32 sum's own rounding is below
 * F32_SLACK).
 */
function rowBound(a: number[]): { sum: number; delta: number } {
  let sum = 0;
  let err = 0;
  for (const v of a) {
    sum += Math.exp(v);
    err += expErr(v);
  }
  return { sum, delta: err / sum };
}

/** The f32 kernels' own agreement with cpu (sums in another order): 1e-6, relative and absolute. */
const F32_SLACK = 1e-6;

/** Asserts |got - want| <= tol for element i of `name`, keeping the worst |got - want| / tol in `worst`. */
function within(
  worst: Map<string, number>,
  name: string,
  i: number,
  got: number,
  want: number,
  tol: number,
): void {
  const e = Math.abs(got - want);
  assert.ok(e <= tol, `${name}[${i}]: ${got} vs ${want} (bound ${tol})`);
  if (e > 0) worst.set(name, Math.max(worst.get(name) ?? 0, e / tol));
}

const report = (worst: Map<string, number>): string =>
  [...worst].map(([k, v]) => `${k} ${v.toFixed(3)}`).join(', ');

/** The count of elements where `a` and `b` differ: an f16 program's results are not the f32 kernel's. */
const differing = (a: ArrayLike<number>, b: ArrayLike<number>): number => {
  let n = 0;
  for (let i = 0; i < a.length; i++) if (a[i] !== b[i]) n++;
  return n;
};

/** [loss, probs, dlogits] of the softmax cross-entropy and its gradient on the current backend. */
async function crossEntropy(
  logits: Float32Array,
  labels: Int32Array,
  dy: number,
): Promise<Float32Array[]> {
  const rows = labels.length;
  const x = tf.tensor2d(logits, [rows, logits.length / rows]);
  const l = tf.tensor1d(labels, 'int32');
  const [loss, probs] = tf.engine().runKernel(SOFTMAX_CROSS_ENTROPY_KERNEL, {
    logits: x,
    labels: l,
  }) as tf.Tensor[];
  const grad = run(SOFTMAX_CROSS_ENTROPY_GRAD_KERNEL, {
    probs: probs!,
    labels: l,
    dy: tf.scalar(dy),
  });
  return Promise.all(
    [loss!, probs!, grad].map((t) => t.data() as Promise<Float32Array>),
  );
}

test('webgpu f16: softmax cross-entropy and its gradient take their exps and probs - onehot in f16 and equal the cpu backend within f16 bounds', {
  skip: why,
}, async () => {
  await initBackend('webgpu', { precision: 'f16' });
  const { useF16Arithmetic } = await import('./webgpu-kernels.js');
  const [rows, cols] = [37, 100];
  const logits = randomArray(rows * cols, 21).map((v) => v * 4);
  // a row with a logit beyond f16's range (kept f32), one with a wide spread (exps underflow f16)
  logits[5] = 1e5;
  for (let c = 0; c < cols; c++) logits[cols + c] = -c;
  const labels = Int32Array.from({ length: rows }, (_, i) => (i * 7) % cols);
  labels[3] = -1; // an all-zero one-hot row
  const dy = 65536; // the loss scale
  const [loss, probs, grad] = await crossEntropy(logits, labels, dy);
  useF16Arithmetic(false);
  const [, probs32, grad32] = await crossEntropy(logits, labels, dy);
  useF16Arithmetic(true);
  await tf.setBackend('cpu');
  const [rloss, rprobs] = await crossEntropy(logits, labels, dy);
  let lossBound = 0;
  const worst = new Map<string, number>();
  for (let r = 0; r < rows; r++) {
    const row = Array.from(logits.subarray(r * cols, (r + 1) * cols));
    const top = Math.max(...row);
    const { sum, delta } = rowBound(row.map((v) => v - top));
    const lse = top + Math.log(sum);
    // lse moves by log(1 +- delta) <= delta / (1 - delta), plus f32's rounding of top + log
    const dLse = delta / (1 - delta) + F32_SLACK * (1 + Math.abs(lse));
    if (labels[r]! >= 0) lossBound += dLse / rows;
    for (let c = 0; c < cols; c++) {
      const i = r * cols + c;
      // p = expH(x - lse'): the argument off by dLse (exp moves by expm1(dLse) relative)
      const a = Math.abs(logits[i]! - lse) + dLse;
      const tol =
        expErr(-a) + rprobs![i]! * Math.expm1(dLse) + F32_SLACK * 1e-3;
      within(worst, 'probs', i, probs![i]!, rprobs![i]!, tol);
      // the gradient of the webgpu probs: p rounded to f16, p - hot rounded, times dy / N in f32
      const hot = labels[r] === c ? 1 : 0;
      const p = probs![i]!;
      const g = ((p - hot) * dy) / rows;
      const tolG =
        (ulp16(p) + ulp16(p - hot)) * (dy / rows) + F32_SLACK * Math.abs(g);
      within(worst, 'grad', i, grad![i]!, g, tolG);
    }
  }
  assert.ok(
    Math.abs(loss![0]! - rloss![0]!) <= lossBound,
    `loss ${loss![0]} vs ${rloss![0]} (bound ${lossBound})`,
  );
  console.log(
    `f16 softmax cross-entropy: worst |error| / bound ${report(worst)}`,
  );
  assert.ok(differing(probs!, probs32!) > probs!.length / 4, 'probs in f16');
  assert.ok(differing(grad!, grad32!) > grad!.length / 4, 'gradient in f16');
});

/** [y, dx] of the causal softmax of x [2, T, T] and its gradient (of the given y) on the current backend. */
async function causalSoftmaxOn(
  x: Float32Array,
  y: Float32Array | undefined,
  dy: Float32Array,
  t: number,
  scale: number,
): Promise<Float32Array[]> {
  const shape = [2, t, t];
  const out = run(CAUSAL_SOFTMAX_KERNEL, { x: tf.tensor(x, shape) }, { scale });
  const dx = run(
    CAUSAL_SOFTMAX_GRAD_KERNEL,
    { y: y ? tf.tensor(y, shape) : out, dy: tf.tensor(dy, shape) },
    { scale },
  );
  return Promise.all([out, dx].map((v) => v.data() as Promise<Float32Array>));
}

test('webgpu f16: the causal softmax takes its exps, and its gradient y * scale, in f16 and equals the cpu backend within f16 bounds', {
  skip: why,
}, async () => {
  await initBackend('webgpu', { precision: 'f16' });
  const { useF16Arithmetic } = await import('./webgpu-kernels.js');
  const [t, scale] = [70, 0.25];
  const x = randomArray(2 * t * t, 31).map((v) => v * 12);
  const dy = randomArray(2 * t * t, 32).map((v) => v * 1000);
  await tf.setBackend('cpu');
  const [ry] = await causalSoftmaxOn(x, undefined, dy, t, scale);
  const [, rdx] = await causalSoftmaxOn(x, ry, dy, t, scale);
  await tf.setBackend('webgpu');
  // the gradient of cpu's y, so that it is compared alone
  const [y, dx] = await causalSoftmaxOn(x, ry, dy, t, scale);
  useF16Arithmetic(false);
  const [y32, dx32] = await causalSoftmaxOn(x, ry, dy, t, scale);
  useF16Arithmetic(true);
  const worst = new Map<string, number>();
  for (let r = 0; r < 2 * t; r++) {
    const last = r % t;
    const s = Array.from(x.subarray(r * t, r * t + last + 1), (v) => v * scale);
    const top = Math.max(...s);
    const { sum, delta } = rowBound(s.map((v) => v - top));
    let dot = 0;
    for (let c = 0; c <= last; c++) dot += dy[r * t + c]! * ry![r * t + c]!;
    for (let c = 0; c < t; c++) {
      const i = r * t + c;
      const yr = ry![i]!;
      // y = expH(a) / S': exp's bound over S, and S' off by delta relative
      const tol =
        c <= last
          ? (expErr(s[c]! - top) / sum + yr * delta) / (1 - delta) +
            F32_SLACK * (yr + 1e-3)
          : 0;
      within(worst, 'y', i, y[i]!, yr, tol);
      // w = f16(y) f16(scale) in f16: three roundings of at most one ulp, times |dy - dot|
      const m = Math.abs(dy[i]! - dot);
      const tolDx =
        (ulp16(yr) * scale + ulp16(scale) * yr + ulp16(yr * scale)) * m +
        F32_SLACK * (m * yr * scale + 1e-3);
      within(worst, 'dx', i, dx[i]!, rdx![i]!, tolDx);
    }
  }
  console.log(`f16 causal softmax: worst |error| / bound ${report(worst)}`);
  assert.ok(differing(y, y32!) > y.length / 8, 'y in f16');
  assert.ok(differing(dx!, dx32!) > dx!.length / 8, 'dx in f16');
});

/** Attention's sizes [B, T, H, dh]: T past one 64-row block, two heads. */
const ATT: [number, number, number, number] = [2, 70, 2, 16];

/** [ctx, p, dqkv] of the P attention pair (the cpu reference) on the current backend. */
async function attentionOn(
  qkv: Float32Array,
  dy: Float32Array,
): Promise<Float32Array[]> {
  const [b, t, h, dh] = ATT;
  const q = tf.tensor(qkv, [b, t, 3 * h * dh]);
  const [ctx, probs] = tf
    .engine()
    .runKernel(
      CAUSAL_ATTENTION_KERNEL,
      { qkv: q },
      { heads: h },
    ) as tf.Tensor[];
  const dqkv = run(
    CAUSAL_ATTENTION_GRAD_KERNEL,
    { dy: tf.tensor(dy, [b, t, h * dh]), qkv: q, p: probs! },
    { heads: h },
  );
  return Promise.all(
    [ctx!, probs!, dqkv].map((v) => v.data() as Promise<Float32Array>),
  );
}

/**
 * [ctx, lse, dqkv] of the flash attention pair on the current backend; the gradient of the
 * given forward outputs `fwd` (ctx, lse: cpu's) where given, so that it is compared alone.
 */
async function flashOn(
  qkv: Float32Array,
  dy: Float32Array,
  fwd?: [Float32Array, Float32Array],
): Promise<Float32Array[]> {
  const [b, t, h, dh] = ATT;
  const q = tf.tensor(qkv, [b, t, 3 * h * dh]);
  const [ctx, lse] = tf
    .engine()
    .runKernel(FLASH_ATTENTION_KERNEL, { qkv: q }, { heads: h }) as tf.Tensor[];
  const dqkv = run(
    FLASH_ATTENTION_GRAD_KERNEL,
    {
      dy: tf.tensor(dy, [b, t, h * dh]),
      qkv: q,
      ctx: fwd ? tf.tensor(fwd[0], ctx!.shape) : ctx!,
      lse: fwd ? tf.tensor(fwd[1], lse!.shape) : lse!,
    },
    { heads: h },
  );
  return Promise.all(
    [ctx!, lse!, dqkv].map((v) => v.data() as Promise<Float32Array>),
  );
}

/**
 * The f32 attention kernel's agreement with cpu (webgpu-attention.test.ts: 1e-4, absolute, at
 * unit-scale inputs), the slack of the attention bounds for f32's sums in another order.
 */
const ATT_SLACK = 1e-4;

/** Attention's inputs, f16-rounded (q16: qkv, dy16: dy), read by position (f64 math). */
function attentionReader(q16: Float32Array, dy16: Float32Array) {
  const [, t, h, dh] = ATT;
  return {
    at: (bi: number, ti: number, part: number, hi: number, d: number) =>
      q16[(((bi * t + ti) * 3 + part) * h + hi) * dh + d]!,
    g: (bi: number, ti: number, hi: number, d: number) =>
      dy16[((bi * t + ti) * h + hi) * dh + d]!,
    /** Row i's scaled scores s_j, j <= i, of (bi, hi). */
    scores(bi: number, hi: number, i: number): number[] {
      const s: number[] = [];
      for (let j = 0; j <= i; j++) {
        let dot = 0;
        for (let d = 0; d < dh; d++)
          dot += this.at(bi, i, 0, hi, d) * this.at(bi, j, 1, hi, d);
        s.push(dot / Math.sqrt(dh));
      }
      return s;
    },
  };
}

/**
 * Bounds of the flash forward's lse and ctx against the exact lse and cpu's ctx on the
 * f16-rounded qkv (f64), and that lse [B, H, T]. Each term's f16 exp is taken against the
 * running max of its key block and rescaled in f32 to the row's max: the rescaling keeps its
 * relative error and, its argument being nearer 0, shrinks WGSL's 3 + 2|a| ulps, but an ulp
 * scaled is within two ulps of the scaled value: twice expErr of the term's final argument.
 * The row's sum S is then within delta = sum 2 expErr / S, relative; lse = m + log S within
 * delta / (1 - delta); ctx = sum_j exp_j v_j / S within sum_j (2 expErr_j / S + p_j delta) /
 * (1 - delta) |v_j| (the products' weights are f16 values already: no rounding).
 */
function flashForwardBounds(
  q16: Float32Array,
  dy16: Float32Array,
): { lse: Float64Array; lseTol: Float64Array; ctxTol: Float64Array } {
  const [b, t, h, dh] = ATT;
  const r = attentionReader(q16, dy16);
  const lse = new Float64Array(b * h * t);
  const lseTol = new Float64Array(b * h * t);
  const ctxTol = new Float64Array(b * t * h * dh).fill(ATT_SLACK);
  for (let bi = 0; bi < b; bi++)
    for (let hi = 0; hi < h; hi++)
      for (let i = 0; i < t; i++) {
        const s = r.scores(bi, hi, i);
        const top = Math.max(...s);
        const a = s.map((v) => v - top);
        const sum = a.reduce((acc, v) => acc + Math.exp(v), 0);
        const delta = a.reduce((acc, v) => acc + 2 * expErr(v), 0) / sum;
        lse[(bi * h + hi) * t + i] = top + Math.log(sum);
        lseTol[(bi * h + hi) * t + i] = delta / (1 - delta) + ATT_SLACK;
        for (let j = 0; j <= i; j++) {
          const pj = Math.exp(a[j]!) / sum;
          const w = ((2 * expErr(a[j]!)) / sum + pj * delta) / (1 - delta);
          for (let d = 0; d < dh; d++)
            ctxTol[((bi * t + i) * h + hi) * dh + d]! +=
              w * Math.abs(r.at(bi, j, 2, hi, d));
        }
      }
  return { lse, lseTol, ctxTol };
}

/**
 * The f16 flash gradient's bound against cpu's P-form gradient on f16-rounded dy and qkv (f64),
 * the flash kernel given cpu's ctx and the exact lse: the kernel recomputes P as an f16 exp of
 * s - lse (within pErr = expErr(s - lse), and 1e-5 p for the f32 argument), and D = sum dy ctx
 * is cpu's rowsum(dP P) within f32's slack. So dv = sum P dy within sum pErr |dy|; dS =
 * scale P (dP - D) within scale (pErr |dP - D| + p |D - D'|) and its rounding to f16 (one ulp),
 * times |k| (dq) or |q| (dk).
 */
function flashGradBounds(
  q16: Float32Array,
  dy16: Float32Array,
  rp: Float32Array,
  lse: Float64Array,
): Float64Array {
  const [b, t, h, dh] = ATT;
  const r = attentionReader(q16, dy16);
  const tol = new Float64Array(q16.length).fill(ATT_SLACK);
  const add = (
    bi: number,
    ti: number,
    part: number,
    hi: number,
    d: number,
    v: number,
  ) => {
    tol[(((bi * t + ti) * 3 + part) * h + hi) * dh + d]! += v;
  };
  const scale = 1 / Math.sqrt(dh);
  for (let bi = 0; bi < b; bi++)
    for (let hi = 0; hi < h; hi++)
      for (let i = 0; i < t; i++) {
        const base = ((bi * h + hi) * t + i) * t;
        const s = r.scores(bi, hi, i);
        const dp: number[] = [];
        let delta = 0;
        let deltaAbs = 0;
        for (let j = 0; j <= i; j++) {
          let v = 0;
          let va = 0;
          for (let d = 0; d < dh; d++) {
            v += r.g(bi, i, hi, d) * r.at(bi, j, 2, hi, d);
            va += Math.abs(r.g(bi, i, hi, d) * r.at(bi, j, 2, hi, d));
          }
          dp.push(v);
          delta += rp[base + j]! * v;
          deltaAbs += rp[base + j]! * va;
        }
        const dErr = F32_SLACK * deltaAbs;
        for (let j = 0; j <= i; j++) {
          const pij = rp[base + j]!;
          const a = s[j]! - lse[(bi * h + hi) * t + i]!;
          const pErr = expErr(Math.min(a, 0)) + 1e-5 * pij;
          const ds = scale * pij * (dp[j]! - delta);
          const dsErr =
            scale * (pErr * Math.abs(dp[j]! - delta) + pij * dErr) +
            ulp16(ds) +
            F32_SLACK * Math.abs(ds);
          for (let d = 0; d < dh; d++) {
            add(bi, i, 0, hi, d, dsErr * Math.abs(r.at(bi, j, 1, hi, d)));
            add(bi, j, 1, hi, d, dsErr * Math.abs(r.at(bi, i, 0, hi, d)));
            add(
              bi,
              j,
              2,
              hi,
              d,
              (pErr + ulp16(pij)) * Math.abs(r.g(bi, i, hi, d)),
            );
          }
        }
      }
  return tol;
}

/** Asserts |a - r| <= tol elementwise; the worst |a - r| / tol. */
function checkWithin(
  name: string,
  a: Float32Array,
  r: ArrayLike<number>,
  tol: Float64Array,
): string {
  let worst = 0;
  for (let i = 0; i < a.length; i++) {
    const e = Math.abs(a[i]! - r[i]!);
    assert.ok(
      e <= tol[i]!,
      `${name}[${i}]: ${a[i]} vs ${r[i]} (bound ${tol[i]})`,
    );
    if (e > 0) worst = Math.max(worst, e / tol[i]!);
  }
  return worst.toFixed(3);
}

test('webgpu f16: flash attention and its gradient take f16 operands and f16 exps, equal the cpu backend on f16-rounded inputs within f16 bounds, and overflow past f16 as the f16 matmuls do', {
  skip: why,
}, async () => {
  await initBackend('webgpu', { precision: 'f16' });
  const { roundF16 } = await import('./webgpu-f16.js');
  const { useF16Arithmetic } = await import('./webgpu-kernels.js');
  const [b, t, h, dh] = ATT;
  const qkv = randomArray(b * t * 3 * h * dh, 41).map((v) => v * 2);
  const dy = randomArray(b * t * h * dh, 42);
  const q16 = (await roundF16(tf.tensor1d(qkv)).data()) as Float32Array;
  const dy16 = (await roundF16(tf.tensor1d(dy)).data()) as Float32Array;
  await tf.setBackend('cpu');
  const [rctx, rp, rdqkv] = await attentionOn(q16, dy16);
  const { lse: rlse, lseTol, ctxTol } = flashForwardBounds(q16, dy16);
  const given: [Float32Array, Float32Array] = [rctx!, Float32Array.from(rlse)];
  await tf.setBackend('webgpu');
  const [ctx, lse] = await flashOn(qkv, dy);
  const [, , dqkv] = await flashOn(qkv, dy, given);
  useF16Arithmetic(false);
  const [ctx32, lse32] = await flashOn(qkv, dy);
  const [, , dqkv32] = await flashOn(qkv, dy, given);
  useF16Arithmetic(true);
  const dTol = flashGradBounds(q16, dy16, rp!, rlse);
  console.log(
    `f16 flash attention: worst |error| / bound lse ${checkWithin('lse', lse!, rlse, lseTol)}, ctx ${checkWithin('ctx', ctx!, rctx!, ctxTol)}, dqkv ${checkWithin('dqkv', dqkv!, rdqkv!, dTol)}`,
  );
  // the f16 programs ran: their results are not the f32 kernels'
  assert.ok(differing(lse!, lse32!) > lse!.length / 8, 'lse in f16');
  assert.ok(differing(ctx!, ctx32!) > ctx!.length / 4, 'ctx in f16');
  assert.ok(differing(dqkv!, dqkv32!) > dqkv!.length / 4, 'dqkv in f16');
  // a loss-scaled dctx past f16's range is an f16 operand's overflow: the gradient is not finite
  // (what the loss scaler tests), where the f32 kernel's stays finite
  const big = dy.slice();
  big[0] = 1e5;
  const [, , over] = await flashOn(qkv, big, given);
  useF16Arithmetic(false);
  const [, , over32] = await flashOn(qkv, big, given);
  useF16Arithmetic(true);
  assert.ok(
    over!.some((v) => !Number.isFinite(v)),
    'overflow is not finite',
  );
  assert.ok(over32!.every(Number.isFinite), 'f32 stays finite');
});

test('webgpu f16: charlm-tiny trains 3 steps with the f16-arithmetic kernels as the f16 path with f32 element-wise kernels does', {
  skip: why,
  timeout: 300_000,
}, () => {
  const tmp = mkdtempSync(join(tmpdir(), 'layerwise-f16k-'));
  try {
    const args = (out: string) => [
      'train',
      '--preset',
      'charlm-tiny',
      '--data',
      'moby-dick',
      '--backend',
      'webgpu',
      '--precision',
      'f16',
      '--batch-size',
      '8',
      '--steps',
      '3',
      '--eval-every',
      '0',
      '--eval-batches',
      '1',
      '--out',
      out,
    ];
    const losses = (out: string, env: Record<string, string> = {}) => {
      const r = runCli(args(out), env, 240_000);
      assert.equal(r.code, 0, r.err);
      return readStepMetrics(out).map((m) => m.loss);
    };
    const f16 = losses(join(tmp, 'f16'));
    // LAYERWISE_WEBGPU_KERNELS=tfjs: the f16 products with TF.js's f32 kernels and composed forms
    const ref = losses(join(tmp, 'ref'), { LAYERWISE_WEBGPU_KERNELS: 'tfjs' });
    assert.equal(f16.length, 3);
    console.log(`losses f16 kernels ${f16}, f32 element-wise ${ref}`);
    f16.forEach((l, i) =>
      assert.ok(
        Math.abs(l - ref[i]!) <= TRAIN_TOLERANCE * Math.abs(ref[i]!),
        `step ${i}: ${l} vs ${ref[i]}`,
      ),
    );
  } finally {
    rmSync(tmp, { recursive: true, force: true });
  }
});
