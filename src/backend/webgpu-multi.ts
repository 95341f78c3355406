/**
 * layerwise's webgpu kernels that run on pipelines of their own rather than as TF.js programs
 * (which write one output each and bind one buffer per tensor): layer norm's forward with its
 * three outputs in one dispatch and its parameter gradients (dg, db) in one; and the
 * multi-tensor kernels, AdamW over all of a stage's
 * parameters and the per-tensor sums of squares of all of its gradients, each one dispatch (per
 * chunk of at most maxStorageBufferBindingSize bytes a buffer) instead of three (AdamW) or two
 * (the norm's square and sum) TF.js programs a tensor, as PyTorch's `foreach`/fused optimizers
 * and apex's multi_tensor_apply do on CUDA.
 *
 * TF.js keeps every tensor in its own GPUBuffer and a shader binds at most
 * maxStorageBuffersPerShaderStage buffers (8 by default), and always from offset 0 (so a tensor
 * cannot be a view into a larger buffer). So the parameters and gradients are copied back to
 * back into two scratch buffers of this backend (copyBufferToBuffer: copies, not dispatches),
 * one WGSL pipeline of its own (backend/wgsl/multi.ts) runs on them, and the updated parameters
 * are copied back out. AdamW's moments need no copies: the optimizer keeps each of them, for all
 * of a stage's parameters, in one flat tensor that the kernel binds directly.
 *
 * AdamW updates in place: the outputs are the inputs' own data (as Reshape's output is), so the
 * optimizer's variables keep their GPU buffers from step to step. That saves the device a new
 * copy of every parameter and both moments at the update (3 x 4 bytes a parameter at the step's
 * end) and makes a step bind exactly the buffers of the step before (a step's commands repeat
 * with period 1, not 2: what capturing a step needs). TF.js's kernels are otherwise functional,
 * so an input is updated in place only where nothing else holds its values (TF.js's refCount of
 * its data is 1: the variable alone); where a kept tensor shares them (a clone, a reshape), that
 * input is written to a new output instead and the kept tensor sees the old values, as before.
 * Copies are skipped
 * where a scratch buffer already holds the tensor at its place ({@link MultiState.held}): the
 * parameters AdamW copied out last step (still in the P scratch) and the gradients the sums of
 * squares just copied (both lay the tensors out in kernel-names.ts's multiOrder). So a steady step of
 * one stage copies each gradient once (into the sums' scratch) and each parameter once (out).
 * The commands go on TF.js's command encoder, in order with TF.js's own, and are submitted at
 * once (the uniforms and the offsets table are one buffer each, rewritten by every call: a
 * second call must not overwrite them before the first's commands are submitted). Dispatches
 * and copies are counted by backend/gpu-queue.ts like TF.js's programs.
 */
import { consecutiveRuns } from '../util/runs.js';
import { gpuQueue } from './gpu-queue.js';
import { adamwMultiCount, multiOrder } from './kernel-names.js';
import type { tf } from './tfjs.js';
import { keptUniformBuffer } from './webgpu-host.js';
import {
  ADAMW_MULTI_WGSL,
  LAYER_NORM_FUSED_F16_WGSL,
  LAYER_NORM_FUSED_WGSL,
  LAYER_NORM_PARAM_GRADS_WGSL,
  MAX_WORKGROUPS_PER_DIMENSION,
  MULTI_THREADS,
  SUM_SQUARES_MULTI_WGSL,
} from './wgsl/multi.js';

/** WebGPU's GPUBufferUsage flags used here (the constants are globals only where Dawn installed them). */
const USAGE = {
  COPY_SRC: 0x04,
  COPY_DST: 0x08,
  UNIFORM: 0x40,
  STORAGE: 0x80,
} as const;

