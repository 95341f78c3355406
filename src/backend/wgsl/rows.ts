/**
 * WGSL bodies of layerwise's row-wise webgpu kernels (backend/webgpu-kernels.ts): one workgroup
 * of {@link ROW_THREADS} threads per row (or per column, for the column sums), the threads
 * striding over the row and reducing through workgroup memory. The row is the workgroup's flat
 * id, so it stays right when TF.js reshapes a dispatch past 65,535 workgroups into two or three
 * dimensions; workgroups past the last row read nothing and write nothing, and every barrier
 * stays in uniform control flow. Sizes come as uniforms (rows, cols), so one compiled pipeline
 * serves every shape. The math is composed-kernels.ts's; storage is float32 (see elementwise.ts).
 */

import { F16_FUNCTIONS } from './elementwise.js';

/** Threads per workgroup of a row kernel. */
export const ROW_THREADS = 64;

/** The prelude every row kernel shares: its row, thread, and sum/max reductions over the workgroup. */
const REDUCTIONS = `
  var<workgroup> red : array<f32, ${ROW_THREADS}>;
  fn flatWorkgroup() -> i32 {
    return i32(workgroupId.x + workgroupId.y * numWorkgroups.x +
               workgroupId.z * numWorkgroups.x * numWorkgroups.y);
  }
  fn reduceSum(v : f32) -> f32 {
    let tid = i32(localId.x);
    red[tid] = v;
    workgroupBarrier();
    for (var s = ${ROW_THREADS / 2}; s > 0; s = s >> 1u) {
      if (tid < s) {
        red[tid] = red[tid] + red[tid + s];
      }
      workgroupBarrier();
    }
    let r = red[0];
    workgroupBarrier();
    return r;
  }
  fn reduceMax(v : f32) -> f32 {
    let tid = i32(localId.x);
    red[tid] = v;
    workgroupBarrier();
    for (var s = ${ROW_THREADS / 2}; s > 0; s = s >> 1u) {
      if (tid < s) {
        red[tid] = max(red[tid], red[tid + s]);
      }
      workgroupBarrier();
    }
    let r = red[0];
    workgroupBarrier();
    return r;
  }
`;

/** A row kernel: `body` runs in every thread with row, tid, cols, valid (row < rows) and base (row * cols). */
const perRow = (body: string): string => `${REDUCTIONS}
  fn main(index : i32) {
    let row = flatWorkgroup();
    let tid = i32(localId.x);
    let cols = uniforms.cols;
    let valid = row < uniforms.rows;
    let base = row * cols;
    ${body}
  }
`;

/** Sum over the row of `term` (an expression of c, the column), 0 past the last row. */
const rowSum = (name: string, term: string): string => `
    var ${name}Part = 0.0;
    if (valid) {
      for (var c = tid; c < cols; c += ${ROW_THREADS}) {
        ${name}Part += ${term};
      }
    }
    let ${name} = reduceSum(${name}Part);
`;

/**
 * Layer norm's dx = (dxhat - mean(dxhat) - xhat * mean(dxhat * xhat)) * rstd with dxhat = dy * g,
 * per row: inputs Dy, Xhat [rows, cols], Rstd [rows], G [cols]. f32 under `--precision f16` too:
 * every term (dy g, the two means, xhat times the second, the difference times rstd) is a
 * loss-scaled gradient (up to 2^24 times the gradient), which f16 arithmetic could overflow where
 * f32 does not (and an f16 overflow is not defined in WGSL at run time, so the loss scaler would
 * not see it); the unscaled factors (xhat, g, rstd) enter only in products with them. Mixed
 * precision keeps normalisation layers in f32 (Micikevicius et al., 2018; PyTorch's autocast).
 */
export const LAYER_NORM_DX_WGSL = perRow(`${rowSum('s1', 'Dy[base + c] * G[c]')}
    ${rowSum('s2', '(Dy[base + c] * G[c]) * Xhat[base + c]')}
    let m1 = s1 / f32(cols);
    let m2 = s2 / f32(cols);
    if (valid) {
      let rstd = Rstd[row];
      for (var c = tid; c < cols; c += ${ROW_THREADS}) {
        let dxhat = Dy[base + c] * G[c];
        setOutputAtIndex(base + c, ((dxhat - m1) - Xhat[base + c] * m2) * rstd);
      }
    }
`);

/** log-sum-exp of each row of X with `expOf` the exp of its terms (exp or F16_FUNCTIONS's expH). */
const logSumExp = (expOf: string): string =>
  perRow(`
    var hi = -3.402823e+38;
    if (valid) {
      for (var c = tid; c < cols; c += ${ROW_THREADS}) {
        hi = max(hi, X[base + c]);
      }
    }
    let top = reduceMax(hi);
    ${rowSum('total', `${expOf}(X[base + c] - top)`)}
    if (valid && tid == 0) {
      setOutputAtIndex(row, top + log(total));
    }
`);

