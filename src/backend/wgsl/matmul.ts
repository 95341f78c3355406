/**
 * WGSL of layerwise's batched matrix product on the webgpu backend (backend/webgpu-matmul.ts):
 * C[b] = act(op(A[b]) op(B[b]) + bias), op an optional transpose of the last two axes, float32
 * accumulation. Tiled in workgroup memory (the classic shared-memory GEMM, as in CUTLASS's and
 * TF.js's own MatMulPackedProgram; the large tiling follows S. Boehm, "How to optimize a CUDA
 * matmul kernel for cuBLAS-like performance", 2022, kernels 5-7): a workgroup of wgX x wgY
 * invocations computes a tileM x tileN block of C ({@link MatMulTiling}), walking K in steps of
 * tileK; at each step the workgroup copies an A tile [tileK, tileM] and a B tile [tileK, tileN]
 * into workgroup memory, then each invocation accumulates its (tileM / wgY) x (tileN / wgX)
 * outputs from them, reading the tiles as vec4s and keeping its sums in vec4 registers (named
 * variables, no indexing).
 *
 * An invocation's outputs are groups of 4 x 4: rows 4 wgY g + 4 ty + i and columns
 * 4 wgX h + 4 tx + j (i, j < 4; g < tileM / (4 wgY), h < tileN / (4 wgX)), so that the
 * invocations of a row of the workgroup read consecutive vec4s of a tile row (no bank
 * conflicts) and store consecutive outputs. Edges: an operand row or column past M or N is
 * read clamped to the last one (its products land only in outputs that are not stored), a K
 * index past K reads as zero (a select, no branch), so any M, N, K works with no bounds check
 * in the loops. `pad` floats at the end of each tile row in workgroup memory spread the
 * column-wise stores of a K-contiguous operand (A as stored, B transposed) over the banks;
 * `prefetch` loads the next K step's tile into registers before this step's products (its
 * global reads overlap the FMAs; one tile in workgroup memory, two barriers a step).
 *
 * The shader is the user code TF.js's webgpu backend wraps (webgpu_program.js makeShader): the
 * inputs are arrays named A, B (and Bias) viewed flat, `result` the flat output [batch, M, N],
 * `uniforms` the program's uniforms ({@link MATMUL_UNIFORMS}); the dispatch is
 * (ceil(N / tileN), ceil(M / tileM), batch), one workgroup per output block.
 */

/** One tiling of the product (each its own pipeline; see the module's comment). */
export interface MatMulTiling {
  /** Its name in program keys and benches. */
  name: string;
  /** Output rows and columns per workgroup, and the K step held in workgroup memory. */
  tileM: number;
  tileN: number;
  tileK: number;
  /** Invocations per workgroup along x (columns) and y (rows). */
  wgX: number;
  wgY: number;
  /** Floats (a multiple of 4) added at the end of each tile row in workgroup memory. */
  pad: number;
  /** Whether the next K step's tile is loaded into registers before this step's products. */
  prefetch: boolean;
}

/**
 * The product's tile before issue 36's large tiling: 64 x 64 outputs, 16 x 16 invocations of
 * 4 x 4 outputs, K steps of 16, no padding, no prefetch. Every product but the large ones.
 */
export const SMALL_TILING: MatMulTiling = {
  name: 't64',
  tileM: 64,
  tileN: 64,
  tileK: 16,
  wgX: 16,
  wgY: 16,
  pad: 0,
  prefetch: false,
};

/**
 * The large products' tile (backend/webgpu-matmul.ts productTiling): 128 x 128 outputs, 16 x 16
 * invocations of 8 x 8 outputs (16 vec4 sums: 4 FMAs of vec4 per vec4 read from workgroup
 * memory, twice the small tile's), K steps of 8 (workgroup memory 2 x 8 x 132 floats, 8.25 KiB,
 * within WebGPU's default 16 KiB), rows padded by 4 floats, register prefetch.
 */
export const LARGE_TILING: MatMulTiling = {
  name: 't128',
  tileM: 128,
  tileN: 128,
  tileK: 8,
  wgX: 16,
  wgY: 16,
  pad: 4,
  prefetch: true,
};

/**
 * The tilings a bench may compare (src/bench/matmul-tiles.ts; backend/webgpu-matmul.ts
 * forceProductTiling): the two used, and candidates to measure on a GPU: 128 x 64 with 8 x 4
 * outputs an invocation and K steps of 16, and the small tile with the large one's padding and
 * prefetch. All pass the same tests.
 */