/** The slice of WebGPU's GPUBuffer used here. */
export interface GpuBuffer {
  size: number;
  destroy(): void;
}
/** The slice of WebGPU's GPUComputePipeline used here. */
interface GpuPipeline {
  getBindGroupLayout(i: number): unknown;
}
/** The slice of WebGPU's GPUComputePassEncoder used here. */
interface GpuPass {
  setPipeline(p: GpuPipeline): void;
  setBindGroup(i: number, g: unknown): void;
  dispatchWorkgroups(x: number, y?: number, z?: number): void;
  end(): void;
}
/** A whole buffer, or a range of one (byte offset a multiple of minStorageBufferOffsetAlignment). */
export type GpuBinding =
  | GpuBuffer
  | { buffer: GpuBuffer; offset: number; size: number };
/** The slice of WebGPU's GPUDevice used here. */
interface GpuDevice {
  limits: {
    maxStorageBufferBindingSize: number;
    minStorageBufferOffsetAlignment: number;
  };
  queue: {
    writeBuffer(b: GpuBuffer, offset: number, data: ArrayBufferView): void;
  };
  createBuffer(d: { size: number; usage: number }): GpuBuffer;
  createShaderModule(d: { code: string }): unknown;
  createComputePipeline(d: {
    layout: 'auto';
    compute: { module: unknown; entryPoint: string };
  }): GpuPipeline;
  createBindGroup(d: {
    layout: unknown;
    entries: Array<{
      binding: number;
      resource: { buffer: GpuBuffer; offset?: number; size?: number };
    }>;
  }): unknown;
}
/** The parts of tfjs-backend-webgpu's WebGPUBackend (4.22) these kernels use. */
export interface RawBackend {
  device: GpuDevice;
  commandEncoder: {
    copyBufferToBuffer(
      src: GpuBuffer,
      srcOffset: number,
      dst: GpuBuffer,
      dstOffset: number,
      size: number,
    ): void;
    beginComputePass(d?: object): GpuPass;
  } | null;
  /** TF.js's open compute pass on commandEncoder (null between passes). */
  computePassEncoder: GpuPass | null;
  commandQueueOwnedIds: WeakSet<object>;
  tensorMap: {
    get(dataId: object): { resource?: unknown; values?: unknown };
  };
  ensureCommandEncoderReady(): void;
  endComputePassEncoder(): void;
  submitQueue(): void;
  uploadToGPU(dataId: object): void;
  makeTensorInfo(shape: number[], dtype: tf.DataType): tf.TensorInfo;
  disposeData(dataId: object): void;
  /** How many tensors hold `dataId`'s values (the variable alone: 1). */
  refCount(dataId: object): number;
  incRef(dataId: object): void;
}

/** Which scratch buffer: the parameters (AdamW's P) or the gradients (AdamW's G, the sums' X). */
const P = 0;
const G = 1;

/** A backend's scratch buffers, uniform and table buffers, and compiled pipelines. */
export interface MultiState {
  /** Two scratch buffers of `capacity` float32 elements each ({@link P}, {@link G}). */
  scratch: GpuBuffer[];
  capacity: number;
  /**
   * Per scratch buffer, the tensors (by dataId) whose values it holds and at which element
   * offset: written where a copy or AdamW's update puts them, so a later call finding a tensor
   * at the offset it wants skips the copy (a dataId is never reused, and a tensor's values
   * change only by AdamW's update in place, which leaves them in the P scratch too).
   */
  held: Array<Map<object, number>>;
  uniforms: GpuBuffer;
  /** The sums' table, grown as needed. */
  table: GpuBuffer;
  pipelines: Map<string, GpuPipeline>;
  /** Uniform buffers whose contents never change, by contents (see {@link constantUniforms}). */
  constants: Map<string, GpuBuffer>;
}

const states = new WeakMap<object, MultiState>();

const BYTES = 4;

