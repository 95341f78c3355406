/**
 * WGSL of causal attention's gradient on the webgpu backend (backend/webgpu-attention.ts):
 * inputs dy [B, T, D] (the context's gradient, heads side by side), qkv [B, T, 3D] laid out
 * [B, T, 3, H, dh] and the forward's P [B, H, T, T]. Two programs: {@link scoreGradShader}
 * writes dS = scale P (dP - rowsum(dP P)) with dP = dctx v^T, by rows, the values v held in
 * workgroup memory block by block as the forward holds its keys; {@link qkvGradShader} writes
 * dqkv [B, T, 3D]: dq = dS k, dk = dS^T q, dv = P^T dctx, one invocation per element.
 */
import { rowHead } from './forward.js';

/** dS [B, H, T, T] by rows; inputs: dy, qkv, probs. */
export function scoreGradShader(dh: number): string {
  return `${rowHead(dh)}
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
        g[d] = dy[gBase + d];
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

/** dqkv [B, T, 3D] laid out [B, T, 3, H, dh]; inputs: ds, probs, qkv, dy. */
export function qkvGradShader(dh: number): string {
  return `
    const DH = ${dh};
    fn main(index : i32) {
      if (index < uniforms.size) {
        let nT = uniforms.nT;
        let D = uniforms.nH * DH;
        let c3 = index % (3 * D);
        let t = (index / (3 * D)) % nT;
        let b = index / (3 * D * nT);
        let part = c3 / D;
        let c = c3 % D;
        let rowBase = (b * uniforms.nH + c / DH) * nT;
        var acc = 0.0;
        if (part == 0) {
          for (var j = 0; j <= t; j++) {
            acc += ds[(rowBase + t) * nT + j] * qkv[((b * nT + j) * 3 + 1) * D + c];
          }
        } else if (part == 1) {
          for (var i = t; i < nT; i++) {
            acc += ds[(rowBase + i) * nT + t] * qkv[(b * nT + i) * 3 * D + c];
          }
        } else {
          for (var i = t; i < nT; i++) {
            acc += probs[(rowBase + i) * nT + t] * dy[(b * nT + i) * D + c];
          }
        }
        setOutputAtIndex(index, acc);
      }
    }
  `;
}
