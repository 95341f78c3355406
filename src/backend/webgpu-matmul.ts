/**
 * layerwise's own matrix products on the webgpu backend (issue 36 item 1): `BatchMatMul` and
 * `_FusedMatMul` as one tiled WGSL program (backend/wgsl/matmul.ts: workgroup-memory tiles of
 * 64 x 64 outputs, 4 x 4 an invocation; 128 x 128, 8 x 8 an invocation, for the large products:
 * {@link productTiling}), in place of TF.js's stock kernels, with the same inputs, attributes
 * and results (float32 accumulation; the cpu backend's numbers to rounding):
 *
 * - `transposeA` / `transposeB` read the operand in its stored layout (no transpose dispatch);
 * - batch axes: A and B may each be broadcast over the output's leading batch axes (the
 *   operand's batch shape, leading 1s dropped, is a suffix of the output's: [B, M, K] x [K, N],
 *   [1, M, K] x [B, K, N], [H, M, K] x [B, H, K, N]); other broadcasts ([3, 1] x [1, 4] batches, which TF.js's
 *   stock webgpu kernel refuses too) go to the stock kernel, as do
 *   non-float32 operands, empty outputs and grids past the dispatch limit (65,535 workgroups
 *   along x, y or z: N or M past 4,194,240, or more batches);
 * - `_FusedMatMul`: the bias, any shape broadcastable to the output by the same suffix rule
 *   with rows and columns each 1 or full ([N], [M, 1], [M, N], [B, M, N]), is added in the
 *   product's epilogue, then the activation (linear, relu, relu6, elu, leakyrelu, sigmoid);
 *   `prelu` (a weights tensor) goes to the stock kernel;
 * - f16 compute (`--precision f16`, {@link setProductOperands} from the run's precision policy):
 *   the operands are rounded to f16 as the tiles are loaded, in the same dispatch (TF.js's
 *   kernels need a rounding dispatch per operand first: backend/webgpu-f16.ts).
 *
 * - the Transformer MLP's product + bias + GELU (kernel-names.ts DENSE_GELU_KERNEL) is this
 *   program with an epilogue writing both h and GELU(h), in one dispatch:
 *   backend/webgpu-matmul-gelu.ts, registered after these by backend/index.ts initBackend (it
 *   imports this module's productOperands, so this module does not import it).
 *
 * Subgroups: lavapipe's adapter lists 'subgroups', but TF.js 4.22 requests its device without
 * the feature, and a register-and-workgroup-memory tiling needs none; a subgroup variant
 * (operand broadcasts by subgroupShuffle) is left for a GPU where its speed can be measured.
 *
 * This module imports only types from `@tensorflow/tfjs-backend-webgpu` (whose import needs
 * navigator.gpu), so it loads before the webgpu backend does.
 */
import type { WebGPUProgram } from '@tensorflow/tfjs-backend-webgpu';
import type { NumberFormat } from './precision.js';
import { tf, wrapStockKernel } from './tfjs.js';
import type { WebGPUBackendish } from './webgpu-kernels.js';
import { registerWebGPUColumnSum } from './webgpu-matmul-bias.js';
import {
  checkTiling,
  LARGE_TILING,
  MATMUL_ACTIVATIONS,
  MATMUL_UNIFORMS,
  type MatMulActivation,
  type MatMulTiling,
  type MatMulVariant,
  matMulWgsl,
  SMALL_TILING,
  TILINGS,
} from './wgsl/matmul.js';

/** WebGPU's default maxComputeWorkgroupsPerDimension: the dispatch is (N tiles, M tiles, batch). */
const MAX_WORKGROUPS = 65535;

/**
 * The fewest workgroups of {@link LARGE_TILING} for which a product takes it: 256, so that one
 * wave of them covers every SM of a big GPU (an H200's 132 SMs take 2 each: 256 invocations of
 * about 128 registers fill half an SM's 64 K) where the 64 x 64 tile would leave SMs idle or
 * spread over few waves. Smaller products keep {@link SMALL_TILING} (four times the workgroups).
 * [8192, 1024] x [1024, 4096] has 2,048 large tiles, [8192, 4096] x [4096, 1024] and
 * [1024, 8192] x [8192, 4096] 512 and 256; [1024, 8192] x [8192, 1024] (64) stays small.
 */