export function stateOf(b: RawBackend): MultiState {
  let s = states.get(b);
  if (!s) {
    const d = b.device;
    s = {
      scratch: [],
      capacity: 0,
      held: [new Map(), new Map()],
      uniforms: d.createBuffer({
        size: 64,
        usage: USAGE.UNIFORM | USAGE.COPY_DST,
      }),
      table: d.createBuffer({
        size: 256,
        usage: USAGE.STORAGE | USAGE.COPY_DST,
      }),
      pipelines: new Map(),
      constants: new Map(),
    };
    states.set(b, s);
  }
  return s;
}

/**
 * A uniform buffer holding `words` (u32 or f32 bit patterns, as `view` writes them), made and
 * written once and reused by every call with the same values (webgpu-host.ts keptUniformBuffer,
 * kept in this backend's state; size rounded up to 16 bytes).
 */
export function constantUniforms(
  b: RawBackend,
  s: MultiState,
  words: ArrayBuffer,
): GpuBuffer {
  const size = Math.max(16, Math.ceil(words.byteLength / 16) * 16);
  return keptUniformBuffer(b.device, s.constants, words, size);
}

/** The alignment of a binding's offset, in float32 elements. */
function alignment(b: RawBackend): number {
  return Math.max(1, b.device.limits.minStorageBufferOffsetAlignment / BYTES);
}

/**
 * The most float32 elements of one chunk of a multi-tensor call: one binding's limit, less one
 * alignment (AdamW binds its chunk of the flat moments from the aligned offset below its start).
 */
function maxElements(b: RawBackend): number {
  return (
    Math.floor(b.device.limits.maxStorageBufferBindingSize / BYTES) -
    alignment(b)
  );
}

/** Makes every scratch buffer hold at least `elements` float32 values (old ones destroyed once submitted). */
function ensureScratch(b: RawBackend, s: MultiState, elements: number): void {
  if (s.capacity >= elements) return;
  const old = s.scratch;
  const capacity = Math.min(
    maxElements(b),
    Math.max(elements, Math.ceil(s.capacity * 1.5)),
  );
  s.scratch = [P, G].map(() =>
    b.device.createBuffer({
      size: capacity * BYTES,
      usage: USAGE.STORAGE | USAGE.COPY_SRC | USAGE.COPY_DST,
    }),
  );
  s.capacity = capacity;
  for (const h of s.held) h.clear();
  // WebGPU frees a destroyed buffer only after the submitted work that uses it
  if (old.length) {
    submit(b);
    for (const x of old) x.destroy();
  }
}

function pipelineOf(b: RawBackend, s: MultiState, code: string): GpuPipeline {
  let p = s.pipelines.get(code);
  if (!p) {
    const module = b.device.createShaderModule({ code });
    p = b.device.createComputePipeline({
      layout: 'auto',
      compute: { module, entryPoint: 'main' },
    });
    s.pipelines.set(code, p);
  }
  return p;
}

/** The GPUBuffer holding a tensor's values, uploading them first if they are still on the host. */
export function bufferOf(b: RawBackend, t: tf.TensorInfo): GpuBuffer {
  b.uploadToGPU(t.dataId);
  b.commandQueueOwnedIds.add(t.dataId); // freed only after the queued commands are submitted
  return b.tensorMap.get(t.dataId).resource as GpuBuffer;
}

/** A new output tensor of `shape` and `dtype` (float32 unless given) with its (uninitialised) GPUBuffer. */
export function newOutput(
  b: RawBackend,
  shape: number[],
  dtype: tf.DataType = 'float32',
): [tf.TensorInfo, GpuBuffer] {
  const info = b.makeTensorInfo(shape, dtype);
  return [info, bufferOf(b, info)];
}

/** TF.js's command encoder, outside any compute pass (to record copies or a pass of ours). */
function encoder(b: RawBackend): NonNullable<RawBackend['commandEncoder']> {
  b.ensureCommandEncoderReady();
  b.endComputePassEncoder();
  return b.commandEncoder!;
}

/** Submits what is recorded on TF.js's encoder (through the backend, so gpu-queue.ts counts it). */
function submit(b: RawBackend): void {
  if (!b.commandEncoder) return;
  b.endComputePassEncoder();
  b.submitQueue();
}

