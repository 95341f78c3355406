/**
 * WGSL of flash-style causal attention's gradient on the webgpu backend
 * (backend/webgpu-attention.ts; FlashAttention-2, Dao 2023, section 3.1.2 / algorithm 2):
 * inputs dy [B, T, D] (the context's gradient, heads side by side), qkv [B, T, 3D] laid out
 * [B, T, 3, H, dh], and the forward's ctx [B, T, D] and lse [B, H, T]; output dqkv [B, T, 3D].
 * Nothing of size T x T: P = exp(scale q k^T - lse) is recomputed block by block, and
 * rowsum(dP P) is D = rowsum(dy ctx) (the same number: ctx = P v, dP = dy v^T).
 *
 * One dispatch, deterministic, no atomics: the first nBlk * B * H workgroups own 64 query rows
 * each and write dq = dS k over keys j <= t (the keys and values held in workgroup memory block
 * by block); the rest own 64 key rows each and write dk = dS^T q and dv = P^T dy over queries
 * i >= t (the queries, dy rows, lse and D held block by block; D computed as the block is
 * loaded). dS = scale P (dP - D) with dP = dy v^T.
 *
 * `f16` (`--precision f16` where the device has shader-f16): every product's operands are
 * rounded to f16 (`R`: q, k, v, dy, and the weights P and dS; +-Infinity beyond f16's range, so
 * that a loss-scaled gradient past it reaches the loss scaler as the f16 matmuls make it do),
 * the products formed exactly in f32 and summed in f32; P's exp is f16's (`expH`, as the
 * forward's). dS = scale P (dP - D) and D = sum R(dy) ctx stay f32: dP and D are loss-scaled (up
 * to 2^24 times the gradient), and an f16 overflow there is not defined in WGSL at run time.
 */
import {
  attentionPrelude,
  keyBlockLoader,
  loadChunk,
  ROWS_PER_WORKGROUP,
  rowsPerBlock,
  rowWidth,
  storeChunk,
} from './forward.js';

/** The gradient's bindings, the dq role and the block loads. */
function gradHead(dh: number, f16: boolean): string {
  const tk = rowsPerBlock(dh);
  return `${attentionPrelude(dh, f16, 5)}
    @group(0) @binding(0) var<storage, read> dy : array<f32>;
    @group(0) @binding(1) var<storage, read> qkv : array<f32>;
    @group(0) @binding(2) var<storage, read> ctx : array<f32>;
    @group(0) @binding(3) var<storage, read> lse : array<f32>;
    @group(0) @binding(4) var<storage, read_write> dqkv : array<f32>;
    ${keyBlockLoader(dh)}
    var<workgroup> lseT : array<f32, ${tk}>;
    var<workgroup> dT : array<f32, ${tk}>;

    /** dy's chunk c of row t in (b, h). */
    fn dyAt(r : Rows, t : i32, c : i32) -> V {
      return ${loadChunk(dh, 'dy', `(r.b * uniforms.nT + t) * uniforms.nH * DH + r.h * DH + c * ${rowWidth(dh)}`)};
    }

    /** D = sum R(dy) ctx of row t in (b, h), f32. */
    fn rowD(r : Rows, t : i32) -> f32 {
      let base = (r.b * uniforms.nT + t) * uniforms.nH * DH + r.h * DH;
      var s = 0.0;
      for (var c = 0; c < DV; c++) {
        let o = base + c * ${rowWidth(dh)};
        s += DOT(RV(${loadChunk(dh, 'dy', 'o')}), ${loadChunk(dh, 'ctx', 'o')});
      }
      return s;
    }

    fn writeRow(r : Rows, part : i32, v : ptr<function, array<V, DV>>) {
      let D = uniforms.nH * DH;
      let out = ((r.b * uniforms.nT + r.row) * 3 + part) * D + r.h * DH;
      for (var c = 0; c < DV; c++) {
        ${storeChunk(dh, 'dqkv', `out + c * ${rowWidth(dh)}`, '(*v)[c]')}
      }
    }

    /** Queries and dy rows i0.. into at, bt (TK rows of DV chunks), their lse and D into lseT, dT. */
    fn loadQueries(r : Rows, i0 : i32, li : i32) {
      for (var e = li; e < TK * DV; e += WG) {
        let i = i0 + e / DV;
        var qv = V(0.0);
        var gv = V(0.0);
        if (i < uniforms.nT) {
          qv = qkvAt(r, i, 0, e % DV);
          gv = dyAt(r, i, e % DV);
        }
        at[e] = RV(qv);
        bt[e] = RV(gv);
      }
      if (li < TK) {
        let i = i0 + li;
        var ls = 0.0;
        var dd = 0.0;
        if (i < uniforms.nT) {
          ls = lse[r.bh * uniforms.nT + i];
          dd = rowD(r, i);
        }
        lseT[li] = ls;
        dT[li] = dd;
      }
    }

    /** dq of the invocation's query row; i0 = r.i0, uniform. */
    fn queryRole(r : Rows, i0 : i32, li : i32) {
      var q : array<V, DV>;
      var g : array<V, DV>;
      for (var c = 0; c < DV; c++) {
        q[c] = RV(qkvAt(r, r.row, 0, c));
        g[c] = RV(dyAt(r, r.row, c));
      }
      let ls = lse[r.bh * uniforms.nT + r.row];
      let dd = rowD(r, r.row);
      var acc : array<V, DV>;
      let end = min(uniforms.nT, i0 + WG);
      for (var j0 = 0; j0 < end; j0 += TK) {
        loadKeys(r, j0, li);
        workgroupBarrier();
        for (var jj = 0; jj < min(TK, r.row - j0 + 1); jj++) {
          var s = 0.0;
          var dp = 0.0;
          for (var c = 0; c < DV; c++) {
            s += DOT(q[c], at[jj * DV + c]);
            dp += DOT(g[c], bt[jj * DV + c]);
          }
          let p = EXP(s * uniforms.scale - ls);
          let w = R(uniforms.scale * p * (dp - dd));
          for (var c = 0; c < DV; c++) {
            acc[c] += w * at[jj * DV + c];
          }
        }
        workgroupBarrier();
      }
      if (r.valid) {
        writeRow(r, 0, &acc);
      }
    }
  `;
}

