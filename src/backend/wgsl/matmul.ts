/**
 * WGSL of layerwise's batched matrix product on the webgpu backend (backend/webgpu-matmul.ts):
 * C[b] = act(op(A[b]) op(B[b]) + bias), op an optional transpose of the last two axes, float32
 * accumulation. Tiled in workgroup memory (the classic shared-memory GEMM, as in CUTLASS's and
 * TF.js's own MatMulPackedProgram): a workgroup of {@link WG_X} x {@link WG_Y} invocations
 * computes a {@link TILE_M} x {@link TILE_N} block of C, walking K in steps of {@link TILE_K}; at
 * each step the workgroup copies an A tile [TILE_K, TILE_M] and a B tile [TILE_K, TILE_N] into
 * workgroup memory (zero past the matrix edges, so any M, N, K works), then each invocation
 * accumulates its 4 x 4 outputs (rows 4 ty + i, columns 4 tx + j) from them, reading the tiles
 * as vec4s and keeping its sums in four vec4 registers.
 *
 * The shader is the user code TF.js's webgpu backend wraps (webgpu_program.js makeShader): the
 * inputs are arrays named A, B (and Bias) viewed flat, `result` the flat output [batch, M, N],
 * `uniforms` the program's uniforms ({@link MATMUL_UNIFORMS}); the dispatch is
 * (ceil(N / TILE_N), ceil(M / TILE_M), batch), one workgroup per output block.
 */

/** Output rows and columns per workgroup, and the K step held in workgroup memory. */
export const TILE_M = 64;
export const TILE_N = 64;
export const TILE_K = 16;
/** Invocations per workgroup along x (columns) and y (rows): each computes 4 x 4 outputs. */
export const WG_X = 16;
export const WG_Y = 16;

/**
 * The program's uniforms: the product's sizes M, N, K; the batch counts of A, B and the bias
 * (an output batch b reads batch b mod count of each: 1 for an operand broadcast over every
 * batch); the bias's strides per batch, row and column (0 along a broadcast axis); leaky
 * ReLU's slope.
 */
export const MATMUL_UNIFORMS =
  'M : i32, N : i32, K : i32, batchA : i32, batchB : i32, batchBias : i32, biasBatch : i32, biasRow : i32, biasCol : i32, alpha : f32,';

/** The fused activations the kernel applies after the bias (TF.js's `_FusedMatMul` names but prelu). */
export const MATMUL_ACTIVATIONS = {
  linear: 'v',
  relu: 'max(v, 0.0)',
  relu6: 'clamp(v, 0.0, 6.0)',
  elu: 'select(exp(v) - 1.0, v, v >= 0.0)',
  leakyrelu: 'select(uniforms.alpha * v, v, v >= 0.0)',
  sigmoid: '1.0 / (1.0 + exp(-v))',
} as const;

/** An activation {@link matMulWgsl} fuses. */
export type MatMulActivation = keyof typeof MATMUL_ACTIVATIONS;

/** What one compiled product program does (each combination is its own pipeline). */
export interface MatMulVariant {
  transposeA: boolean;
  transposeB: boolean;
  /** Whether a third input, Bias, is added before the activation. */
  bias: boolean;
  activation: MatMulActivation;
  /**
   * 'float16': the operands are rounded to f16 as they are loaded (products of f16 values,
   * exact in f32, accumulated in f32: the numerics of f16 tensor cores); 'float32': as stored.
   */
  operands: 'float32' | 'float16';
}

/**
 * `fn roundF16(a : f32) -> f32`: the nearest f16 value of `a` as an f32, by integer rounding
 * of the mantissa to 10 bits, nearest-even (GPU compilers may fold a pack2x16float /
 * unpack2x16float pair into nothing); f16's subnormals (below 2^-14) are multiples of 2^-24;
 * 65520 and beyond round to infinity (so that loss scaling sees the overflow); NaN stays NaN.
 * Shared with backend/webgpu-f16.ts's rounding program.
 */
export const ROUND_F16_WGSL = `
  fn roundF16(a : f32) -> f32 {
    let bits = bitcast<u32>(a);
    if ((bits & 0x7fffffffu) > 0x7f800000u) {
      return a;
    }
    if (abs(a) < 6.103515625e-05) {
      return round(a * 16777216.0) / 16777216.0;
    }
    let lsb = (bits >> 13u) & 1u;
    let r = bitcast<f32>((bits + 0xfffu + lsb) & 0xffffe000u);
    if (abs(r) > 65504.0) {
      return sign(a) * uniforms.INFINITY;
    }
    return r;
  }
`;

