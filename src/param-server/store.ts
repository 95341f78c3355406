/**
 * Host memory of the eager parameter server (EPS): every parameter's fp32 master copy and its
 * optimizer slots, each in its own SharedArrayBuffer, plus one version counter per layer.
 * The same memory is viewed from every thread: the main thread (the server), the optimizer
 * worker threads (which write updates) and the device thread (which reads a layer's
 * parameters when it uploads the layer, after waiting on that layer's version).
 *
 * Source: L2L's eager parameter server (Pudipeddi et al., 2020, arXiv 2002.05645), which keeps
 * the whole model and the optimizer state in host memory.
 *
 * This module must not import TF.js: it runs in the optimizer worker threads.
 */

import type { Precision } from '../backend/names.js';
import {
  bytesOfFormat,
  type Narrowing,
  type NumberFormat,
  narrowingTo,
  onlyNarrowPolicy,
  paramCopyFormat,
  policyOf,
} from '../backend/precision.js';
import { type Block, paramKey, sizeOf } from '../model/block.js';
import type { HostParams } from '../model/init.js';
import type { OptimizerConfig } from '../optim/optimizer.js';
import { check, LayerwiseError } from '../util/errors.js';
import { slotNames } from './host-optimizer.js';

/**
 * Where a {@link ParamStore} lives: plain structured-clonable data (SharedArrayBuffers are
 * shared, not copied, when posted), sent to worker threads, which {@link ParamStore.attach} it.
 */
export interface StoreLayout {
  /** Per layer (= model block index), its parameter keys in order (may be empty). */
  layers: string[][];
  /** Per parameter key, its shape (the product is its number of elements). */
  shapes: Record<string, number[]>;
  /** Per key, its fp32 master values: a Float32Array's buffer, 4 bytes per element. */
  params: Record<string, SharedArrayBuffer>;
  /**
   * Per key, its optimizer slots, each a Float32Array's buffer of the parameter's size:
   * `{m, v}` (AdamW), `{velocity}` (SGD with momentum > 0) or `{}` (plain SGD).
   */
  slots: Record<string, Record<string, SharedArrayBuffer>>;
  /**
   * Per key shipped in the precision policy's parameter format (issue 23 item 4; backend/
   * precision.ts storage.params, {@link StoreLayout.lowFormat}), a Uint16Array's buffer of the
   * master's copy in it (2 bytes per element, rounded to nearest even),
   * rewritten by the optimizer thread after each update of the key and before its layer's
   * version moves on, so a device that waited on the version reads the copy of the same
   * update. Absent for a float32 run. The masters stay float32.
   */
  low?: Record<string, SharedArrayBuffer>;
  /**
   * The 2-byte format of {@link low}'s copies: the run's policy's storage.params (backend/
   * precision.ts paramCopyFormat). Present exactly where `low` is; the optimizer threads read
   * it here to pick their rounding.
   */
  lowFormat?: NumberFormat;
  /** Int32Array, one per layer: optimizer updates applied to that layer since the store was created. */
  versions: SharedArrayBuffer;
  /**
   * Int32Array(1): 0 while the store is usable, 1 once
   * its server failed, 2 once it was closed. Waiters on versions are woken when it changes, so a
   * device never waits forever for an update that will not come.
   */
  status: SharedArrayBuffer;
}

/** {@link StoreLayout.status} values. */
export const STORE_OK = 0;
export const STORE_FAILED = 1;
export const STORE_CLOSED = 2;

/**
 * Layers and shapes of a model's blocks, for {@link ParamStore.create}: layer b holds the keys
 * `<b>.<name>` of block b's parameters, in declaration order.
 */
export function blockLayers(blocks: readonly Block[]): {
  layers: string[][];
  shapes: Record<string, number[]>;
} {
  const shapes: Record<string, number[]> = {};
  const layers = blocks.map((b, bi) =>
    b.params.map((spec) => {
      const key = paramKey(bi, spec.name);
      shapes[key] = [...spec.shape];
      return key;
    }),
  );
  return { layers, shapes };
}

interface AtomicsWithWaitAsync {
  waitAsync(
    a: Int32Array,
    index: number,
    value: number,
    timeout?: number,
  ):
    | { async: false; value: 'not-equal' | 'timed-out' }
    | { async: true; value: Promise<'ok' | 'timed-out'> };
}
const atomics = Atomics as unknown as AtomicsWithWaitAsync;

/**
 * Views over the shared host memory of a {@link StoreLayout}. Cheap to create; every view
 * aliases the shared memory (writes are seen by every thread; synchronise through
 * {@link markUpdated} / {@link waitVersion}, which are sequentially consistent atomics).
 */
export class ParamStore {
  private readonly paramViews = new Map<string, Float32Array>();
  private readonly slotViews = new Map<string, Record<string, Float32Array>>();
  private readonly lowViews = new Map<string, Uint16Array>();
  private readonly layerOfKey = new Map<string, number>();
  private readonly versions: Int32Array;
  private readonly statusView: Int32Array;