/**
 * TF.js's open compute pass, opened as TF.js opens it (backend_webgpu.ts recordAndSubmit) where
 * none is: a dispatch of ours recorded in it spares a pass of its own (a begin and an end, and a
 * new pass for TF.js's next program: some 13 us of host time a pass here). Within a compute pass
 * each dispatch is its own usage scope (WebGPU), so its writes are seen by the next dispatch as
 * between passes; TF.js ends the pass before any copy (as {@link encoder} does).
 */
function computePass(b: RawBackend): GpuPass {
  b.ensureCommandEncoderReady();
  b.computePassEncoder ??= b.commandEncoder!.beginComputePass({});
  return b.computePassEncoder;
}

/**
 * Records one dispatch of `code` with `buffers` bound in order as group 0, over `workgroups`
 * workgroups, in TF.js's compute pass; `label` names it in kernel times (gpu-queue.ts
 * KERNEL_TIMES_ENV: the kernel and its output shape).
 */
export function dispatch(
  b: RawBackend,
  s: MultiState,
  code: string,
  buffers: GpuBinding[],
  workgroups: number,
  label: string,
): void {
  const q = gpuQueue();
  const commands = () => record(b, s, code, buffers, workgroups);
  if (q) q.kernel(label, commands);
  else commands();
  q?.countDispatches(1);
}

/** {@link dispatch}'s commands. */
function record(
  b: RawBackend,
  s: MultiState,
  code: string,
  buffers: GpuBinding[],
  workgroups: number,
): void {
  const pipeline = pipelineOf(b, s, code);
  const group = b.device.createBindGroup({
    layout: pipeline.getBindGroupLayout(0),
    entries: buffers.map((x, binding) => ({
      binding,
      resource: 'buffer' in x ? x : { buffer: x },
    })),
  });
  const pass = computePass(b);
  pass.setPipeline(pipeline);
  pass.setBindGroup(0, group);
  const x = Math.min(workgroups, MAX_WORKGROUPS_PER_DIMENSION);
  pass.dispatchWorkgroups(x, Math.ceil(workgroups / x), 1);
}

/** Elements of `t`. */
export const sizeOf = (t: tf.TensorInfo): number =>
  t.shape.reduce((a, c) => a * c, 1);

/**
 * Cuts tensors of `sizes` elements (in order) into runs of consecutive tensors of at most `max`
 * elements together. Returns [first, end) index pairs.
 * @throws Error naming the tensor when one alone is over `max` (TF.js could not bind it either).
 */
export function chunksOf(
  sizes: readonly number[],
  max: number,
): Array<[number, number]> {
  sizes.forEach((n, i) => {
    if (n > max)
      throw new Error(
        `tensor ${i} has ${n} elements, over one storage binding's ${max}; raise maxStorageBufferBindingSize or split the parameter`,
      );
  });
  return consecutiveRuns(sizes, max);
}

/**
 * Records copies of `tensors` (of `sizes` elements) into scratch buffer `k` back to back from
 * element 0, skipping each that the buffer already holds at its place, and records what the
 * buffer then holds.
 */
function stage(
  b: RawBackend,
  s: MultiState,
  k: number,
  tensors: readonly tf.TensorInfo[],
  sizes: readonly number[],
): void {
  const held = s.held[k]!;
  const now = new Map<object, number>();
  const enc = encoder(b);
  let offset = 0;
  tensors.forEach((t, i) => {
    const n = sizes[i]!;
    if (n > 0 && held.get(t.dataId) !== offset)
      enc.copyBufferToBuffer(
        bufferOf(b, t),
        0,
        s.scratch[k]!,
        offset * BYTES,
        n * BYTES,
      );
    now.set(t.dataId, offset);
    offset += n;
  });
  s.held[k] = now;
}

