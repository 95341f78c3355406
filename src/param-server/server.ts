/**
 * The eager parameter server (EPS) of L2L (Pudipeddi et al., 2020, "Training Large Neural
 * Networks with Constant Memory using a New Execution Algorithm", arXiv 2002.05645): the whole
 * model's fp32 parameters and optimizer state live in host memory ({@link ParamStore}), and the
 * optimizer runs there, in background worker threads, for one layer as soon as its gradient
 * arrives, while the device computes the next layer. The host optimizer is a fused single-pass
 * loop ({@link hostUpdate}), the idea of ZeRO-Offload's CPU Adam (Ren et al., 2021, arXiv
 * 2101.06840).
 *
 * Updates equal {@link DeviceOptimizer}'s (same rules, same global-norm clipping, same
 * {@link OptimizerState} format), so checkpoints move freely between L2L and the other strategies.
 *
 * Threads: the server runs on the main thread; `threads` optimizer workers
 * (dist/param-server/optimizer-worker.js) write the shared memory; the device thread reads it after
 * {@link ParamStore.waitVersion}. Every key is always updated by the same worker, so the updates
 * of one tensor are applied in step order even when steps overlap.
 */
import { Worker } from 'node:worker_threads';
import type { Precision } from '../backend/names.js';
import { configureOpenMP } from '../backend/native-addon.js';
import type { HostParams } from '../model/init.js';
import {
  initialLossScale,
  type LossScaleState,
  lossScaleStep,
} from '../optim/loss-scale.js';
import {
  clipScale,
  type OptimizerConfig,
  type OptimizerState,
} from '../optim/optimizer.js';
import { check, LayerwiseError } from '../util/errors.js';
import { slotNames } from './host-optimizer.js';
import type {
  DoneMessage,
  ErrorMessage,
  JobMessage,
  OptimizerWorkerData,
} from './optimizer-worker.js';
import {
  ParamStore,
  STORE_CLOSED,
  STORE_FAILED,
  type StoreLayout,
} from './store.js';

/** One part of one layer's update, for the trace (one track per optimizer thread). */
export interface ServerSpan {
  layer: number;
  /** Optimizer thread index, 0-based. */
  thread: number;
  /** When the part started, ms since the Unix epoch (performance.timeOrigin + now). */
  startedAt: number;
  /** Duration, ms. */
  ms: number;
  /** Parameters (elements) updated by the part. */
  params: number;
}

/** Options of {@link ParameterServer.create}. */
export interface ParameterServerOptions {
  /** Initial fp32 values by key (copied into shared memory; not retained). */
  params: HostParams;
  /** Per layer (model block index), its parameter keys (see blockLayers in store.ts). */
  layers: string[][];
  /** Per key, its shape: the rank decides weight decay (rank >= 2 only), and HostParams carry no shapes. */
  shapes: Record<string, number[]>;
  optimizer: OptimizerConfig;
  /** Optimizer worker threads, >= 1. */
  threads: number;
  /**
   * Take over the SharedArrayBuffer-backed arrays of `params` instead of copying them (see
   * {@link ParamStore.create}'s `opts.adopt`); the caller must not use them afterwards.
   */
  adopt?: boolean;
  /** Keys that also keep a 2-byte copy for the device (see StoreLayout.low); none by default. */
  lowPrecision?: ReadonlySet<string>;
  /**
   * The run's precision: its policy's storage.params is the copies' format (backend/
   * precision.ts). Absent: the one policy that keeps copies (see ParamStore.create).
   */
  precision?: Precision;
  /**
   * f16: dynamic loss scaling from this initial scale (optim/loss-scale.ts): the devices'
   * gradients come scaled by {@link ParameterServer.lossScale}; the server unscales them in the
   * update, and a step whose gradients overflow updates nothing. Absent: no loss scaling.
   */
  lossScale?: number;
}

interface Job {
  layer: number;
  parts: number;
  counter: number;
}

