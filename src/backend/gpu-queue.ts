/**
 * The GPU command queue of this thread's backend, as the layers above see it (webgpu only; every
 * function here is a no-op, or answers null, on the other backends).
 *
 * tfjs-backend-webgpu 4.22 works lazily: `tf.tensor(values)` keeps `values` on the host until a
 * kernel first reads the tensor (`uploadToGPU` then copies them into a mapped staging buffer and
 * queues a copy), and kernels are encoded into one command encoder that is submitted every
 * `WEBGPU_DEFERRED_SUBMIT_BATCH_SIZE` (15) dispatches or when something is read. So without help
 * a "prefetch" moves nothing, and a layer's last few kernels may sit unsubmitted while the host
 * goes on. Here:
 * - {@link makeResident} uploads tensors at once and submits the copies;
 * - {@link GpuQueue.flush} submits whatever is queued; {@link GpuQueue.submit} does too and
 *   returns a promise of the time the GPU finished all submitted work
 *   (`GPUQueue.onSubmittedWorkDone`), without blocking the host; {@link GpuQueue.poll} lets that
 *   promise resolve on time;
 * - the backend's `submitQueue` is wrapped (once per backend instance) to note when the current
 *   action first submitted work and how long the host was held inside `queue.submit` (on a
 *   software GPU, Mesa's llvmpipe behind Dawn's OpenGL backend, the GPU's work runs there,
 *   synchronously).
 */
import { openSync, readSync } from 'node:fs';
import { LayerwiseError } from '../util/errors.js';
import type { GpuCounts, KernelTime } from './gpu-counts.js';
import { tf } from './tfjs.js';

/** The slice of WebGPU's GPUCommandEncoder the pass timer uses. */
interface EncoderLike {
  beginComputePass(d?: Record<string, unknown>): unknown;
  resolveQuerySet(
    q: unknown,
    first: number,
    count: number,
    dst: unknown,
    offset: number,
  ): void;
  copyBufferToBuffer(
    src: unknown,
    srcOffset: number,
    dst: unknown,
    dstOffset: number,
    size: number,
  ): void;
}

/** The slice of WebGPU's GPUBuffer the pass timer uses. */
interface MappableBuffer {
  mapAsync(mode: number): Promise<void>;
  getMappedRange(): ArrayBuffer;
  unmap(): void;
}

/** The parts of tfjs-backend-webgpu's WebGPUBackend used here (4.22: backend_webgpu.js). */
interface WebGPUBackendLike {
  device: {
    queue: {
      onSubmittedWorkDone(): Promise<void>;
      submit(commandBuffers: unknown[]): void;
    };
    features: { has(name: string): boolean };
    createQuerySet(d: { type: 'timestamp'; count: number }): unknown;
    createBuffer(d: { size: number; usage: number }): MappableBuffer;
  };
  commandEncoder: EncoderLike | null;
  ensureCommandEncoderReady(): void;
  endComputePassEncoder(): void;
  submitQueue(): void;
  getBufferData(buffer: unknown): Promise<unknown>;
  runWebGPUProgram(...args: unknown[]): unknown;
  uploadToGPU(dataId: object): void;
  tensorMap: { get(dataId: object): { resource?: unknown } | undefined };
}

/** What one {@link GpuQueue.submit} reports about the action it closes. */
export interface GpuSubmit {
  /** performance.now() of the action's first submit (a batch, a read, or this one); null if it submitted nothing. */
  firstSubmitAt: number | null;
  /** performance.now() right after this submit returned. */
  submittedAt: number;
  /** Host milliseconds spent inside `queue.submit` during the action (on a synchronous software GPU: its execution). */
  submitMs: number;
  /** Resolves with performance.now() when the GPU has finished every command submitted so far (NaN if the device was lost). */
  done: Promise<number>;
  /**
   * performance.now() by which the GPU had certainly finished this action's work: a read (a
   * download) that completed after the action's last submit; null when work was submitted after
   * the last read. `done` arrives a host turn or more after the GPU finished; this does not.
   */
  idleBy: number | null;
}

