/**
 * WGSL of causal attention's gradient on the webgpu backend (backend/webgpu-attention.ts):
 * inputs dy [B, T, D] (the context's gradient, heads side by side), qkv [B, T, 3D] laid out
 * [B, T, 3, H, dh] and the forward's P [B, H, T, T]. Two programs: {@link scoreGradShader}
 * writes dS = scale P (dP - rowsum(dP P)) with dP = dctx v^T, by rows, the values v held in
 * workgroup memory block by block as the forward holds its keys; {@link qkvGradShader} writes
 * dqkv [B, T, 3D]: dq = dS k, dk = dS^T q, dv = P^T dctx, by rows in the same way.
 *
 * `f16` (`--precision f16` where the device has shader-f16): every product's operands are
 * rounded to f16 (`roundF16`: dctx, v, dS, k, q, P; +-Infinity beyond f16's range, so that a
 * loss-scaled gradient past it reaches the loss scaler as the composed form's f16 matmuls make
 * it do), the products formed exactly in f32 and summed in f32, the numerics of f16 products
 * with f32 accumulation. dS = scale P (dP - delta) itself stays f32: dP and delta are
 * loss-scaled (up to 2^24 times the gradient), and an f16 overflow there is not defined in WGSL
 * at run time; there is no exp in the gradient.
 */
import { rowHead } from './forward.js';

/** dS [B, H, T, T] by rows; inputs: dy, qkv, probs. */
export function scoreGradShader(dh: number, f16 = false): string {
  return `${rowHead(dh, f16)}
    fn main(index : i32) {
      var r = rows(index);
      if (r.li == 0) {
        blockEnd = r.end;
      }
      let end = workgroupUniformLoad(&blockEnd);
      let D = uniforms.nH * DH;
      var g : array<f32, DH>;
      let gBase = (r.b * uniforms.nT + r.row) * D + r.h * DH;
      for (var d = 0; d < DH; d++) {
        g[d] = ${f16 ? 'roundF16(dy[gBase + d])' : 'dy[gBase + d]'};
      }
      let pBase = (r.bh * uniforms.nT + r.row) * uniforms.nT;
      var delta = 0.0;
      for (var j0 = 0; j0 < end; j0 += TK) {
        loadTile(r, j0, 2);
        workgroupBarrier();
        for (var jj = 0; jj < min(TK, r.row - j0 + 1); jj++) {
          var dp = 0.0;
          for (var d = 0; d < DH; d++) {
            dp += g[d] * tile[jj * DH + d];
          }
          delta += probs[pBase + j0 + jj] * dp;
        }
        workgroupBarrier();
      }
      for (var j0 = 0; j0 < end; j0 += TK) {
        loadTile(r, j0, 2);
        workgroupBarrier();
        for (var jj = 0; jj < min(TK, r.row - j0 + 1); jj++) {
          var dp = 0.0;
          for (var d = 0; d < DH; d++) {
            dp += g[d] * tile[jj * DH + d];
          }
          if (r.valid) {
            let p = probs[pBase + j0 + jj];
            result[pBase + j0 + jj] = uniforms.scale * p * (dp - delta);
          }
        }
        workgroupBarrier();
      }
      if (r.valid) {
        for (var j = r.row + 1; j < uniforms.nT; j++) {
          result[pBase + j] = 0.0;
        }
      }
    }
  `;
}

/**
 * dqkv [B, T, 3D] laid out [B, T, 3, H, dh]; inputs: ds, probs, qkv, dy. By rows, three sets of
 * workgroups (the dispatch's z: part 0 dq, 1 dk, 2 dv): each invocation keeps its row t of
 * dq = dS k (keys j <= t), dk = dS^T q or dv = P^T dctx (queries i >= t), the other operand
 * held in workgroup memory block by block.
 */
export function qkvGradShader(dh: number, f16 = false): string {
  return `${rowHead(dh, f16)}
    var<workgroup> blockStart : i32;

    fn loadDyTile(r : Rows, j0 : i32) {
      for (var e = r.li; e < TK * DH; e += WG) {
        let j = j0 + e / DH;
        var val = 0.0;
        if (j < uniforms.nT) {
          val = dy[(r.b * uniforms.nT + j) * uniforms.nH * DH + r.h * DH + e % DH];
        }
        tile[e] = ${f16 ? 'roundF16(val)' : 'val'};
      }
    }

    fn weight(r : Rows, part : i32, j : i32) -> f32 {
      let nT = uniforms.nT;
      if (part == 0) {
        return ds[(r.bh * nT + r.row) * nT + j];
      }
      if (part == 1) {
        return ds[(r.bh * nT + j) * nT + r.row];
      }
      return probs[(r.bh * nT + j) * nT + r.row];
    }

    fn main(index : i32) {
      let perPart = uniforms.nBlk * uniforms.nBH * WG;
      let part = min(index / perPart, 2);
      var r = rows(index % perPart);
      if (r.li == 0) {
        blockStart = select(0, r.i0, part > 0);
        blockEnd = select(r.end, uniforms.nT, part > 0);
      }
      let start = workgroupUniformLoad(&blockStart);
      let end = workgroupUniformLoad(&blockEnd);
      var acc : array<f32, DH>;
      for (var j0 = start; j0 < end; j0 += TK) {
        if (part == 2) {
          loadDyTile(r, j0);
        } else {
          loadTile(r, j0, 1 - part);
        }
        workgroupBarrier();
        var lo = max(0, r.row - j0);
        var hi = min(TK, end - j0);
        if (part == 0) {
          lo = 0;
          hi = min(TK, r.row - j0 + 1);
        }
        for (var jj = lo; jj < hi; jj++) {
          let w = ${f16 ? 'roundF16(weight(r, part, j0 + jj))' : 'weight(r, part, j0 + jj)'};
          for (var d = 0; d < DH; d++) {
            acc[d] += w * tile[jj * DH + d];
          }
        }
        workgroupBarrier();
      }
      if (r.valid && index / perPart < 3) {
        let out = ((r.b * uniforms.nT + r.row) * 3 + part) * uniforms.nH * DH + r.h * DH;
        for (var d = 0; d < DH; d++) {
          result[out + d] = acc[d];
        }
      }
    }
  `;
}