interface Held {
  layer: number;
  grads: Record<string, Float32Array>;
}

/** Error of an optimizer thread, re-raised on the main thread. */
export class EpsError extends Error {
  override readonly name = 'EpsError';
  constructor(
    message: string,
    readonly causeName?: string,
  ) {
    super(message);
  }
}

/**
 * The host side of L2L: parameters, optimizer state and background optimizer threads.
 * Usage per step: {@link beginStep}(lr), then {@link push} every layer's gradient once, then
 * (before reading parameters or state) {@link idle}. Not for concurrent use from several
 * async flows beyond that protocol.
 */
export class ParameterServer {
  private step = 0;
  private lr = 0;
  private stepOpen = false;
  private pushed: boolean[];
  private pushedCount = 0;
  /** Pushes that make up one layer's gradient this step (see {@link beginStep}). */
  private parts = 1;
  /** Per layer, the pushes summed so far this step and their sum (parts > 1). */
  private partial = new Map<
    number,
    { count: number; grads: Record<string, Float32Array> }
  >();
  private sumSquares = 0;
  private held: Held[] = [];
  /** f16: the dynamic loss scaler (null: none), and what it decided for the last complete step. */
  private scaler: LossScaleState | null = null;
  private lastScaled: { scale: number; skipped: boolean } | null = null;
  /** Keys that have optimizer slots (a gradient since the last setOptimizerState, or set by it). */
  private readonly live = new Set<string>();
  private readonly jobs = new Map<number, Job>();
  private nextJob = 0;
  private readonly counters: Int32Array;
  private readonly freeCounters: number[];
  private spans: ServerSpan[] = [];
  private waiters: Array<{ resolve: () => void; reject: (e: Error) => void }> =
    [];
  private failure: Error | undefined;
  private closed = false;
  private running: number;
  /** Per layer, per key: its optimizer thread. */
  private readonly owner: Array<Map<string, number>>;

  private constructor(
    private readonly mem: ParamStore,
    private readonly config: OptimizerConfig,
    private readonly workers: Worker[],
    counters: SharedArrayBuffer,
  ) {
    this.pushed = new Array<boolean>(mem.numLayers).fill(false);
    this.counters = new Int32Array(counters);
    this.freeCounters = Array.from(
      { length: this.counters.length },
      (_, i) => this.counters.length - 1 - i,
    );
    this.running = workers.length;
    this.owner = assignThreads(mem.layout, workers.length);
    workers.forEach((w, i) => {
      w.on('message', (m: DoneMessage | ErrorMessage) => this.onMessage(m));
      w.on('error', (e) =>
        this.fail(
          new EpsError(`optimizer thread ${i} crashed: ${e.message}`, e.name),
        ),
      );
      w.on('exit', (code) => {
        this.running--;
        if (!this.closed)
          this.fail(
            new EpsError(`optimizer thread ${i} exited with code ${code}`),
          );
      });
    });
  }