/** This thread's /proc/thread-self/schedstat, open (null: not yet; false: cannot be read here). */
let schedstat: number | null | false = null;
const schedstatBytes = new Uint8Array(128);

/**
 * CPU time the calling thread has run so far, ms (ns resolution): the first field of Linux's
 * /proc/thread-self/schedstat (ns on a CPU; a synchronous read, so in a worker it is the
 * worker's thread). Node 20 has no per-thread CPU clock (process.threadCpuUsage is Node 23.9).
 * The file is opened once per thread (this module's state is per thread: a worker has its own)
 * and read again from its start each call: about 1 us, where readFileSync took 8-11 us and left
 * a 64 KiB buffer to collect each time. undefined where the file cannot be read (other systems,
 * the browser); tried once.
 */
export function threadCpuMs(): number | undefined {
  if (schedstat === false) return undefined;
  try {
    schedstat ??= openSync('/proc/thread-self/schedstat', 'r');
    const n = readSync(schedstat, schedstatBytes, 0, schedstatBytes.length, 0);
    // the first field's decimal digits (ns: exact in a double for 104 days of CPU)
    let ns = 0;
    let i = 0;
    for (; i < n && schedstatBytes[i]! >= 48 && schedstatBytes[i]! <= 57; i++)
      ns = ns * 10 + schedstatBytes[i]! - 48;
    if (i > 0 && schedstatBytes[i] === 32) return ns / 1e6;
  } catch {
    // not Linux, or no /proc
  }
  schedstat = false;
  return undefined;
}

/**
 * Where the device has timestamp queries: the seconds the GPU spent in compute passes (the sum
 * of each pass's end minus begin timestamps) over a step, and that step's wall seconds on the
 * device. A step's busy time is known only after its work has run, so a step reports the
 * previous one's. Their ratio is the GPU's busy fraction (`gpu_busy`).
 */
export interface GpuBusy {
  busySeconds: number;
  stepSeconds: number;
  /**
   * With {@link KERNEL_TIMES_ENV}: the busy seconds by kernel (each dispatch timed in a pass of
   * its own), with how many dispatches each label had.
   */
  kernels?: Record<string, KernelTime>;
}

/** What {@link GpuQueue.endStep} resolves with: the step's seconds in compute passes and, with {@link KERNEL_TIMES_ENV}, by kernel. */
export interface PassTimes {
  seconds: number;
  kernels?: Record<string, KernelTime>;
}

/**
 * `LAYERWISE_WEBGPU_KERNEL_TIMES=1` (where the device has timestamp queries): every dispatch
 * runs in a compute pass of its own, timed, and summary.json's `gpu_kernels` gives the GPU ms
 * per step by kernel (TF.js's program or layerwise's pipeline, with its output shape). A pass per
 * dispatch costs the host a begin and an end each and the GPU a barrier between dispatches, so
 * a run with it is for finding where the GPU's time goes, not for its tokens/s. A captured step's
 * replayed passes (pipeline/captured-step.ts) are timed as '(other passes)': run it without
 * LAYERWISE_WEBGPU_CAPTURE (the kernels' GPU time is the same either way).
 */
export const KERNEL_TIMES_ENV = 'LAYERWISE_WEBGPU_KERNEL_TIMES';

/** GPUBufferUsage and GPUMapMode flags (globals only where Dawn installed them). */
const MAP_READ = 0x01;
const COPY_SRC = 0x04;
const COPY_DST = 0x08;
const QUERY_RESOLVE = 0x200;

/**
 * The GPU's busy time per step from timestamp queries: every compute pass begun on TF.js's
 * command encoders while a step is timed (layerwise's own passes included) gets a begin and an
 * end timestamp (`timestampWrites`), unless it has its own (TF.js's `tf.time`); at the step's
 * end the timestamps are resolved and copied to a mapped buffer on the GPU's queue, and read
 * when the GPU gets there, without waiting (so a step's figure comes with the next step).
 * Passes past {@link PassTimer.CAPACITY} in a step leave the step untimed.
 */