/** log-sum-exp of each row of X (max + log(sum(exp(x - max)))): output [rows]. */
export const LOG_SUM_EXP_WGSL = logSumExp('exp');

/**
 * {@link LOG_SUM_EXP_WGSL} with each term exp(x - max) in f16 arithmetic (`expH`: the argument,
 * <= 0, rounded to f16, its exp in f16): the max, the argument x - max (the logits can exceed
 * f16's range), the sum and the log stay f32, as the accumulators of a reduction.
 */
export const LOG_SUM_EXP_F16_WGSL = `${F16_FUNCTIONS}${logSumExp('expH')}`;

/**
 * The mean over rows of lse - logit[label] (one workgroup): inputs X [rows, cols], Lse [rows],
 * Labels [rows] int32 (a label outside [0, cols) adds 0, an all-zero one-hot row); output [1].
 */
export const XENT_LOSS_WGSL = `${REDUCTIONS}
  fn main(index : i32) {
    let tid = i32(localId.x);
    var part = 0.0;
    for (var r = tid; r < uniforms.rows; r += ${ROW_THREADS}) {
      let label = Labels[r];
      if (label >= 0 && label < uniforms.cols) {
        part += Lse[r] - X[r * uniforms.cols + label];
      }
    }
    let total = reduceSum(part);
    if (tid == 0) {
      setOutputAtIndex(0, total / f32(uniforms.rows));
    }
  }
`;

/**
 * The causal softmax with `expOf` the exp of its terms (exp or expH): scale * x in f32, its max
 * and sum f32, y = exp(scale x - max) / sum with the division in f32.
 */
const causalSoftmax = (expOf: string): string =>
  perRow(`
    let last = row % cols;
    var hi = -3.402823e+38;
    if (valid) {
      for (var c = tid; c <= last; c += ${ROW_THREADS}) {
        hi = max(hi, X[base + c] * uniforms.scale);
      }
    }
    let top = reduceMax(hi);
    var part = 0.0;
    if (valid) {
      for (var c = tid; c <= last; c += ${ROW_THREADS}) {
        part += ${expOf}(X[base + c] * uniforms.scale - top);
      }
    }
    let total = reduceSum(part);
    if (valid) {
      for (var c = tid; c < cols; c += ${ROW_THREADS}) {
        var y = 0.0;
        if (c <= last) {
          y = ${expOf}(X[base + c] * uniforms.scale - top) / total;
        }
        setOutputAtIndex(base + c, y);
      }
    }
`);

/**
 * Causal softmax of scale * x over each row of X [rows, T] (the row's query is row % T): the
 * columns past it are 0, as exp(-1e9 - max) is in the composed form.
 */
export const CAUSAL_SOFTMAX_WGSL = causalSoftmax('exp');

/**
 * {@link CAUSAL_SOFTMAX_WGSL} with each exp(scale x - max) in f16 arithmetic (`expH`). The
 * scores scale * x (not bounded by f16's range before the max is subtracted), the max, the sum
 * and the division by it (the sum counts up to T terms) stay f32.
 */
export const CAUSAL_SOFTMAX_F16_WGSL = `${F16_FUNCTIONS}${causalSoftmax('expH')}`;

/** The causal softmax's gradient scale * y * (dy - sum(dy * y)) per row: inputs Y, Dy [rows, T]. */
export const CAUSAL_SOFTMAX_GRAD_WGSL =
  perRow(`${rowSum('dot', 'Dy[base + c] * Y[base + c]')}
    if (valid) {
      for (var c = tid; c < cols; c += ${ROW_THREADS}) {
        setOutputAtIndex(base + c, ((Dy[base + c] - dot) * Y[base + c]) * uniforms.scale);
      }
    }
`);

/**
 * {@link CAUSAL_SOFTMAX_GRAD_WGSL} with the factor y * scale in f16 arithmetic (y in [0, 1]
 * rounded to f16, scale rounded to f16: the caller passes |scale| <= 65504, so the product is
 * within f16's range); dy is loss-scaled (up to 2^24 times the gradient), so dot = sum(dy y),
 * dy - dot and its product with the factor stay f32, where an f16 overflow (undefined in WGSL at
 * run time) would hide from the loss scaler.
 */
export const CAUSAL_SOFTMAX_GRAD_F16_WGSL = `enable f16;${perRow(`${rowSum('dot', 'Dy[base + c] * Y[base + c]')}
    if (valid) {
      let scaleH = f16(uniforms.scale);
      for (var c = tid; c < cols; c += ${ROW_THREADS}) {
        let w = f16(clamp(Y[base + c], 0.0, 1.0)) * scaleH;
        setOutputAtIndex(base + c, (Dy[base + c] - dot) * f32(w));
      }
    }
`)}`;