  /**
   * Copies (or with `adopt`, takes over) the parameters into shared host memory (4 bytes per
   * parameter, plus 4 per parameter per optimizer slot: 12 for AdamW) and starts `threads` optimizer worker threads.
   * Throws {@link LayerwiseError} for a missing, duplicated, layer-less or mis-sized key (see
   * {@link ParamStore.create}) or a bad thread count; rejects if a thread fails to start.
   */
  static async create(o: ParameterServerOptions): Promise<ParameterServer> {
    check(
      Number.isInteger(o.threads) && o.threads >= 1,
      `the parameter server needs a positive integer number of threads, got ${o.threads}`,
    );
    const store = ParamStore.create(o.params, o.layers, o.optimizer, o.shapes, {
      adopt: o.adopt,
      lowPrecision: o.lowPrecision,
      precision: o.precision,
    });
    const counters = new SharedArrayBuffer(4 * (4 * store.numLayers + 64));
    const workers: Worker[] = [];
    const started: Array<Promise<void>> = [];
    try {
      for (let i = 0; i < o.threads; i++) {
        const data: OptimizerWorkerData = {
          layout: store.layout,
          config: { ...o.optimizer },
          thread: i,
          counters,
        };
        configureOpenMP(); // before the thread may load the native addon
        workers.push(
          new Worker(new URL('./optimizer-worker.js', import.meta.url), {
            workerData: data,
          }),
        );
      }
    } catch (e) {
      await Promise.all(workers.map((w) => w.terminate())); // threads started before the one that failed
      throw e;
    }
    for (let i = 0; i < o.threads; i++) {
      const w = workers[i];
      started.push(
        new Promise<void>((resolve, reject) => {
          const onError = (e: Error) =>
            reject(
              new EpsError(
                `optimizer thread ${i} failed to start: ${e.message}`,
                e.name,
              ),
            );
          w.once('error', onError);
          w.once('exit', (code) =>
            reject(
              new EpsError(
                `optimizer thread ${i} exited with code ${code} before it was ready`,
              ),
            ),
          );
          w.once('message', (m: { type: string }) => {
            w.off('error', onError);
            if (m.type === 'ready') resolve();
            else
              reject(
                new EpsError(
                  `optimizer thread ${i} sent '${m.type}' before 'ready'`,
                ),
              );
          });
        }),
      );
    }
    try {
      await Promise.all(started);
      const s = new ParameterServer(
        store,
        { ...o.optimizer },
        workers,
        counters,
      );
      if (o.lossScale !== undefined) s.scaler = initialLossScale(o.lossScale);
      return s;
    } catch (e) {
      store.stop(STORE_CLOSED);
      await Promise.all(workers.map((w) => w.terminate()));
      throw e;
    }
  }

  /** The shared memory, for {@link ParamStore.attach} in the device thread. */
  get layout(): StoreLayout {
    return this.mem.layout;
  }

  /** The server's own views of the shared memory (parameters, slots, versions). */
  get store(): ParamStore {
    return this.mem;
  }

  /** Optimizer steps begun so far (the t of the current step for AdamW), counting a loaded state's step. */
  get steps(): number {
    return this.step;
  }

  /** Optimizer threads still running (0 after {@link close}). */
  get runningThreads(): number {
    return this.running;
  }

  private usable(what: string): void {
    if (this.closed)
      throw new EpsError(`parameter server was closed; cannot ${what}`);
    if (this.failure) throw this.failure;
  }

  /**
   * Starts the next step (its 1-based t for AdamW) with learning rate `lr`. `parts`: the
   * pushes that make up each layer's gradient this step (1: the device accumulated it; M: a
   * pipelined relay pushes each micro-batch's part, and the server sums them, as the L2L
   * paper's EPS sums what its devices push). Throws an Error if the previous step is missing
   * layers (every layer's gradient is pushed once per step, in `parts` pushes), if `lr` is not
   * a finite number or `parts` not a positive integer, or if the server failed (its error) or
   * was closed.
   */
  beginStep(lr: number, parts = 1): void {
    this.usable('begin a step');
    if (!Number.isFinite(lr))
      throw new RangeError(`learning rate must be a finite number, got ${lr}`);
    if (!(Number.isInteger(parts) && parts >= 1))
      throw new RangeError(
        `a layer's gradient comes in a positive integer number of pushes, got ${parts}`,
      );
    if (this.stepOpen && this.pushedCount < this.pushed.length) {
      throw new Error(
        `step ${this.step} is incomplete: layers ${this.missing().join(', ')} were not pushed`,
      );
    }
    this.step++;
    this.lr = lr;
    this.stepOpen = true;
    this.pushed.fill(false);
    this.pushedCount = 0;
    this.sumSquares = 0;
    this.parts = parts;
    this.partial.clear();
  }

  private missing(): number[] {
    return this.pushed.flatMap((p, l) => (p ? [] : [l]));
  }

