/**
 * WGSL of the MLP's product + bias + GELU on webgpu (backend/webgpu-matmul-gelu.ts,
 * kernel-names.ts DENSE_GELU_KERNEL) in one dispatch: layerwise's tiled product
 * (wgsl/matmul.ts {@link matMulWgsl}, same tiles, same operand loads, same f32 accumulation)
 * with an epilogue that adds the bias and writes both outputs, h = x W + b and y = GELU(h)
 * (wgsl/elementwise.ts geluFunctionWgsl: LayerwiseGelu's math).
 *
 * A TF.js program writes one output, so this is a module of its own, run as a pipeline of ours
 * (backend/webgpu-multi.ts dispatch): its own bindings (A, B, Bias read; Y, H written; the
 * uniforms), and an entry point that sets the workgroup and invocation ids the product's code
 * reads (TF.js's prelude declares them as private variables the same way). The output tiles are
 * numbered flat over the dispatch's x and y (a dispatch holds at most 65,535 workgroups along
 * each), tile t covering rows tileM (t / tilesN) and columns tileN (t mod tilesN) of the
 * tiling's (wgsl/matmul.ts {@link MatMulTiling}: the large products' 128 x 128 tile, or the
 * 64 x 64 one, as backend/webgpu-matmul.ts productTiling chooses).
 */
import { geluFunctionWgsl, geluSlopeFunctionWgsl } from './elementwise.js';
import {
  columnPhasesMain,
  MATMUL_UNIFORMS,
  type MatMulTiling,
  type MatMulVariant,
  matMulWgsl,
} from './matmul.js';

/**
 * The module's uniforms: the product's ({@link MATMUL_UNIFORMS}; batches 1, the bias a row
 * [N]), f32 infinity (the f16 operand rounding's overflow value), the tiles along N and in all.
 */
export const DENSE_GELU_UNIFORMS = `${MATMUL_UNIFORMS} INFINITY : f32, tilesN : i32, tiles : i32,`;

/** The epilogue: h = sum + bias, y = GELU(h), each stored at the element's place. */
const EPILOGUE = `let v = x + Bias[c];
      let o = outBase + r * uniforms.N + c;
      H[o] = v;
      Y[o] = geluOf(v);`;

/**
 * The module of one variant: `operands` as the products' ('float16': rounded to f16 as the tiles
 * are loaded), `geluF16` GELU's sigmoid factor in f16 arithmetic (LayerwiseGelu's f16 variant;
 * the device needs shader-f16), `tiling` the product's tiles. Bindings: 0 A [M, K], 1 B [K, N],
 * 2 Bias [N], 3 Y [M, N], 4 H [M, N], 5 the uniforms ({@link DENSE_GELU_UNIFORMS}).
 * @throws Error when `tiling` breaks wgsl/matmul.ts checkTiling's rules.
 */
export function denseGeluWgsl(
  operands: MatMulVariant['operands'],
  geluF16: boolean,
  tiling: MatMulTiling,
): string {
  const variant: MatMulVariant = {
    transposeA: false,
    transposeB: false,
    bias: true,
    activation: 'linear',
    operands,
  };
  return `${geluF16 ? 'enable f16;' : ''}
struct Uniforms { ${DENSE_GELU_UNIFORMS} };
@group(0) @binding(0) var<storage, read> A : array<f32>;
@group(0) @binding(1) var<storage, read> B : array<f32>;
@group(0) @binding(2) var<storage, read> Bias : array<f32>;
@group(0) @binding(3) var<storage, read_write> Y : array<f32>;
@group(0) @binding(4) var<storage, read_write> H : array<f32>;
@group(0) @binding(5) var<uniform> uniforms : Uniforms;
var<private> localId : vec3<u32>;
var<private> localIndex : u32;
var<private> workgroupId : vec3<u32>;
${geluFunctionWgsl(geluF16)}
${matMulWgsl(variant, tiling, EPILOGUE, 'product')}
@compute @workgroup_size(${tiling.wgX}, ${tiling.wgY}, 1)
fn main(@builtin(local_invocation_id) lid : vec3<u32>,
        @builtin(local_invocation_index) lindex : u32,
        @builtin(workgroup_id) wid : vec3<u32>,
        @builtin(num_workgroups) groups : vec3<u32>) {
  let tile = i32(wid.x + wid.y * groups.x);
  if (tile >= uniforms.tiles) {
    return;
  }
  localId = lid;
  localIndex = lindex;
  workgroupId = vec3<u32>(u32(tile % uniforms.tilesN), u32(tile / uniforms.tilesN), 0u);
  product(0);
}
`;
}

/** Columns per workgroup of {@link geluGradColumnSumWgsl}, and the row phases its threads take. */
export const GRAD_COLUMNS = 16;
export const GRAD_ROW_PHASES = 16;

/**
 * GELU's gradient with the bias's gradient in one dispatch (DENSE_GELU_GRAD_KERNEL): over
 * H, Dy viewed [rows, cols], writes Dh = Dy GELU'(H) and Db [cols] = Dh summed over rows. A
 * workgroup takes {@link GRAD_COLUMNS} adjacent columns (adjacent threads on adjacent
 * elements) with {@link GRAD_ROW_PHASES} threads each, thread p of a column walking rows p,
 * p + phases, ...; the phases' partial sums (f32) are added in workgroup memory, in phase
 * order. Workgroups are numbered flat over the dispatch's x and y. `geluF16`: the slope in f16
 * arithmetic, as LayerwiseGeluGrad's f16 variant (dy times it, and the sums, in f32: dy is
 * loss-scaled). Bindings: 0 H, 1 Dy, 2 Dh, 3 Db, 4 the uniforms {rows, cols, groups}.
 */
export function geluGradColumnSumWgsl(geluF16: boolean): string {
  return `${geluF16 ? 'enable f16;' : ''}
struct Uniforms { rows : u32, cols : u32, groups : u32, };
@group(0) @binding(0) var<storage, read> H : array<f32>;
@group(0) @binding(1) var<storage, read> Dy : array<f32>;
@group(0) @binding(2) var<storage, read_write> Dh : array<f32>;
@group(0) @binding(3) var<storage, read_write> Db : array<f32>;
@group(0) @binding(4) var<uniform> u : Uniforms;
${geluFunctionWgsl(geluF16)}
${geluSlopeFunctionWgsl(geluF16)}
${columnPhasesMain(
  GRAD_COLUMNS,
  GRAD_ROW_PHASES,
  `for (var r = lid.y; r < u.rows; r += ${GRAD_ROW_PHASES}u) {
      let i = r * u.cols + col;
      let g = Dy[i] * geluSlope(H[i]);
      Dh[i] = g;
      s += g;
    }`,
  'Db',
)}`;
}