class PassTimer {
  static readonly CAPACITY = 4096; // timestamps: 2,048 passes a step
  private readonly querySet: unknown;
  private readonly resolveBuffer: unknown;
  /** Mapped-read buffers not in use (reused from step to step). */
  private readonly free: MappableBuffer[] = [];
  private next = 0;
  private armed = false;
  private overflow = false;
  /** The kernel the next passes belong to (set by {@link GpuQueue.kernel}), and each timed pass's kernel this step, by pass. */
  label: string | null = null;
  private labels: string[] = [];

  constructor(private readonly backend: WebGPUBackendLike) {
    const d = backend.device;
    this.querySet = d.createQuerySet({
      type: 'timestamp',
      count: PassTimer.CAPACITY,
    });
    this.resolveBuffer = d.createBuffer({
      size: PassTimer.CAPACITY * 8,
      usage: QUERY_RESOLVE | COPY_SRC,
    });
  }

  /** Makes `e`'s compute passes write timestamps while a step is timed (once per encoder: {@link GpuQueue}'s encoder hook). */
  patch(e: EncoderLike): void {
    const begin = e.beginComputePass.bind(e);
    e.beginComputePass = (d: Record<string, unknown> = {}) => {
      if (!this.armed || d.timestampWrites) return begin(d);
      if (this.next + 2 > PassTimer.CAPACITY) {
        this.overflow = true;
        return begin(d);
      }
      const i = this.next;
      this.next += 2;
      this.labels[i / 2] = this.label ?? UNLABELLED;
      return begin({
        ...d,
        timestampWrites: {
          querySet: this.querySet,
          beginningOfPassWriteIndex: i,
          endOfPassWriteIndex: i + 1,
        },
      });
    };
  }

  /** Starts timing a step's passes. */
  begin(): void {
    this.next = 0;
    this.overflow = false;
    this.armed = true;
    this.labels = [];
  }

  /**
   * Ends the step: queues the resolve and copy of its timestamps (one submit) and resolves with
   * the seconds its passes took (and, `byKernel`, by each pass's label), once the GPU has run
   * them; null where nothing was timed, the passes overflowed the query set, or the device was
   * lost.
   */
  end(byKernel: boolean): Promise<PassTimes | null> {
    this.armed = false;
    const n = this.next;
    const labels = this.labels;
    if (n === 0 || this.overflow) return Promise.resolve(null);
    const b = this.backend;
    b.ensureCommandEncoderReady();
    b.endComputePassEncoder();
    const staging =
      this.free.pop() ??
      b.device.createBuffer({
        size: PassTimer.CAPACITY * 8,
        usage: MAP_READ | COPY_DST,
      });
    b.commandEncoder!.resolveQuerySet(
      this.querySet,
      0,
      n,
      this.resolveBuffer,
      0,
    );
    b.commandEncoder!.copyBufferToBuffer(
      this.resolveBuffer,
      0,
      staging,
      0,
      n * 8,
    );
    b.submitQueue();
    return staging.mapAsync(MAP_READ).then(
      () => {
        const t = new BigUint64Array(staging.getMappedRange(), 0, n);
        let ns = 0;
        const kernels: Record<string, KernelTime> = {};
        for (let i = 0; i < n; i += 2) {
          const d = t[i + 1]! > t[i]! ? Number(t[i + 1]! - t[i]!) : 0;
          ns += d;
          if (!byKernel) continue;
          const k = (kernels[labels[i / 2]!] ??= { seconds: 0, dispatches: 0 });
          k.seconds += d / 1e9;
          k.dispatches++;
        }
        staging.unmap();
        this.free.push(staging);
        return { seconds: ns / 1e9, ...(byKernel ? { kernels } : {}) };
      },
      () => null,
    );
  }
}