  /**
   * A layer's gradient of the current step, accumulated over the mini-batch: Float32Arrays
   * by key, each with the parameter's number of elements (ownership taken: their buffers are
   * transferred to the optimizer threads, so they are detached afterwards; a buffer shared by
   * several keys or a SharedArrayBuffer is copied or shared instead). May be empty for a layer
   * without parameters; a key left out is not updated (as in {@link DeviceOptimizer}).
   * `sumSquares`: the layer's sum of squared gradient elements (for global-norm clipping).
   *
   * - clipNorm == 0: the layer's update starts at once in the background (scale 1).
   * - clipNorm > 0: the gradients are held until every layer of the step is in; then
   *   scale = clipScale(sum, clipNorm) and the layers are updated in forward order 0, 1, ...
   * When a layer's update is applied its version is incremented ({@link ParamStore.markUpdated};
   * at once for a layer without gradients).
   *
   * With `parts` > 1 ({@link beginStep}) each push is one part of the layer's gradient: the
   * parts are summed here (in push order, float32) and the layer is complete at its last part;
   * `sumSquares` is then ignored and computed from the sum.
   *
   * Throws an Error (synchronously) for a push outside a step, a layer out of range or pushed
   * more often than its parts in a step, or a key not of that layer; throws the server's error
   * if it failed. A gradient of the wrong length fails in the optimizer thread: {@link idle}
   * rejects naming the key (a part of the wrong length: here, naming it).
   */
  push(
    layer: number,
    grads: Record<string, Float32Array>,
    sumSquares: number,
  ): void {
    this.usable('push a gradient');
    if (!this.stepOpen) throw new Error('push before beginStep');
    if (
      !(Number.isInteger(layer) && layer >= 0 && layer < this.pushed.length)
    ) {
      throw new RangeError(
        `layer ${layer} is out of range: the model has ${this.pushed.length} layers`,
      );
    }
    if (this.pushed[layer])
      throw new Error(`layer ${layer} was already pushed in step ${this.step}`);
    const owner = this.owner[layer];
    for (const key of Object.keys(grads)) {
      if (!owner.has(key))
        throw new Error(
          `gradient '${key}' pushed for layer ${layer}, which has no such parameter (it has ${[...owner.keys()].join(', ') || 'none'})`,
        );
    }
    if (this.parts > 1) {
      const whole = this.sumPart(layer, grads);
      if (!whole) return;
      grads = whole;
      sumSquares =
        this.config.clipNorm > 0 || this.scaler ? squaredNorm(grads) : 0;
    } else if (this.scaler) {
      sumSquares = squaredNorm(grads); // whatever the device sent: loss scaling needs the norm
    }
    this.pushed[layer] = true;
    this.pushedCount++;
    for (const key of Object.keys(grads)) this.live.add(key);
    if (!(this.config.clipNorm > 0) && !this.scaler) {
      this.dispatch(layer, grads, 1);
      this.settle();
      return;
    }
    this.held.push({ layer, grads });
    this.sumSquares += sumSquares;
    if (this.pushedCount < this.pushed.length) return;
    const held = this.held.sort((a, b) => a.layer - b.layer);
    this.held = [];
    let scale = clipScale(this.sumSquares, this.config.clipNorm);
    if (this.scaler) {
      const o = lossScaleStep(this.scaler, this.sumSquares, (sq) =>
        clipScale(sq, this.config.clipNorm),
      );
      this.lastScaled = { scale: this.scaler.scale, skipped: o.skip };
      if (o.fault) {
        this.fail(
          new LayerwiseError(
            `step ${this.step}: the gradients are not finite even at loss scale ${this.scaler.scale}: a numeric fault, not f16's range; resume from the last checkpoint with a lower --lr`,
          ),
        );
        return;
      }
      this.scaler = o.next;
      if (o.skip) {
        // an overflow: nothing is updated (AdamW's step count included); each layer's version
        // still moves on, so the device goes on with the same parameters
        this.step--;
        for (const h of held) this.mem.markUpdated(h.layer);
        this.settle();
        return;
      }
      scale = o.gradScale;
    }
    for (const h of held) this.dispatch(h.layer, h.grads, scale);
    // once every layer is dispatched: a layer without gradients must not resolve idle() early
    this.settle();
  }

