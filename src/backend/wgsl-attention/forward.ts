/**
 * WGSL of flash-style causal attention's forward on the webgpu backend
 * (backend/webgpu-attention.ts; FlashAttention, Dao et al. 2022, with FlashAttention-2's loop
 * order, Dao 2023: queries outside, keys inside). qkv is [B, T, 3D] laid out [B, T, 3, H, dh];
 * one dispatch writes the context ctx [B, T, D] and each query row's log-sum-exp lse [B, H, T]
 * and nothing of size T x T: a workgroup of {@link ROWS_PER_WORKGROUP} query rows of one
 * (batch, head) walks the key blocks, the keys and values of each held in workgroup memory, and
 * every invocation keeps its row's running max, running sum and context (the online softmax).
 *
 * The shaders here are whole WGSL modules dispatched by webgpu-multi.ts's `dispatch` (TF.js
 * programs write one output each): {@link attentionPrelude} declares the uniforms (the struct is
 * named `uniforms` and has TF.js's `INFINITY`, so that wgsl/elementwise.ts's F16_FUNCTIONS
 * apply) and the workgroup's rows.
 */

import { F16_FUNCTIONS } from '../wgsl/elementwise.js';

/** Query (or key) rows per workgroup, one invocation each. */
export const ROWS_PER_WORKGROUP = 64;

/**
 * Rows per block of a workgroup-memory tile pair: `tiles` tiles of dh floats a row and two f32
 * per row besides (the gradient's lse and D), at most 64 rows and at most 15 KiB in all
 * (WebGPU's default limit on workgroup memory is 16 KiB).
 */
export function rowsPerBlock(dh: number, tiles = 2): number {
  return Math.max(1, Math.min(64, Math.floor(3840 / (tiles * dh + 2))));
}

/**
 * The uniforms, in this order, as 32-bit words: T, H, the number of 64-row blocks per
 * (batch, head) (nBlk), B * H, 1 / sqrt(dh), +Infinity (roundF16's overflow value).
 */
export function attentionUniforms(
  b: number,
  t: number,
  h: number,
  dh: number,
): ArrayBuffer {
  const words = new ArrayBuffer(24);
  const ints = new Int32Array(words);
  const floats = new Float32Array(words);
  ints[0] = t;
  ints[1] = h;
  ints[2] = Math.ceil(t / ROWS_PER_WORKGROUP);
  ints[3] = b * h;
  floats[4] = 1 / Math.sqrt(dh);
  floats[5] = Number.POSITIVE_INFINITY;
  return words;
}

/**
 * The common head of the attention shaders: the uniforms (binding `uniformBinding`), DH, TK (rows
 * of a block, {@link rowsPerBlock}), `R(x)` (an operand of a product: x, or x rounded to f16 with
 * `f16`), `EXP(a)` (exp of a <= 0: f32, or f16's expH with `f16`), and `Rows`, a workgroup's
 * (batch, head) and first row (`i0`) and an invocation's row (clamped to T - 1 for the
 * invocations past T, which compute and write nothing: `valid`). WGSL's uniformity analysis
 * takes a struct as one value, and `Rows` depends on the invocation: loop bounds around barriers
 * are computed from the workgroup index instead.
 */
export function attentionPrelude(
  dh: number,
  f16: boolean,
  uniformBinding: number,
): string {
  return `${f16 ? F16_FUNCTIONS : ''}
    struct Uniforms { nT : i32, nH : i32, nBlk : i32, nBH : i32, scale : f32, INFINITY : f32 };
    @group(0) @binding(${uniformBinding}) var<uniform> uniforms : Uniforms;
    const DH = ${dh};
    const TK = ${rowsPerBlock(dh)};
    const WG = ${ROWS_PER_WORKGROUP};

    fn R(x : f32) -> f32 { return ${f16 ? 'roundF16(x)' : 'x'}; }
    fn EXP(a : f32) -> f32 { return ${f16 ? 'expH(a)' : 'exp(a)'}; }

    struct Rows { b : i32, h : i32, bh : i32, i0 : i32, row : i32, valid : bool };

    /** Workgroup wg (of nBlk * nBH) and invocation li: the (batch, head) and row. */
    fn rowsOf(wg : i32, li : i32) -> Rows {
      var r : Rows;
      r.bh = wg / uniforms.nBlk;
      r.b = r.bh / uniforms.nH;
      r.h = r.bh % uniforms.nH;
      r.i0 = (wg % uniforms.nBlk) * WG;
      r.row = min(r.i0 + li, uniforms.nT - 1);
      r.valid = r.i0 + li < uniforms.nT;
      return r;
    }

    /** qkv's element d of part (0 q, 1 k, 2 v) of row t in (b, h). */
    fn qkvAt(r : Rows, t : i32, part : i32, d : i32) -> f32 {
      let D = uniforms.nH * DH;
      return qkv[((r.b * uniforms.nT + t) * 3 + part) * D + r.h * DH + d];
    }
  `;
}

