/**
 * layerwise's own kernels (backend/kernel-names.ts) for the webgpu backend, as WGSL compute
 * shaders (backend/wgsl/) run through TF.js's `runWebGPUProgram`: each fused op is one to three
 * dispatches instead of the composed form's many stock ones (TF.js spends 50-1,100 us an op on a
 * real GPU, whatever the op's size). {@link registerWebGPUKernels} replaces the composed forms
 * (backend/composed-kernels.ts) for 'webgpu'; the causal attention pair has its own module
 * (backend/webgpu-attention.ts), registered beside these by initBackend.
 *
 * Every program views its tensors as flat [n] or [rows, cols] (same data, other shape), so any
 * rank works and one compiled pipeline per kernel serves every shape (sizes are uniforms). A
 * kernel with several outputs runs one program per output (a TF.js program writes one buffer).
 * The math is the composed form's, so results match the other backends to rounding. `--precision
 * f16` on webgpu rounds the products' operands (backend/webgpu-f16.ts) and, where the device has
 * shader-f16, runs f16-arithmetic variants ({@link useF16Arithmetic}): GELU and its gradient,
 * layer norm's forward, the softmax cross-entropy's exps and its gradient's probs - onehot, the
 * causal softmax's exps and its gradient's y * scale (and, in webgpu-attention.ts, attention's
 * f16 product operands and exps). Sums, maxima, the loss and anything loss-scaled stay f32 (each
 * variant's doc says why); layer norm's gradient and the optimizers stay f32 throughout: every
 * term of layer norm's dx, dg and db is a loss-scaled gradient or a sum of them, and mixed
 * precision keeps normalisation and its gradient in f32 (Micikevicius et al., 2018).
 *
 * Storage is float32 ({@link STORAGE}): TF.js 4.22's tensors have no f16 dtype (its webgpu
 * backend allocates 4 bytes per 'float32' element), so f16 storage would need a dtype of our own
 * through every op; the f16 programs convert on load and store.
 */
import type { WebGPUProgram } from '@tensorflow/tfjs-backend-webgpu';
import {
  ADAMW_KERNEL,
  ADAMW_MULTI_KERNEL,
  CAUSAL_SOFTMAX_GRAD_KERNEL,
  CAUSAL_SOFTMAX_KERNEL,
  GELU_GRAD_KERNEL,
  GELU_KERNEL,
  LAYER_NORM_GRAD_KERNEL,
  LAYER_NORM_KERNEL,
  SGD_KERNEL,
  SOFTMAX_CROSS_ENTROPY_GRAD_KERNEL,
  SOFTMAX_CROSS_ENTROPY_KERNEL,
  SUM_SQUARES_KERNEL,
} from './kernel-names.js';
import { tf } from './tfjs.js';
import {
  type AdamWMultiAttrs,
  adamwMulti,
  layerNormFused,
  layerNormParamGrads,
  rowsOf,
  sizeOf,
  sumSquaresMulti,
} from './webgpu-multi.js';
import {
  adamwWgsl,
  GELU_F16_WGSL,
  GELU_GRAD_F16_WGSL,
  GELU_GRAD_WGSL,
  GELU_WGSL,
  SOFTMAX_PROBS_F16_WGSL,
  SOFTMAX_PROBS_WGSL,
  SOFTMAX_XENT_GRAD_F16_WGSL,
  SOFTMAX_XENT_GRAD_WGSL,
  sgdWgsl,
} from './wgsl/elementwise.js';
import {
  CAUSAL_SOFTMAX_F16_WGSL,
  CAUSAL_SOFTMAX_GRAD_F16_WGSL,
  CAUSAL_SOFTMAX_GRAD_WGSL,
  CAUSAL_SOFTMAX_WGSL,
  LAYER_NORM_DX_WGSL,
  LOG_SUM_EXP_F16_WGSL,
  LOG_SUM_EXP_WGSL,
  ROW_THREADS,
  XENT_LOSS_WGSL,
} from './wgsl/rows.js';

/** The dtype these kernels store (and take) their floating-point tensors in. */
export const STORAGE = 'float32' as const;

