/**
 * The host's work per compute dispatch on webgpu, cut where tfjs-backend-webgpu 4.22 redoes per
 * dispatch what does not change from one step to the next (issue 36: on a GPU, a charlm-small
 * step is bound by the host: 146 dispatches at some 35-85 us of host time each on this machine).
 *
 * TF.js, for every program it runs (backend_webgpu.ts `recordAndSubmit`), packs the program's
 * uniforms (its shapes, strides and own constants) into a uniform buffer taken from its pool,
 * writes them with `queue.writeBuffer` (the buffer goes back to the pool at the next submit,
 * an `indexOf` over the pool's buffers in use), then asks the pipeline for its bind-group layout
 * (Dawn makes a new object each time) and creates the bind group. The same program at the same
 * shapes packs the same bytes in every step (99% of a charlm-small step's programs after the
 * first step, counted), so:
 * - a program's uniforms live in a buffer kept by its contents (the packed bytes), written once
 *   and never rewritten (what layerwise's own multi-tensor kernels already do: webgpu-multi.ts
 *   `constantUniforms`): one key built and looked up instead of a pool round trip and a write;
 * - a pipeline's bind-group layout is asked of Dawn once;
 * - TF.js's buffer pool hands out, of the free buffers of the asked size and usage, the one made
 *   first (it handed out the one freed last: which one that was changed from step to step), so
 *   that a step's programs get the same buffers as the step before; and bind groups are kept by
 *   their layout and bound buffer ranges. On lavapipe a charlm-small step's 186 `createBindGroup`
 *   calls (130 TF.js dispatches and layerwise's multi-tensor kernels) all found theirs from the
 *   third step on, where with TF.js's own pool order about a quarter did; each one made costs
 *   Dawn 19-23 us of host time there (measured in a loop of small programs).
 * The caches are bounded ({@link HOST_CACHE_ENTRIES}): when full they are emptied (a buffer or
 * bind group still used by recorded or submitted work stays alive in Dawn until that work has
 * run). The numbers computed are unchanged (the same programs read the same values); the
 * webgpu-against-cpu tests check that.
 */

/** The most uniform buffers, or bind groups, a cache keeps before it is emptied. */
export const HOST_CACHE_ENTRIES = 4096;

const UNIFORM = 0x40;
const COPY_DST = 0x08;

/** One of TF.js's program uniforms (backend_webgpu.ts ProgramUniform). */
interface ProgramUniform {
  type: 'int32' | 'uint32' | 'float32';
  data: number[];
}

interface BufferLike {
  size: number;
}

interface PipelineLike {
  getBindGroupLayout(index: number): object;
}

/** One entry of a bind group's descriptor: a buffer range, or another resource (kept as it is). */
interface BindGroupEntryLike {
  binding: number;
  resource: { buffer?: object; offset?: number; size?: number } | object;
}

/** The parts of Dawn's GPUDevice used here. */
interface DeviceLike {
  createBuffer(d: { size: number; usage: number }): BufferLike;
  createBindGroup(d: { layout: object; entries: BindGroupEntryLike[] }): object;
  createComputePipeline(d: unknown): PipelineLike;
  createComputePipelineAsync(d: unknown): Promise<PipelineLike>;
  queue: {
    writeBuffer(b: BufferLike, offset: number, data: Uint8Array): void;
  };
}

/** The parts of tfjs-backend-webgpu 4.22's WebGPUBackend used here. */
interface BackendLike {
  device: DeviceLike;
  /** TF.js's buffer pool (backend_webgpu.ts BufferManager); absent on stand-ins. */
  bufferManager?: BufferPoolLike;
  makeUniforms(u: ProgramUniform[]): {
    offset: number;
    size: number;
    buffer: BufferLike;
  };
}

/** The parts of tfjs-backend-webgpu 4.22's BufferManager used here. */
interface BufferPoolLike {
  /** Free buffers by `${size}_${usage}`; acquireBuffer pops the last. */
  freeBuffers: Map<string, BufferLike[]>;
  acquireBuffer(size: number, usage: number, ...rest: unknown[]): BufferLike;
  releaseBuffer(buffer: BufferLike, reuse?: boolean): void;
}