  private constructor(readonly layout: StoreLayout) {
    for (const [k, b] of Object.entries(layout.params))
      this.paramViews.set(k, new Float32Array(b));
    for (const [k, s] of Object.entries(layout.slots)) {
      const rec: Record<string, Float32Array> = {};
      for (const [name, b] of Object.entries(s))
        rec[name] = new Float32Array(b);
      this.slotViews.set(k, rec);
    }
    for (const [k, b] of Object.entries(layout.low ?? {}))
      this.lowViews.set(k, new Uint16Array(b));
    layout.layers.forEach((keys, l) =>
      keys.forEach((k) => this.layerOfKey.set(k, l)),
    );
    this.versions = new Int32Array(layout.versions);
    this.statusView = new Int32Array(layout.status);
  }

  /**
   * Allocates shared memory for `params` (copying their values in) and zeroed optimizer slots
   * for `optimizer` (see {@link slotNames}); versions start at 0. Bytes: 4 x parameters x
   * (1 + number of slots), plus 4 per layer.
   *
   * - `params`: fp32 values by key (from src/model/init.ts or a checkpoint); not retained.
   * - `layers`: per layer, its keys (see {@link blockLayers}); every key of `params` in exactly one layer.
   * - `shapes`: per key, its shape (needed for the rank: weight decay applies to rank >= 2 only).
   *
   * - `opts.adopt`: take over, instead of copying, every value array that is a whole
   *   SharedArrayBuffer (byteOffset 0, covering the buffer; see initParams' `shared`): it becomes
   *   the master copy, updated in place by the optimizer threads, so the caller must not use it
   *   afterwards. Saves 4 bytes per parameter at start-up. Other arrays are copied.
   *
   * - `opts.lowPrecision`: keys that also get a shared 2-byte copy ({@link StoreLayout.low},
   *   2 bytes per element more), filled here from the initial values.
   * - `opts.precision`: the run's precision, whose policy's storage.params is the copies'
   *   format; absent, the one policy that keeps such copies (backend/precision.ts
   *   onlyNarrowPolicy). Copies under a policy that stores parameters as float32 are a
   *   RangeError (precision.ts paramCopyFormat).
   *
   * Throws {@link LayerwiseError} naming the key if a layer names a key that `params` or
   * `shapes` lacks, a key appears twice, a key of `params` belongs to no layer, or a value
   * array's length differs from its shape's size.
   */
  static create(
    params: HostParams,
    layers: string[][],
    optimizer: OptimizerConfig,
    shapes: Record<string, number[]>,
    opts: {
      adopt?: boolean;
      lowPrecision?: ReadonlySet<string>;
      precision?: Precision;
    } = {},
  ): ParamStore {
    const seen = new Set<string>();
    const layout: StoreLayout = {
      layers: layers.map((ks) => [...ks]),
      shapes: {},
      params: {},
      slots: {},
      versions: new SharedArrayBuffer(4 * layers.length),
      status: new SharedArrayBuffer(4),
    };
    const names = slotNames(optimizer);
    layers.forEach((keys, l) => {
      for (const key of keys) {
        check(
          !seen.has(key),
          `parameter '${key}' appears in more than one layer (again in layer ${l})`,
        );
        seen.add(key);
        const values = params.get(key);
        check(
          values !== undefined,
          `layer ${l} names parameter '${key}', which the parameters do not have`,
        );
        const shape = shapes[key];
        check(Array.isArray(shape), `parameter '${key}' has no shape`);
        const n = sizeOf(shape);
        check(
          values.length === n,
          `parameter '${key}' has ${values.length} values, its shape [${shape}] needs ${n}`,
        );
        const own = values.buffer;
        if (
          opts.adopt &&
          own instanceof SharedArrayBuffer &&
          values.byteOffset === 0 &&
          values.byteLength === own.byteLength
        ) {
          layout.params[key] = own;
        } else {
          const buf = new SharedArrayBuffer(4 * n);
          new Float32Array(buf).set(values);
          layout.params[key] = buf;
        }
        layout.shapes[key] = [...shape];
        layout.slots[key] = Object.fromEntries(
          names.map((s) => [s, new SharedArrayBuffer(4 * n)]),
        );
      }
    });
    for (const key of params.keys())
      check(seen.has(key), `parameter '${key}' belongs to no layer`);
    if (opts.lowPrecision !== undefined) {
      const format = paramCopyFormat(
        opts.precision ? policyOf(opts.precision) : onlyNarrowPolicy(),
      );
      layout.low = {};
      layout.lowFormat = format;
      for (const key of opts.lowPrecision) {
        check(seen.has(key), `low-precision key '${key}' belongs to no layer`);
        const n = sizeOf(layout.shapes[key]!);
        layout.low[key] = new SharedArrayBuffer(bytesOfFormat(format) * n);
      }
    }
    const store = new ParamStore(layout);
    for (const key of store.lowViews.keys()) store.refreshLow(key);
    return store;
  }

