/**
 * Data-movement kernels for the TF.js wasm backend that replace slow stock ones (measured on
 * charlm-small training, tfjs-backend-wasm 4.22, bench/substrate/profile-step.mjs):
 * - `Identity`: the stock kernel copies the data; the engine calls it for every tensor it saves
 *   for a gradient (`saveTensorsForBackwardMode` clones) and for `tf.clone`. Data on the device
 *   is immutable, so this version shares the buffer by reference count, as the cpu backend does.
 * - `Transpose`: the stock C++ kernel moves ~5 ns/element for 2-D and ~200 ns/element for the
 *   5-D head split of attention. This one is a strided copy in JS over the heap: rows copied
 *   whole when the last axis stays last, else cache-blocked 2-D tiles.
 * - `Slice` and `Unpack`: the stock kernels start with `readSync` of the whole input (a full
 *   copy out of the heap) for every slice; these read the heap in place.
 * - `Sum` over leading axes (bias and layer-norm gain gradients): the stock kernel transposes
 *   the input first with the slow transpose; this one sums columns in one pass (float64
 *   accumulators), other reductions go to the stock kernel after a fast transpose.
 * All copies go through Int32Array views, so they are bit-exact for float32 and int32.
 */
import * as tf from '@tensorflow/tfjs-core';
import { wrapStockKernel } from './tfjs.js';
import { type Attrs, release, runWasm, type WasmBackend } from './wasm-util.js';

type KernelArgs = {
  inputs: tf.NamedTensorInfoMap;
  backend: unknown;
  attrs?: tf.NamedAttrMap;
};

/** Row-major strides of a shape. */
function stridesOf(shape: readonly number[]): number[] {
  const s = new Array<number>(shape.length);
  let acc = 1;
  for (let i = shape.length - 1; i >= 0; i--) {
    s[i] = acc;
    acc *= shape[i]!;
  }
  return s;
}

const TILE = 32;

/**
 * `shape0` with unit dimensions dropped and dimensions contiguous in the source (strides
 * `strides0`) merged: the same copy over fewer, longer axes; null when a dimension is 0 (nothing
 * to copy).
 */
function mergeDims(
  shape0: readonly number[],
  strides0: readonly number[],
): { shape: number[]; st: number[] } | null {
  const shape: number[] = [];
  const st: number[] = [];
  for (let i = 0; i < shape0.length; i++) {
    const n = shape0[i]!;
    if (n === 1) continue;
    if (n === 0) return null;
    const s = strides0[i]!;
    const r = shape.length;
    if (r > 0 && st[r - 1] === s * n) {
      shape[r - 1] = shape[r - 1]! * n;
      st[r - 1] = s;
    } else {
      shape.push(n);
      st.push(s);
    }
  }
  return { shape, st };
}

/**
 * The copy of {@link stridedCopy} (merged `shape`, source strides `st`, rank >= 1) when the
 * last axis has source stride 1: whole rows of `shape[r-1]` contiguous elements.
 */
function copyRows(
  heap: Int32Array,
  srcBase: number,
  dst: Int32Array,
  dstBase: number,
  shape: readonly number[],
  st: readonly number[],
): void {
  const r = shape.length;
  const last = shape[r - 1]!;
  const total = shape.reduce((a, b) => a * b, 1);
  const rows = total / last;
  const idx = new Array<number>(r - 1).fill(0);
  let src = srcBase;
  let d0 = dstBase;
  for (let row = 0; row < rows; row++) {
    if (last >= 256) dst.set(heap.subarray(src, src + last), d0);
    else for (let j = 0; j < last; j++) dst[d0 + j] = heap[src + j]!;
    d0 += last;
    // advance the odometer over dims r-2..0
    for (let d = r - 2; d >= 0; d--) {
      src += st[d]!;
      if (++idx[d]! < shape[d]!) break;
      src -= st[d]! * shape[d]!;
      idx[d] = 0;
    }
  }
}

/**
 * The copy of {@link stridedCopy} (merged `shape`, source strides `st`) when no axis has source
 * stride 1 (e.g. a strided slice): element by element.
 */
function copyElements(
  heap: Int32Array,
  srcBase: number,
  dst: Int32Array,
  dstBase: number,
  shape: readonly number[],
  st: readonly number[],
): void {
  const r = shape.length;
  const total = shape.reduce((a, b) => a * b, 1);
  const idx = new Array<number>(r).fill(0);
  let src = srcBase;
  for (let i = 0; i < total; i++) {
    dst[dstBase + i] = heap[src]!;
    for (let d = r - 1; d >= 0; d--) {
      src += st[d]!;
      if (++idx[d]! < shape[d]!) break;
      src -= st[d]! * shape[d]!;
      idx[d] = 0;
    }
  }
}

/**
 * The copy of {@link stridedCopy} (merged `shape`, source strides `st`) when output axis `p`
 * (not the last) has source stride 1: cache-blocked TILE x TILE tiles of axes p and r-1, for
 * each index of the other (outer) axes.
 */
