/**
 * WGSL bodies of layerwise's row-wise webgpu kernels (backend/webgpu-kernels.ts): one workgroup
 * of {@link ROW_THREADS} threads per row (or per column, for the column sums), the threads
 * striding over the row and reducing through workgroup memory. The row is the workgroup's flat
 * id, so it stays right when TF.js reshapes a dispatch past 65,535 workgroups into two or three
 * dimensions; workgroups past the last row read nothing and write nothing, and every barrier
 * stays in uniform control flow. Sizes come as uniforms (rows, cols), so one compiled pipeline
 * serves every shape. The math is composed-kernels.ts's; storage is float32 (see elementwise.ts).
 */

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
 * per row: inputs Dy, Xhat [rows, cols], Rstd [rows], G [cols].
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

/** log-sum-exp of each row of X (max + log(sum(exp(x - max)))): output [rows]. */
export const LOG_SUM_EXP_WGSL = perRow(`
    var hi = -3.402823e+38;
    if (valid) {
      for (var c = tid; c < cols; c += ${ROW_THREADS}) {
        hi = max(hi, X[base + c]);
      }
    }
    let top = reduceMax(hi);
    ${rowSum('total', 'exp(X[base + c] - top)')}
    if (valid && tid == 0) {
      setOutputAtIndex(row, top + log(total));
    }
`);

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
 * Causal softmax of scale * x over each row of X [rows, T] (the row's query is row % T): the
 * columns past it are 0, as exp(-1e9 - max) is in the composed form.
 */
export const CAUSAL_SOFTMAX_WGSL = perRow(`
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
        part += exp(X[base + c] * uniforms.scale - top);
      }
    }
    let total = reduceSum(part);
    if (valid) {
      for (var c = tid; c < cols; c += ${ROW_THREADS}) {
        var y = 0.0;
        if (c <= last) {
          y = exp(X[base + c] * uniforms.scale - top) / total;
        }
        setOutputAtIndex(base + c, y);
      }
    }
`);

/** The causal softmax's gradient scale * y * (dy - sum(dy * y)) per row: inputs Y, Dy [rows, T]. */
export const CAUSAL_SOFTMAX_GRAD_WGSL =
  perRow(`${rowSum('dot', 'Dy[base + c] * Y[base + c]')}
    if (valid) {
      for (var c = tid; c < cols; c += ${ROW_THREADS}) {
        setOutputAtIndex(base + c, ((Dy[base + c] - dot) * Y[base + c]) * uniforms.scale);
      }
    }
`);
