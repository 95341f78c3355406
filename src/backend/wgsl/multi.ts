/**
 * WGSL of layerwise's webgpu kernels that run on pipelines of their own (backend/webgpu-multi.ts):
 * whole WGSL modules (not bodies in TF.js's prelude). The multi-tensor ones run over scratch
 * buffers holding every tensor of the op back to back (and AdamW over the optimizer's flat
 * moment buffers), so that one dispatch serves all of a stage's parameters or gradients (TF.js
 * keeps each tensor in its own buffer, and a shader binds at most maxStorageBuffersPerShaderStage
 * of them, 8 by default); layer norm's write several outputs in one dispatch (a TF.js program
 * writes one).
 */

/** Threads per workgroup of the multi-tensor programs. */
export const MULTI_THREADS = 256;

/** Workgroups per dispatch dimension before a dispatch spreads over y (WebGPU's default limit). */
export const MAX_WORKGROUPS_PER_DIMENSION = 65535;

/**
 * AdamW over elements [0, n) of two scratch buffers P, G (the parameters and gradients of many
 * tensors back to back) and of the moments' flat buffers from element `base` on (the optimizer
 * keeps each moment of all of a stage's parameters in one buffer, in the same order): P is
 * updated in place, and so are the moments M, V (the optimizer's own flat tensors, which nothing
 * else holds: backend/webgpu-multi.ts adamwMulti copies them first where something does). The math of
 * {@link ./elementwise.ts adamwWgsl}, operation for operation (optim/optimizer.ts's composed
 * form). Elements below `decayEnd` (the decayed tensors, laid out first) get the decoupled weight
 * decay `weightDecay`; the rest none. One thread per element, workgroups flat over x and y.
 */
export const ADAMW_MULTI_WGSL = `
struct Uniforms {
  n : u32, decayEnd : u32, base : u32, lr : f32,
  beta1 : f32, beta2 : f32, oneMinusBeta1 : f32, oneMinusBeta2 : f32,
  epsilon : f32, weightDecay : f32, scale : f32, bc1 : f32,
  bc2 : f32,
};
@group(0) @binding(0) var<storage, read_write> P : array<f32>;
@group(0) @binding(1) var<storage, read> G : array<f32>;
@group(0) @binding(2) var<storage, read_write> M : array<f32>;
@group(0) @binding(3) var<storage, read_write> V : array<f32>;
@group(0) @binding(4) var<uniform> u : Uniforms;

@compute @workgroup_size(${MULTI_THREADS})
fn main(@builtin(global_invocation_id) gid : vec3<u32>,
        @builtin(num_workgroups) groups : vec3<u32>) {
  let i = gid.x + gid.y * groups.x * ${MULTI_THREADS}u;
  if (i >= u.n) {
    return;
  }
  let j = u.base + i;
  let g = G[i] * u.scale;
  let m = M[j] * u.beta1 + g * u.oneMinusBeta1;
  let v = V[j] * u.beta2 + (g * g) * u.oneMinusBeta2;
  var upd = (m / u.bc1) / (sqrt(v / u.bc2) + u.epsilon);
  let p = P[i];
  if (i < u.decayEnd && u.weightDecay > 0.0) {
    upd = upd + p * u.weightDecay;
  }
  P[i] = p - upd * u.lr;
  M[j] = m;
  V[j] = v;
}
`;

/**
 * Sum of squares of each of many tensors laid out back to back in X: Table holds [count,
 * offset 0, offset 1, ..., offset count, output index 0, ..., output index count-1] (element
 * offsets into X, the last one the end); workgroup t sums tensor t's squares (its threads
 * striding over the tensor, eight elements a round into eight sums so that eight loads are in
 * flight, then a tree reduction in workgroup memory) into Out[its output index]. float32
 * throughout, as the composed form's sum(square(g)). One load in flight a round took 6.7 ms a
 * step for the 8 x d1024 model's 101 M gradients on an H100 (a 4 M-element tensor is 16 K
 * rounds of one workgroup's threads).
 */
