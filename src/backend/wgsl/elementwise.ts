/**
 * WGSL bodies of layerwise's element-wise webgpu kernels (backend/webgpu-kernels.ts): one thread
 * per element, `index` the flat index, inputs read from their buffers by name (TF.js's webgpu
 * program prelude declares each input as `var<storage, read> NAME : array<f32>` and the
 * output's `setOutputAtIndex`). The math is composed-kernels.ts's, operation for operation, so
 * the results match the other backends' to rounding. Storage is float32 (f32); an f16 storage
 * type would change the prelude's array type, not these bodies' f32 arithmetic.
 */
import { ROUND_F16_WGSL } from './matmul.js';

const GELU_C1 = 2 * Math.sqrt(2 / Math.PI);
const GELU_C2 = GELU_C1 * 0.044715;

/** WGSL's spelling of a float constant (always with a decimal point or exponent). */
const f32 = (v: number): string => {
  const s = String(Math.fround(v));
  return /[.e]/.test(s) ? s : `${s}.0`;
};

/** `body` (which sets the output at `index`) for every index below the output's size. */
const perElement = (body: string): string => `
  fn sigmoidOf(u : f32) -> f32 {
    return 1.0 / (1.0 + exp(-u));
  }
  fn main(index : i32) {
    if (index < uniforms.size) {
      ${body}
    }
  }
`;

/** GELU (tanh form as x * sigmoid(x * (C1 + C2 x^2))): inputs X. */
export const GELU_WGSL = perElement(`
      let x = X[index];
      let s = sigmoidOf(x * (x * x * ${f32(GELU_C2)} + ${f32(GELU_C1)}));
      setOutputAtIndex(index, x * s);
`);

/** GELU's gradient dy * GELU'(x): inputs X, Dy. */
export const GELU_GRAD_WGSL = perElement(`
      let x = X[index];
      let sq = x * x;
      let sg = sigmoidOf(x * (sq * ${f32(GELU_C2)} + ${f32(GELU_C1)}));
      let du = x * (sq * ${f32(3 * GELU_C2)} + ${f32(GELU_C1)});
      let slope = sg + du * (sg - sg * sg);
      setOutputAtIndex(index, Dy[index] * slope);
`);

/** exp(logit - lse(row)), the softmax cross-entropy's probabilities: inputs X [N, C], Lse [N]. */
export const SOFTMAX_PROBS_WGSL = perElement(`
      setOutputAtIndex(index, exp(X[index] - Lse[index / uniforms.cols]));
`);

/**
 * f16 helpers for programs in TF.js's prelude (`uniforms.INFINITY`), with `enable f16;` (hoisted
 * by backend/webgpu.ts; the device needs shader-f16):
 *
 * - `expH(a)`: exp of an argument a <= 0 (an exp of a softmax or log-sum-exp, its max already
 *   subtracted in f32) in f16 arithmetic: a rounded to f16 and exp taken in f16, the result
 *   widened to f32. a is clamped to [-32, 0]: exp(a) underflows f16 (2^-25, half its smallest
 *   subnormal) below -17.4, so the lower clamp changes no f16 result, and the upper one keeps a
 *   rounding's positive residue from overflowing (exp overflows f16 past 11.1).
 * - `roundF16(x)` (wgsl/matmul.ts ROUND_F16_WGSL, the products' own operand rounding): x
 *   rounded to the nearest f16 (ties to even) and held in f32 (the operand of an f16 product):
 *   on the bits (a conversion pair f32(f16(x)) is folded into x by Mesa's compiler:
 *   measured on lavapipe, the attention gradient's results equalled the f32 kernel's), f16's
 *   subnormals as multiples of 2^-24, beyond f16's range +-Infinity, so that the loss scaler
 *   sees the overflow; NaN stays NaN.
 */
export const F16_FUNCTIONS = `
  enable f16;
  fn expH(a : f32) -> f32 {
    return f32(exp(f16(clamp(a, -32.0, 0.0))));
  }
  ${ROUND_F16_WGSL}
`;

/**
 * {@link SOFTMAX_PROBS_WGSL} in f16 arithmetic: the argument logit - lse (<= 0; taken in f32,
 * since the logits and lse can exceed f16's range, e.g. logits times a large scale) rounded to
 * f16 and its exp taken in f16 (`expH`). A probability lies in [0, 1], within f16's range.
 */
export const SOFTMAX_PROBS_F16_WGSL = `${F16_FUNCTIONS}${perElement(`
      setOutputAtIndex(index, expH(X[index] - Lse[index / uniforms.cols]));
`)}`;