/** The webgpu backend's queue with the bookkeeping of {@link GpuSubmit} and {@link GpuCounts}. */
export class GpuQueue {
  private firstSubmitAt: number | null = null;
  private submitMs = 0;
  /** Submits of work so far, and the count and time when a read last found the GPU done with all of them. */
  private submits = 0;
  private idle: { seq: number; at: number } | null = null;
  private dispatches = 0;
  private readbacks = 0;
  private copies = 0;
  private replays = 0;
  /** Timestamps on every compute pass, where the device has 'timestamp-query' (TF.js asks for it where the adapter has it). */
  private readonly timer: PassTimer | null;
  /** Reads in flight, the thread's CPU ms when the first of them began, and the CPU ms spent with reads in flight so far. */
  private reading = 0;
  private readingSince = 0;
  private pollMs = 0;

  /** Whether each dispatch is timed in a pass of its own ({@link KERNEL_TIMES_ENV}). */
  readonly timesKernels: boolean;

  constructor(private readonly backend: WebGPUBackendLike) {
    this.timer = backend.device.features.has('timestamp-query')
      ? new PassTimer(backend)
      : null;
    this.timesKernels =
      this.timer !== null &&
      globalThis.process?.env?.[KERNEL_TIMES_ENV] === '1';
    const submit = backend.submitQueue.bind(backend);
    backend.submitQueue = () => {
      const t = performance.now();
      submit();
      this.submits++;
      this.firstSubmitAt ??= t;
      this.submitMs += performance.now() - t;
    };
    // a read queues a copy after everything submitted, submits it and waits for it: when it
    // completes with nothing submitted since, the GPU has finished all the work so far
    const read = backend.getBufferData.bind(backend);
    backend.getBufferData = async (buffer: unknown) => {
      this.readbacks++;
      const seq = this.submits + 1; // its own copy's submit
      if (this.reading++ === 0) this.readingSince = threadCpuMs() ?? 0;
      try {
        const values = await read(buffer);
        if (this.submits === seq) this.idle = { seq, at: performance.now() };
        return values;
      } finally {
        if (--this.reading === 0)
          this.pollMs += (threadCpuMs() ?? 0) - this.readingSince;
      }
    };
    const run = backend.runWebGPUProgram.bind(backend);
    backend.runWebGPUProgram = (...args: unknown[]) => {
      this.dispatches++;
      if (!this.timesKernels) return run(...args);
      return this.kernel(programLabel(args[0]), () => run(...args));
    };
    this.hookEncoders();
  }

  /**
   * One hook on TF.js's command encoders (a new one after each submit), made when the backend
   * opens one: counts every copyBufferToBuffer recorded on it and, with timestamp queries, lets
   * the pass timer time its compute passes. TF.js calls ensureCommandEncoderReady before every
   * program it records, so the hook checks only whether the encoder is still the one it patched.
   */
  private hookEncoders(): void {
    const b = this.backend;
    let patched: EncoderLike | null = null;
    const patch = (e: EncoderLike | null) => {
      if (!e || e === patched) return;
      patched = e;
      const copy = e.copyBufferToBuffer.bind(e);
      e.copyBufferToBuffer = (...args) => {
        this.copies++;
        copy(...args);
      };
      this.timer?.patch(e);
    };
    patch(b.commandEncoder); // one opened before this queue was made
    const ready = b.ensureCommandEncoderReady.bind(b);
    b.ensureCommandEncoderReady = () => {
      ready();
      patch(b.commandEncoder);
    };
  }

  /** The counts so far (see {@link GpuCounts}). */
  counts(): GpuCounts {
    const cpu = threadCpuMs();
    const pollMs =
      this.pollMs +
      (this.reading > 0 && cpu !== undefined ? cpu - this.readingSince : 0);
    return {
      dispatches: this.dispatches,
      submits: this.submits,
      readbacks: this.readbacks,
      copies: this.copies,
      replays: this.replays,
      ...(cpu === undefined ? {} : { hostMs: cpu - pollMs, pollMs }),
    };
  }