export const LARGE_TILE_MIN_WORKGROUPS = 256;

/** The tiling forced on every product ({@link forceProductTiling}), else undefined (chosen by size). */
let forced: MatMulTiling | undefined;

/**
 * Forces the tiling of this thread's products and dense + GELU products (wgsl/matmul.ts
 * TILINGS by name), or lets {@link productTiling} choose by size again (undefined or 'auto'):
 * for tests, benches and A/B runs. The environment's LAYERWISE_MATMUL_TILING sets it at
 * {@link registerWebGPUMatMul}.
 * @throws Error naming the tilings when `name` is none of them.
 */
export function forceProductTiling(name: string | undefined): void {
  if (name === undefined || name === 'auto') {
    forced = undefined;
    return;
  }
  const t = TILINGS[name];
  if (!t)
    throw new Error(
      `matmul tiling ${name}: use auto or one of ${Object.keys(TILINGS).join(', ')}`,
    );
  checkTiling(t);
  forced = t;
}

/**
 * The tiling of an [m, n] output with `batch` batches: the forced one ({@link
 * forceProductTiling}), else {@link LARGE_TILING} when its workgroups number at least
 * {@link LARGE_TILE_MIN_WORKGROUPS}, else {@link SMALL_TILING}.
 */
export function productTiling(
  m: number,
  n: number,
  batch: number,
): MatMulTiling {
  if (forced) return forced;
  const t = LARGE_TILING;
  const groups = Math.ceil(m / t.tileM) * Math.ceil(n / t.tileN) * batch;
  return groups >= LARGE_TILE_MIN_WORKGROUPS ? t : SMALL_TILING;
}

/** One product program: output [batch * M * N], one workgroup per output tile of one batch. */
class MatMulProgram implements WebGPUProgram {
  readonly workgroupSize: [number, number, number];
  readonly uniforms = MATMUL_UNIFORMS;
  readonly dispatchLayout = { x: [0] };
  readonly dispatch: [number, number, number];
  readonly outputShape: number[];
  readonly shaderKey: string;
  readonly variableNames: string[];
  /** The product in kernel times (gpu-queue.ts): its shader key and sizes, batch x M x N x K. */
  readonly label: string;
  constructor(
    private readonly variant: MatMulVariant,
    private readonly tiling: MatMulTiling,
    { batch, m, n, k }: Pick<ProductPlan, 'batch' | 'm' | 'n' | 'k'>,
  ) {
    this.outputShape = [batch * m * n];
    this.workgroupSize = [tiling.wgX, tiling.wgY, 1];
    this.dispatch = [
      Math.ceil(n / tiling.tileN),
      Math.ceil(m / tiling.tileM),
      batch,
    ];
    this.variableNames = variant.bias ? ['A', 'B', 'Bias'] : ['A', 'B'];
    const { transposeA: ta, transposeB: tb, bias, activation } = variant;
    this.shaderKey = `lw_matmul_${tiling.name}_${+ta}${+tb}_${bias ? 'bias' : 'nobias'}_${activation}_${variant.operands}`;
    this.label = `${this.shaderKey} [${batch}x${m}x${n}x${k}]`;
  }
  getUserCode(): string {
    return matMulWgsl(this.variant, this.tiling);
  }
}

/** The sizes of one product `op(A) op(B)` the program covers (see the module's comment). */
interface ProductPlan {
  m: number;
  n: number;
  k: number;
  /** Output batches (the batch axes' product) and those of A and B (1: broadcast). */
  batch: number;
  batchA: number;
  batchB: number;
  /** The output's shape: the broadcast batch axes, then [M, N]. */
  outShape: number[];
}

/**
 * How many batches an operand with batch axes `outer` holds when the output's are `out`, if
 * batch b of the output reads batch b mod that count of the operand (its batch shape, leading
 * 1s dropped, is a suffix of `out`); undefined otherwise.
 */
