/**
 * Kernels that tfjs-backend-wasm 4.22 lacks but training needs:
 * - `UnsortedSegmentSum`: the gradient of `gather` (so embeddings train on wasm);
 * - `Conv2DBackpropFilter`: the filter gradient of `conv2d`.
 * And one it gets wrong:
 * - `MaxPoolGrad`: the stock C++ kernel (src/cc/kernels/MaxPoolGrad.cc) starts its running max at
 *   `std::numeric_limits<float>::min()` (the smallest *positive* float), so a window whose values
 *   are all <= 0 (all negative, or all zero after a ReLU) sends its gradient to input element 0.
 * (Conv2DBackpropInput and AvgPoolGrad exist in the stock backend and match the cpu backend.)
 */
import * as tf from '@tensorflow/tfjs-core';
import { type Attrs, release, runWasm, type WasmBackend } from './wasm-util.js';

/**
 * out[s, ...] = sum of x[i, ...] over the i with segmentIds[i] = s (TensorFlow semantics: x has
 * shape [...ids.shape, ...rest], out has shape [numSegments, ...rest], ids outside
 * [0, numSegments) are dropped). A single pass in JS over x; exact in float32 accumulation order.
 */
function unsortedSegmentSum(args: {
  inputs: tf.NamedTensorInfoMap;
  backend: unknown;
  attrs?: tf.NamedAttrMap;
}): tf.TensorInfo {
  const backend = args.backend as WasmBackend;
  const { x, segmentIds } = args.inputs as {
    x: tf.TensorInfo;
    segmentIds: tf.TensorInfo;
  };
  const numSegments = Number((args.attrs as Attrs).numSegments);
  const rest = x.shape.slice(segmentIds.shape.length);
  const inner = tf.util.sizeFromShape(rest);
  const out = backend.makeOutput([numSegments, ...rest], x.dtype);
  const o = backend.typedArrayFromHeap(out);
  o.fill(0);
  const xs = backend.typedArrayFromHeap(x);
  const ids = backend.typedArrayFromHeap(segmentIds);
  for (let i = 0; i < ids.length; i++) {
    const s = ids[i]!;
    if (s < 0 || s >= numSegments) continue;
    const src = i * inner;
    const dst = s * inner;
    for (let j = 0; j < inner; j++) o[dst + j]! += xs[src + j]!;
  }
  return out;
}

/**
 * dW[kh,kw,ci,co] = sum over n,oh,ow of xpad[n, oh*sh+kh, ow*sw+kw, ci] * dy[n,oh,ow,co] (NHWC,
 * dilation 1 as in tfjs-core's conv2d gradient). Computed as one XNNPACK convolution, the
 * standard identity used e.g. by cuDNN-less TensorFlow paths: treat input channels as the batch
 * and the batch as channels, x' = xpad^[ci,H,W,n], filter dy^[oh,ow,n,co], with the forward
 * stride as dilation; then crop to [KH,KW] and transpose back.
 */
function conv2DBackpropFilter(args: {
  inputs: tf.NamedTensorInfoMap;
  backend: unknown;
  attrs?: tf.NamedAttrMap;
}): tf.TensorInfo {
  const backend = args.backend as WasmBackend;
  const { x, dy } = args.inputs as { x: tf.TensorInfo; dy: tf.TensorInfo };
  const attrs = args.attrs as Attrs;
  const filterShape = attrs.filterShape as [number, number, number, number];
  const dataFormat = tf.backend_util.convertConv2DDataFormat(
    attrs.dataFormat as 'NHWC' | 'NCHW',
  );
  if (dataFormat !== 'channelsLast')
    throw new Error('wasm Conv2DBackpropFilter supports only NHWC');
  const info = tf.backend_util.computeConv2DInfo(
    x.shape as [number, number, number, number],
    filterShape,
    attrs.strides as [number, number],
    1,
    attrs.pad as 'same',
    attrs.dimRoundingMode as 'round' | undefined,
    false,
    dataFormat,
  );
  const [kh, kw] = [info.filterHeight, info.filterWidth];
  const { top, left } = info.padInfo;
  const needH = (info.outHeight - 1) * info.strideHeight + kh;
  const needW = (info.outWidth - 1) * info.strideWidth + kw;
  const bottom = Math.max(0, needH - top - info.inHeight);
  const right = Math.max(0, needW - left - info.inWidth);
  const xpad = runWasm(
    backend,
    'PadV2',
    { x },
    {
      paddings: [
        [0, 0],
        [top, bottom],
        [left, right],
        [0, 0],
      ],
      constantValue: 0,
    },
  );
  const xT = runWasm(backend, 'Transpose', { x: xpad }, { perm: [3, 1, 2, 0] });
  const dyT = runWasm(backend, 'Transpose', { x: dy }, { perm: [1, 2, 0, 3] });
  const conv = runWasm(
    backend,
    'Conv2D',
    { x: xT, filter: dyT },
    {
      strides: [1, 1],
      pad: 'valid',
      dilations: [info.strideHeight, info.strideWidth],
      dataFormat: 'NHWC',
    },
  );
  const crop = runWasm(
    backend,
    'Slice',
    { x: conv },
    {
      begin: [0, 0, 0, 0],
      size: [info.inChannels, kh, kw, info.outChannels],
    },
  );
  const dw = runWasm(backend, 'Transpose', { x: crop }, { perm: [1, 2, 0, 3] });
  release(backend, xpad, xT, dyT, conv, crop);
  return dw;
}