export const TILINGS: Record<string, MatMulTiling> = {
  t64: SMALL_TILING,
  t128: LARGE_TILING,
  t128x64: {
    name: 't128x64',
    tileM: 128,
    tileN: 64,
    tileK: 16,
    wgX: 16,
    wgY: 16,
    pad: 4,
    prefetch: true,
  },
  t64p: { ...SMALL_TILING, name: 't64p', pad: 4, prefetch: true },
};

/**
 * Checks that `t` is a tiling {@link matMulWgsl} can generate: outputs per invocation in whole
 * 4 x 4 groups, each tile's loads an equal share of every invocation, `pad` a multiple of 4.
 * @throws Error naming the first rule `t` breaks.
 */
export function checkTiling(t: MatMulTiling): void {
  const threads = t.wgX * t.wgY;
  const rules: Array<[boolean, string]> = [
    [t.tileM % (4 * t.wgY) === 0, 'tileM a multiple of 4 wgY'],
    [t.tileN % (4 * t.wgX) === 0, 'tileN a multiple of 4 wgX'],
    [(t.tileM * t.tileK) % threads === 0, 'tileM tileK a multiple of wgX wgY'],
    [(t.tileN * t.tileK) % threads === 0, 'tileN tileK a multiple of wgX wgY'],
    [t.pad % 4 === 0 && t.pad >= 0, 'pad a multiple of 4'],
  ];
  for (const [ok, rule] of rules)
    if (!ok) throw new Error(`matmul tiling ${t.name}: needs ${rule}`);
}

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

/**
 * The tile loads: `loadA(l)` / `loadB(l)` read the l-th element an invocation copies of the A / B
 * tile at K step k0 (invocations `li + l THREADS` in order along the operand's contiguous axis,
 * so a load is coalesced), `storeA(l, v)` / `storeB(l, v)` put it in workgroup memory.
 */
function loads(v: MatMulVariant): string {
  const round = v.operands === 'float16' ? 'roundF16' : '';
  // A is [M, K] (or [K, M] transposed), B is [K, N] (or [N, K] transposed), row-major
  const aPos = v.transposeA
    ? 'let k = i / TM; let m = i % TM;'
    : 'let m = i / TK; let k = i % TK;';
  const aAt = v.transposeA ? 'gk * uniforms.M + gm' : 'gm * uniforms.K + gk';
  const bPos = v.transposeB
    ? 'let n = i / TK; let k = i % TK;'
    : 'let k = i / TN; let n = i % TN;';
  const bAt = v.transposeB ? 'gn * uniforms.K + gk' : 'gk * uniforms.N + gn';
  return `
  fn loadA(aBase : i32, row0 : i32, k0 : i32, li : i32, l : i32) -> f32 {
    let i = li + l * THREADS;
    ${aPos}
    let gm = min(row0 + m, uniforms.M - 1);
    let gk = min(k0 + k, uniforms.K - 1);
    return select(0.0, ${round}(A[aBase + ${aAt}]), k0 + k < uniforms.K);
  }
  fn storeA(li : i32, l : i32, x : f32) {
    let i = li + l * THREADS;
    ${aPos}
    As[(k * SA + m) / 4][m % 4] = x;
  }
  fn loadB(bBase : i32, col0 : i32, k0 : i32, li : i32, l : i32) -> f32 {
    let i = li + l * THREADS;
    ${bPos}
    let gn = min(col0 + n, uniforms.N - 1);
    let gk = min(k0 + k, uniforms.K - 1);
    return select(0.0, ${round}(B[bBase + ${bAt}]), k0 + k < uniforms.K);
  }
  fn storeB(li : i32, l : i32, x : f32) {
    let i = li + l * THREADS;
    ${bPos}
    Bs[(k * SB + n) / 4][n % 4] = x;
  }
`;
}

const range = (n: number) => Array.from({ length: n }, (_, i) => i);
const XYZW = ['x', 'y', 'z', 'w'];

/**
 * The WGSL user code of one product variant in tiling `t` (see the module's comment).
 * `epilogue`: WGSL that stores one output element (in scope: `x` its f32 sum, `r` and `c` its
 * row and column, both in range, `outBase` its batch's first element, `biasBase` the bias's),
 * in place of the bias, the activation and the store to `result` (wgsl/dense-gelu.ts writes two
 * outputs so); `entry` the name of the function TF.js's (or a caller's own) entry point calls,
 * with workgroup size (t.wgX, t.wgY, 1).
 * @throws Error when `t` breaks {@link checkTiling}'s rules.
 */
