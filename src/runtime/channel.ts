/**
 * One channel abstraction for every link: main thread <-> worker and stage <-> stage. It wraps
 * anything with `postMessage` and message events (a worker_threads Worker, its parentPort or a
 * MessagePort) and turns incoming messages into per-type FIFO queues that can be awaited.
 */
import type { TransferListItem } from 'node:worker_threads';
import { coversOwnBuffer } from '../util/buffers.js';

/** Messages are plain objects with a `type` tag. */
export interface Message {
  type: string;
  [k: string]: unknown;
}

/** The endpoint types we can wrap. */
export interface PortLike {
  postMessage(value: unknown, transferList?: readonly TransferListItem[]): void;
  on(event: 'message', listener: (value: unknown) => void): unknown;
}

export class Channel {
  private readonly queues = new Map<string, Message[]>();
  private readonly waiters = new Map<string, Array<(m: Message) => void>>();
  private failure: Error | null = null;
  private readonly failers = new Set<(e: Error) => void>();

  constructor(private readonly port: PortLike) {
    port.on('message', (v) => this.deliver(v as Message));
  }

  /** Sends a message; buffers in `transfer` move to the receiver. */
  send(msg: Message, transfer: readonly TransferListItem[] = []): void {
    this.port.postMessage(msg, transfer);
  }

  /** The next message of this type (FIFO); rejects if the channel has failed. */
  recv<T extends Message = Message>(type: string): Promise<T> {
    if (this.failure) return Promise.reject(this.failure);
    const q = this.queues.get(type);
    if (q?.length) return Promise.resolve(q.shift() as T);
    return new Promise<T>((resolve, reject) => {
      const list = this.waiters.get(type) ?? [];
      const onFail = (e: Error) => reject(e);
      this.failers.add(onFail);
      list.push((m) => {
        this.failers.delete(onFail);
        resolve(m as T);
      });
      this.waiters.set(type, list);
    });
  }

  /** The next message of this type if one has arrived, else null (never waits). */
  tryRecv<T extends Message = Message>(type: string): T | null {
    if (this.failure) throw this.failure;
    const q = this.queues.get(type);
    return q?.length ? (q.shift() as T) : null;
  }

  /** Rejects every pending and future receive with `e` (the peer died). */
  fail(e: Error): void {
    this.failure = e;
    for (const f of this.failers) f(e);
    this.failers.clear();
    this.waiters.clear();
  }

  private deliver(m: Message): void {
    const w = this.waiters.get(m.type);
    if (w?.length) {
      w.shift()!(m);
      return;
    }
    const q = this.queues.get(m.type) ?? [];
    q.push(m);
    this.queues.set(m.type, q);
  }
}

/**
 * A link between two devices (stage to stage, replica to replica) ended while the run used it:
 * a fault of the machines (the device at its other end died, the network dropped it), so
 * `--max-restarts` restarts the devices for it as for a lost device (train/restarts.ts).
 */
export class LinkLostError extends Error {
  override readonly name = 'LinkLostError';
}

/**
 * The ArrayBuffers behind the typed arrays in a message (up to 6 levels of nesting deep), to
 * transfer rather than copy: only a buffer a typed array covers whole, never a
 * SharedArrayBuffer (shared, not moved) nor a slice of a larger buffer (the rest would go too).
 */
export function ownedBuffers(v: unknown): ArrayBuffer[] {
  const out = new Set<ArrayBuffer>();
  const walk = (x: unknown, depth: number): void => {
    if (depth > 6 || x === null || typeof x !== 'object') return;
    if (ArrayBuffer.isView(x)) {
      if (coversOwnBuffer(x)) out.add(x.buffer as ArrayBuffer);
      return;
    }
    for (const y of Object.values(x)) walk(y, depth + 1);
  };
  walk(v, 0);
  return [...out];
}
