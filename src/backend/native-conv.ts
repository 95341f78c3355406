/**
 * The native backend's convolution and pooling kernels (backend/native.ts spreads
 * {@link NATIVE_CONV_KERNELS} into its kernel table): `Conv2D`, `Conv2DBackpropInput`,
 * `Conv2DBackpropFilter` and `FusedConv2D` (bias and ReLU / linear fused) on oneDNN's
 * convolution primitives, `MaxPool`, `MaxPoolGrad`, `AvgPool` and `AvgPoolGrad` as direct loops
 * (native/src/conv.cc). All NHWC with HWIO filters, as TF.js: x [batch, height, width, channels],
 * filter [filterHeight, filterWidth, inChannels, outChannels]. Strides, dilations, pads and output
 * shapes come from TF.js's own `backend_util.computeConv2DInfo` / `computePool2DInfo`, so every
 * padding mode ('same', 'valid', explicit, dimRoundingMode) means what it means on cpu; the
 * results equal the cpu backend's kernels within float32 rounding (src/backend/native-conv.test.ts),
 * including its pooling conventions: the max pool gradient goes to the first maximum of each
 * window, the average pool divides by the window's positions inside the input and its gradient
 * by the whole window's size.
 *
 * Everything else runs the cpu backend's kernel on the same storage: dtypes other than float32,
 * NCHW, empty tensors, other fused activations or bias shapes, and any geometry oneDNN declines
 * (the addon returns its status, never a partial result). Shape errors are the cpu kernel's own
 * (the native path only runs where TF.js's shape computation succeeded and the operands match it).
 */
import * as tf from '@tensorflow/tfjs-core';
import type { NativeBackend } from './native.js';
import { nativeAddon } from './native-addon.js';

/** The addon's convolution and pooling functions (native/src/conv_addon.cc); `geometry`: {@link geometry}. */
interface ConvAddon {
  /**
   * y = conv(x, w) (+ bias, ReLU when asked); 0 or oneDNN's status. bf16: x and w converted to
   * bf16 (oneDNN's bf16 convolution, f32 accumulation and output; emulated without bf16
   * instructions), likewise the two gradients' inputs.
   */
  conv2d(
    x: Float32Array,
    w: Float32Array,
    bias: Float32Array | null,
    y: Float32Array,
    geometry: number[],
    relu: boolean,
    bf16?: boolean,
  ): number;
  /** dx from dy and w; 0 or oneDNN's status. */
  conv2dBackpropInput(
    dy: Float32Array,
    w: Float32Array,
    dx: Float32Array,
    geometry: number[],
    bf16?: boolean,
  ): number;
  /** dw from x and dy; 0 or oneDNN's status. */
  conv2dBackpropFilter(
    x: Float32Array,
    dy: Float32Array,
    dw: Float32Array,
    geometry: number[],
    bf16?: boolean,
  ): number;
  maxPool(x: Float32Array, y: Float32Array, geometry: number[]): void;
  maxPoolGrad(
    x: Float32Array,
    dy: Float32Array,
    dx: Float32Array,
    geometry: number[],
  ): void;
  avgPool(x: Float32Array, y: Float32Array, geometry: number[]): void;
  avgPoolGrad(dy: Float32Array, dx: Float32Array, geometry: number[]): void;
}

type Attrs = Record<string, unknown>;
type KernelArgs = Parameters<tf.KernelFunc>[0];
type Shape4 = [number, number, number, number];

const lib = () => nativeAddon() as unknown as ConvAddon;
const values = (backend: NativeBackend, t: tf.TensorInfo) =>
  backend.data.get(t.dataId).values as Float32Array;
const isF32 = (...ts: tf.TensorInfo[]) =>
  ts.every((t) => t.dtype === 'float32');
const nhwc = (attrs: Attrs) =>
  attrs.dataFormat === undefined || attrs.dataFormat === 'NHWC';