/** The tile loads: invocation `li` copies 4 elements of each tile, consecutive invocations along the operand's contiguous axis. */
function loads(v: MatMulVariant): string {
  const load = v.operands === 'float16' ? 'roundF16' : '';
  // A is [M, K] (or [K, M] transposed), B is [K, N] (or [N, K] transposed), row-major
  const aPos = v.transposeA
    ? 'let k = i / TM; let m = i % TM;'
    : 'let m = i / TK; let k = i % TK;';
  const aAt = v.transposeA ? 'gk * uniforms.M + gm' : 'gm * uniforms.K + gk';
  const bPos = v.transposeB
    ? 'let n = i / TK; let kb = i % TK;'
    : 'let kb = i / TN; let n = i % TN;';
  const bAt = v.transposeB ? 'gn * uniforms.K + gkb' : 'gkb * uniforms.N + gn';
  return `
  fn loadTiles(aBase : i32, bBase : i32, row0 : i32, col0 : i32, k0 : i32, li : i32) {
    for (var l = 0; l < LOADS; l++) {
      let i = li + l * THREADS;
      ${aPos}
      let gm = row0 + m;
      let gk = k0 + k;
      var va = 0.0;
      if (gm < uniforms.M && gk < uniforms.K) {
        va = ${load}(A[aBase + ${aAt}]);
      }
      As[(k * TM + m) / 4][m % 4] = va;
      ${bPos}
      let gn = col0 + n;
      let gkb = k0 + kb;
      var vb = 0.0;
      if (gn < uniforms.N && gkb < uniforms.K) {
        vb = ${load}(B[bBase + ${bAt}]);
      }
      Bs[(kb * TN + n) / 4][n % 4] = vb;
    }
  }
`;
}

/**
 * The WGSL user code of one product variant (see the module's comment). `epilogue`: WGSL that
 * stores one output element (in scope: `x` its f32 sum, `r` and `c` its row and column, both in
 * range, `outBase` its batch's first element, `biasBase` the bias's), in place of the bias, the
 * activation and the store to `result` (wgsl/dense-gelu.ts writes two outputs so); `entry` the
 * name of the function TF.js's (or a caller's own) entry point calls.
 */
export function matMulWgsl(
  v: MatMulVariant,
  epilogue?: string,
  entry = 'main',
): string {
  const bias = v.bias
    ? 'v += Bias[biasBase + r * uniforms.biasRow + c * uniforms.biasCol];'
    : '';
  const store =
    epilogue ??
    `var v = x;
      ${bias}
      result[outBase + r * uniforms.N + c] = ${MATMUL_ACTIVATIONS[v.activation]};`;
  // each invocation's outputs: rows row0 + 4 ty + i, columns col0 + 4 tx + j (i, j < 4), read
  // from the tiles as vec4s; the accumulators are four vec4 rows (registers, no indexing)
  const rows = [0, 1, 2, 3];
  const xyzw = ['x', 'y', 'z', 'w'];
  return `
  const TM = ${TILE_M};
  const TN = ${TILE_N};
  const TK = ${TILE_K};
  const THREADS = ${WG_X * WG_Y};
  const LOADS = ${(TILE_M * TILE_K) / (WG_X * WG_Y)};
  var<workgroup> As : array<vec4<f32>, ${(TILE_K * TILE_M) / 4}>;
  var<workgroup> Bs : array<vec4<f32>, ${(TILE_K * TILE_N) / 4}>;
  ${v.operands === 'float16' ? ROUND_F16_WGSL : ''}
  ${loads(v)}
  fn finish(biasBase : i32, outBase : i32, r : i32, c : i32, x : f32) {
    if (r < uniforms.M && c < uniforms.N) {
      ${store}
    }
  }
  fn ${entry}(index : i32) {
    let tx = i32(localId.x);
    let ty = i32(localId.y);
    let li = i32(localIndex);
    let batch = i32(workgroupId.z);
    let row0 = i32(workgroupId.y) * TM;
    let col0 = i32(workgroupId.x) * TN;
    let aBase = (batch % uniforms.batchA) * uniforms.M * uniforms.K;
    let bBase = (batch % uniforms.batchB) * uniforms.K * uniforms.N;
    ${rows.map((i) => `var acc${i} = vec4<f32>(0.0);`).join(' ')}
    for (var k0 = 0; k0 < uniforms.K; k0 += TK) {
      loadTiles(aBase, bBase, row0, col0, k0, li);
      workgroupBarrier();
      for (var k = 0; k < TK; k++) {
        let a = As[k * ${TILE_M / 4} + ty];
        let b = Bs[k * ${TILE_N / 4} + tx];
        ${rows.map((i) => `acc${i} += a.${xyzw[i]} * b;`).join(' ')}
      }
      workgroupBarrier();
    }
    let biasBase = (batch % uniforms.batchBias) * uniforms.biasBatch;
    let outBase = batch * uniforms.M * uniforms.N;
    ${rows
      .map(
        (i) => `for (var j = 0; j < 4; j++) {
      finish(biasBase, outBase, row0 + 4 * ty + ${i}, col0 + 4 * tx + j, acc${i}[j]);
    }`,
      )
      .join('\n    ')}
  }
`;
}

/** Columns per workgroup of {@link COLUMN_SUM_WGSL}. */
export const COLUMN_THREADS = 64;

/**
 * Column sums of X viewed [rows, size] (one invocation per column, rows in order, consecutive
 * invocations on consecutive columns): a fused product's bias gradient, dy summed over every
 * axis but the last ones (backend/matmul-grad.ts), in one dispatch where TF.js's stock Sum
 * transposes first.
 */
export const COLUMN_SUM_WGSL = `
  fn main(index : i32) {
    if (index < uniforms.size) {
      var s = 0.0;
      for (var r = 0; r < uniforms.rows; r++) {
        s += X[r * uniforms.size + index];
      }
      setOutputAtIndex(index, s);
    }
  }
`;