/** f16's largest finite value. */
const F16_MAX = 65504;

/** Threads per workgroup of an element-wise program. */
const ELEMENT_THREADS = 64;

/** One uniform: a name, its WGSL type and value (in the order the program declares them). */
type Uniform = [name: string, type: 'i32' | 'f32', value: number];

/** One WGSL program over flat [n] or [rows, cols] views of its inputs (backend/wgsl/, webgpu-f16.ts). */
export class LayerwiseProgram implements WebGPUProgram {
  readonly dispatchLayout: { x: number[] };
  readonly dispatch: [number, number, number];
  readonly workgroupSize: [number, number, number];
  readonly size: boolean;
  readonly uniforms: string;
  /**
   * @param shaderKey the WGSL's identity (TF.js adds ranks and dtypes).
   * @param perRow `undefined`: one thread per output element; else the number of workgroups of
   *   {@link ROW_THREADS} threads (one per row or column).
   */
  constructor(
    readonly shaderKey: string,
    readonly variableNames: string[],
    readonly outputShape: number[],
    private readonly code: string,
    uniforms: readonly Uniform[],
    perRow?: number,
  ) {
    this.dispatchLayout = { x: outputShape.map((_, i) => i) };
    const n = outputShape.reduce((a, b) => a * b, 1);
    this.size = perRow === undefined;
    this.workgroupSize = [
      perRow === undefined ? ELEMENT_THREADS : ROW_THREADS,
      1,
      1,
    ];
    this.dispatch = [perRow ?? Math.ceil(n / ELEMENT_THREADS), 1, 1];
    this.uniforms = uniforms
      .map(([name, type]) => `${name} : ${type}, `)
      .join('');
  }
  getUserCode(): string {
    // the row programs ignore the flat index TF.js's entry point passes
    return this.code;
  }
}

/** The slice of TF.js's WebGPUBackend layerwise's WGSL kernels use (these and webgpu-attention.ts's). */
export interface WebGPUBackendish {
  runWebGPUProgram(
    p: WebGPUProgram,
    inputs: tf.TensorInfo[],
    dtype: tf.DataType,
    uniforms?: Array<{ type: string; data: number[] }>,
  ): tf.TensorInfo;
  disposeData(id: object): void;
}

type Inputs = Record<string, tf.TensorInfo | undefined>;
type Attrs = Record<string, unknown>;

/** `t` viewed with `shape` (same data: a TensorInfo names its data, not a copy). */
const view = (t: tf.TensorInfo, shape: number[]): tf.TensorInfo => ({
  dataId: t.dataId,
  shape,
  dtype: t.dtype,
});

/** Runs `program` on `inputs` (already viewed flat or as rows) and gives the output `shape`. */
export function run(
  backend: unknown,
  program: LayerwiseProgram,
  inputs: tf.TensorInfo[],
  uniforms: readonly Uniform[],
  shape: number[],
): tf.TensorInfo {
  const out = (backend as WebGPUBackendish).runWebGPUProgram(
    program,
    inputs,
    STORAGE,
    uniforms.map(([, type, value]) => ({
      type: type === 'i32' ? 'int32' : 'float32',
      data: [value],
    })),
  );
  return view(out, shape);
}

/** An element-wise program over flat views of `inputs` (named by `names`), output shaped like the first. */
function elementwise(
  backend: unknown,
  key: string,
  code: string,
  names: string[],
  inputs: tf.TensorInfo[],
  uniforms: readonly Uniform[] = [],
): tf.TensorInfo {
  const n = sizeOf(inputs[0]!);
  const program = new LayerwiseProgram(key, names, [n], code, uniforms);
  const flat = inputs.map((t) => view(t, [sizeOf(t)]));
  return run(backend, program, flat, uniforms, inputs[0]!.shape);
}