const installed = new WeakSet<object>();

/**
 * Installs the uniform cache, the layouts' memo, the pool's first-made order and the bind-group
 * cache on a webgpu backend (once per backend; see the module's comment). Call before its first
 * program runs (pipelines made earlier keep asking Dawn for their layouts, and their bind groups
 * are made each time).
 */
export function cutDispatchHostWork(backend: object): void {
  if (installed.has(backend)) return;
  installed.add(backend);
  const b = backend as BackendLike;
  memoizeLayouts(b.device);
  b.makeUniforms = keptProgramUniforms(b.device);
  if (b.bufferManager) firstMadeFirst(b.bufferManager);
  keepBindGroups(b.device);
}

/** Bind groups made and found by a device's cache since {@link cutDispatchHostWork}. */
export interface BindGroupCounts {
  made: number;
  found: number;
}

const bindGroupCounts = new WeakMap<object, BindGroupCounts>();

/** The device's bind-group counts (zeros where no cache is installed); a copy. */
export function bindGroupCountsOf(device: object): BindGroupCounts {
  return { ...(bindGroupCounts.get(device) ?? { made: 0, found: 0 }) };
}

/** A number per object, in the order first seen (WeakMap: the objects stay collectable). */
function objectIds(): (x: object) => number {
  const ids = new WeakMap<object, number>();
  let next = 0;
  return (x) => {
    let id = ids.get(x);
    if (id === undefined) {
      id = ++next;
      ids.set(x, id);
    }
    return id;
  };
}

/**
 * Makes the pool hand out, of its free buffers of a size and usage, the one it made first: each
 * free list is kept in descending order of making, so that acquireBuffer's pop takes the oldest.
 * A step that asks for the same buffers in the same order as the step before then gets the same
 * ones, whatever order the step before freed them in.
 */
function firstMadeFirst(pool: BufferPoolLike): void {
  const idOf = objectIds();
  // the held buffers (holdBuffers): each one in the pool's free lists is taken out of them, and
  // each one released later is too, until unholdBuffers puts them all back
  const watched = new Set<object>();
  const taken = new Set<BufferLike>();
  // the pool's free-list key of a buffer (buffer_manager.ts getBufferKey)
  const keyOf = (buffer: BufferLike) =>
    `${buffer.size}_${(buffer as { usage?: number }).usage}`;
  const listOf = (buffer: BufferLike) => {
    const key = keyOf(buffer);
    let free = pool.freeBuffers.get(key);
    if (!free) pool.freeBuffers.set(key, (free = []));
    return free;
  };
  /** Puts `buffer` into its free list in the order of making (the list is in that order). */
  const insert = (free: BufferLike[], buffer: BufferLike) => {
    const id = idOf(buffer);
    free.push(buffer);
    let i = free.length - 1;
    for (; i > 0 && idOf(free[i - 1]!) < id; i--) free[i] = free[i - 1]!;
    free[i] = buffer;
  };
  const counted = pool as unknown as { numFreeBuffers?: number };
  /** Moves TF.js's count of free buffers (where the pool keeps one) by `d`. */
  const countFree = (d: number) => {
    if (counted.numFreeBuffers !== undefined) counted.numFreeBuffers += d;
  };
  let holder: object | null = null;
  holds.set(pool, {
    hold(owner, buffers) {
      if (holder !== null && holder !== owner) return false;
      holder = owner;
      for (const b of buffers) watched.add(b);
      for (const free of pool.freeBuffers.values())
        for (let i = free.length - 1; i >= 0; i--)
          if (watched.has(free[i]!)) {
            taken.add(free[i]!);
            free.splice(i, 1);
            countFree(-1);
          }
      return true;
    },
    unhold(owner) {
      if (owner !== holder) return;
      holder = null;
      watched.clear();
      for (const b of taken) {
        insert(listOf(b), b);
        countFree(1);
      }
      taken.clear();
    },
  });
  const acquire = pool.acquireBuffer.bind(pool);
  pool.acquireBuffer = (size, usage, ...rest) => {
    const buffer = acquire(size, usage, ...rest);
    idOf(buffer);
    return buffer;
  };
  const release = pool.releaseBuffer.bind(pool);
  pool.releaseBuffer = (buffer, reuse = true) => {
    release(buffer, reuse);
    if (!reuse) return;
    const free = pool.freeBuffers.get(keyOf(buffer));
    if (free?.at(-1) !== buffer) return; // not pushed (a pool being torn down)
    free.pop();
    if (watched.has(buffer)) {
      taken.add(buffer);
      countFree(-1);
      return;
    }
    insert(free, buffer);
  };
}