export function matMulWgsl(
  v: MatMulVariant,
  t: MatMulTiling = SMALL_TILING,
  epilogue?: string,
  entry = 'main',
): string {
  checkTiling(t);
  const bias = v.bias
    ? 'v += Bias[biasBase + r * uniforms.biasRow + c * uniforms.biasCol];'
    : '';
  const store =
    epilogue ??
    `var v = x;
      ${bias}
      result[outBase + r * uniforms.N + c] = ${MATMUL_ACTIVATIONS[v.activation]};`;
  const threads = t.wgX * t.wgY;
  const loadsA = (t.tileM * t.tileK) / threads;
  const loadsB = (t.tileN * t.tileK) / threads;
  // row groups g (vec4 a${g} of A's tile row k) and column groups h (vec4 b${h} of B's);
  // sums acc${4 g + i}_${h}: rows 4 wgY g + 4 ty + i, columns 4 wgX h + 4 tx + (0..3)
  const groupsM = range(t.tileM / (4 * t.wgY));
  const groupsN = range(t.tileN / (4 * t.wgX));
  const sums = groupsM.flatMap((g) =>
    range(4).flatMap((i) => groupsN.map((h) => [g, i, h] as const)),
  );
  const acc = (g: number, i: number, h: number) => `acc${4 * g + i}_${h}`;
  const regs = [
    ...range(loadsA).map((l) => `ra${l}`),
    ...range(loadsB).map((l) => `rb${l}`),
  ];
  const load = (k0: string, indent: string) =>
    [
      ...range(loadsA).map(
        (l) => `ra${l} = loadA(aBase, row0, ${k0}, li, ${l});`,
      ),
      ...range(loadsB).map(
        (l) => `rb${l} = loadB(bBase, col0, ${k0}, li, ${l});`,
      ),
    ].join(`\n${indent}`);
  const stores = [
    ...range(loadsA).map((l) => `storeA(li, ${l}, ra${l});`),
    ...range(loadsB).map((l) => `storeB(li, ${l}, rb${l});`),
  ].join('\n      ');
  return `
  const TM = ${t.tileM};
  const TN = ${t.tileN};
  const TK = ${t.tileK};
  const SA = ${t.tileM + t.pad};
  const SB = ${t.tileN + t.pad};
  const THREADS = ${threads};
  var<workgroup> As : array<vec4<f32>, ${(t.tileK * (t.tileM + t.pad)) / 4}>;
  var<workgroup> Bs : array<vec4<f32>, ${(t.tileK * (t.tileN + t.pad)) / 4}>;
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
    ${sums.map(([g, i, h]) => `var ${acc(g, i, h)} = vec4<f32>(0.0);`).join('\n    ')}
    ${regs.map((r) => `var ${r} = 0.0;`).join(' ')}
    ${
      t.prefetch
        ? `if (uniforms.K > 0) {
      ${load('0', '      ')}
    }`
        : ''
    }
    for (var k0 = 0; k0 < uniforms.K; k0 += TK) {
      ${
        t.prefetch
          ? ''
          : `${load('k0', '      ')}
      `
      }${stores}
      workgroupBarrier();
      ${
        t.prefetch
          ? `if (k0 + TK < uniforms.K) {
        ${load('k0 + TK', '        ')}
      }`
          : ''
      }
      for (var k = 0; k < TK; k++) {
        ${groupsM.map((g) => `let a${g} = As[k * ${(t.tileM + t.pad) / 4} + ${g * t.wgY} + ty];`).join('\n        ')}
        ${groupsN.map((h) => `let b${h} = Bs[k * ${(t.tileN + t.pad) / 4} + ${h * t.wgX} + tx];`).join('\n        ')}
        ${sums.map(([g, i, h]) => `${acc(g, i, h)} += a${g}.${XYZW[i]} * b${h};`).join('\n        ')}
      }
      workgroupBarrier();
    }
    let biasBase = (batch % uniforms.batchBias) * uniforms.biasBatch;
    let outBase = batch * uniforms.M * uniforms.N;
    ${sums
      .map(
        ([g, i, h]) => `for (var j = 0; j < 4; j++) {
      finish(biasBase, outBase, row0 + ${4 * t.wgY * g + i} + 4 * ty, col0 + ${4 * t.wgX * h} + 4 * tx + j, ${acc(g, i, h)}[j]);
    }`,
      )
      .join('\n    ')}
  }
`;
}