/** A row program (one workgroup per row or column) with output [outSize] shaped `shape`. */
function perRow(
  backend: unknown,
  key: string,
  code: string,
  workgroups: number,
  inputs: Array<[name: string, t: tf.TensorInfo]>,
  uniforms: readonly Uniform[],
  shape: number[],
): tf.TensorInfo {
  const outSize = shape.reduce((a, b) => a * b, 1);
  const program = new LayerwiseProgram(
    key,
    inputs.map(([name]) => name),
    [outSize],
    code,
    uniforms,
    workgroups,
  );
  const flat = inputs.map(([, t]) => view(t, [sizeOf(t)]));
  return run(backend, program, flat, uniforms, shape);
}

/** Layer norm's forward: one dispatch of a pipeline of ours with its three outputs (backend/webgpu-multi.ts). */
function layerNorm(inputs: Inputs, attrs: Attrs, backend: unknown) {
  const { x, g, b } = inputs as Record<string, tf.TensorInfo>;
  const eps = attrs.epsilon as number;
  return layerNormFused(x!, g!, b!, eps, backend, f16Arithmetic(backend));
}

/** Layer norm's gradient [dx, dg, db], f32 under every precision (wgsl/rows.ts LAYER_NORM_DX_WGSL says why). */
function layerNormGrad(inputs: Inputs, _attrs: Attrs, backend: unknown) {
  const { dy, xhat, rstd, g } = inputs as Record<string, tf.TensorInfo>;
  const [rows, cols] = rowsOf(dy!);
  const u: Uniform[] = [
    ['rows', 'i32', rows],
    ['cols', 'i32', cols],
  ];
  const dx = perRow(
    backend,
    'lw_ln_dx',
    LAYER_NORM_DX_WGSL,
    rows,
    [
      ['Dy', dy!],
      ['Xhat', xhat!],
      ['Rstd', rstd!],
      ['G', g!],
    ],
    u,
    dy!.shape,
  );
  // dg and db in one dispatch of a pipeline of ours (two outputs)
  const [dg, db] = layerNormParamGrads(dy!, xhat!, backend);
  return [dx, dg, db];
}

function softmaxCrossEntropy(inputs: Inputs, _attrs: Attrs, backend: unknown) {
  const { logits, labels } = inputs as Record<string, tf.TensorInfo>;
  const [rows, cols] = rowsOf(logits!);
  const u: Uniform[] = [
    ['rows', 'i32', rows],
    ['cols', 'i32', cols],
  ];
  const h = f16Arithmetic(backend);
  const lse = perRow(
    backend,
    h ? 'lw_lse_f16' : 'lw_lse',
    h ? LOG_SUM_EXP_F16_WGSL : LOG_SUM_EXP_WGSL,
    rows,
    [['X', logits!]],
    u,
    [rows],
  );
  const loss = perRow(
    backend,
    'lw_xent_loss',
    XENT_LOSS_WGSL,
    1,
    [
      ['X', logits!],
      ['Lse', lse],
      ['Labels', labels!],
    ],
    u,
    [],
  );
  const probs = elementwise(
    backend,
    h ? 'lw_xent_probs_f16' : 'lw_xent_probs',
    h ? SOFTMAX_PROBS_F16_WGSL : SOFTMAX_PROBS_WGSL,
    ['X', 'Lse'],
    [logits!, lse],
    [['cols', 'i32', cols]],
  );
  (backend as { disposeData(id: object): void }).disposeData(lse.dataId);
  return [loss, probs];
}

function softmaxCrossEntropyGrad(
  inputs: Inputs,
  _attrs: Attrs,
  backend: unknown,
) {
  const { probs, labels, dy } = inputs as Record<string, tf.TensorInfo>;
  const [rows, cols] = rowsOf(probs!);
  const h = f16Arithmetic(backend);
  return elementwise(
    backend,
    h ? 'lw_xent_grad_f16' : 'lw_xent_grad',
    h ? SOFTMAX_XENT_GRAD_F16_WGSL : SOFTMAX_XENT_GRAD_WGSL,
    ['P', 'Labels', 'Dy'],
    [probs!, labels!, dy!],
    [
      ['rows', 'i32', rows],
      ['cols', 'i32', cols],
    ],
  );
}