/** A pool's hold on some of its buffers ({@link holdBuffers}). */
interface PoolHold {
  /** False, holding nothing, where another owner holds buffers. */
  hold(owner: object, buffers: Iterable<object>): boolean;
  unhold(owner: object): void;
}
const holds = new WeakMap<object, PoolHold>();

/**
 * Keeps `buffers` out of the hands of TF.js's buffer pool on `backend` (with
 * {@link cutDispatchHostWork} installed): the free ones are taken out of its free lists, and any
 * of them released later (a tensor disposed) is too, so the pool hands none of them out until
 * {@link unholdBuffers}. For a captured step (pipeline/captured-step.ts), whose replays write
 * into the buffers its recording used. One owner at a time (a later call by the same owner adds
 * to its buffers). Returns false, holding nothing, where the backend has no such pool or another
 * owner holds buffers of it.
 */
export function holdBuffers(
  backend: object,
  owner: object,
  buffers: Iterable<object>,
): boolean {
  const pool = (backend as BackendLike).bufferManager;
  const h = pool && holds.get(pool);
  return h ? h.hold(owner, buffers) : false;
}

/** Gives every buffer `owner` holds ({@link holdBuffers}) back to the pool's free lists. */
export function unholdBuffers(backend: object, owner: object): void {
  const pool = (backend as BackendLike).bufferManager;
  if (pool) holds.get(pool)?.unhold(owner);
}

/**
 * Keeps the device's bind groups by layout and bound buffer ranges: createBindGroup with the
 * same layout object and, binding by binding, the same buffers at the same offsets and sizes
 * returns the group made the first time (a bind group holds references, not contents: the
 * buffers' values when the dispatch runs are read). Descriptors binding anything but buffers are
 * made each time. Emptied at {@link HOST_CACHE_ENTRIES} groups.
 */
function keepBindGroups(device: DeviceLike): void {
  const idOf = objectIds();
  const kept = new Map<string, object>();
  const counts: BindGroupCounts = { made: 0, found: 0 };
  bindGroupCounts.set(device, counts);
  const create = device.createBindGroup.bind(device);
  const made = (d: Parameters<DeviceLike['createBindGroup']>[0]) => {
    const group = create(d);
    bound.set(
      group,
      d.entries.flatMap((e) => {
        const r = e.resource as { buffer?: object };
        return r.buffer ? [r.buffer] : [];
      }),
    );
    return group;
  };
  device.createBindGroup = (d) => {
    let key = `${idOf(d.layout)}`;
    for (const e of d.entries) {
      const r = e.resource as {
        buffer?: object;
        offset?: number;
        size?: number;
      };
      if (!r.buffer) return made(d);
      key += `|${e.binding}:${idOf(r.buffer)}:${r.offset ?? 0}:${r.size ?? ''}`;
    }
    let group = kept.get(key);
    if (group) {
      counts.found++;
      return group;
    }
    if (kept.size >= HOST_CACHE_ENTRIES) kept.clear();
    group = made(d);
    counts.made++;
    kept.set(key, group);
    return group;
  };
}

/** The buffers each bind group made through {@link keepBindGroups} binds. */
const bound = new WeakMap<object, readonly object[]>();

/**
 * The buffers bind group `group` binds, where it was made on a device with the bind-group cache
 * ({@link cutDispatchHostWork}); undefined for others.
 */