/**
 * LayerwiseSumSquares on webgpu: inputs are n float32 tensors (any shapes); output [n] float32,
 * sum(x^2) of each. The tensors are copied into the G scratch in kernel-names.ts's multiOrder
 * (where AdamW finds them). One dispatch per chunk (one in all below maxStorageBufferBindingSize bytes).
 */
export function sumSquaresMulti(
  inputs: readonly tf.TensorInfo[],
  backend: unknown,
): tf.TensorInfo {
  const b = backend as RawBackend;
  const s = stateOf(b);
  const order = multiOrder(inputs.map((t) => t.shape));
  const xs = order.map((i) => inputs[i]!);
  const sizes = xs.map(sizeOf);
  const [out, outBuffer] = newOutput(b, [inputs.length]);
  for (const [first, end] of chunksOf(sizes, maxElements(b))) {
    const count = end - first;
    let total = 0;
    for (let i = first; i < end; i++) total += sizes[i]!;
    ensureScratch(b, s, total);
    stage(b, s, G, xs.slice(first, end), sizes.slice(first, end));
    const table = new Uint32Array(2 * count + 2);
    table[0] = count;
    for (let j = 0, offset = 0; j <= count; j++) {
      table[j + 1] = offset;
      if (j < count) {
        offset += sizes[first + j]!;
        table[count + 2 + j] = order[first + j]!;
      }
    }
    if (s.table.size < table.byteLength) {
      s.table.destroy();
      s.table = b.device.createBuffer({
        size: table.byteLength,
        usage: USAGE.STORAGE | USAGE.COPY_DST,
      });
    }
    b.device.queue.writeBuffer(s.table, 0, table);
    dispatch(
      b,
      s,
      SUM_SQUARES_MULTI_WGSL,
      [s.scratch[G]!, s.table, outBuffer],
      count,
      `lw_sum_squares_multi [${count}]`,
    );
    submit(b); // the table is rewritten by the next chunk or call
  }
  return out;
}

/** AdamW's hyper-parameters for one call of {@link adamwMulti} (kernel-names.ts ADAMW_MULTI_KERNEL). */
export interface AdamWMultiAttrs {
  lr: number;
  beta1: number;
  beta2: number;
  epsilon: number;
  /** Decoupled weight decay of the first `decayed` parameters (the rest have none). */
  weightDecay: number;
  decayed: number;
  /** 1-based step count (bias correction). */
  step: number;
  /** Gradient scale (clipping, loss unscaling). */
  scale: number;
}

/**
 * The uniforms of ADAMW_MULTI_WGSL for a chunk of `n` elements, the first `decayEnd` decayed,
 * whose moments start at element `base` of their bound range.
 */
function adamwUniforms(
  a: AdamWMultiAttrs,
  n: number,
  decayEnd: number,
  base: number,
) {
  const u = new ArrayBuffer(64);
  new Uint32Array(u, 0, 3).set([n, decayEnd, base]);
  new Float32Array(u, 12, 10).set([
    a.lr,
    a.beta1,
    a.beta2,
    1 - a.beta1,
    1 - a.beta2,
    a.epsilon,
    a.weightDecay,
    a.scale,
    1 - a.beta1 ** a.step,
    1 - a.beta2 ** a.step,
  ]);
  return new Uint8Array(u);
}

/**
 * LayerwiseAdamWMulti on webgpu: inputs are 2n + 2 float32 tensors [p_0..p_n-1, g_0..g_n-1, m,
 * v]: n parameters, their gradients (each of its parameter's shape), and the first and second
 * moments of all n as two flat tensors, parameter after parameter in the inputs' order; outputs
 * n + 2 tensors [p'_0.., m', v'], the update of optim/optimizer.ts's AdamW (the first `decayed`
 * parameters decayed). Each output is its input's own data, updated in place, where nothing but
 * the input holds that data, else a new tensor (see the module's comment). One dispatch per chunk
 * of parameters whose elements fit one storage binding; parameters and gradients go through the
 * scratch buffers (copies skipped where they are there already), the moments are bound directly.
 * @throws Error where the inputs are not laid out so (kernel-names.ts adamwMultiCount).
 */