export const SUM_SQUARES_MULTI_WGSL = `
@group(0) @binding(0) var<storage, read> X : array<f32>;
@group(0) @binding(1) var<storage, read> Table : array<u32>;
@group(0) @binding(2) var<storage, read_write> Out : array<f32>;
var<workgroup> red : array<f32, ${MULTI_THREADS}>;

@compute @workgroup_size(${MULTI_THREADS})
fn main(@builtin(workgroup_id) wid : vec3<u32>,
        @builtin(local_invocation_index) tid : u32) {
  let t = wid.x;
  let count = Table[0];
  var s = vec4<f32>(0.0);
  var z = vec4<f32>(0.0);
  if (t < count) {
    let end = Table[t + 2u];
    let T = ${MULTI_THREADS}u;
    var i = Table[t + 1u] + tid;
    for (; i + 7u * T < end; i += 8u * T) {
      let a = vec4<f32>(X[i], X[i + T], X[i + 2u * T], X[i + 3u * T]);
      let b = vec4<f32>(X[i + 4u * T], X[i + 5u * T], X[i + 6u * T], X[i + 7u * T]);
      s += a * a;
      z += b * b;
    }
    for (; i < end; i += T) {
      let x = X[i];
      s.x += x * x;
    }
  }
  let w = s + z;
  red[tid] = (w.x + w.y) + (w.z + w.w);
  workgroupBarrier();
  for (var k = ${MULTI_THREADS / 2}u; k > 0u; k = k >> 1u) {
    if (tid < k) {
      red[tid] = red[tid] + red[tid + k];
    }
    workgroupBarrier();
  }
  if (tid == 0u && t < count) {
    Out[Table[count + 2u + t]] = red[0];
  }
}
`;

/** Threads per workgroup of the layer-norm programs (one workgroup per row or column). */
export const NORM_THREADS = 64;

/** A tree sum over the workgroup's threads (every thread calls it; all get the sum). */
const WORKGROUP_SUM = `
var<workgroup> red : array<f32, ${NORM_THREADS}>;
fn workgroupSum(tid : u32, v : f32) -> f32 {
  red[tid] = v;
  workgroupBarrier();
  for (var k = ${NORM_THREADS / 2}u; k > 0u; k = k >> 1u) {
    if (tid < k) {
      red[tid] = red[tid] + red[tid + k];
    }
    workgroupBarrier();
  }
  let r = red[0];
  workgroupBarrier();
  return r;
}
`;

/**
 * Layer norm's forward in one dispatch with its three outputs (TF.js's programs write one each,
 * so its WGSL form took three): per row of X [rows, cols], mean, variance of the deviations,
 * rstd = 1 / sqrt(variance + epsilon), xhat = (x - mean) rstd, y = xhat g + b; outputs Y, Xhat
 * [rows, cols], Rstd [rows]. The math of backend/wgsl/rows.ts's three programs, in their order.
 * One workgroup per row (flat over x and y).
 */
