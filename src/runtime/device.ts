/**
 * The main thread's handle on one device, spoken to with a small request/reply protocol over a
 * {@link Channel}: {@link StageWorker} is a worker thread running runtime/worker.js;
 * runtime/remote-device.ts's RemoteDevice is a process on this or another host, over gRPC. A
 * device that crashes, exits or stops answering rejects every pending call, so a failing stage
 * stops the whole run.
 */
import { type TransferListItem, Worker } from 'node:worker_threads';
import { configureOpenMP } from '../backend/native-addon.js';
import { configureWebGPUEnvironment } from '../backend/webgpu.js';
import type { LayerGrads } from '../pipeline/executor.js';
import { Channel, type Message } from './channel.js';
import type { StageApi } from './protocol.js';

/** What a {@link StageWorker}'s thread (runtime/worker.ts) is started with. */
export interface WorkerData {
  /** The CPUs its kernel team is bound to (undefined: not pinned). */
  cpus: number[] | undefined;
}

interface Reply extends Message {
  id: number;
  result?: unknown;
  error?: { name: string; message: string; stack?: string; schedule?: string };
}

/**
 * Error raised in a stage worker, carrying the stage index, the name of the error there
 * (`causeName`) and, when an action of a step failed, the stage's schedule with that action
 * marked (`schedule`, see pipeline/executor.ts ScheduleError).
 */
export class StageError extends Error {
  override readonly name = 'StageError';
  constructor(
    readonly stage: number,
    message: string,
    readonly causeName?: string,
    readonly schedule?: string,
  ) {
    super(`stage ${stage}: ${message}`);
  }
}

/**
 * Whether `e` is a lost device (gone, exited, crashed: a StageError the device handle raised,
 * without a cause from inside the stage) or a link between two devices that was lost (the
 * stage's {@link LinkLostError}), rather than an error the stage raised: a fault of the
 * machines, which `--max-restarts` restarts.
 */
export const isDeviceLoss = (e: unknown): boolean =>
  e instanceof StageError &&
  (e.causeName === undefined || e.causeName === 'LinkLostError');

/** What every kind of device offers the strategies. */
export abstract class Device {
  protected abstract readonly ch: Channel;
  private nextId = 0;
  protected closed = false;
  /** Requests sent and not answered yet. */
  protected pending = 0;
  /** Whether the link to the device has failed (crashed, exited, lost). */
  protected failed = false;
  /** Whether the device has answered a request yet (a link lost before that never worked). */
  protected answered = false;

  constructor(readonly index: number) {}

  /** Where the device runs, for messages: 'worker thread', 'process 1234 at 127.0.0.1:40111', ... */
  abstract readonly where: string;

  /** Calls a worker method and waits for its reply. Throws {@link StageError} on failure. */
  async call<K extends keyof StageApi>(
    method: K,
    args: StageApi[K][0],
    transfer: readonly TransferListItem[] = [],
  ): Promise<StageApi[K][1]> {
    if (this.closed)
      throw new StageError(
        this.index,
        `worker was stopped; cannot call ${method}`,
      );
    const id = this.nextId++;
    this.pending++;
    let r: Reply;
    try {
      this.ch.send({ type: 'request', id, method, args }, transfer);
      r = await this.ch.recv<Reply>('reply');
    } catch (e) {
      this.failed = true;
      throw e;
    } finally {
      this.pending--;
    }
    this.answered = true;
    if (r.id !== id)
      throw new StageError(
        this.index,
        `protocol error: reply ${r.id} to request ${id}`,
      );
    if (r.error) {
      const e = new StageError(
        this.index,
        r.error.message,
        r.error.name,
        r.error.schedule,
      );
      if (r.error.stack)
        e.stack = `${e.message}\n--- in the worker ---\n${r.error.stack}`;
      throw e;
    }
    return r.result as StageApi[K][1];
  }

  /** Waits for the stage's squared gradient norm (during a step's reduce_grad_norm). */
  async recvGradNorm(): Promise<number> {
    return (await this.ch.recv<Message & { sumSquares: number }>('norm'))
      .sumSquares;
  }

  /** L2L: waits for the next layer gradient the relay hands to the parameter server. */
  async recvLayerGrads(): Promise<LayerGrads> {
    const m = await this.ch.recv<Message & LayerGrads>('grads');
    return { layer: m.layer, grads: m.grads, sumSquares: m.sumSquares };
  }

  /** Sends the global clipping scale back. */
  sendScale(scale: number): void {
    this.ch.send({ type: 'scale', scale });
  }

  /** Stops the device at once. */
  abstract terminate(): Promise<void>;
}

/**
 * A device that is a worker thread of this process. `cpus`: the CPUs it owns on this host
 * (runtime/pinning.ts threadPinning), which its native backend's OpenMP team is bound to, member
 * i to `cpus[i % cpus.length]`, once the backend starts (runtime/stage-host.ts); undefined: not
 * pinned.
 */
export class StageWorker extends Device {
  private readonly worker: Worker;
  protected readonly ch: Channel;
  readonly where = 'worker thread';
  /** Resolves when the worker thread has exited. */
  readonly exited: Promise<number>;

  constructor(index: number, cpus?: readonly number[]) {
    super(index);
    configureOpenMP(); // before any device thread may load the native addon
    configureWebGPUEnvironment(); // before any device thread may load Dawn
    const workerData: WorkerData = { cpus: cpus ? [...cpus] : undefined };
    this.worker = new Worker(new URL('./worker.js', import.meta.url), {
      workerData,
    });
    this.ch = new Channel(this.worker);
    this.worker.on('error', (e) =>
      this.ch.fail(new StageError(index, `worker crashed: ${e.message}`)),
    );
    this.exited = new Promise((resolve) => {
      this.worker.on('exit', (code) => {
        if (!this.closed)
          this.ch.fail(
            new StageError(index, `worker exited with code ${code}`),
          );
        resolve(code);
      });
    });
  }

  async terminate(): Promise<void> {
    if (!this.closed && !this.failed && this.pending === 0) {
      // a healthy worker frees its backend first (a GPU device's queue drained), within 5 s
      await Promise.race([
        this.call('shutdown', null).catch(() => undefined),
        new Promise((r) => setTimeout(r, 5000).unref()),
      ]);
    }
    if (!this.closed)
      this.ch.fail(new StageError(this.index, 'worker was stopped'));
    this.closed = true;
    await this.worker.terminate();
  }
}
