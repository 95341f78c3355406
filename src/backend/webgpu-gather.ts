/**
 * The embedding's kernels on webgpu, replacing TF.js's stock ones for 'webgpu' where they apply
 * (tf.gather of an embedding table, model/transformer.ts, and its gradient):
 * - GatherV2 of float32 params along axis 0 with int32 indices (batchDims 0): one dispatch of
 *   our own (wgsl/gather.ts GATHER_WGSL);
 * - UnsortedSegmentSum of float32 rows by 1-D int32 segment ids, which tfjs-core's GatherV2
 *   gradient (gradients/GatherV2_grad.js) calls to scatter-add dy into [vocab, d]: two
 *   dispatches without atomics, deterministic, summing each row in ascending position order as
 *   the cpu backend does (TF.js's webgpu kernel transposes, fills, adds with float atomics in no
 *   fixed order and transposes back: four dispatches);
 * - Transpose with the identity permutation, which that gradient runs twice around the sum (for
 *   axis 0): the input itself (as TF.js's Identity kernel), not a copying program.
 * Every other case goes to TF.js's stock kernel. {@link registerWebGpuGather} registers them
 * (backend/index.ts, beside backend/webgpu-kernels.ts's).
 */
import { type tf, wrapStockKernel } from './tfjs.js';
import {
  bufferOf,
  constantUniforms,
  dispatch,
  type GpuBuffer,
  newOutput,
  type RawBackend,
  sizeOf,
  stateOf,
} from './webgpu-multi.js';
import {
  GATHER_THREADS,
  GATHER_WGSL,
  LINK_THREADS,
  SEGMENT_LINKS_WGSL,
  SEGMENT_SUM_WGSL,
} from './wgsl/gather.js';

/** The parts of the webgpu backend these kernels use beyond webgpu-multi.ts's. */
type GatherBackend = RawBackend & { incRef(dataId: object): void };

/** A kernel of ours: its result, or null to run TF.js's stock kernel. */
type Ours = (
  inputs: Record<string, tf.TensorInfo>,
  attrs: Record<string, unknown>,
  backend: GatherBackend,
) => tf.TensorInfo | null;

/** Uniforms of three u32 values (as each program here declares them), shared by equal calls. */
const uniforms = (b: RawBackend, values: [number, number, number]) =>
  constantUniforms(b, stateOf(b), new Uint32Array([...values, 0]).buffer);

/** Workgroups of `threads` threads for `n` threads in all. */
const groups = (n: number, threads: number) => Math.ceil(n / threads);

/**
 * GatherV2 on webgpu: x float32 [rows, ...inner], indices int32 (any shape), axis 0, batchDims
 * 0; output [...indices.shape, ...inner], row indices[p] of x at p (0 for an index outside
 * [0, rows)). Null (the stock kernel) for other dtypes, axes or batch dimensions.
 */
export const gatherRows: Ours = ({ x, indices }, attrs, b) => {
  const axis = Number(attrs.axis ?? 0);
  if (
    x!.dtype !== 'float32' ||
    indices!.dtype !== 'int32' ||
    x!.shape.length === 0 ||
    (axis < 0 ? axis + x!.shape.length : axis) !== 0 ||
    Number(attrs.batchDims ?? 0) !== 0
  )
    return null;
  const rows = x!.shape[0]!;
  const cols = sizeOf(x!) / Math.max(rows, 1);
  const n = sizeOf(indices!);
  const [out, outBuffer] = newOutput(b, [
    ...indices!.shape,
    ...x!.shape.slice(1),
  ]);
  if (n * cols > 0)
    dispatch(
      b,
      stateOf(b),
      GATHER_WGSL,
      [
        bufferOf(b, x!),
        bufferOf(b, indices!),
        outBuffer,
        uniforms(b, [rows, cols, n]),
      ],
      groups(n * cols, GATHER_THREADS),
      `lw_gather [${out.shape}]`,
    );
  return out;
};