  /** Adds one part of layer's gradient to its sum; returns the sum at the last part, else null. */
  private sumPart(
    layer: number,
    grads: Record<string, Float32Array>,
  ): Record<string, Float32Array> | null {
    let p = this.partial.get(layer);
    if (!p) this.partial.set(layer, (p = { count: 0, grads: {} }));
    for (const [key, g] of Object.entries(grads)) {
      const sum = p.grads[key];
      if (!sum) {
        p.grads[key] = g;
        continue;
      }
      if (sum.length !== g.length)
        throw new RangeError(
          `gradient '${key}' of layer ${layer}: a part of ${g.length} elements after one of ${sum.length}`,
        );
      for (let i = 0; i < g.length; i++) sum[i]! += g[i]!;
    }
    if (++p.count < this.parts) return null;
    this.partial.delete(layer);
    return p.grads;
  }

  private dispatch(
    layer: number,
    grads: Record<string, Float32Array>,
    scale: number,
  ): void {
    const owner = this.owner[layer];
    const parts = new Map<number, { keys: string[]; grads: Float32Array[] }>();
    for (const key of this.mem.layout.layers[layer]) {
      // the layer's order, not the caller's
      const g = grads[key];
      if (g === undefined) continue;
      const t = owner.get(key)!;
      let part = parts.get(t);
      if (!part) parts.set(t, (part = { keys: [], grads: [] }));
      part.keys.push(key);
      part.grads.push(g);
    }
    if (parts.size === 0) {
      this.mem.markUpdated(layer); // push() settles once the whole batch of dispatches is out
      return;
    }
    const counter = parts.size === 1 ? -1 : (this.freeCounters.pop() ?? -2);
    if (counter >= 0) Atomics.store(this.counters, counter, parts.size);
    const job = this.nextJob++;
    this.jobs.set(job, { layer, parts: parts.size, counter });
    // Transfer lists first (copying a view whose buffer goes to another thread), then post:
    // posting detaches the buffers.
    const claimedBy = new Map<ArrayBufferLike, number>(); // buffer -> the part (thread) it goes to
    const transfers = new Map<number, ArrayBuffer[]>();
    for (const [t, part] of parts) {
      const transfer: ArrayBuffer[] = [];
      transfers.set(t, transfer);
      part.grads = part.grads.map((g) => {
        const buf = g.buffer;
        if (!(buf instanceof ArrayBuffer)) return g; // shared memory (or not a typed array): posted as is
        const by = claimedBy.get(buf);
        if (by === t) return g; // another key of this part in the same buffer: already in the list
        if (by !== undefined) g = g.slice(); // the buffer goes to another thread: copy this view
        claimedBy.set(g.buffer, t);
        transfer.push(g.buffer as ArrayBuffer);
        return g;
      });
    }
    for (const [t, part] of parts) {
      const msg: JobMessage = {
        type: 'job',
        job,
        layer,
        keys: part.keys,
        grads: part.grads,
        lr: this.lr,
        scale,
        t: this.step,
        counter,
      };
      this.workers[t].postMessage(msg, transfers.get(t));
    }
  }

