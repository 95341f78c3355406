/**
 * The fused products' bias gradient on webgpu: `Sum` over leading axes (dy [..., N] summed to
 * the bias's [N], backend/matmul-grad.ts) as one dispatch of ours, column sums (wgsl/matmul.ts
 * {@link COLUMN_SUM_WGSL}: each column's rows split among 32 threads), where TF.js's stock Sum
 * over non-trailing axes is a transpose then a reduction (two dispatches). Every other Sum
 * (trailing or scattered axes, a full reduction, non-float32 input, few long columns) runs the
 * stock kernel, which suits a few long columns better.
 *
 * Imports no value from `@tensorflow/tfjs-backend-webgpu`, so it loads before the backend.
 */
import { tf, wrapStockKernel } from './tfjs.js';
import {
  bufferOf,
  constantUniforms,
  dispatch,
  newOutput,
  type RawBackend,
  stateOf,
} from './webgpu-multi.js';
import { COLUMN_SUM_COLUMNS, COLUMN_SUM_WGSL } from './wgsl/matmul.js';

/** Most rows a column may have below {@link MIN_COLUMNS} columns (else the stock reduction runs). */
const MAX_ROWS_FEW_COLUMNS = 4096;
const MIN_COLUMNS = 64;

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
    const raw = args.backend as unknown as RawBackend;
    const groups = Math.ceil(plan.cols / COLUMN_SUM_COLUMNS);
    const [out, outBuffer] = newOutput(raw, plan.outShape);
    const uniforms = new Uint32Array([plan.rows, plan.cols, groups]).buffer;
    dispatch(
      raw,
      stateOf(raw),
      COLUMN_SUM_WGSL,
      [
        bufferOf(raw, x),
        outBuffer,
        constantUniforms(raw, stateOf(raw), uniforms),
      ],
      groups,
      `lw_column_sum [${plan.cols}]`,
    );
    return out;
  });
}