export function suffixBatches(
  outer: readonly number[],
  out: readonly number[],
): number | undefined {
  const first = outer.findIndex((d) => d !== 1);
  const own = first < 0 ? [] : outer.slice(first);
  if (own.length > out.length) return undefined;
  const tail = out.slice(out.length - own.length);
  return own.every((d, i) => d === tail[i])
    ? tf.util.sizeFromShape(own)
    : undefined;
}

/** The plan of `op(a) op(b)`, or undefined where the stock kernel runs it (see the module's comment). */
export function planProduct(
  a: tf.TensorInfo,
  b: tf.TensorInfo,
  transposeA: boolean,
  transposeB: boolean,
): ProductPlan | undefined {
  if (a.dtype !== 'float32' || b.dtype !== 'float32') return undefined;
  if (a.shape.length < 2 || b.shape.length < 2) return undefined;
  const [a0, a1] = a.shape.slice(-2) as [number, number];
  const [b0, b1] = b.shape.slice(-2) as [number, number];
  const [m, k] = transposeA ? [a1, a0] : [a0, a1];
  const [kb, n] = transposeB ? [b1, b0] : [b0, b1];
  if (k !== kb) return undefined; // the stock kernel throws TF.js's own message
  const outerA = a.shape.slice(0, -2);
  const outerB = b.shape.slice(0, -2);
  let outer: number[];
  try {
    outer = tf.backend_util.assertAndGetBroadcastShape(outerA, outerB);
  } catch {
    return undefined;
  }
  const batchA = suffixBatches(outerA, outer);
  const batchB = suffixBatches(outerB, outer);
  const batch = tf.util.sizeFromShape(outer);
  if (batchA === undefined || batchB === undefined) return undefined;
  if (m * n * batch === 0) return undefined;
  // the small tile's grid: the largest of every tiling's
  const grid = [
    Math.ceil(n / SMALL_TILING.tileN),
    Math.ceil(m / SMALL_TILING.tileM),
    batch,
  ];
  if (grid.some((g) => g > MAX_WORKGROUPS)) return undefined;
  return { m, n, k, batch, batchA, batchB, outShape: [...outer, m, n] };
}

/** The bias's uniforms (count of batches, strides per batch, row, column), or undefined where it does not broadcast by the suffix rule. */
function biasLayout(
  bias: tf.TensorInfo,
  plan: ProductPlan,
): [number, number, number, number] | undefined {
  const rank = plan.outShape.length;
  if (bias.dtype !== 'float32' || bias.shape.length > rank) return undefined;
  const padded = [
    ...new Array<number>(rank - bias.shape.length).fill(1),
    ...bias.shape,
  ];
  const [bm, bn] = padded.slice(-2) as [number, number];
  if ((bm !== 1 && bm !== plan.m) || (bn !== 1 && bn !== plan.n))
    return undefined;
  const count = suffixBatches(padded.slice(0, -2), plan.outShape.slice(0, -2));
  if (count === undefined) return undefined;
  return [count, bm * bn, bm > 1 ? bn : 0, bn > 1 ? 1 : 0];
}

let operands: MatMulVariant['operands'] = 'float32';

/**
 * Sets the format this thread's products round their operands to as they load them: the run's
 * precision policy's `compute` (backend/precision.ts). float32 and float16 only.
 * @throws Error for bfloat16 (webgpu has no bf16 products; initBackend refuses bf16 there).
 */
export function setProductOperands(format: NumberFormat): void {
  if (format === 'bfloat16')
    throw new Error(
      'webgpu products take float32 or float16 operands, not bfloat16: use --precision fp32 or f16',
    );
  operands = format;
}

/** The format this thread's products round their operands to ({@link setProductOperands}). */
export function productOperands(): MatMulVariant['operands'] {
  return operands;
}