function copyTiles(
  heap: Int32Array,
  srcBase: number,
  dst: Int32Array,
  dstBase: number,
  shape: readonly number[],
  st: readonly number[],
  p: number,
): void {
  const r = shape.length;
  const last = shape[r - 1]!;
  const dstStrides = stridesOf(shape);
  const np = shape[p]!;
  const dp = dstStrides[p]!;
  const s1 = st[r - 1]!;
  // Outer dims: all but p and r-1.
  const outer: number[] = [];
  for (let d = 0; d < r - 1; d++) if (d !== p) outer.push(d);
  const outerCount = outer.reduce((a, d) => a * shape[d]!, 1);
  const idx = new Array<number>(outer.length).fill(0);
  let sb = srcBase;
  let db = dstBase;
  for (let o = 0; o < outerCount; o++) {
    for (let j0 = 0; j0 < last; j0 += TILE) {
      const j1 = Math.min(j0 + TILE, last);
      for (let i0 = 0; i0 < np; i0 += TILE) {
        const i1 = Math.min(i0 + TILE, np);
        copyTile(heap, sb, s1, dst, db, dp, i0, i1, j0, j1);
      }
    }
    for (let k = outer.length - 1; k >= 0; k--) {
      const d = outer[k]!;
      sb += st[d]!;
      db += dstStrides[d]!;
      if (++idx[k]! < shape[d]!) break;
      sb -= st[d]! * shape[d]!;
      db -= dstStrides[d]! * shape[d]!;
      idx[k] = 0;
    }
  }
}

/**
 * One tile of {@link copyTiles}: dst[db + i * dp + j] = heap[sb + j * s1 + i] for i in [i0, i1),
 * j in [j0, j1).
 */
function copyTile(
  heap: Int32Array,
  sb: number,
  s1: number,
  dst: Int32Array,
  db: number,
  dp: number,
  i0: number,
  i1: number,
  j0: number,
  j1: number,
): void {
  let j = j0;
  // four output columns at a time: four contiguous source runs, short dst bursts
  for (; j + 4 <= j1; j += 4) {
    const r0 = sb + j * s1;
    const r1 = r0 + s1;
    const r2 = r1 + s1;
    const r3 = r2 + s1;
    for (let i = i0; i < i1; i++) {
      const d = db + i * dp + j;
      dst[d] = heap[r0 + i]!;
      dst[d + 1] = heap[r1 + i]!;
      dst[d + 2] = heap[r2 + i]!;
      dst[d + 3] = heap[r3 + i]!;
    }
  }
  for (; j < j1; j++) {
    const sRow = sb + j * s1;
    const dCol = db + j;
    for (let i = i0; i < i1; i++) dst[dCol + i * dp] = heap[sRow + i]!;
  }
}

/**
 * dst[dstBase + contiguous index over `shape`] = src[srcBase + sum_i idx_i * srcStrides[i]]:
 * the copy behind transpose and slice (`src0`, `dst`: views of the two tensors' data).
 */
export function stridedCopy(
  src0: Int32Array,
  srcBase: number,
  dst: Int32Array,
  dstBase: number,
  shape0: readonly number[],
  strides0: readonly number[],
): void {
  const merged = mergeDims(shape0, strides0);
  if (merged === null) return;
  const { shape, st } = merged;
  const r = shape.length;
  if (r === 0) {
    dst[dstBase] = src0[srcBase]!;
    return;
  }
  if (st[r - 1] === 1) {
    copyRows(src0, srcBase, dst, dstBase, shape, st);
    return;
  }
  // Find the output dimension that is contiguous in the source, to tile with the last one.
  let p = -1;
  for (let d = r - 2; d >= 0; d--)
    if (st[d] === 1) {
      p = d;
      break;
    }
  if (p < 0) copyElements(src0, srcBase, dst, dstBase, shape, st);
  else copyTiles(src0, srcBase, dst, dstBase, shape, st, p);
}

const fourBytes = (dtype: string): boolean =>
  dtype === 'float32' || dtype === 'int32';

/** An Int32Array view of a tensor's data (bit-exact copies; indices stay small). */
function view(backend: WasmBackend, t: tf.TensorInfo): Int32Array {
  const buffer = (backend.wasm as unknown as { HEAPU8: Uint8Array }).HEAPU8
    .buffer;
  return new Int32Array(
    buffer,
    backend.getMemoryOffset(t.dataId),
    tf.util.sizeFromShape(t.shape),
  );
}

/** Zero-copy Identity: share the buffer (reference counted), like the cpu backend. */
function identity(args: KernelArgs): tf.TensorInfo {
  const backend = args.backend as WasmBackend;
  const { x } = args.inputs as { x: tf.TensorInfo };
  backend.incRef(x.dataId);
  return { dataId: x.dataId, shape: x.shape, dtype: x.dtype };
}

function transpose(orig: tf.KernelFunc): tf.KernelFunc {
  return (args) => {
    const backend = args.backend as WasmBackend;
    const { x } = args.inputs as { x: tf.TensorInfo };
    if (!fourBytes(x.dtype)) return orig(args);
    const perm = (args.attrs as Attrs).perm as number[];
    const outShape = perm.map((p) => x.shape[p]!);
    const out = backend.makeOutput(outShape, x.dtype);
    if (tf.util.sizeFromShape(outShape) === 0) return out;
    const xs = stridesOf(x.shape);
    stridedCopy(
      view(backend, x),
      0,
      view(backend, out),
      0,
      outShape,
      perm.map((p) => xs[p]!),
    );
    return out;
  };
}

