/**
 * The main thread's handle on one device: a worker thread running runtime/worker.js, spoken to
 * with a small request/reply protocol over a {@link Channel}. A worker that crashes or exits
 * rejects every pending call, so a failing stage stops the whole run.
 */
import { Worker, type TransferListItem } from 'node:worker_threads';
import { configureOpenMP } from '../backend/native-addon.js';
import { Channel, type Message } from './channel.js';
import type { StageApi } from './protocol.js';
import type { LayerGrads } from '../pipeline/executor.js';

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
  constructor(readonly stage: number, message: string, readonly causeName?: string, readonly schedule?: string) {
    super(`stage ${stage}: ${message}`);
  }
}

export class StageWorker {
  private readonly worker: Worker;
  private readonly ch: Channel;
  private nextId = 0;
  private closed = false;
  /** Resolves when the worker thread has exited. */
  readonly exited: Promise<number>;

  constructor(readonly index: number) {
    configureOpenMP(); // before any device thread may load the native addon
    this.worker = new Worker(new URL('./worker.js', import.meta.url));
    this.ch = new Channel(this.worker);
    this.worker.on('error', (e) => this.ch.fail(new StageError(index, `worker crashed: ${e.message}`)));
    this.exited = new Promise((resolve) => {
      this.worker.on('exit', (code) => {
        if (!this.closed) this.ch.fail(new StageError(index, `worker exited with code ${code}`));
        resolve(code);
      });
    });
  }

  /** Calls a worker method and waits for its reply. Throws {@link StageError} on failure. */
  async call<K extends keyof StageApi>(method: K, args: StageApi[K][0], transfer: readonly TransferListItem[] = []): Promise<StageApi[K][1]> {
    if (this.closed) throw new StageError(this.index, `worker was stopped; cannot call ${method}`);
    const id = this.nextId++;
    this.ch.send({ type: 'request', id, method, args }, transfer);
    const r = await this.ch.recv<Reply>('reply');
    if (r.id !== id) throw new StageError(this.index, `protocol error: reply ${r.id} to request ${id}`);
    if (r.error) {
      const e = new StageError(this.index, r.error.message, r.error.name, r.error.schedule);
      if (r.error.stack) e.stack = `${e.message}\n--- in the worker ---\n${r.error.stack}`;
      throw e;
    }
    return r.result as StageApi[K][1];
  }

  /** Waits for the stage's squared gradient norm (during a step's reduce_grad_norm). */
  async recvGradNorm(): Promise<number> {
    return (await this.ch.recv<Message & { sumSquares: number }>('norm')).sumSquares;
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

  /** Stops the worker thread at once. */
  async terminate(): Promise<void> {
    if (!this.closed) this.ch.fail(new StageError(this.index, 'worker was stopped'));
    this.closed = true;
    await this.worker.terminate();
  }
}