/** An int32 scratch tensor of `n` elements for this call's commands (freed once they are submitted). */
function scratchInt(b: RawBackend, n: number): [tf.TensorInfo, GpuBuffer] {
  const info = b.makeTensorInfo([n], 'int32');
  return [info, bufferOf(b, info)];
}

/**
 * UnsortedSegmentSum on webgpu: x float32 [n, ...inner], segmentIds int32 [n], attrs
 * {numSegments}; output [numSegments, ...inner], row r the sum of the rows of x whose id is r
 * (ids outside [0, numSegments) add to nothing), summed in ascending position order. Two
 * dispatches (wgsl/gather.ts: link each segment's positions, then sum them). Null (the stock
 * kernel) for other dtypes or shapes.
 */
export const segmentSum: Ours = ({ x, segmentIds }, attrs, b) => {
  const segments = Number(attrs.numSegments);
  if (
    x!.dtype !== 'float32' ||
    segmentIds!.dtype !== 'int32' ||
    segmentIds!.shape.length !== 1 ||
    x!.shape.length === 0 ||
    segmentIds!.shape[0] !== x!.shape[0] ||
    !Number.isInteger(segments) ||
    segments < 0
  )
    return null;
  const n = x!.shape[0]!;
  const cols = sizeOf(x!) / Math.max(n, 1);
  const [out, outBuffer] = newOutput(b, [segments, ...x!.shape.slice(1)]);
  if (segments * cols === 0) return out;
  const s = stateOf(b);
  const u = uniforms(b, [segments, n, cols]);
  const [head, headBuffer] = scratchInt(b, segments);
  const [next, nextBuffer] = scratchInt(b, Math.max(n, 1));
  const ids = bufferOf(b, segmentIds!);
  dispatch(
    b,
    s,
    SEGMENT_LINKS_WGSL,
    [ids, headBuffer, nextBuffer, u],
    groups(segments, LINK_THREADS),
    `lw_segment_links [${segments}]`,
  );
  dispatch(
    b,
    s,
    SEGMENT_SUM_WGSL,
    [bufferOf(b, x!), headBuffer, nextBuffer, outBuffer, u],
    groups(segments * cols, GATHER_THREADS),
    `lw_segment_sum [${segments}, ${cols}]`,
  );
  b.disposeData(head.dataId);
  b.disposeData(next.dataId);
  return out;
};

/** Transpose by the identity permutation on webgpu: x itself (as TF.js's Identity kernel); null (the stock kernel) for any other. */
export const transposeIdentity: Ours = ({ x }, attrs, b) => {
  const perm = attrs.perm as number[];
  if (!perm.every((p, i) => p === i)) return null;
  b.incRef(x!.dataId);
  return { dataId: x!.dataId, shape: x!.shape, dtype: x!.dtype };
};

/** The embedding's kernels by kernel name (each falls back to TF.js's stock webgpu kernel). */
const GATHER_KERNELS: Record<string, Ours> = {
  GatherV2: gatherRows,
  UnsortedSegmentSum: segmentSum,
  Transpose: transposeIdentity,
};

let registered = false;

/**
 * Registers the embedding's kernels ({@link GATHER_KERNELS}) for 'webgpu' in this thread over
 * TF.js's stock ones, which they call for the cases they do not take. Once per thread, after
 * @tensorflow/tfjs-backend-webgpu has registered its kernels and before the first op runs.
 * @throws Error naming the kernel if TF.js's webgpu backend has no stock kernel of that name
 *   (the package is not loaded yet: call initBackend('webgpu')).
 */
export function registerWebGpuGather(): void {
  if (registered) return;
  for (const [kernelName, ours] of Object.entries(GATHER_KERNELS))
    wrapStockKernel(
      kernelName,
      'webgpu',
      (stock) => (args) =>
        ours(
          args.inputs as Record<string, tf.TensorInfo>,
          (args.attrs ?? {}) as Record<string, unknown>,
          args.backend as unknown as GatherBackend,
        ) ?? stock(args),
    );
  registered = true;
}