  /** Views over the memory of a layout made by {@link create} (in any thread). */
  static attach(layout: StoreLayout): ParamStore {
    return new ParamStore(layout);
  }

  /** Number of layers. */
  get numLayers(): number {
    return this.layout.layers.length;
  }

  /** All parameter keys, layer by layer. */
  keys(): string[] {
    return this.layout.layers.flat();
  }

  /** The fp32 master values of `key` (a view of the shared memory, not a copy). Throws LayerwiseError for an unknown key. */
  param(key: string): Float32Array {
    const p = this.paramViews.get(key);
    if (!p) throw new LayerwiseError(`unknown parameter '${key}'`);
    return p;
  }

  /** The optimizer slots of `key` by slot name (views, not copies). Throws LayerwiseError for an unknown key. */
  slots(key: string): Record<string, Float32Array> {
    const s = this.slotViews.get(key);
    if (!s) throw new LayerwiseError(`unknown parameter '${key}'`);
    return s;
  }

  /** The 2-byte copy of `key`'s master (a shared view), or undefined where the key has none. */
  low(key: string): Uint16Array | undefined {
    return this.lowViews.get(key);
  }

  /**
   * Rewrites `key`'s 2-byte copy from its master with `convert` (default: plain JavaScript's
   * rounding to {@link StoreLayout.lowFormat}, backend/precision.ts narrowingTo; the
   * optimizer threads pass the native addon's vectorised loop). No-op for a key without one.
   */
  refreshLow(key: string, convert?: Narrowing): void {
    const low = this.lowViews.get(key);
    if (low === undefined) return;
    const round = convert ?? narrowingTo(this.layout.lowFormat!);
    round(this.param(key), low);
  }

  /** The shape of `key`. Throws LayerwiseError for an unknown key. */
  shape(key: string): number[] {
    const s = this.layout.shapes[key];
    if (!s) throw new LayerwiseError(`unknown parameter '${key}'`);
    return s;
  }

  /** The layer holding `key`, or undefined. */
  layerOf(key: string): number | undefined {
    return this.layerOfKey.get(key);
  }

  private checkLayer(layer: number): void {
    if (
      !(Number.isInteger(layer) && layer >= 0 && layer < this.versions.length)
    ) {
      throw new RangeError(
        `layer ${layer} is out of range: the store has ${this.versions.length} layers`,
      );
    }
  }

  /** Optimizer updates applied to `layer` so far (an atomic load). Throws RangeError for a bad layer. */
  version(layer: number): number {
    this.checkLayer(layer);
    return Atomics.load(this.versions, layer);
  }

  /** {@link STORE_OK}, {@link STORE_FAILED} or {@link STORE_CLOSED}. */
  get status(): number {
    return Atomics.load(this.statusView, 0);
  }

  /**
   * Resolves once `layer` has had at least `atLeast` updates (at once if it has), without
   * blocking the thread (Atomics.waitAsync). Rejects with a LayerwiseError if the server fails
   * or is closed before that; throws RangeError for a bad layer.
   * While it waits, it keeps the thread's event loop alive (a pending Atomics.waitAsync alone
   * does not, so a thread with nothing else to do would otherwise exit in the middle).
   */
  async waitVersion(layer: number, atLeast: number): Promise<void> {
    this.checkLayer(layer);
    if (Atomics.load(this.versions, layer) >= atLeast) return;
    const keepAlive = setInterval(() => undefined, 1 << 30);
    try {
      for (;;) {
        const cur = Atomics.load(this.versions, layer);
        if (cur >= atLeast) return;
        // Register the wait before looking at the status: a stop() after the look notifies us.
        const r = atomics.waitAsync(this.versions, layer, cur);
        const status = this.status;
        if (status !== STORE_OK) {
          Atomics.notify(this.versions, layer); // release the waiter just registered
          throw new LayerwiseError(
            `layer ${layer} will not reach version ${atLeast} (at ${cur}): the parameter server ${status === STORE_CLOSED ? 'was closed' : 'failed'}`,
          );
        }
        if (r.async) await r.value;
      }
    } finally {
      clearInterval(keepAlive);
    }
  }

  /** Counts one applied update of `layer` and wakes its waiters (Atomics.add + Atomics.notify). */
  markUpdated(layer: number): void {
    this.checkLayer(layer);
    Atomics.add(this.versions, layer, 1);
    Atomics.notify(this.versions, layer);
  }

  /** Marks the store failed or closed (first call wins) and wakes every waiter so it can reject. */
  stop(status: typeof STORE_FAILED | typeof STORE_CLOSED): void {
    Atomics.compareExchange(this.statusView, 0, STORE_OK, status);
    for (let l = 0; l < this.versions.length; l++)
      Atomics.notify(this.versions, l);
  }
}
