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
 * Floats of a row the shaders hold as one value: 4 (`vec4<f32>`) where dh is a multiple of 4, so
 * that a row of keys in workgroup memory is read 4 floats a load (4 FMAs a load where a float a
 * load gave 1; on an H100 the scalar form ran 3-4 TFLOP/s), else 1.
 */
export function rowWidth(dh: number): 1 | 4 {
  return dh % 4 === 0 ? 4 : 1;
}

/** WGSL reading chunk `at` (a float index) of the f32 array `array` as a `V` ({@link rowWidth} floats). */
export function loadChunk(dh: number, array: string, at: string): string {
  return rowWidth(dh) === 4
    ? `V(${array}[${at}], ${array}[${at} + 1], ${array}[${at} + 2], ${array}[${at} + 3])`
    : `${array}[${at}]`;
}

/** WGSL statements storing the `V` value `value` as floats `at`.. of the f32 array `array`. */
export function storeChunk(
  dh: number,
  array: string,
  at: string,
  value: string,
): string {
  return rowWidth(dh) === 4
    ? `{ let w = ${value}; let o = ${at}; ${array}[o] = w.x; ${array}[o + 1] = w.y; ${array}[o + 2] = w.z; ${array}[o + 3] = w.w; }`
    : `${array}[${at}] = ${value};`;
}

/**
 * The common head of the attention shaders: the uniforms (binding `uniformBinding`), DH, TK (rows
 * of a block, {@link rowsPerBlock}), `V` (a row's chunk of {@link rowWidth} floats: vec4<f32> or
 * f32) and DV (chunks a row), `R(x)` (an operand of a product: x, or x rounded to f16 with
 * `f16`) and `RV` (R of each float of a chunk), `DOT(a, b)` (a chunk's dot product, summed in
 * f32), `EXP(a)` (exp of a <= 0: f32, or f16's expH with `f16`), and `Rows`, a workgroup's
 * (batch, head) and first row (`i0`) and an invocation's row (clamped to T - 1 for the
 * invocations past T, which compute and write nothing: `valid`). WGSL's uniformity analysis
 * takes a struct as one value, and `Rows` depends on the invocation: loop bounds around barriers
 * are computed from the workgroup index instead. `qkvAt(r, t, part, c)` reads chunk c of a row
 * of q, k or v (the module binds `qkv`).
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
    const DV = ${dh / rowWidth(dh)};
    alias V = ${rowWidth(dh) === 4 ? 'vec4<f32>' : 'f32'};

    fn R(x : f32) -> f32 { return ${f16 ? 'roundF16(x)' : 'x'}; }
    fn RV(x : V) -> V { return ${rowWidth(dh) === 4 ? 'V(R(x.x), R(x.y), R(x.z), R(x.w))' : 'R(x)'}; }
    fn DOT(a : V, b : V) -> f32 { return ${rowWidth(dh) === 4 ? 'dot(a, b)' : 'a * b'}; }
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

    /** qkv's chunk c of part (0 q, 1 k, 2 v) of row t in (b, h). */
    fn qkvAt(r : Rows, t : i32, part : i32, c : i32) -> V {
      let D = uniforms.nH * DH;
      return ${loadChunk(dh, 'qkv', `((r.b * uniforms.nT + t) * 3 + part) * D + r.h * DH + c * ${rowWidth(dh)}`)};
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
  const chunks = (rowsPerBlock(dh) * dh) / rowWidth(dh);
  return `var<workgroup> at : array<V, ${chunks}>;
    var<workgroup> bt : array<V, ${chunks}>;

    /** Keys and values j0.. into at, bt (TK rows of DV chunks). */
    fn loadKeys(r : Rows, j0 : i32, li : i32) {
      for (var e = li; e < TK * DV; e += WG) {
        let j = j0 + e / DV;
        var kv = V(0.0);
        var vv = V(0.0);
        if (j < uniforms.nT) {
          kv = qkvAt(r, j, 1, e % DV);
          vv = qkvAt(r, j, 2, e % DV);
        }
        at[e] = RV(kv);
        bt[e] = RV(vv);
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
      var q : array<V, DV>;
      for (var c = 0; c < DV; c++) {
        q[c] = ${f16 ? 'RV(qkvAt(r, r.row, 0, c))' : 'qkvAt(r, r.row, 0, c) * uniforms.scale'};
      }
      var acc : array<V, DV>;
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
          for (var c = 0; c < DV; c++) {
            s += DOT(q[c], at[jj * DV + c]);
          }
          ${f16 ? 's = s * uniforms.scale;' : ''}
          sc[jj] = s;
          mNew = max(mNew, s);
        }
        if (n > 0) {
          let corr = exp(m - mNew);
          l = l * corr;
          for (var c = 0; c < DV; c++) {
            acc[c] = acc[c] * corr;
          }
          for (var jj = 0; jj < n; jj++) {
            let e = EXP(sc[jj] - mNew);
            l += e;
            for (var c = 0; c < DV; c++) {
              acc[c] += e * bt[jj * DV + c];
            }
          }
          m = mNew;
        }
        workgroupBarrier();
      }
      if (r.valid) {
        let out = (r.b * uniforms.nT + r.row) * uniforms.nH * DH + r.h * DH;
        for (var c = 0; c < DV; c++) {
          ${storeChunk(dh, 'ctx', `out + c * ${rowWidth(dh)}`, 'acc[c] / l')}
        }
        lse[r.bh * uniforms.nT + r.row] = m + log(l);
      }
    }
  `;
}
