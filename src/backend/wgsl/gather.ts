/**
 * WGSL of layerwise's webgpu embedding kernels (backend/webgpu-gather.ts): a row gather and its
 * gradient, the sum of rows by segment id (a scatter-add). Whole WGSL modules on pipelines of
 * our own, as backend/wgsl/multi.ts's.
 *
 * WGSL has no float atomics, so the scatter-add is done without any: one pass links, for each
 * segment, its positions in ascending order (Head[segment], Next[position]: a linked list per
 * segment, -1 ending it), and a second sums, for each output element, its segment's rows in that
 * order. Deterministic, and the same order as the cpu backend's sum over positions.
 */

/** Threads per workgroup of the element-wise programs (one thread per output element). */
export const GATHER_THREADS = 256;

/** Threads per workgroup of the linking program (one thread per segment). */
export const LINK_THREADS = 64;

/**
 * Row gather: Out[p, c] = X[Idx[p], c] over X [rows, cols] and Idx [n] (int32); 0 where Idx[p]
 * is outside [0, rows) (a GPU cannot throw; TF.js's webgpu gather does the same). One thread
 * per output element, workgroups flat over x and y.
 */
export const GATHER_WGSL = `
struct Uniforms { rows : u32, cols : u32, n : u32, };
@group(0) @binding(0) var<storage, read> X : array<f32>;
@group(0) @binding(1) var<storage, read> Idx : array<i32>;
@group(0) @binding(2) var<storage, read_write> Out : array<f32>;
@group(0) @binding(3) var<uniform> u : Uniforms;

@compute @workgroup_size(${GATHER_THREADS})
fn main(@builtin(global_invocation_id) gid : vec3<u32>,
        @builtin(num_workgroups) groups : vec3<u32>) {
  let i = gid.x + gid.y * groups.x * ${GATHER_THREADS}u;
  if (i >= u.n * u.cols) {
    return;
  }
  let p = i / u.cols;
  let c = i - p * u.cols;
  let r = Idx[p];
  var x = 0.0;
  if (r >= 0 && u32(r) < u.rows) {
    x = X[u32(r) * u.cols + c];
  }
  Out[i] = x;
}
`;

/**
 * The segments' position lists: thread r walks Ids [n] (int32) in order and links the positions
 * p with Ids[p] == r: Head[r] is the first (-1: none), Next[p] the one after p (-1: the last).
 * Positions whose id is outside [0, segments) are left unlinked (and Next unwritten there).
 * segments * n comparisons in all, segments threads.
 */
export const SEGMENT_LINKS_WGSL = `
struct Uniforms { segments : u32, n : u32, cols : u32, };
@group(0) @binding(0) var<storage, read> Ids : array<i32>;
@group(0) @binding(1) var<storage, read_write> Head : array<i32>;
@group(0) @binding(2) var<storage, read_write> Next : array<i32>;
@group(0) @binding(3) var<uniform> u : Uniforms;

@compute @workgroup_size(${LINK_THREADS})
fn main(@builtin(global_invocation_id) gid : vec3<u32>,
        @builtin(num_workgroups) groups : vec3<u32>) {
  let r = gid.x + gid.y * groups.x * ${LINK_THREADS}u;
  if (r >= u.segments) {
    return;
  }
  var last = -1;
  for (var p = 0u; p < u.n; p++) {
    if (Ids[p] == i32(r)) {
      if (last < 0) {
        Head[r] = i32(p);
      } else {
        Next[u32(last)] = i32(p);
      }
      last = i32(p);
    }
  }
  if (last < 0) {
    Head[r] = -1;
  } else {
    Next[u32(last)] = -1;
  }
}
`;

/**
 * The segment sums from the links of {@link SEGMENT_LINKS_WGSL}: Out[r, c] = the sum of X[p, c]
 * over the positions p of segment r in ascending order, in float32 (0 for an empty segment);
 * X [n, cols], Out [segments, cols]. One thread per output element, workgroups flat over x and y.
 */
export const SEGMENT_SUM_WGSL = `
struct Uniforms { segments : u32, n : u32, cols : u32, };
@group(0) @binding(0) var<storage, read> X : array<f32>;
@group(0) @binding(1) var<storage, read> Head : array<i32>;
@group(0) @binding(2) var<storage, read> Next : array<i32>;
@group(0) @binding(3) var<storage, read_write> Out : array<f32>;
@group(0) @binding(4) var<uniform> u : Uniforms;

@compute @workgroup_size(${GATHER_THREADS})
fn main(@builtin(global_invocation_id) gid : vec3<u32>,
        @builtin(num_workgroups) groups : vec3<u32>) {
  let i = gid.x + gid.y * groups.x * ${GATHER_THREADS}u;
  if (i >= u.segments * u.cols) {
    return;
  }
  let r = i / u.cols;
  let c = i - r * u.cols;
  var s = 0.0;
  var p = Head[r];
  loop {
    if (p < 0) {
      break;
    }
    s += X[u32(p) * u.cols + c];
    p = Next[u32(p)];
  }
  Out[i] = s;
}
`;