export function buffersOfBindGroup(
  group: object,
): readonly object[] | undefined {
  return bound.get(group);
}

/** Makes every pipeline the device creates from now on answer getBindGroupLayout(i) with one object per index. */
function memoizeLayouts(device: DeviceLike): void {
  const memoize = (p: PipelineLike): PipelineLike => {
    const ask = p.getBindGroupLayout.bind(p);
    const known: object[] = [];
    p.getBindGroupLayout = (i: number) => {
      known[i] ??= ask(i);
      return known[i];
    };
    return p;
  };
  const create = device.createComputePipeline.bind(device);
  device.createComputePipeline = (d) => memoize(create(d));
  const createAsync = device.createComputePipelineAsync.bind(device);
  device.createComputePipelineAsync = async (d) =>
    memoize(await createAsync(d));
}

/**
 * tfjs-backend-webgpu 4.22's makeUniforms (backend_webgpu.ts; WGSL's alignment rules: a field of
 * 1, 2, 3-4 and 5-6 components aligned to 4, 8 and 16 bytes, a field after a 5-6 component one
 * to 16, the struct to its largest alignment), returning a buffer kept by the packed bytes
 * instead of a pooled buffer written for this dispatch.
 * @throws Error on a field of more than 6 components (as TF.js).
 */
function keptProgramUniforms(device: DeviceLike): BackendLike['makeUniforms'] {
  const buffers = new Map<string, BufferLike>();
  return (uniforms) => {
    const offsets: number[] = [];
    let at = 0;
    let previous = 0;
    let structAlign = 1;
    for (const u of uniforms) {
      if (u.data.length === 0) u.data = [1]; // as TF.js
      const n = u.data.length;
      if (n > 6) throw new Error(`Unsupported ${n}D shape`);
      const align =
        previous === 5 || previous === 6 ? 16 : n === 1 ? 4 : n === 2 ? 8 : 16;
      structAlign = Math.max(structAlign, align);
      at = Math.ceil(at / align) * align;
      offsets.push(at);
      at += n * 4;
      previous = n;
    }
    const size = Math.ceil(at / structAlign) * structAlign;
    const bytes = new ArrayBuffer(size);
    const f32 = new Float32Array(bytes);
    const i32 = new Int32Array(bytes);
    const u32 = new Uint32Array(bytes);
    uniforms.forEach((u, k) => {
      const view = u.type === 'int32' ? i32 : u.type === 'uint32' ? u32 : f32;
      view.set(u.data, offsets[k]! / 4);
    });
    const buffer = keptUniformBuffer(
      device,
      buffers,
      bytes,
      size,
      HOST_CACHE_ENTRIES,
    );
    return { offset: 0, size, buffer };
  };
}

/**
 * The uniform buffer of `size` bytes holding `words` (u32 or f32 bit patterns; byteLength a
 * multiple of 4, at most `size`), made and written once and kept in `cache` by the words, so
 * that every later call with the same values reuses it (calls recorded before one submit may
 * share it, where a rewritten buffer would give them all the last call's values). The cache is
 * emptied when it holds `limit` buffers. Used for TF.js's program uniforms here and for
 * layerwise's own dispatches (webgpu-multi.ts constantUniforms).
 */
export function keptUniformBuffer<B>(
  device: {
    createBuffer(d: { size: number; usage: number }): B;
    queue: { writeBuffer(b: B, offset: number, data: Uint8Array): void };
  },
  cache: Map<string, B>,
  words: ArrayBuffer,
  size: number,
  limit = Number.POSITIVE_INFINITY,
): B {
  const u32 = new Uint32Array(words);
  let key = '';
  for (let k = 0; k < u32.length; k++) key += `${u32[k]},`;
  let buffer = cache.get(key);
  if (!buffer) {
    if (cache.size >= limit) cache.clear();
    buffer = device.createBuffer({ size, usage: COPY_DST | UNIFORM });
    device.queue.writeBuffer(buffer, 0, new Uint8Array(words));
    cache.set(key, buffer);
  }
  return buffer;
}