/**
 * The entry point of a column reduction over X viewed [u.rows, u.cols] (uniforms `u` with rows,
 * cols and groups, the workgroups of the dispatch; module-scope declarations are the caller's):
 * a workgroup takes `columns` adjacent columns (adjacent threads on adjacent elements) with
 * `phases` threads each, workgroups numbered flat over the dispatch's x and y. `body` runs for
 * an invocation whose column `col` (u32) is below u.cols and sets its partial sum `s` (f32, 0
 * before) from rows lid.y, lid.y + phases, ...; the phases' sums are added in workgroup memory,
 * in phase order, into `out[col]`. Shared by the column sums ({@link COLUMN_SUM_WGSL}) and GELU's
 * gradient with the bias's (wgsl/dense-gelu.ts).
 */
export function columnPhasesMain(
  columns: number,
  phases: number,
  body: string,
  out: string,
): string {
  return `var<workgroup> partial : array<f32, ${columns * phases}>;
@compute @workgroup_size(${columns}, ${phases}, 1)
fn main(@builtin(local_invocation_id) lid : vec3<u32>,
        @builtin(workgroup_id) wid : vec3<u32>,
        @builtin(num_workgroups) groups : vec3<u32>) {
  let group = wid.x + wid.y * groups.x;
  if (group >= u.groups) {
    return;
  }
  let col = group * ${columns}u + lid.x;
  var s = 0.0;
  if (col < u.cols) {
    ${body}
  }
  partial[lid.y * ${columns}u + lid.x] = s;
  workgroupBarrier();
  if (lid.y == 0u && col < u.cols) {
    var total = 0.0;
    for (var p = 0u; p < ${phases}u; p++) {
      total += partial[p * ${columns}u + lid.x];
    }
    ${out}[col] = total;
  }
}
`;
}

/** Columns per workgroup of {@link COLUMN_SUM_WGSL}, and the threads (row phases) each column takes. */
export const COLUMN_SUM_COLUMNS = 8;
export const COLUMN_SUM_PHASES = 32;

/**
 * Column sums of X viewed [rows, cols] into Y [cols]: a fused product's bias gradient, dy summed
 * over every axis but the last ones (backend/matmul-grad.ts), in one dispatch where TF.js's stock
 * Sum transposes first. A workgroup takes {@link COLUMN_SUM_COLUMNS} adjacent columns (adjacent
 * threads on adjacent elements: 32 bytes of a row) with {@link COLUMN_SUM_PHASES} threads each;
 * thread p of a column walks rows p, p + phases, ..., four rows a round into four sums, so
 * four loads are in flight where one sum would wait on each load in turn. The phases' sums
 * (f32) are added in workgroup memory, in phase order. Workgroups are numbered flat over the
 * dispatch's x and y. Bindings: 0 X, 1 Y, 2 the uniforms {rows, cols, groups}.
 *
 * Its forerunner (one thread per column walking every row) took 3.2 ms for an [8192, 1024]
 * bias gradient on an H100, a quarter of the 8 x d1024 model's GPU time: 16 workgroups, each
 * load waited on in turn.
 */
export const COLUMN_SUM_WGSL = `
struct Uniforms { rows : u32, cols : u32, groups : u32, };
@group(0) @binding(0) var<storage, read> X : array<f32>;
@group(0) @binding(1) var<storage, read_write> Y : array<f32>;
@group(0) @binding(2) var<uniform> u : Uniforms;
${columnPhasesMain(
  COLUMN_SUM_COLUMNS,
  COLUMN_SUM_PHASES,
  `var v = vec4<f32>(0.0);
    let stride = ${COLUMN_SUM_PHASES}u * u.cols;
    var i = lid.y * u.cols + col;
    var r = lid.y;
    for (; r + ${3 * COLUMN_SUM_PHASES}u < u.rows; r += ${4 * COLUMN_SUM_PHASES}u) {
      v += vec4<f32>(X[i], X[i + stride], X[i + 2u * stride], X[i + 3u * stride]);
      i += 4u * stride;
    }
    for (; r < u.rows; r += ${COLUMN_SUM_PHASES}u) {
      v.x += X[i];
      i += stride;
    }
    s = (v.x + v.y) + (v.z + v.w);`,
  'Y',
)}`;