/** Runs the cpu backend's kernel `name` on the native backend (same storage). */
function cpuKernel(name: string, args: KernelArgs): tf.TensorInfo {
  const k = tf.getKernel(name, 'cpu');
  if (!k) throw new Error(`the cpu backend has no ${name} kernel`);
  return k.kernelFunc(args) as tf.TensorInfo;
}

/** The 17 numbers of native/src/kernels.h's ConvGeometry, from TF.js's convolution info. */
function geometry(c: tf.backend_util.Conv2DInfo): number[] {
  const p = c.padInfo;
  return [
    c.batchSize,
    c.inHeight,
    c.inWidth,
    c.inChannels,
    c.filterHeight,
    c.filterWidth,
    c.outChannels,
    c.outHeight,
    c.outWidth,
    c.strideHeight,
    c.strideWidth,
    c.dilationHeight,
    c.dilationWidth,
    p.top,
    p.left,
    p.bottom,
    p.right,
  ];
}

/** Whether the native kernels take this geometry: no empty tensor, no negative pad. */
function usable(c: tf.backend_util.Conv2DInfo): boolean {
  return geometry(c).every((v, i) => (i < 13 ? v >= 1 : v >= 0));
}

/** conv(x, filter) [+ bias, ReLU] into a new tensor, or null where oneDNN declines the geometry. */
function convForward(
  backend: NativeBackend,
  x: tf.TensorInfo,
  filter: tf.TensorInfo,
  c: tf.backend_util.Conv2DInfo,
  bias: tf.TensorInfo | null,
  relu: boolean,
): tf.TensorInfo | null {
  const y = backend.alloc(tf.util.sizeFromShape(c.outShape));
  const s = lib().conv2d(
    values(backend, x),
    values(backend, filter),
    bias ? values(backend, bias) : null,
    y,
    geometry(c),
    relu,
    backend.computesNarrow(),
  );
  return s === 0 ? backend.makeTensorInfo(c.outShape, 'float32', y) : null;
}

function convInfo(
  x: number[],
  filter: number[],
  attrs: Attrs,
  dilations: unknown,
): tf.backend_util.Conv2DInfo {
  return tf.backend_util.computeConv2DInfo(
    x as Shape4,
    filter as Shape4,
    attrs.strides as [number, number],
    dilations as [number, number],
    attrs.pad as 'same',
    attrs.dimRoundingMode as 'round' | undefined,
    false,
    'channelsLast',
  );
}

/** `Conv2D`: x [b, h, w, cin], filter [fh, fw, cin, cout] -> [b, oh, ow, cout]. */
function conv2DKernel(args: KernelArgs): tf.TensorInfo {
  const { x, filter } = args.inputs as {
    x: tf.TensorInfo;
    filter: tf.TensorInfo;
  };
  const attrs = args.attrs as Attrs;
  if (
    !isF32(x, filter) ||
    !nhwc(attrs) ||
    x.shape.length !== 4 ||
    filter.shape.length !== 4
  )
    return cpuKernel('Conv2D', args);
  const c = convInfo(x.shape, filter.shape, attrs, attrs.dilations ?? 1);
  if (!usable(c) || x.shape[3] !== filter.shape[2])
    return cpuKernel('Conv2D', args);
  return (
    convForward(args.backend as NativeBackend, x, filter, c, null, false) ??
    cpuKernel('Conv2D', args)
  );
}

/**
 * `FusedConv2D` with a bias of one value per output channel ([cout], or any shape of cout
 * elements that broadcasts along the last axis) or none, and a linear or ReLU activation: one
 * oneDNN primitive (bias and ReLU as its post-op). Other biases and activations: the cpu kernel.
 */