/**
 * A key block in workgroup memory, shared by the forward and the gradient: `at` and `bt`
 * (TK rows of DH floats each) and `loadKeys(r, j0, li)`, which fills them with the keys and the
 * values of rows j0.. of (b, h), rounded by `R` (zeros past T), the workgroup's WG invocations
 * striding over the elements.
 */
export function keyBlockLoader(dh: number): string {
  return `var<workgroup> at : array<f32, ${rowsPerBlock(dh) * dh}>;
    var<workgroup> bt : array<f32, ${rowsPerBlock(dh) * dh}>;

    /** Keys and values j0.. into at, bt. */
    fn loadKeys(r : Rows, j0 : i32, li : i32) {
      for (var e = li; e < TK * DH; e += WG) {
        let j = j0 + e / DH;
        var kv = 0.0;
        var vv = 0.0;
        if (j < uniforms.nT) {
          kv = qkvAt(r, j, 1, e % DH);
          vv = qkvAt(r, j, 2, e % DH);
        }
        at[e] = R(kv);
        bt[e] = R(vv);
      }
    }
`;
}

/**
 * The forward, bindings: qkv (read), ctx, lse (written), uniforms. Per key block: the block's
 * scores s = scale q . k (kept in a private array of TK), the new max mNew, the running sum and
 * context rescaled once by exp(m - mNew), then l += exp(s - mNew) and ctx += exp(s - mNew) v;
 * at the end ctx / l and lse = m + log(l).
 *
 * `f16` (`--precision f16` where the device has shader-f16): q, k and v rounded to f16 (`R`,
 * +-Infinity beyond f16's range, as the f16 matmuls' operands), the dot products formed exactly
 * in f32 (a product of two f16 values fits f32's significand, as on tensor cores) and summed in
 * f32, then scaled in f32 (the scores before the max is subtracted are not bounded by f16's
 * range). Each term's exp(s - mNew) (argument <= 0) is in f16 (`expH`), an f16 value and so an
 * exact operand of its product with v; the running max and sum, the rescaling exp(m - mNew) (an
 * accumulator's correction), the division by l and the lse stay f32. Without `f16`, q is scaled
 * before the products (as the P form was).
 */
export function forwardShader(dh: number, f16 = false): string {
  return `${attentionPrelude(dh, f16, 3)}
    @group(0) @binding(0) var<storage, read> qkv : array<f32>;
    @group(0) @binding(1) var<storage, read_write> ctx : array<f32>;
    @group(0) @binding(2) var<storage, read_write> lse : array<f32>;
    ${keyBlockLoader(dh)}
    @compute @workgroup_size(${ROWS_PER_WORKGROUP})
    fn main(@builtin(workgroup_id) wid : vec3<u32>,
            @builtin(num_workgroups) groups : vec3<u32>,
            @builtin(local_invocation_index) lid : u32) {
      let wg = i32(wid.x + wid.y * groups.x);
      if (wg >= uniforms.nBlk * uniforms.nBH) {
        return;
      }
      let li = i32(lid);
      let r = rowsOf(wg, li);
      // the block bound from wg alone: uniform, as the barriers need (r depends on li)
      let end = min(uniforms.nT, (wg % uniforms.nBlk) * WG + WG);
      var q : array<f32, DH>;
      for (var d = 0; d < DH; d++) {
        q[d] = ${f16 ? 'R(qkvAt(r, r.row, 0, d))' : 'qkvAt(r, r.row, 0, d) * uniforms.scale'};
      }
      var acc : array<f32, DH>;
      var sc : array<f32, TK>;
      var m = -3.402823e+38;
      var l = 0.0;
      for (var j0 = 0; j0 < end; j0 += TK) {
        loadKeys(r, j0, li);
        workgroupBarrier();
        let n = min(TK, r.row - j0 + 1);
        var mNew = m;
        for (var jj = 0; jj < n; jj++) {
          var s = 0.0;
          for (var d = 0; d < DH; d++) {
            s += q[d] * at[jj * DH + d];
          }
          ${f16 ? 's = s * uniforms.scale;' : ''}
          sc[jj] = s;
          mNew = max(mNew, s);
        }
        if (n > 0) {
          let corr = exp(m - mNew);
          l = l * corr;
          for (var d = 0; d < DH; d++) {
            acc[d] = acc[d] * corr;
          }
          for (var jj = 0; jj < n; jj++) {
            let e = EXP(sc[jj] - mNew);
            l += e;
            for (var d = 0; d < DH; d++) {
              acc[d] += e * bt[jj * DH + d];
            }
          }
          m = mNew;
        }
        workgroupBarrier();
      }
      if (r.valid) {
        let out = (r.b * uniforms.nT + r.row) * uniforms.nH * DH + r.h * DH;
        for (var d = 0; d < DH; d++) {
          ctx[out + d] = acc[d] / l;
        }
        lse[r.bh * uniforms.nT + r.row] = m + log(l);
      }
    }
  `;
}