/** The gradient's shader: bindings dy, qkv, ctx, lse (read), dqkv (written), uniforms. */
export function gradShader(dh: number, f16 = false): string {
  return `${gradHead(dh, f16)}
    /** dk and dv of the invocation's key row; j0 = r.i0, uniform. */
    fn keyRole(r : Rows, j0 : i32, li : i32) {
      var k : array<V, DV>;
      var v : array<V, DV>;
      for (var c = 0; c < DV; c++) {
        k[c] = RV(qkvAt(r, r.row, 1, c));
        v[c] = RV(qkvAt(r, r.row, 2, c));
      }
      var dk : array<V, DV>;
      var dv : array<V, DV>;
      for (var i0 = j0; i0 < uniforms.nT; i0 += TK) {
        loadQueries(r, i0, li);
        workgroupBarrier();
        for (var ii = max(0, r.row - i0); ii < min(TK, uniforms.nT - i0); ii++) {
          var s = 0.0;
          var dp = 0.0;
          for (var c = 0; c < DV; c++) {
            s += DOT(at[ii * DV + c], k[c]);
            dp += DOT(bt[ii * DV + c], v[c]);
          }
          let p = EXP(s * uniforms.scale - lseT[ii]);
          let w = R(uniforms.scale * p * (dp - dT[ii]));
          let pw = R(p);
          for (var c = 0; c < DV; c++) {
            dk[c] += w * at[ii * DV + c];
            dv[c] += pw * bt[ii * DV + c];
          }
        }
        workgroupBarrier();
      }
      if (r.valid) {
        writeRow(r, 1, &dk);
        writeRow(r, 2, &dv);
      }
    }

    @compute @workgroup_size(${ROWS_PER_WORKGROUP})
    fn main(@builtin(workgroup_id) wid : vec3<u32>,
            @builtin(num_workgroups) groups : vec3<u32>,
            @builtin(local_invocation_index) lid : u32) {
      let perRole = uniforms.nBlk * uniforms.nBH;
      let wg = i32(wid.x + wid.y * groups.x);
      if (wg >= 2 * perRole) {
        return;
      }
      let li = i32(lid);
      let own = wg % perRole;
      let i0 = (own % uniforms.nBlk) * WG;
      if (wg < perRole) {
        queryRole(rowsOf(own, li), i0, li);
      } else {
        keyRole(rowsOf(own, li), i0, li);
      }
    }
  `;
}