function fusedConv2DKernel(args: KernelArgs): tf.TensorInfo {
  const { x, filter, bias } = args.inputs as Record<
    string,
    tf.TensorInfo | undefined
  >;
  const attrs = args.attrs as Attrs;
  const activation = String(attrs.activation ?? 'linear');
  if (
    !isF32(x!, filter!) ||
    !nhwc(attrs) ||
    x!.shape.length !== 4 ||
    filter!.shape.length !== 4 ||
    (activation !== 'linear' && activation !== 'relu')
  ) {
    return cpuKernel('FusedConv2D', args);
  }
  const c = convInfo(x!.shape, filter!.shape, attrs, attrs.dilations ?? 1);
  const channelBias =
    bias === undefined ||
    (bias.dtype === 'float32' &&
      bias.shape.length <= 4 &&
      bias.shape.length > 0 &&
      bias.shape[bias.shape.length - 1] === c.outChannels &&
      tf.util.sizeFromShape(bias.shape) === c.outChannels);
  if (!channelBias || !usable(c) || x!.shape[3] !== filter!.shape[2])
    return cpuKernel('FusedConv2D', args);
  return (
    convForward(
      args.backend as NativeBackend,
      x!,
      filter!,
      c,
      bias ?? null,
      activation === 'relu',
    ) ?? cpuKernel('FusedConv2D', args)
  );
}

/** `Conv2DBackpropInput` (conv2d's gradient for x): dy [b, oh, ow, cout], filter -> dx of attrs.inputShape. */
function conv2DBackpropInputKernel(args: KernelArgs): tf.TensorInfo {
  const { dy, filter } = args.inputs as {
    dy: tf.TensorInfo;
    filter: tf.TensorInfo;
  };
  const attrs = args.attrs as Attrs;
  const inputShape = attrs.inputShape as number[];
  if (
    !isF32(dy, filter) ||
    !nhwc(attrs) ||
    inputShape.length !== 4 ||
    filter.shape.length !== 4
  )
    return cpuKernel('Conv2DBackpropInput', args);
  const c = convInfo(inputShape, filter.shape, attrs, 1);
  if (
    !usable(c) ||
    !tf.util.arraysEqual(dy.shape, c.outShape) ||
    inputShape[3] !== filter.shape[2]
  )
    return cpuKernel('Conv2DBackpropInput', args);
  const backend = args.backend as NativeBackend;
  const dx = backend.alloc(tf.util.sizeFromShape(inputShape));
  if (
    lib().conv2dBackpropInput(
      values(backend, dy),
      values(backend, filter),
      dx,
      geometry(c),
      backend.computesNarrow(),
    ) !== 0
  )
    return cpuKernel('Conv2DBackpropInput', args);
  return backend.makeTensorInfo(inputShape, 'float32', dx);
}

/** `Conv2DBackpropFilter` (conv2d's gradient for the filter): x, dy -> dw of attrs.filterShape. */
function conv2DBackpropFilterKernel(args: KernelArgs): tf.TensorInfo {
  const { x, dy } = args.inputs as { x: tf.TensorInfo; dy: tf.TensorInfo };
  const attrs = args.attrs as Attrs;
  const filterShape = attrs.filterShape as number[];
  if (
    !isF32(x, dy) ||
    !nhwc(attrs) ||
    x.shape.length !== 4 ||
    filterShape.length !== 4
  )
    return cpuKernel('Conv2DBackpropFilter', args);
  const c = convInfo(x.shape, filterShape, attrs, 1);
  if (
    !usable(c) ||
    !tf.util.arraysEqual(dy.shape, c.outShape) ||
    x.shape[3] !== filterShape[2]
  )
    return cpuKernel('Conv2DBackpropFilter', args);
  const backend = args.backend as NativeBackend;
  const dw = backend.alloc(tf.util.sizeFromShape(filterShape));
  if (
    lib().conv2dBackpropFilter(
      values(backend, x),
      values(backend, dy),
      dw,
      geometry(c),
      backend.computesNarrow(),
    ) !== 0
  )
    return cpuKernel('Conv2DBackpropFilter', args);
  return backend.makeTensorInfo(filterShape, 'float32', dw);
}