function slice(orig: tf.KernelFunc): tf.KernelFunc {
  return (args) => {
    const backend = args.backend as WasmBackend;
    const { x } = args.inputs as { x: tf.TensorInfo };
    if (!fourBytes(x.dtype)) return orig(args);
    const attrs = args.attrs as Attrs;
    const [begin, size] = tf.slice_util.parseSliceParams(
      x as tf.Tensor,
      attrs.begin as number[],
      attrs.size as number[],
    );
    const out = backend.makeOutput(size, x.dtype);
    if (tf.util.sizeFromShape(size) === 0) return out;
    const xs = stridesOf(x.shape);
    let base = 0;
    for (let i = 0; i < begin.length; i++) base += begin[i]! * xs[i]!;
    stridedCopy(view(backend, x), base, view(backend, out), 0, size, xs);
    return out;
  };
}

function unpack(orig: tf.KernelFunc): tf.KernelFunc {
  return (args) => {
    const backend = args.backend as WasmBackend;
    const { value } = args.inputs as { value: tf.TensorInfo };
    if (!fourBytes(value.dtype)) return orig(args);
    const rank = value.shape.length;
    let axis = Number((args.attrs as Attrs).axis);
    if (axis < 0) axis += rank;
    const outShape = value.shape.filter((_, i) => i !== axis);
    const xs = stridesOf(value.shape);
    const outs: tf.TensorInfo[] = [];
    for (let i = 0; i < value.shape[axis]!; i++) {
      const out = backend.makeOutput(outShape, value.dtype);
      outs.push(out);
      if (tf.util.sizeFromShape(outShape) === 0) continue;
      stridedCopy(
        view(backend, value),
        i * xs[axis]!,
        view(backend, out),
        0,
        outShape,
        xs.filter((_, d) => d !== axis),
      );
    }
    return outs as unknown as tf.TensorInfo;
  };
}

/** Sum: column sums for leading-axis reductions; else a fast transpose and the stock kernel. */
function sum(orig: tf.KernelFunc): tf.KernelFunc {
  return (args) => {
    const backend = args.backend as WasmBackend;
    const { x } = args.inputs as { x: tf.TensorInfo };
    if (x.dtype !== 'float32') return orig(args);
    const attrs = args.attrs as Attrs;
    const rank = x.shape.length;
    const axes = tf.util
      .parseAxisParam(attrs.axis as number | number[], x.shape)
      .sort((a, b) => a - b);
    const keepDims = attrs.keepDims === true;
    const reduced = (d: number) => axes.includes(d);
    // reduced axes after ignoring unit dims: innermost (stock is fast) or leading (column sum)?
    const big = [...Array(rank).keys()].filter((d) => x.shape[d] !== 1);
    const flags = big.map(reduced);
    const firstKept = flags.indexOf(false);
    const innermost = flags.every(
      (f, i) => !f || flags.slice(i).every(Boolean),
    );
    if (innermost || tf.util.sizeFromShape(x.shape) === 0) return orig(args);
    const outShape = keepDims
      ? x.shape.map((n, d) => (reduced(d) ? 1 : n))
      : x.shape.filter((_, d) => !reduced(d));
    const leading = firstKept > 0 && flags.slice(firstKept).every((f) => !f);
    if (leading) {
      const rows = big.slice(0, firstKept).reduce((a, d) => a * x.shape[d]!, 1);
      const cols = tf.util.sizeFromShape(x.shape) / rows;
      const out = backend.makeOutput(outShape, 'float32');
      const xv = backend.typedArrayFromHeap(x) as Float32Array;
      const acc = new Float64Array(cols);
      for (let i = 0, o = 0; i < rows; i++, o += cols)
        for (let j = 0; j < cols; j++) acc[j]! += xv[o + j]!;
      (backend.typedArrayFromHeap(out) as Float32Array).set(acc);
      return out;
    }
    const perm = [
      ...[...Array(rank).keys()].filter((d) => !reduced(d)),
      ...axes,
    ];
    const t = runWasm(backend, 'Transpose', { x }, { perm });
    const inner = [...Array(axes.length).keys()].map(
      (i) => rank - axes.length + i,
    );
    const s = runWasm(
      backend,
      'Sum',
      { x: t },
      { axis: inner, keepDims: false },
    );
    release(backend, t);
    s.shape = outShape;
    return s;
  };
}

/** Register the kernels above for the wasm backend in place of the stock ones (once per thread). */
export function registerWasmLayoutKernels(): void {
  const wrapped: [string, (orig: tf.KernelFunc) => tf.KernelFunc][] = [
    ['Identity', () => identity as tf.KernelFunc],
    ['Transpose', transpose],
    ['Slice', slice],
    ['Unpack', unpack],
    ['Sum', sum],
  ];
  for (const [name, make] of wrapped) {
    wrapStockKernel(name, 'wasm', make);
  }
}
