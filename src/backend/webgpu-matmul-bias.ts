/**
 * The fused products' bias gradient on webgpu: `Sum` over leading axes (dy [..., N] summed to
 * the bias's [N], backend/matmul-grad.ts) as one program of ours, column sums
 * (wgsl/matmul.ts {@link COLUMN_SUM_WGSL}), where TF.js's stock Sum over non-trailing axes is a
 * transpose then a reduction (two dispatches). Every other Sum (trailing or scattered axes, a
 * full reduction, non-float32 input, few long columns, more than 4,194,240 columns) runs the
 * stock kernel: one invocation per column walks its rows, which suits the bias's many short
 * columns, not a few long ones.
 *
 * Imports only types from `@tensorflow/tfjs-backend-webgpu`, so it loads before the backend.
 */
import type { WebGPUProgram } from '@tensorflow/tfjs-backend-webgpu';
import { tf, wrapStockKernel } from './tfjs.js';
import type { WebGPUBackendish } from './webgpu-kernels.js';
import { COLUMN_SUM_WGSL, COLUMN_THREADS } from './wgsl/matmul.js';

/** Most rows a column may have below {@link MIN_COLUMNS} columns (else the stock reduction runs). */
const MAX_ROWS_FEW_COLUMNS = 4096;
const MIN_COLUMNS = 64;
/** WebGPU's default maxComputeWorkgroupsPerDimension (the dispatch is one-dimensional). */
const MAX_WORKGROUPS = 65535;

/** Column sums: output [cols], one invocation per column. */
class ColumnSumProgram implements WebGPUProgram {
  readonly variableNames = ['X'];
  readonly workgroupSize: [number, number, number] = [COLUMN_THREADS, 1, 1];
  readonly uniforms = 'rows : i32,';
  readonly size = true;
  readonly shaderKey = 'lw_column_sum';
  readonly dispatchLayout = { x: [0] };
  readonly dispatch: [number, number, number];
  readonly outputShape: number[];
  constructor(cols: number) {
    this.outputShape = [cols];
    this.dispatch = [Math.ceil(cols / COLUMN_THREADS), 1, 1];
  }
  getUserCode(): string {
    return COLUMN_SUM_WGSL;
  }
}

/**
 * The [rows, cols] view and output shape of `Sum(x, axis, keepDims)` when it reduces a leading
 * prefix of x's axes only and this module takes it; undefined otherwise.
 */
export function columnSumPlan(
  shape: readonly number[],
  axis: number | number[],
  keepDims: boolean,
): { rows: number; cols: number; outShape: number[] } | undefined {
  const axes = tf.util.parseAxisParam(axis, [...shape]).sort((a, b) => a - b);
  const r = axes.length;
  if (r === 0 || r >= shape.length || axes.some((a, i) => a !== i))
    return undefined;
  const rows = tf.util.sizeFromShape(shape.slice(0, r));
  const cols = tf.util.sizeFromShape(shape.slice(r));
  if (cols === 0 || rows === 0) return undefined;
  if (Math.ceil(cols / COLUMN_THREADS) > MAX_WORKGROUPS) return undefined;
  if (cols < MIN_COLUMNS && rows > MAX_ROWS_FEW_COLUMNS) return undefined;
  const outShape = keepDims
    ? [...new Array<number>(r).fill(1), ...shape.slice(r)]
    : shape.slice(r);
  return { rows, cols, outShape };
}

/**
 * Registers the column-sum `Sum` for 'webgpu' over TF.js's stock kernel (kept for the rest).
 * Once per thread, after the webgpu package is loaded.
 * @throws Error when the stock Sum is missing (the webgpu package is not loaded).
 */
export function registerWebGPUColumnSum(): void {
  wrapStockKernel('Sum', 'webgpu', (stock) => (args) => {
    const x = (args.inputs as { x: tf.TensorInfo }).x;
    const attrs = args.attrs as {
      axis: number | number[];
      keepDims?: boolean;
    };
    const plan =
      x.dtype === 'float32'
        ? columnSumPlan(x.shape, attrs.axis, attrs.keepDims === true)
        : undefined;
    if (!plan) return stock(args);
    const out = (args.backend as unknown as WebGPUBackendish).runWebGPUProgram(
      new ColumnSumProgram(plan.cols),
      [{ ...x, shape: [plan.rows * plan.cols] }],
      'float32',
      [{ type: 'int32', data: [plan.rows] }],
    );
    return { dataId: out.dataId, shape: plan.outShape, dtype: out.dtype };
  });
}