  /**
   * Records `record`'s dispatch under `label`: with {@link KERNEL_TIMES_ENV}, in a compute pass
   * of its own (the open pass ended before and after), whose time counts for `label`; otherwise
   * just calls it. Returns what `record` returns. TF.js's programs come through here from the
   * `runWebGPUProgram` hook, layerwise's pipelines from webgpu-multi.ts `dispatch`.
   */
  kernel<T>(label: string, record: () => T): T {
    if (!this.timesKernels || !this.timer) return record();
    this.backend.endComputePassEncoder();
    this.timer.label = label;
    try {
      return record();
    } finally {
      this.backend.endComputePassEncoder();
      this.timer.label = null;
    }
  }

  /** Counts `n` dispatches recorded outside TF.js's programs (layerwise's own pipelines, backend/webgpu-multi.ts). */
  countDispatches(n: number): void {
    this.dispatches += n;
  }

  /**
   * Counts one replayed recording and what it submitted outside TF.js (`c`: what
   * backend/webgpu-commands.ts replayCommands returned).
   */
  countReplayed(c: {
    dispatches: number;
    copies: number;
    submits: number;
  }): void {
    this.dispatches += c.dispatches;
    this.copies += c.copies;
    this.submits += c.submits;
    this.replays++;
  }

  /**
   * Times the compute passes later recorded on `encoder` as TF.js's are timed (with timestamp
   * queries; no-op without): for an encoder made outside TF.js (a replayed recording's).
   */
  timePasses(encoder: object): void {
    this.timer?.patch(encoder as EncoderLike);
  }

  /** Whether {@link endStep} measures the GPU's busy time (the device has timestamp queries). */
  get timesPasses(): boolean {
    return this.timer !== null;
  }

  /** Starts timing a step's compute passes (no-op without timestamp queries). */
  beginStep(): void {
    this.timer?.begin();
  }

  /**
   * Ends the step's timing: resolves, once the GPU has run the step's work, with the seconds the
   * GPU spent in its compute passes, by kernel with {@link KERNEL_TIMES_ENV} (null without
   * timestamp queries or when the step could not be timed). Queues a copy of the timestamps and
   * submits it; does not wait.
   */
  endStep(): Promise<PassTimes | null> {
    return this.timer
      ? this.timer.end(this.timesKernels)
      : Promise.resolve(null);
  }

  /** Starts a new action: forgets the previous one's submits. */
  begin(): void {
    this.firstSubmitAt = null;
    this.submitMs = 0;
  }

  /** Submits the commands queued so far (none queued: nothing to do). */
  flush(): void {
    if (!this.backend.commandEncoder) return;
    this.backend.endComputePassEncoder();
    this.backend.submitQueue();
  }

  /**
   * Ends an action: submits its queued commands and asks the GPU to report when it has
   * finished them. Does not wait.
   */
  submit(): GpuSubmit {
    this.flush();
    const submittedAt = performance.now();
    const done = this.backend.device.queue.onSubmittedWorkDone().then(
      () => performance.now(),
      () => NaN,
    );
    // an empty submit after the request: on Dawn's OpenGL backend (Mesa) the completion was
    // otherwise reported only at the next real submit, one action late; with it, at the next turn
    this.backend.device.queue.submit([]);
    const idleBy =
      this.idle !== null && this.idle.seq === this.submits
        ? this.idle.at
        : null;
    const r = {
      firstSubmitAt: this.firstSubmitAt,
      submittedAt,
      submitMs: this.submitMs,
      done,
      idleBy,
    };
    this.begin();
    return r;
  }

  /** Uploads the tensors' values to GPU buffers now and submits the copies. */
  makeResident(tensors: readonly tf.Tensor[]): void {
    for (const t of tensors) this.backend.uploadToGPU(t.dataId);
    this.flush();
  }

  /**
   * One turn of the event loop, in which Dawn's Node bindings deliver the notifications of
   * finished work (they poll from a setImmediate task: a host that only chains promises never
   * lets them run, and `onSubmittedWorkDone` would resolve at the next real wait instead of when
   * the GPU finished). About 0.3-0.5 ms.
   */
  poll(): Promise<void> {
    return new Promise((resolve) => setImmediate(resolve));
  }