/**
 * The softmax cross-entropy's gradient (probs - onehot(label)) * (dy / N): inputs P [N, C],
 * Labels [N] (int32; a label outside [0, C) is an all-zero one-hot row, as tf.oneHot's), Dy [1].
 */
export const SOFTMAX_XENT_GRAD_WGSL = perElement(`
      let row = index / uniforms.cols;
      let hot = select(0.0, 1.0, Labels[row] == index % uniforms.cols);
      setOutputAtIndex(index, (P[index] - hot) * (Dy[0] / f32(uniforms.rows)));
`);

/**
 * {@link SOFTMAX_XENT_GRAD_WGSL} with probs - onehot in f16 arithmetic (a probability, in
 * [0, 1], rounded to f16; the difference in [-1, 1]); the factor dy / N stays f32, and so does
 * its product: dy is the loss scale (up to 2^24 after growth), and f16 overflow is not defined
 * in WGSL at run time, so the loss scaler's overflow test sees f32's, as GELU's gradient does.
 */
export const SOFTMAX_XENT_GRAD_F16_WGSL = `enable f16;${perElement(`
      let row = index / uniforms.cols;
      let hot = select(0.0h, 1.0h, Labels[row] == index % uniforms.cols);
      let d = f16(clamp(P[index], 0.0, 1.0)) - hot;
      setOutputAtIndex(index, f32(d) * (Dy[0] / f32(uniforms.rows)));
`)}`;

/** AdamW's new moments from the scaled gradient (shared by the three outputs' programs). */
const adamwMoments = (which: 'p' | 'm' | 'v'): string => `
      let g = G[index] * uniforms.scale;
      ${which === 'v' ? '' : 'let m = M[index] * uniforms.beta1 + g * uniforms.oneMinusBeta1;'}
      ${which === 'm' ? '' : 'let v = V[index] * uniforms.beta2 + (g * g) * uniforms.oneMinusBeta2;'}
`;

/**
 * One output of AdamW's update (optim/optimizer.ts's composed form): `which` 'p' (the
 * parameter), 'm' or 'v' (the moments). Inputs P, G, M, V for 'p', G, M for 'm', G, V for 'v'; uniforms lr, beta1, beta2, epsilon,
 * oneMinusBeta1, oneMinusBeta2 (as the host computes them), weightDecay, scale, bc1 = 1 -
 * beta1^t, bc2 = 1 - beta2^t.
 */
export const adamwWgsl = (which: 'p' | 'm' | 'v'): string =>
  perElement(`${adamwMoments(which)}
      ${
        which === 'm'
          ? 'setOutputAtIndex(index, m);'
          : which === 'v'
            ? 'setOutputAtIndex(index, v);'
            : `var upd = (m / uniforms.bc1) / (sqrt(v / uniforms.bc2) + uniforms.epsilon);
      if (uniforms.weightDecay > 0.0) {
        upd = upd + P[index] * uniforms.weightDecay;
      }
      setOutputAtIndex(index, P[index] - upd * uniforms.lr);`
      }
`);

/**
 * One output of SGD's update: `which` 'p' or 'velocity'; `momentum` whether a velocity is kept
 * (input Vel). Inputs P, G[, Vel]; uniforms lr, momentum, weightDecay, scale.
 */
export const sgdWgsl = (which: 'p' | 'velocity', momentum: boolean): string =>
  perElement(`
      var gw = G[index] * uniforms.scale;
      if (uniforms.weightDecay > 0.0) {
        gw = gw + P[index] * uniforms.weightDecay;
      }
      ${momentum ? 'let vel = Vel[index] * uniforms.momentum + gw;' : 'let vel = gw;'}
      ${which === 'velocity' ? 'setOutputAtIndex(index, vel);' : 'setOutputAtIndex(index, P[index] - vel * uniforms.lr);'}
`);

/** WGSL's spelling of an f16 constant (`h` suffix; the compiler rounds it to f16). */
const f16 = (v: number): string => `${Math.fround(v)}h`;

/**
 * `body` for every index below the output's size, in a module with WGSL's f16 type (`enable
 * f16;`, hoisted to the top by backend/webgpu.ts; the device needs `shader-f16`). sigmoidH is
 * the logistic function in f16 arithmetic without overflow: exp only of -|u| (<= 0).
 */
const perElementF16 = (body: string): string => `
  enable f16;
  fn sigmoidH(u : f16) -> f16 {
    let e = exp(-abs(u));
    return select(e / (1.0h + e), 1.0h / (1.0h + e), u >= 0.0h);
  }
  fn main(index : i32) {
    if (index < uniforms.size) {
      ${body}
    }
  }
`;