/** Runs the planned product (with `bias` laid out by `layout`) and gives it the output's shape. */
function runProduct(
  backend: unknown,
  inputs: tf.TensorInfo[],
  plan: ProductPlan,
  variant: MatMulVariant,
  biasUniforms: [number, number, number, number],
  alpha: number,
): tf.TensorInfo {
  const tiling = productTiling(plan.m, plan.n, plan.batch);
  const program = new MatMulProgram(variant, tiling, plan);
  const flat = inputs.map((t) => ({
    ...t,
    shape: [tf.util.sizeFromShape(t.shape)],
  }));
  const ints = [plan.m, plan.n, plan.k, plan.batchA, plan.batchB];
  const out = (backend as WebGPUBackendish).runWebGPUProgram(
    program,
    flat,
    'float32',
    [
      ...[...ints, ...biasUniforms].map((v) => ({ type: 'int32', data: [v] })),
      { type: 'float32', data: [alpha] },
    ],
  );
  return { dataId: out.dataId, shape: plan.outShape, dtype: out.dtype };
}

type KernelFunc = tf.KernelConfig['kernelFunc'];
type KernelArgs = Parameters<KernelFunc>[0];

/** `BatchMatMul`: ours where {@link planProduct} covers the shapes, else `stock`. */
function batchMatMul(args: KernelArgs, stock: KernelFunc) {
  const { a, b } = args.inputs as Record<string, tf.TensorInfo>;
  const transposeA = args.attrs?.transposeA === true;
  const transposeB = args.attrs?.transposeB === true;
  const plan = planProduct(a!, b!, transposeA, transposeB);
  if (!plan) return stock(args);
  const variant: MatMulVariant = {
    transposeA,
    transposeB,
    bias: false,
    activation: 'linear',
    operands,
  };
  return runProduct(args.backend, [a!, b!], plan, variant, [1, 0, 0, 0], 0);
}

/** `_FusedMatMul`: ours for the covered shapes, biases and activations, else `stock`. */
function fusedMatMul(args: KernelArgs, stock: KernelFunc) {
  const { a, b, bias, preluActivationWeights } = args.inputs as Record<
    string,
    tf.TensorInfo | undefined
  >;
  const attrs = args.attrs ?? {};
  const activation = (attrs.activation ?? 'linear') as string;
  const transposeA = attrs.transposeA === true;
  const transposeB = attrs.transposeB === true;
  const plan = planProduct(a!, b!, transposeA, transposeB);
  const layout =
    plan && bias ? biasLayout(bias, plan) : ([1, 0, 0, 0] as const);
  if (
    !plan ||
    !layout ||
    preluActivationWeights !== undefined ||
    !(activation in MATMUL_ACTIVATIONS)
  )
    return stock(args);
  const variant: MatMulVariant = {
    transposeA,
    transposeB,
    bias: bias !== undefined,
    activation: activation as MatMulActivation,
    operands,
  };
  const inputs = bias ? [a!, b!, bias] : [a!, b!];
  const alpha = (attrs.leakyreluAlpha as number | undefined) ?? 0.2;
  return runProduct(args.backend, inputs, plan, variant, [...layout], alpha);
}

let registered = false;

/**
 * Registers the products of this module for 'webgpu' in this thread, over TF.js's stock
 * kernels (kept for the shapes this module leaves to them), their bias gradient's column
 * sum (backend/webgpu-matmul-bias.ts: `Sum` over leading axes). Once per thread, after the webgpu
 * backend package is loaded (its stock kernels must be registered) and before
 * backend/webgpu-f16.ts's registerF16Products.
 * @throws Error when the stock kernels are missing (the webgpu package is not loaded).
 */
export function registerWebGPUMatMul(): void {
  if (registered) return;
  forceProductTiling(process.env.LAYERWISE_MATMUL_TILING);
  for (const [name, impl] of [
    ['BatchMatMul', batchMatMul],
    ['_FusedMatMul', fusedMatMul],
  ] as const)
    wrapStockKernel(name, 'webgpu', (stock) => (args) => impl(args, stock));
  registerWebGPUColumnSum();
  registered = true;
}

/** Whether this thread's webgpu products are this module's ({@link registerWebGPUMatMul} ran). */
export function ownsWebGPUProducts(): boolean {
  return registered;
}