  private onMessage(m: DoneMessage | ErrorMessage): void {
    if (m.type === 'error') {
      const job = this.jobs.get(m.job);
      this.fail(
        new EpsError(
          `optimizer thread ${m.thread}, layer ${job?.layer ?? '?'}: ${m.error.message}`,
          m.error.name,
        ),
      );
      return;
    }
    if (m.type !== 'done') return;
    this.spans.push({
      layer: this.jobs.get(m.job)?.layer ?? -1,
      thread: m.thread,
      startedAt: m.startedAt,
      ms: m.ms,
      params: m.params,
    });
    const job = this.jobs.get(m.job);
    if (!job) return;
    if (--job.parts > 0) return;
    this.jobs.delete(m.job);
    if (job.counter === -2) this.mem.markUpdated(job.layer);
    if (job.counter >= 0) this.freeCounters.push(job.counter);
    this.settle();
  }

  private settle(): void {
    if (this.failure || this.jobs.size > 0 || this.held.length > 0) return;
    const ws = this.waiters;
    this.waiters = [];
    for (const w of ws) w.resolve();
  }

  private fail(e: Error): void {
    if (this.failure || this.closed) return;
    this.failure = e;
    this.mem.stop(STORE_FAILED);
    const ws = this.waiters;
    this.waiters = [];
    for (const w of ws) w.reject(e);
  }

  /**
   * Resolves when every pushed gradient has been applied (with clipping, this includes the
   * held gradients of a step whose other layers are still to come: it waits for them).
   * Rejects with the optimizer thread's error ({@link EpsError}, message naming the thread,
   * layer and key) if one failed, or if the server is closed meanwhile.
   */
  idle(): Promise<void> {
    if (this.failure) return Promise.reject(this.failure);
    if (this.closed)
      return Promise.reject(new EpsError('parameter server was closed'));
    if (this.jobs.size === 0 && this.held.length === 0)
      return Promise.resolve();
    return new Promise((resolve, reject) =>
      this.waiters.push({ resolve, reject }),
    );
  }

  /** f16: the loss scale the devices apply to this step's losses (1 without loss scaling). */
  get lossScale(): number {
    return this.scaler?.scale ?? 1;
  }

  /** f16: the scale of the last complete step and whether it overflowed (null: no loss scaling, or no step yet). */
  get lastLossScale(): {
    scale: number;
    skipped: boolean;
    overflows: number;
  } | null {
    return this.lastScaled && this.scaler
      ? { ...this.lastScaled, overflows: this.scaler.overflows }
      : null;
  }

  /** f16: the loss scaler's state (checkpoints), and continuing from one. */
  lossScaleState(): LossScaleState | undefined {
    return this.scaler ? { ...this.scaler } : undefined;
  }
  setLossScaleState(s: LossScaleState): void {
    if (this.scaler) this.scaler = { ...s };
  }

  /** Update spans since the last call (one per part of a layer's update), in completion order. */
  takeSpans(): ServerSpan[] {
    const s = this.spans;
    this.spans = [];
    return s;
  }

  /** Fresh fp32 copies of every parameter, after {@link idle}. Rejects as idle() does. */
  async getParams(): Promise<HostParams> {
    await this.idle();
    const out: HostParams = new Map();
    for (const key of this.mem.keys())
      out.set(key, this.mem.param(key).slice());
    return out;
  }

  /**
   * The optimizer state in {@link DeviceOptimizer}'s format, after {@link idle}: the step
   * count and, for each parameter that has slots (it had a gradient, or a loaded state gave
   * them), copies of its slots. `{step: 0, slots: {}}` before the first step; no slots for SGD
   * without momentum.
   */
  async getOptimizerState(): Promise<OptimizerState> {
    await this.idle();
    const slots: OptimizerState['slots'] = {};
    for (const key of this.mem.keys()) {
      if (!this.live.has(key)) continue;
      const s = this.mem.slots(key);
      const names = Object.keys(s);
      if (names.length === 0) continue;
      slots[key] = Object.fromEntries(names.map((n) => [n, s[n].slice()]));
    }
    return { step: this.step, slots };
  }