/** The pooling geometry of x's shape and the pool's attrs (dilation 1), or null where the cpu kernel must run. */
function poolInfo(
  x: tf.TensorInfo,
  attrs: Attrs,
): tf.backend_util.Conv2DInfo | null {
  if (x.shape.length !== 4) return null;
  const c = tf.backend_util.computePool2DInfo(
    x.shape as Shape4,
    attrs.filterSize as [number, number],
    attrs.strides as [number, number],
    1,
    attrs.pad as 'same',
    attrs.dimRoundingMode as 'round' | undefined,
  );
  return usable(c) ? c : null;
}

/** `MaxPool` / `AvgPool`: x [b, h, w, c] -> [b, oh, ow, c]. */
function poolKernel(name: 'MaxPool' | 'AvgPool'): tf.KernelFunc {
  return ((args: KernelArgs) => {
    const { x } = args.inputs as { x: tf.TensorInfo };
    const c = isF32(x) ? poolInfo(x, args.attrs as Attrs) : null;
    if (c === null) return cpuKernel(name, args);
    const backend = args.backend as NativeBackend;
    const y = backend.alloc(tf.util.sizeFromShape(c.outShape));
    (name === 'MaxPool' ? lib().maxPool : lib().avgPool)(
      values(backend, x),
      y,
      geometry(c),
    );
    return backend.makeTensorInfo(c.outShape, 'float32', y);
  }) as tf.KernelFunc;
}

/** `MaxPoolGrad`: dy [b, oh, ow, c] to the first maximum of each window of input x -> dx of x's shape. */
function maxPoolGradKernel(args: KernelArgs): tf.TensorInfo {
  const { dy, input } = args.inputs as {
    dy: tf.TensorInfo;
    input: tf.TensorInfo;
  };
  const c = isF32(dy, input) ? poolInfo(input, args.attrs as Attrs) : null;
  if (c === null || !tf.util.arraysEqual(dy.shape, c.outShape))
    return cpuKernel('MaxPoolGrad', args);
  const backend = args.backend as NativeBackend;
  const dx = backend.alloc(tf.util.sizeFromShape(input.shape));
  lib().maxPoolGrad(
    values(backend, input),
    values(backend, dy),
    dx,
    geometry(c),
  );
  return backend.makeTensorInfo(input.shape, 'float32', dx);
}

/** `AvgPoolGrad`: dy [b, oh, ow, c] / window size to each window's input positions -> dx of input's shape. */
function avgPoolGradKernel(args: KernelArgs): tf.TensorInfo {
  const { dy, input } = args.inputs as {
    dy: tf.TensorInfo;
    input: tf.TensorInfo;
  };
  const c = isF32(dy) ? poolInfo(input, args.attrs as Attrs) : null;
  if (c === null || !tf.util.arraysEqual(dy.shape, c.outShape))
    return cpuKernel('AvgPoolGrad', args);
  const backend = args.backend as NativeBackend;
  const dx = backend.alloc(tf.util.sizeFromShape(input.shape));
  lib().avgPoolGrad(values(backend, dy), dx, geometry(c));
  return backend.makeTensorInfo(input.shape, 'float32', dx);
}

/** The convolution and pooling kernels of the native backend, by TF.js kernel name. */
export const NATIVE_CONV_KERNELS: Record<string, tf.KernelFunc> = {
  Conv2D: conv2DKernel as tf.KernelFunc,
  FusedConv2D: fusedConv2DKernel as tf.KernelFunc,
  Conv2DBackpropInput: conv2DBackpropInputKernel as tf.KernelFunc,
  Conv2DBackpropFilter: conv2DBackpropFilterKernel as tf.KernelFunc,
  MaxPool: poolKernel('MaxPool'),
  MaxPoolGrad: maxPoolGradKernel as tf.KernelFunc,
  AvgPool: poolKernel('AvgPool'),
  AvgPoolGrad: avgPoolGradKernel as tf.KernelFunc,
};