export function adamwMulti(
  inputs: readonly tf.TensorInfo[],
  attrs: AdamWMultiAttrs,
  backend: unknown,
): tf.TensorInfo[] {
  const b = backend as RawBackend;
  const s = stateOf(b);
  const n = adamwMultiCount(inputs);
  const sizes = inputs.slice(0, n).map(sizeOf);
  const [[mOut, mBuffer], [vOut, vBuffer]] = [
    inputs[2 * n]!,
    inputs[2 * n + 1]!,
  ].map((t) => {
    const [out, buffer] = updatedInPlace(b, t);
    if (out.dataId !== t.dataId && sizeOf(t) > 0)
      encoder(b).copyBufferToBuffer(
        bufferOf(b, t),
        0,
        buffer,
        0,
        sizeOf(t) * BYTES,
      );
    return [out, buffer] as const;
  }) as [[tf.TensorInfo, GpuBuffer], [tf.TensorInfo, GpuBuffer]];
  const outs: tf.TensorInfo[] = new Array(n);
  let start = 0; // the chunk's first element in the flat moments
  for (const [first, end] of chunksOf(sizes, maxElements(b))) {
    let total = 0;
    let decayEnd = 0;
    for (let i = first; i < end; i++) {
      total += sizes[i]!;
      if (i < attrs.decayed) decayEnd = total;
    }
    ensureScratch(b, s, total);
    stage(b, s, P, inputs.slice(first, end), sizes.slice(first, end));
    stage(b, s, G, inputs.slice(n + first, n + end), sizes.slice(first, end));
    if (total > 0) {
      const from = start - (start % alignment(b));
      const range = (buffer: GpuBuffer) => ({
        buffer,
        offset: from * BYTES,
        size: (start - from + total) * BYTES,
      });
      b.device.queue.writeBuffer(
        s.uniforms,
        0,
        adamwUniforms(attrs, total, decayEnd, start - from),
      );
      dispatch(
        b,
        s,
        ADAMW_MULTI_WGSL,
        [
          s.scratch[P]!,
          s.scratch[G]!,
          range(mBuffer),
          range(vBuffer),
          s.uniforms,
        ],
        Math.ceil(total / MULTI_THREADS),
        `lw_adamw_multi [${total}]`,
      );
    }
    copyOut(b, s, inputs.slice(first, end), sizes.slice(first, end)).forEach(
      (t, j) => {
        outs[first + j] = t;
      },
    );
    submit(b); // the uniforms are rewritten by the next chunk or call
    start += total;
  }
  return [...outs, mOut, vOut];
}

/**
 * The output that holds `t`'s update, with its buffer: `t`'s own data (one more reference to it)
 * where nothing but `t` holds that data (TF.js's refCount 1), else a new float32 tensor of `t`'s
 * shape (the holders keep the old values).
 */
function updatedInPlace(
  b: RawBackend,
  t: tf.TensorInfo,
): [tf.TensorInfo, GpuBuffer] {
  if (b.refCount(t.dataId) !== 1) return newOutput(b, t.shape);
  const buffer = bufferOf(b, t);
  // a read caches the values on the host (backend_webgpu.ts convertAndCacheOnCPU) and later
  // reads return that copy: the update makes it stale
  b.tensorMap.get(t.dataId).values = null;
  b.incRef(t.dataId);
  return [{ dataId: t.dataId, shape: t.shape, dtype: t.dtype }, buffer];
}

/**
 * Copies the updated parameters of a chunk (the P scratch) out into `params` themselves (or new
 * tensors where something else holds a parameter's data: {@link updatedInPlace}), and records
 * that the scratch holds them.
 */