/**
 * The sigmoid's argument x (C1 + C2 x^2) of GELU in f16: x rounded to f16 and clamped to
 * [-16, 16], where the argument (at most 317) is finite in f16 and the sigmoid is already 0 or 1
 * in f16 (so the clamp changes no f16 result).
 */
const GELU_ARG_F16 = `
      let x = X[index];
      let xh = f16(clamp(x, -16.0, 16.0));
      let sq = xh * xh;
      let sg = sigmoidH(xh * (sq * ${f16(GELU_C2)} + ${f16(GELU_C1)}));
`;

/**
 * GELU with the sigmoid factor in f16 arithmetic (`--precision f16` where the device has
 * shader-f16): inputs X (float32 storage). The factor s in [0, 1] is computed in f16; x * s is
 * taken in f32 with x as stored, so values beyond f16's range (65504) give the f32 kernel's.
 */
export const GELU_F16_WGSL = perElementF16(`${GELU_ARG_F16}
      setOutputAtIndex(index, x * f32(sg));
`);

/**
 * GELU's gradient with the slope GELU'(x) in f16 arithmetic: inputs X, Dy (float32 storage).
 * dy * slope is taken in f32: dy is loss-scaled (up to 2^16 times the gradient), and an f16
 * overflow is not defined in WGSL at run time, so the loss scaler's overflow test sees f32's.
 */
export const GELU_GRAD_F16_WGSL = perElementF16(`${GELU_ARG_F16}
      let du = xh * (sq * ${f16(3 * GELU_C2)} + ${f16(GELU_C1)});
      let slope = sg + du * (sg - sg * sg);
      setOutputAtIndex(index, Dy[index] * f32(slope));
`);

/**
 * `fn geluOf(x : f32) -> f32`: {@link GELU_WGSL}'s math as a function, for a kernel that applies
 * GELU in its own epilogue (wgsl/dense-gelu.ts, the MLP's product + bias + GELU); with `f16`,
 * {@link GELU_F16_WGSL}'s (the sigmoid factor in f16 arithmetic, x * s in f32; the module must
 * `enable f16;`). Same operations in the same order as the element-wise kernels, so the fused
 * kernel's y equals LayerwiseGelu of its h.
 */
export const geluFunctionWgsl = (f16Arithmetic: boolean): string =>
  f16Arithmetic
    ? `
  fn sigmoidH(u : f16) -> f16 {
    let e = exp(-abs(u));
    return select(e / (1.0h + e), 1.0h / (1.0h + e), u >= 0.0h);
  }
  fn geluOf(x : f32) -> f32 {
    let xh = f16(clamp(x, -16.0, 16.0));
    let sq = xh * xh;
    let sg = sigmoidH(xh * (sq * ${f16(GELU_C2)} + ${f16(GELU_C1)}));
    return x * f32(sg);
  }
`
    : `
  fn sigmoidOf(u : f32) -> f32 {
    return 1.0 / (1.0 + exp(-u));
  }
  fn geluOf(x : f32) -> f32 {
    let s = sigmoidOf(x * (x * x * ${f32(GELU_C2)} + ${f32(GELU_C1)}));
    return x * s;
  }
`;

/**
 * `fn geluSlope(x : f32) -> f32`: GELU'(x) as {@link GELU_GRAD_WGSL} computes it (with `f16`,
 * as {@link GELU_GRAD_F16_WGSL}: in f16 arithmetic, widened to f32; the module must
 * `enable f16;`), for a kernel that multiplies it by dy itself (wgsl/dense-gelu.ts, GELU's
 * gradient with the bias's column sums). Needs {@link geluFunctionWgsl}'s sigmoid in the module.
 */
export const geluSlopeFunctionWgsl = (f16Arithmetic: boolean): string =>
  f16Arithmetic
    ? `
  fn geluSlope(x : f32) -> f32 {
    let xh = f16(clamp(x, -16.0, 16.0));
    let sq = xh * xh;
    let sg = sigmoidH(xh * (sq * ${f16(GELU_C2)} + ${f16(GELU_C1)}));
    let du = xh * (sq * ${f16(3 * GELU_C2)} + ${f16(GELU_C1)});
    return f32(sg + du * (sg - sg * sg));
  }
`
    : `
  fn geluSlope(x : f32) -> f32 {
    let sq = x * x;
    let sg = sigmoidOf(x * (sq * ${f32(GELU_C2)} + ${f32(GELU_C1)}));
    let du = x * (sq * ${f32(3 * GELU_C2)} + ${f32(GELU_C1)});
    return sg + du * (sg - sg * sg);
  }
`;