  /**
   * Submits what is queued and resolves once the GPU has finished everything submitted so far,
   * polling the event loop meanwhile ({@link poll}): the GPU caught up, for a bench or a test
   * that times or records one step at a time.
   */
  async caughtUp(): Promise<void> {
    let finished = false;
    void this.submit().done.then(() => {
      finished = true;
    });
    while (!finished) await this.poll();
  }

  /** Whether the tensor's values are in a GPU buffer (not only on the host, waiting for first use). */
  isResident(t: tf.Tensor): boolean {
    return this.backend.tensorMap.get(t.dataId)?.resource != null;
  }
}

/** The label of passes begun outside {@link GpuQueue.kernel} (a replayed recording's, a copy's). */
const UNLABELLED = '(other passes)';

/**
 * A TF.js program's label for kernel times: its own `label` where it has one (layerwise's
 * products: batch x M x N x K), else layerwise's programs by their shader key, TF.js's by class
 * (and op, where it has one), each with its output shape.
 */
function programLabel(program: unknown): string {
  const p = program as {
    label?: unknown;
    shaderKey?: string;
    op?: unknown;
    outputShape?: number[];
    constructor?: { name?: string };
  };
  if (typeof p.label === 'string') return p.label;
  const name =
    typeof p.shaderKey === 'string' && p.shaderKey.startsWith('lw_')
      ? p.shaderKey
      : `${p.constructor?.name ?? 'program'}${p.op === undefined ? '' : `:${String(p.op)}`}`;
  return `${name} [${p.outputShape ?? []}]`;
}

const queues = new WeakMap<object, GpuQueue>();

/** TF.js 4.22's default dispatches per submit (WEBGPU_DEFERRED_SUBMIT_BATCH_SIZE). */
export const TFJS_SUBMIT_BATCH = 15;

/**
 * `LAYERWISE_WEBGPU_SUBMIT_BATCH=n`: TF.js submits its command encoder every n dispatches
 * (`WEBGPU_DEFERRED_SUBMIT_BATCH_SIZE`, default {@link TFJS_SUBMIT_BATCH}) and at every read.
 * Fewer submits cost the host less (each `queue.submit` took about 220 us on an H200, 11 a
 * charlm-small step) but start the GPU's work later; which wins depends on how host-bound the
 * step is, so it is a setting to measure on a GPU, not a default changed blind. Undefined or
 * empty keeps TF.js's value. Called by initBackend('webgpu') once the webgpu package has
 * registered its flags.
 * @throws LayerwiseError when `value` is not a positive integer, naming the variable.
 */
export function setSubmitBatch(value: string | undefined): void {
  if (value === undefined || value === '') return;
  const n = Number(value);
  if (!Number.isInteger(n) || n < 1)
    throw new LayerwiseError(
      `LAYERWISE_WEBGPU_SUBMIT_BATCH must be a positive integer (dispatches per submit; TF.js's default is ${TFJS_SUBMIT_BATCH}), got '${value}'`,
    );
  tf.env().set('WEBGPU_DEFERRED_SUBMIT_BATCH_SIZE', n);
}

/** This thread's backend's GPU queue: one per webgpu backend instance; null on other backends. */
export function gpuQueue(): GpuQueue | null {
  if (tf.getBackend() !== 'webgpu') return null;
  const b = tf.backend() as unknown as WebGPUBackendLike;
  let q = queues.get(b);
  if (!q) queues.set(b, (q = new GpuQueue(b)));
  return q;
}

/**
 * Makes the tensors' values resident on the device now: on webgpu, uploads them and submits the
 * copies (TF.js would upload them only when a kernel first reads them). No-op on the other
 * backends (wasm copies at creation; cpu and native compute on the host array itself).
 * Returns whether it copied the values (the caller may then reuse the host arrays).
 */
export function makeResident(tensors: readonly tf.Tensor[]): boolean {
  const q = gpuQueue();
  q?.makeResident(tensors);
  return q !== null;
}