function causalSoftmax(inputs: Inputs, attrs: Attrs, backend: unknown) {
  const { x } = inputs as Record<string, tf.TensorInfo>;
  const [rows, cols] = rowsOf(x!);
  const u: Uniform[] = [
    ['rows', 'i32', rows],
    ['cols', 'i32', cols],
    ['scale', 'f32', attrs.scale as number],
  ];
  const h = f16Arithmetic(backend);
  return perRow(
    backend,
    h ? 'lw_causal_softmax_f16' : 'lw_causal_softmax',
    h ? CAUSAL_SOFTMAX_F16_WGSL : CAUSAL_SOFTMAX_WGSL,
    rows,
    [['X', x!]],
    u,
    x!.shape,
  );
}

function causalSoftmaxGrad(inputs: Inputs, attrs: Attrs, backend: unknown) {
  const { y, dy } = inputs as Record<string, tf.TensorInfo>;
  const [rows, cols] = rowsOf(y!);
  const u: Uniform[] = [
    ['rows', 'i32', rows],
    ['cols', 'i32', cols],
    ['scale', 'f32', attrs.scale as number],
  ];
  // the f16 program rounds scale to f16: only where it is within f16's range
  const h =
    f16Arithmetic(backend) && Math.abs(attrs.scale as number) <= F16_MAX;
  return perRow(
    backend,
    h ? 'lw_causal_softmax_grad_f16' : 'lw_causal_softmax_grad',
    h ? CAUSAL_SOFTMAX_GRAD_F16_WGSL : CAUSAL_SOFTMAX_GRAD_WGSL,
    rows,
    [
      ['Y', y!],
      ['Dy', dy!],
    ],
    u,
    y!.shape,
  );
}

function adamw(inputs: Inputs, attrs: Attrs, backend: unknown) {
  const { p, g, m, v } = inputs as Record<string, tf.TensorInfo>;
  const a = attrs as Record<string, number>;
  const u: Uniform[] = [
    ['lr', 'f32', a.lr!],
    ['beta1', 'f32', a.beta1!],
    ['beta2', 'f32', a.beta2!],
    ['oneMinusBeta1', 'f32', 1 - a.beta1!],
    ['oneMinusBeta2', 'f32', 1 - a.beta2!],
    ['epsilon', 'f32', a.epsilon!],
    ['weightDecay', 'f32', a.weightDecay!],
    ['scale', 'f32', a.scale!],
    ['bc1', 'f32', 1 - a.beta1! ** a.step!],
    ['bc2', 'f32', 1 - a.beta2! ** a.step!],
  ];
  // a program binds only the buffers its WGSL reads (TF.js's pipelines take the shader's layout)
  const reads = { p: [p!, g!, m!, v!], m: [g!, m!], v: [g!, v!] };
  const names = { p: ['P', 'G', 'M', 'V'], m: ['G', 'M'], v: ['G', 'V'] };
  return (['p', 'm', 'v'] as const).map((which) =>
    elementwise(
      backend,
      `lw_adamw_${which}`,
      adamwWgsl(which),
      names[which],
      reads[which],
      u,
    ),
  );
}

function sgd(inputs: Inputs, attrs: Attrs, backend: unknown) {
  const { p, g, velocity } = inputs;
  const a = attrs as Record<string, number>;
  const u: Uniform[] = [
    ['lr', 'f32', a.lr!],
    ['momentum', 'f32', a.momentum!],
    ['weightDecay', 'f32', a.weightDecay!],
    ['scale', 'f32', a.scale!],
  ];
  const names = velocity ? ['P', 'G', 'Vel'] : ['P', 'G'];
  const ins = velocity ? [p!, g!, velocity] : [p!, g!];
  const outs: Array<'p' | 'velocity'> = velocity ? ['p', 'velocity'] : ['p'];
  return outs.map((which) =>
    elementwise(
      backend,
      `lw_sgd_${which}_${velocity ? 'm' : 'plain'}`,
      sgdWgsl(which, velocity !== undefined),
      names,
      ins,
      u,
    ),
  );
}

let f16Wanted = false;