  /**
   * Restores a state from {@link getOptimizerState} or {@link DeviceOptimizer.getState}, after
   * {@link idle}: the step count (the next step is step + 1) and the slots of the keys it names;
   * every other key's slots are zeroed (created at its next gradient, as on a device). A key
   * given only some slots gets the others zeroed. Versions are not changed.
   * Throws {@link LayerwiseError} (changing nothing) for a step that is not a non-negative
   * integer, an unknown parameter key, a slot name this optimizer does not have (e.g. 'velocity'
   * under AdamW) or a slot of the wrong length; the server's error if it failed.
   */
  async setOptimizerState(s: OptimizerState): Promise<void> {
    await this.idle();
    this.usable('set the optimizer state');
    check(
      Number.isInteger(s.step) && s.step >= 0,
      `optimizer state step must be a non-negative integer, got ${s.step}`,
    );
    const names = slotNames(this.config);
    for (const [key, rec] of Object.entries(s.slots)) {
      check(
        this.mem.layerOf(key) !== undefined,
        `optimizer state names parameter '${key}', which this model does not have`,
      );
      const n = this.mem.param(key).length;
      for (const [name, arr] of Object.entries(rec)) {
        check(
          names.includes(name),
          `optimizer state '${key}.${name}' is not a slot of ${this.config.kind}${this.config.kind === 'sgd' ? ` with momentum ${this.config.momentum}` : ''} (its slots: ${names.join(', ') || 'none'})`,
        );
        check(
          arr !== null && typeof arr === 'object' && arr.length === n,
          `optimizer state '${key}.${name}' has ${arr?.length} values, parameter has ${n}`,
        );
      }
    }
    this.live.clear();
    for (const key of this.mem.keys()) {
      const slots = this.mem.slots(key);
      const given = s.slots[key];
      if (given) this.live.add(key);
      for (const name of Object.keys(slots)) {
        const arr = given?.[name];
        if (arr) slots[name].set(arr);
        else slots[name].fill(0);
      }
    }
    this.step = s.step;
    this.stepOpen = false;
  }

  /**
   * Stops the optimizer threads (an update in progress is abandoned: call {@link idle} first to
   * keep it), rejects pending {@link idle} calls and wakes version waiters with an error.
   * Safe to call twice.
   */
  async close(): Promise<void> {
    if (this.closed) return;
    this.closed = true;
    this.mem.stop(STORE_CLOSED);
    const ws = this.waiters;
    this.waiters = [];
    for (const w of ws) w.reject(new EpsError('parameter server was closed'));
    await Promise.all(this.workers.map((w) => w.terminate()));
  }
}

/**
 * Per layer, which thread updates each key: longest tensor first onto the thread with the least
 * work in this layer (ties: least work overall), so a layer's parts are balanced by element
 * count and one-tensor layers alternate between threads.
 */
function assignThreads(
  layout: StoreLayout,
  threads: number,
): Array<Map<string, number>> {
  const total = new Array<number>(threads).fill(0);
  const size = (k: string) => layout.shapes[k].reduce((a, b) => a * b, 1);
  return layout.layers.map((keys) => {
    const load = new Array<number>(threads).fill(0);
    const owner = new Map<string, number>();
    const sorted = [...keys].sort((a, b) => size(b) - size(a));
    for (const k of sorted) {
      let best = 0;
      for (let t = 1; t < threads; t++) {
        if (
          load[t] < load[best] ||
          (load[t] === load[best] && total[t] < total[best])
        )
          best = t;
      }
      owner.set(k, best);
      load[best] += size(k);
      total[best] += size(k);
    }
    // keep the layer's key order in the map (dispatch iterates the layout's order anyway)
    return new Map(keys.map((k) => [k, owner.get(k)!]));
  });
}

/** Sum of squares of every element of `grads`, accumulated in double. */
function squaredNorm(grads: Record<string, Float32Array>): number {
  let sum = 0;
  for (const g of Object.values(grads))
    for (let i = 0; i < g.length; i++) sum += g[i]! * g[i]!;
  return sum;
}