function copyOut(
  b: RawBackend,
  s: MultiState,
  params: readonly tf.TensorInfo[],
  sizes: readonly number[],
): tf.TensorInfo[] {
  const enc = encoder(b);
  const held = new Map<object, number>();
  let offset = 0;
  const outs = params.map((t, j) => {
    const [info, buffer] = updatedInPlace(b, t);
    if (sizes[j]! > 0)
      enc.copyBufferToBuffer(
        s.scratch[P]!,
        offset * BYTES,
        buffer,
        0,
        sizes[j]! * BYTES,
      );
    held.set(info.dataId, offset);
    offset += sizes[j]!;
    return info;
  });
  s.held[P] = held;
  return outs;
}

/** `t` as [rows, cols] over its last axis (0 rows where that axis is empty). */
export const rowsOf = (t: tf.TensorInfo): [number, number] => {
  const cols = t.shape[t.shape.length - 1] ?? 1;
  return [sizeOf(t) / Math.max(cols, 1), cols];
};

/** Uniforms {rows, cols(, epsilon)} as LAYER_NORM_*_WGSL declare them. */
function rowUniforms(rows: number, cols: number, epsilon?: number) {
  const u = new ArrayBuffer(16);
  new Uint32Array(u, 0, 2).set([rows, cols]);
  if (epsilon !== undefined) new Float32Array(u, 8, 1).set([epsilon]);
  return u;
}

/**
 * Layer norm over the last axis of x (kernel-names.ts LAYER_NORM_KERNEL) on webgpu in one
 * dispatch: outputs [y (x's shape), xhat (x's shape), rstd [..., 1]], all float32. `f16`: the
 * normalisation in f16 arithmetic (wgsl/multi.ts LAYER_NORM_FUSED_F16_WGSL; the device must
 * have shader-f16).
 */
export function layerNormFused(
  x: tf.TensorInfo,
  g: tf.TensorInfo,
  beta: tf.TensorInfo,
  epsilon: number,
  backend: unknown,
  f16 = false,
): tf.TensorInfo[] {
  const b = backend as RawBackend;
  const s = stateOf(b);
  const [rows, cols] = rowsOf(x);
  const [y, yBuffer] = newOutput(b, x.shape);
  const [xhat, xhatBuffer] = newOutput(b, x.shape);
  const [rstd, rstdBuffer] = newOutput(b, [...x.shape.slice(0, -1), 1]);
  if (rows > 0 && cols > 0) {
    const inputs = [x, g, beta].map((t) => bufferOf(b, t));
    const u = constantUniforms(b, s, rowUniforms(rows, cols, epsilon));
    dispatch(
      b,
      s,
      f16 ? LAYER_NORM_FUSED_F16_WGSL : LAYER_NORM_FUSED_WGSL,
      [...inputs, yBuffer, xhatBuffer, rstdBuffer, u],
      rows,
      `lw_layer_norm${f16 ? '_f16' : ''} [${x.shape}]`,
    );
  }
  return [y, xhat, rstd];
}

/**
 * Layer norm's dg and db (the sums over rows of dy xhat and of dy, [cols] each) on webgpu in
 * one dispatch, from dy and xhat (x's shape).
 */
export function layerNormParamGrads(
  dy: tf.TensorInfo,
  xhat: tf.TensorInfo,
  backend: unknown,
): tf.TensorInfo[] {
  const b = backend as RawBackend;
  const s = stateOf(b);
  const [rows, cols] = rowsOf(dy);
  const [dg, dgBuffer] = newOutput(b, [cols]);
  const [db, dbBuffer] = newOutput(b, [cols]);
  if (cols > 0) {
    const u = constantUniforms(b, s, rowUniforms(rows, cols));
    dispatch(
      b,
      s,
      LAYER_NORM_PARAM_GRADS_WGSL,
      [bufferOf(b, dy), bufferOf(b, xhat), dgBuffer, dbBuffer, u],
      cols,
      `lw_layer_norm_param_grads [${dy.shape}]`,
    );
  }
  return [dg, db];
}