export const LAYER_NORM_FUSED_WGSL = `
struct Uniforms { rows : u32, cols : u32, epsilon : f32, };
@group(0) @binding(0) var<storage, read> X : array<f32>;
@group(0) @binding(1) var<storage, read> G : array<f32>;
@group(0) @binding(2) var<storage, read> B : array<f32>;
@group(0) @binding(3) var<storage, read_write> Y : array<f32>;
@group(0) @binding(4) var<storage, read_write> Xhat : array<f32>;
@group(0) @binding(5) var<storage, read_write> Rstd : array<f32>;
@group(0) @binding(6) var<uniform> u : Uniforms;
${WORKGROUP_SUM}
@compute @workgroup_size(${NORM_THREADS})
fn main(@builtin(workgroup_id) wid : vec3<u32>,
        @builtin(num_workgroups) groups : vec3<u32>,
        @builtin(local_invocation_index) tid : u32) {
  let row = wid.x + wid.y * groups.x;
  let valid = row < u.rows;
  let cols = u.cols;
  let base = row * cols;
  var s = 0.0;
  if (valid) {
    for (var c = tid; c < cols; c += ${NORM_THREADS}u) {
      s += X[base + c];
    }
  }
  let mean = workgroupSum(tid, s) / f32(cols);
  var q = 0.0;
  if (valid) {
    for (var c = tid; c < cols; c += ${NORM_THREADS}u) {
      q += (X[base + c] - mean) * (X[base + c] - mean);
    }
  }
  let variance = workgroupSum(tid, q) / f32(cols);
  if (valid) {
    let rstd = 1.0 / sqrt(variance + u.epsilon);
    for (var c = tid; c < cols; c += ${NORM_THREADS}u) {
      let xhat = (X[base + c] - mean) * rstd;
      Xhat[base + c] = xhat;
      Y[base + c] = xhat * G[c] + B[c];
    }
    if (tid == 0u) {
      Rstd[row] = rstd;
    }
  }
}
`;

/**
 * {@link LAYER_NORM_FUSED_WGSL} with the per-element normalisation in f16 arithmetic
 * (`--precision f16` where the device has shader-f16): mean, variance and rstd stay f32 sums
 * over float32 storage; (x - mean), rstd, g and b are taken to f16, and xhat = (x - mean) rstd,
 * y = xhat g + b are computed in f16 and stored as float32. xhat is at most sqrt(cols) in size,
 * within f16's range; `enable f16;` is hoisted by backend/webgpu.ts.
 */
export const LAYER_NORM_FUSED_F16_WGSL = `enable f16;\n${LAYER_NORM_FUSED_WGSL.replace(
  `      let xhat = (X[base + c] - mean) * rstd;
      Xhat[base + c] = xhat;
      Y[base + c] = xhat * G[c] + B[c];`,
  `      let xhat = f16(X[base + c] - mean) * f16(rstd);
      Xhat[base + c] = f32(xhat);
      Y[base + c] = f32(xhat * f16(G[c]) + f16(B[c]));`,
)}`;

/**
 * Layer norm's parameter gradients in one dispatch: per column of Dy, Xhat [rows, cols],
 * dg = sum over rows of dy xhat and db = sum of dy (outputs DG, DB [cols]); one workgroup per
 * column (flat over x and y), the rows strided over its threads as rows.ts's column sums. f32
 * under `--precision f16` too: both are sums (reductions stay f32) of loss-scaled gradients,
 * whose products could overflow f16 where f32 does not (rows.ts LAYER_NORM_DX_WGSL).
 */
export const LAYER_NORM_PARAM_GRADS_WGSL = `
struct Uniforms { rows : u32, cols : u32, };
@group(0) @binding(0) var<storage, read> Dy : array<f32>;
@group(0) @binding(1) var<storage, read> Xhat : array<f32>;
@group(0) @binding(2) var<storage, read_write> DG : array<f32>;
@group(0) @binding(3) var<storage, read_write> DB : array<f32>;
@group(0) @binding(4) var<uniform> u : Uniforms;
${WORKGROUP_SUM}
@compute @workgroup_size(${NORM_THREADS})
fn main(@builtin(workgroup_id) wid : vec3<u32>,
        @builtin(num_workgroups) groups : vec3<u32>,
        @builtin(local_invocation_index) tid : u32) {
  let col = wid.x + wid.y * groups.x;
  let cols = u.cols;
  let valid = col < cols;
  var g = 0.0;
  var b = 0.0;
  if (valid) {
    for (var r = tid; r < u.rows; r += ${NORM_THREADS}u) {
      let dy = Dy[r * cols + col];
      g += dy * Xhat[r * cols + col];
      b += dy;
    }
  }
  let dg = workgroupSum(tid, g);
  let db = workgroupSum(tid, b);
  if (valid && tid == 0u) {
    DG[col] = dg;
    DB[col] = db;
  }
}
`;