/**
 * dx of max pooling (NHWC): each dy element goes to the first maximum of its window, as in the
 * cpu backend (`maxPoolPositions`). JS loop over the heap: O(outputs x window) compares.
 */
function maxPoolGrad(args: {
  inputs: tf.NamedTensorInfoMap;
  backend: unknown;
  attrs?: tf.NamedAttrMap;
}): tf.TensorInfo {
  const backend = args.backend as WasmBackend;
  const { dy, input } = args.inputs as {
    dy: tf.TensorInfo;
    input: tf.TensorInfo;
  };
  const attrs = args.attrs as Attrs;
  const info = tf.backend_util.computePool2DInfo(
    input.shape as [number, number, number, number],
    attrs.filterSize as [number, number],
    attrs.strides as [number, number],
    1,
    attrs.pad as 'same',
    attrs.dimRoundingMode as 'round' | undefined,
  );
  const dx = backend.makeOutput(input.shape, 'float32');
  const out = backend.typedArrayFromHeap(dx);
  out.fill(0);
  const x = backend.typedArrayFromHeap(input);
  const g = backend.typedArrayFromHeap(dy);
  const {
    batchSize,
    inHeight,
    inWidth,
    inChannels: c,
    outHeight,
    outWidth,
  } = info;
  const { strideHeight, strideWidth, dilationHeight, dilationWidth } = info;
  const { effectiveFilterHeight: fh, effectiveFilterWidth: fw } = info;
  let o = 0;
  for (let b = 0; b < batchSize; b++) {
    for (let oh = 0; oh < outHeight; oh++) {
      const h0 = oh * strideHeight - info.padInfo.top;
      for (let ow = 0; ow < outWidth; ow++) {
        const w0 = ow * strideWidth - info.padInfo.left;
        for (let ch = 0; ch < c; ch++, o++) {
          let best = -Infinity;
          let at = -1;
          for (
            let h = Math.max(h0, 0);
            h < Math.min(h0 + fh, inHeight);
            h += dilationHeight
          ) {
            for (
              let w = Math.max(w0, 0);
              w < Math.min(w0 + fw, inWidth);
              w += dilationWidth
            ) {
              const i = ((b * inHeight + h) * inWidth + w) * c + ch;
              if (x[i]! > best || at < 0) {
                best = x[i]!;
                at = i;
              }
            }
          }
          if (at >= 0) out[at]! += g[o]!;
        }
      }
    }
  }
  return dx;
}

/** Register the kernels above for the wasm backend (call once per thread). */
export function registerWasmKernels(): void {
  const kernels: [string, tf.KernelFunc][] = [
    ['UnsortedSegmentSum', unsortedSegmentSum],
    ['Conv2DBackpropFilter', conv2DBackpropFilter],
    ['MaxPoolGrad', maxPoolGrad],
  ];
  for (const [kernelName, kernelFunc] of kernels) {
    if (tf.getKernel(kernelName, 'wasm') !== undefined)
      tf.unregisterKernel(kernelName, 'wasm');
    tf.registerKernel({ kernelName, backendName: 'wasm', kernelFunc });
  }
}
