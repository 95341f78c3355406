/**
 * An optimizer thread of the eager parameter server (L2L, Pudipeddi et al., 2020, arXiv
 * 2002.05645): it attaches to the shared {@link ParamStore} and, for each job (part of one
 * layer's update), runs the host optimizer on the job's tensors ({@link nativeHostUpdate} on one
 * OpenMP thread where the native addon is built, else {@link hostUpdate}), then counts the part
 * done and, if it was the layer's last part, marks the layer updated (so the device may upload
 * it). No TF.js is loaded, so the thread starts in milliseconds.
 *
 * Started by {@link ParameterServer} with workerData {@link OptimizerWorkerData}; messages in:
 * {@link JobMessage}; out: `{type: 'ready'}`, {@link DoneMessage} or {@link ErrorMessage}.
 */
import { parentPort, workerData } from 'node:worker_threads';
import { nativeAddon } from '../backend/native-addon.js';
import { narrowingTo } from '../backend/precision.js';
import type { OptimizerConfig } from '../optim/optimizer.js';
import { hostUpdate, nativeHostUpdate } from './host-optimizer.js';
import { ParamStore, type StoreLayout } from './store.js';

// the server's threads are its parallelism: one OpenMP thread each, so they do not oversubscribe
const lib = nativeAddon();
lib?.setThreads(1);
const update: typeof hostUpdate = lib
  ? (...args) => nativeHostUpdate(lib, ...args)
  : hostUpdate;

/** What the server passes to each optimizer thread. */
export interface OptimizerWorkerData {
  layout: StoreLayout;
  config: OptimizerConfig;
  /** This thread's index, 0-based. */
  thread: number;
  /** Int32Array of part counters shared by the threads (see {@link JobMessage.counter}). */
  counters: SharedArrayBuffer;
}

/** Part of one layer's update: these tensors, with this step's lr, clipping scale and t. */
export interface JobMessage {
  type: 'job';
  job: number;
  layer: number;
  keys: string[];
  /** Gradients of `keys`, in order (transferred). */
  grads: Float32Array[];
  lr: number;
  scale: number;
  /** 1-based step t. */
  t: number;
  /**
   * -1: this is the layer's only part, mark the layer updated when done; >= 0: index of the
   * shared part counter, the thread that brings it to 0 marks the layer; -2: the server marks it.
   */
  counter: number;
}

/** A part is done: its timing (ms; startedAt in ms since the Unix epoch) and parameter count. */
export interface DoneMessage {
  type: 'done';
  job: number;
  thread: number;
  startedAt: number;
  ms: number;
  params: number;
}

/** A part failed (nothing of that part is marked updated). */
export interface ErrorMessage {
  type: 'error';
  job: number;
  thread: number;
  error: { name: string; message: string; stack?: string };
}

const port = parentPort;
if (!port)
  throw new Error(
    'optimizer-worker.js must run in a worker thread started by ParameterServer',
  );
const data = workerData as OptimizerWorkerData;
const store = ParamStore.attach(data.layout);
// the rounding of the layout's 2-byte copies (the run's policy's storage.params), vectorised
const lowFormat = data.layout.lowFormat;
const toLow = lib && lowFormat ? narrowingTo(lowFormat, lib) : undefined;
const counters = new Int32Array(data.counters);
const { config, thread } = data;

function run(msg: JobMessage): number {
  if (msg.keys.length !== msg.grads.length)
    throw new Error(
      `job of layer ${msg.layer}: ${msg.keys.length} keys but ${msg.grads.length} gradients`,
    );
  // Check every tensor before changing any, so a bad gradient leaves the layer as it was.
  for (let i = 0; i < msg.keys.length; i++) {
    const key = msg.keys[i];
    const g = msg.grads[i];
    const p = store.param(key);
    if (!(g instanceof Float32Array))
      throw new TypeError(
        `gradient of '${key}' (layer ${msg.layer}) is not a Float32Array`,
      );
    if (g.length !== p.length) {
      throw new RangeError(
        `gradient of '${key}' (layer ${msg.layer}) has ${g.length} values, the parameter has ${p.length} (shape [${store.shape(key)}])`,
      );
    }
  }
  let n = 0;
  for (let i = 0; i < msg.keys.length; i++) {
    const key = msg.keys[i];
    const p = store.param(key);
    update(
      config,
      store.shape(key).length,
      p,
      msg.grads[i],
      store.slots(key),
      msg.lr,
      msg.scale,
      msg.t,
    );
    // the device's 2-byte copy of this update, written before the layer's version moves on
    store.refreshLow(key, toLow);
    n += p.length;
  }
  return n;
}

port.on('message', (msg: JobMessage) => {
  if (msg.type !== 'job') return;
  const t0 = performance.now();
  try {
    const params = run(msg);
    const ms = performance.now() - t0;
    if (
      msg.counter === -1 ||
      (msg.counter >= 0 && Atomics.sub(counters, msg.counter, 1) === 1)
    )
      store.markUpdated(msg.layer);
    const done: DoneMessage = {
      type: 'done',
      job: msg.job,
      thread,
      startedAt: performance.timeOrigin + t0,
      ms,
      params,
    };
    port.postMessage(done);
  } catch (e) {
    const err = e instanceof Error ? e : new Error(String(e));
    const out: ErrorMessage = {
      type: 'error',
      job: msg.job,
      thread,
      error: { name: err.name, message: err.message, stack: err.stack },
    };
    port.postMessage(out);
  }
});

port.postMessage({ type: 'ready' });