/**
 * Makes this thread's GELU, its gradient, layer norm's forward, the softmax cross-entropy, the
 * causal softmax (each with its gradient) and causal attention (webgpu-attention.ts) compute in
 * f16 arithmetic (the f16 variants of wgsl/elementwise.ts, rows.ts, multi.ts and
 * wgsl-attention/; float32 storage, as TF.js 4.22's webgpu tensors have no f16 dtype; sums stay
 * f32) where the
 * backend's device has `shader-f16` (backend/webgpu.ts requests it for a policy that computes
 * in f16); elsewhere, and with `on` false, they stay f32. Called by backend/webgpu-f16.ts.
 */
export function useF16Arithmetic(on: boolean): void {
  f16Wanted = on;
}

/** Whether `backend`'s kernels compute in f16: asked for, and its device has shader-f16. */
export function f16Arithmetic(backend: unknown): boolean {
  const device = (backend as { device?: { features?: ReadonlySet<string> } })
    .device;
  return f16Wanted && device?.features?.has('shader-f16') === true;
}

type KernelImpl = (
  inputs: Inputs,
  attrs: Attrs,
  backend: unknown,
) => tf.TensorInfo | tf.TensorInfo[];

/** layerwise's webgpu kernels, by kernel name. */
const WEBGPU_KERNELS: Record<string, KernelImpl> = {
  [GELU_KERNEL]: ({ x }, _a, backend) =>
    f16Arithmetic(backend)
      ? elementwise(backend, 'lw_gelu_f16', GELU_F16_WGSL, ['X'], [x!])
      : elementwise(backend, 'lw_gelu', GELU_WGSL, ['X'], [x!]),
  [GELU_GRAD_KERNEL]: ({ x, dy }, _a, backend) =>
    elementwise(
      backend,
      f16Arithmetic(backend) ? 'lw_gelu_grad_f16' : 'lw_gelu_grad',
      f16Arithmetic(backend) ? GELU_GRAD_F16_WGSL : GELU_GRAD_WGSL,
      ['X', 'Dy'],
      [x!, dy!],
    ),
  [LAYER_NORM_KERNEL]: layerNorm,
  [LAYER_NORM_GRAD_KERNEL]: layerNormGrad,
  [SOFTMAX_CROSS_ENTROPY_KERNEL]: softmaxCrossEntropy,
  [SOFTMAX_CROSS_ENTROPY_GRAD_KERNEL]: softmaxCrossEntropyGrad,
  [CAUSAL_SOFTMAX_KERNEL]: causalSoftmax,
  [CAUSAL_SOFTMAX_GRAD_KERNEL]: causalSoftmaxGrad,
  [ADAMW_KERNEL]: adamw,
  [SGD_KERNEL]: sgd,
  // multi-tensor kernels (backend/webgpu-multi.ts): inputs are an array, keys '0'..'n-1'
  [ADAMW_MULTI_KERNEL]: (inputs, attrs, backend) =>
    adamwMulti(
      Object.values(inputs) as tf.TensorInfo[],
      attrs as unknown as AdamWMultiAttrs,
      backend,
    ),
  [SUM_SQUARES_KERNEL]: (inputs, _a, backend) =>
    sumSquaresMulti(Object.values(inputs) as tf.TensorInfo[], backend),
};

/** The kernel names {@link registerWebGPUKernels} provides. */
export const WEBGPU_KERNEL_NAMES: readonly string[] =
  Object.keys(WEBGPU_KERNELS);

let registered = false;

/**
 * Registers layerwise's WGSL kernels for 'webgpu' in this thread, replacing the composed forms
 * that backend/index.ts registered before (and that the optimizer's fused updates lacked). Once
 * per thread; call before the first op runs on webgpu.
 */
export function registerWebGPUKernels(): void {
  if (registered) return;
  registered = true;
  for (const [kernelName, impl] of Object.entries(WEBGPU_KERNELS)) {
    if (tf.getKernel(kernelName, 'webgpu') !== undefined)
      tf.unregisterKernel(kernelName, 'webgpu');
    tf.registerKernel({
      kernelName,
      backendName: 'webgpu',
      kernelFunc: ({ inputs, attrs, backend }) =>
        impl(inputs as Inputs, (attrs ?? {}) as Attrs, backend),
    });
  }
}
