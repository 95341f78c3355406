/**
 * WGSL of causal attention's forward on the webgpu backend (backend/webgpu-attention.ts). qkv is
 * [B, T, 3D] laid out [B, T, 3, H, dh]; the kernel name declares two outputs, the probabilities
 * P [B, H, T, T] (which the gradient reads) and the context [B, T, D], so the forward is two
 * programs: {@link probsShader} (rows of P, flash-style: a workgroup of query rows of one
 * (batch, head) walks the key blocks in workgroup memory with a running max and sum, then writes
 * its rows of P), and {@link contextShader} (ctx = P V over the causal prefix).
 *
 * Each shader is the user code TF.js's webgpu backend wraps (webgpu_program.js makeShader): the
 * inputs are arrays named after the program's variableNames, `result` the output, `uniforms`
 * holds the program's uniforms; `main(index)` gets the flat invocation index.
 */

import { F16_FUNCTIONS } from '../wgsl/elementwise.js';

/** Query rows per workgroup (one invocation per row). */
export const ROWS_PER_WORKGROUP = 64;

/**
 * Keys per block held in workgroup memory, dh floats each: at most 64, and at most 15 KiB in all
 * (WebGPU's default limit on workgroup memory is 16 KiB).
 */
export function keysPerBlock(dh: number): number {
  return Math.max(1, Math.min(64, Math.floor(3840 / dh)));
}

/**
 * The uniforms of the row programs: T, H, the number of row blocks per (batch, head), B * H, and
 * 1 / sqrt(dh).
 */
export const ROW_UNIFORMS =
  'nT : i32, nH : i32, nBlk : i32, nBH : i32, scale : f32,';

/**
 * The common head of the row programs: the workgroup's (batch, head) and rows, its key-block
 * bound read uniformly (so that barriers stay in uniform control flow), and `loadTile(j0, part)`,
 * which copies keys j0.. of q (part 0), k (1) or v (2) of this (batch, head) into `tile`.
 * `f16`: with wgsl/elementwise.ts's F16_FUNCTIONS, and the tile's values (always an operand of
 * a product) rounded to f16 (`roundF16`).
 */
export function rowHead(dh: number, f16 = false): string {
  const tk = keysPerBlock(dh);
  return `${f16 ? F16_FUNCTIONS : ''}
    const DH = ${dh};
    const TK = ${tk};
    const WG = ${ROWS_PER_WORKGROUP};
    var<workgroup> tile : array<f32, ${tk * dh}>;
    var<workgroup> blockEnd : i32;

    struct Rows { b : i32, h : i32, bh : i32, row : i32, valid : bool, i0 : i32, end : i32, li : i32 };

    fn rows(index : i32) -> Rows {
      let wg = index / WG;
      var r : Rows;
      r.li = index % WG;
      r.bh = min(wg / uniforms.nBlk, uniforms.nBH - 1);
      r.b = r.bh / uniforms.nH;
      r.h = r.bh % uniforms.nH;
      r.i0 = (wg % uniforms.nBlk) * WG;
      r.row = min(r.i0 + r.li, uniforms.nT - 1);
      r.valid = r.i0 + r.li < uniforms.nT && wg / uniforms.nBlk < uniforms.nBH;
      r.end = min(uniforms.nT, r.i0 + WG);
      return r;
    }

    fn loadTile(r : Rows, j0 : i32, part : i32) {
      let D = uniforms.nH * DH;
      for (var e = r.li; e < TK * DH; e += WG) {
        let j = j0 + e / DH;
        var val = 0.0;
        if (j < uniforms.nT) {
          val = qkv[((r.b * uniforms.nT + j) * 3 + part) * D + r.h * DH + e % DH];
        }
        tile[e] = ${f16 ? 'roundF16(val)' : 'val'};
      }
    }
  `;
}

