/**
 * `node:worker_threads` for the browser bundle: the library's worker threads become Web
 * Workers (module workers), and its MessagePorts the browser's own, with the Node-style
 * `on` / `once` / `off` the library calls. A worker's `workerData` is the first message its
 * parent sends (the shim's Worker sends it before anything else), awaited at the top level,
 * so `workerData` is set before the worker's own modules run, as in Node.
 */

type Listener = (value: unknown) => void;

/** The parts of a Web Worker's global scope this shim uses (the DOM lib does not declare it). */
interface DedicatedWorkerGlobalScope extends EventTarget {
  postMessage(value: unknown, transfer: Transferable[]): void;
  close(): void;
}

interface Emitter {
  on(event: string, fn: Listener): unknown;
  once(event: string, fn: Listener): unknown;
  off(event: string, fn: Listener): unknown;
}

/** Node-style listeners over an EventTarget's `message` events (`start()`ed like Node's ports). */
function addNodeEvents(proto: object): void {
  const wrapped = new WeakMap<Listener, EventListener>();
  const add = function (
    this: EventTarget & { start?: () => void },
    event: string,
    fn: Listener,
    once: boolean,
  ) {
    if (event !== 'message' && event !== 'messageerror' && event !== 'close')
      return this;
    const w: EventListener = (e) => fn((e as MessageEvent).data);
    wrapped.set(fn, w);
    this.addEventListener(event, w, { once });
    this.start?.();
    return this;
  };
  Object.assign(proto, {
    on(this: EventTarget, event: string, fn: Listener) {
      return add.call(this, event, fn, false);
    },
    once(this: EventTarget, event: string, fn: Listener) {
      return add.call(this, event, fn, true);
    },
    off(this: EventTarget, event: string, fn: Listener) {
      const w = wrapped.get(fn);
      if (w) this.removeEventListener(event, w);
      return this;
    },
    ref() {},
    unref() {},
  });
}

const BrowserMessagePort = globalThis.MessagePort;
if (BrowserMessagePort && !('on' in BrowserMessagePort.prototype))
  addNodeEvents(BrowserMessagePort.prototype);

export const MessagePort = BrowserMessagePort;
export const MessageChannel = globalThis.MessageChannel;

const inWorker =
  typeof (globalThis as { WorkerGlobalScope?: unknown }).WorkerGlobalScope !==
    'undefined' &&
  typeof (globalThis as { window?: unknown }).window === 'undefined';

/** Whether this is the page's main thread (false in a Web Worker). */
export const isMainThread = !inWorker;

/** The first message of a worker's parent: its `workerData`. */
interface WorkerInit {
  layerwiseWorkerData: unknown;
}

/** A Web Worker with Node's Worker interface (the parts the library uses). */
export class Worker implements Emitter {
  private readonly w: globalThis.Worker;
  private readonly listeners = new Map<string, Set<Listener>>();
  private exitCode: number | null = null;

  constructor(url: URL | string, opts: { workerData?: unknown } = {}) {
    this.w = new globalThis.Worker(url, { type: 'module' });
    const init: WorkerInit = { layerwiseWorkerData: opts.workerData ?? null };
    this.w.postMessage(init);
    this.w.addEventListener('message', (e) => this.emit('message', e.data));
    this.w.addEventListener('messageerror', () =>
      this.emit(
        'error',
        new Error('a message from the worker could not be read'),
      ),
    );
    this.w.addEventListener('error', (e) => {
      e.preventDefault();
      this.emit('error', new Error(e.message || 'the worker failed to load'));
      this.exit(1);
    });
  }

  private emit(event: string, value: unknown): void {
    for (const fn of [...(this.listeners.get(event) ?? [])]) fn(value);
  }

  private exit(code: number): void {
    if (this.exitCode !== null) return;
    this.exitCode = code;
    this.w.terminate();
    queueMicrotask(() => this.emit('exit', code));
  }

  on(event: string, fn: Listener): this {
    const set = this.listeners.get(event) ?? new Set();
    set.add(fn);
    this.listeners.set(event, set);
    return this;
  }

  once(event: string, fn: Listener): this {
    const once: Listener = (v) => {
      this.off(event, once);
      fn(v);
    };
    return this.on(event, once);
  }

  off(event: string, fn: Listener): this {
    this.listeners.get(event)?.delete(fn);
    return this;
  }

  postMessage(value: unknown, transfer: readonly Transferable[] = []): void {
    this.w.postMessage(value, [...transfer]);
  }

  /** Stops the worker; resolves with its exit code (1: terminated). */
  terminate(): Promise<number> {
    this.exit(1);
    return Promise.resolve(this.exitCode ?? 1);
  }

  ref(): void {}
  unref(): void {}
}

/** A worker's own end: `self`, with messages after the first buffered until a listener comes. */
class ParentPort implements Emitter {
  private readonly listeners = new Set<Listener>();
  private readonly buffered: unknown[] = [];
  constructor(private readonly scope: DedicatedWorkerGlobalScope) {}

  deliver(value: unknown): void {
    if (this.listeners.size === 0) this.buffered.push(value);
    else for (const fn of [...this.listeners]) fn(value);
  }

  on(event: string, fn: Listener): this {
    if (event !== 'message') return this;
    this.listeners.add(fn);
    const pending = this.buffered.splice(0);
    if (pending.length)
      queueMicrotask(() => {
        for (const v of pending) this.deliver(v);
      });
    return this;
  }

  once(event: string, fn: Listener): this {
    const once: Listener = (v) => {
      this.off(event, once);
      fn(v);
    };
    return this.on(event, once);
  }

  off(_event: string, fn: Listener): this {
    this.listeners.delete(fn);
    return this;
  }

  postMessage(value: unknown, transfer: readonly Transferable[] = []): void {
    this.scope.postMessage(value, [...transfer]);
  }

  close(): void {
    this.scope.close();
  }

  ref(): void {}
  unref(): void {}
}

/** In a worker: the parent's end of its channel; null in the page's main thread. */
export let parentPort: ParentPort | null = null;
/** In a worker: the `workerData` its parent gave; null in the page's main thread. */
export let workerData: unknown = null;

if (inWorker) {
  const scope = globalThis as unknown as DedicatedWorkerGlobalScope;
  const port = new ParentPort(scope);
  workerData = await new Promise<unknown>((resolve) => {
    let first = true;
    scope.addEventListener('message', (e: Event) => {
      const data = (e as MessageEvent).data;
      if (first) {
        first = false;
        resolve((data as WorkerInit).layerwiseWorkerData);
      } else port.deliver(data);
    });
  });
  parentPort = port;
}

export default { MessagePort, MessageChannel, isMainThread, Worker };