/**
 * P [B, H, T, T] = softmax(scale q k^T + causal mask) by rows; inputs: qkv. Two walks over the
 * key blocks: the first keeps the running max m and sum l of exp(s - m), the second writes
 * exp(s - m) / l, and zeros above the diagonal.
 *
 * `f16` (`--precision f16` where the device has shader-f16): q and k rounded to f16 (`roundF16`,
 * +-Infinity beyond f16's range, as the composed form's f16 matmul operands), their products
 * formed exactly in f32 (a product of two f16 values fits f32's significand, as on tensor cores)
 * and summed in f32, then scaled in f32: the scores before the max is subtracted are not bounded
 * by f16's range. Each term's exp(s - m) (argument <= 0) is in f16 (`expH`); the running max,
 * the running sum l, its rescaling exp(m - mNew) (an accumulator's correction) and the division
 * by l stay f32.
 */
export function probsShader(dh: number, f16 = false): string {
  const expOf = f16 ? 'expH' : 'exp';
  const score = `var s = 0.0;
          for (var d = 0; d < DH; d++) {
            s += q[d] * tile[jj * DH + d];
          }${f16 ? '\n          s = s * uniforms.scale;' : ''}`;
  return `${rowHead(dh, f16)}
    fn main(index : i32) {
      var r = rows(index);
      if (r.li == 0) {
        blockEnd = r.end;
      }
      let end = workgroupUniformLoad(&blockEnd);
      let D = uniforms.nH * DH;
      var q : array<f32, DH>;
      let qBase = (r.b * uniforms.nT + r.row) * 3 * D + r.h * DH;
      for (var d = 0; d < DH; d++) {
        q[d] = ${f16 ? 'roundF16(qkv[qBase + d])' : 'qkv[qBase + d] * uniforms.scale'};
      }
      var m = -3.402823e+38;
      var l = 0.0;
      for (var j0 = 0; j0 < end; j0 += TK) {
        loadTile(r, j0, 1);
        workgroupBarrier();
        for (var jj = 0; jj < min(TK, r.row - j0 + 1); jj++) {
          ${score}
          let mNew = max(m, s);
          l = l * exp(m - mNew) + ${expOf}(s - mNew);
          m = mNew;
        }
        workgroupBarrier();
      }
      let outBase = (r.bh * uniforms.nT + r.row) * uniforms.nT;
      for (var j0 = 0; j0 < end; j0 += TK) {
        loadTile(r, j0, 1);
        workgroupBarrier();
        for (var jj = 0; jj < min(TK, r.row - j0 + 1); jj++) {
          ${score}
          if (r.valid) {
            result[outBase + j0 + jj] = ${expOf}(s - m) / l;
          }
        }
        workgroupBarrier();
      }
      if (r.valid) {
        for (var j = r.row + 1; j < uniforms.nT; j++) {
          result[outBase + j] = 0.0;
        }
      }
    }
  `;
}

/**
 * ctx [B, T, D] (heads side by side) = P V over keys j <= t; inputs: probs, qkv. By rows, as
 * {@link probsShader}: each invocation keeps its row of ctx, the values held in workgroup
 * memory block by block. `f16`: p and v rounded to f16 (`roundF16`), products exact in f32 and
 * sums f32, as the composed form's f16 matmul.
 */
export function contextShader(dh: number, f16 = false): string {
  return `${rowHead(dh, f16)}
    fn main(index : i32) {
      var r = rows(index);
      if (r.li == 0) {
        blockEnd = r.end;
      }
      let end = workgroupUniformLoad(&blockEnd);
      let pBase = (r.bh * uniforms.nT + r.row) * uniforms.nT;
      var acc : array<f32, DH>;
      for (var j0 = 0; j0 < end; j0 += TK) {
        loadTile(r, j0, 2);
        workgroupBarrier();
        for (var jj = 0; jj < min(TK, r.row - j0 + 1); jj++) {
          let p = ${f16 ? 'roundF16(probs[pBase + j0 + jj])' : 'probs[pBase + j0 + jj]'};
          for (var d = 0; d < DH; d++) {
            acc[d] += p * tile[jj * DH + d];
          }
        }
        workgroupBarrier();
      }
      if (r.valid) {
        let out = (r.b * uniforms.nT + r.row) * uniforms.nH * DH + r.h * DH;
        for (var d = 0; d < DH; d++) {
          result[out + d] = acc[d];
        }
      }
    }
  `;
}
