/**
 * What a device runs, whatever it is (a worker thread: runtime/worker.ts; a process on this or
 * another host: runtime/device-server.ts): one TF.js engine with its own backend, its stages
 * (one, or several for interleaved and V-shape schedules: one program each), and the schedules
 * the coordinator sends for each step, exchanging activations and gradients directly with its
 * neighbour devices (MessagePorts between threads, gRPC links between processes; see
 * {@link LinkResolver}). A message names the stage it is for (`act:<stage>`,
 * `grad:<stage>`), so each stage has its own FIFO on a link several stages share.
 */

import { type GpuCounts, gpuCountsSince } from '../backend/gpu-counts.js';
import { gpuQueue, type PassTimes } from '../backend/gpu-queue.js';
import {
  backendHeapBytes,
  initBackend,
  releaseBackend,
} from '../backend/index.js';
import {
  type NarrowWireFields,
  narrowValues,
  narrowWireFields,
  narrowWireOf,
  storesNarrow,
  widenValues,
} from '../backend/low-precision.js';
import {
  countTransfer,
  deviceBytes,
  peakBytes,
  resetPeakBytes,
  setDeviceBudget,
  takeTransferBytes,
} from '../backend/memory.js';
import { nativeAddon } from '../backend/native-addon.js';
import type { tf } from '../backend/tfjs.js';
import type { HostTensor } from '../data/microbatch.js';
import { loadModel } from '../model/model.js';
import type { OptimizerState } from '../optim/optimizer.js';
import {
  execute,
  ScheduleError,
  type StageLinks,
  type StageProgram,
} from '../pipeline/executor.js';
import { nativeReplays } from '../pipeline/native-capture.js';
import { loadStageKind } from '../pipeline/stage-kind.js';
import { linkSide } from '../schedule/schedule.js';
import { type Channel, type Message, ownedBuffers } from './channel.js';
import type {
  StageApi,
  StageInit,
  StageStep,
  StageStepResult,
} from './protocol.js';
import {
  copyOfValues,
  fromReceivedWire,
  fromWire,
  toWire,
  transferables,
  wireBuffers,
} from './serialize.js';

/** Which link of a device: to the neighbour stages, or in the ring of its replicas. */
export type LinkSide = 'prev' | 'next' | 'replica-prev' | 'replica-next';

/** Turns StageInit's `prev` / `next` / `replicaPrev` / `replicaNext` (a MessagePort, or a gRPC link to open or to accept) into a channel. */
export type LinkResolver = (
  link: NonNullable<StageInit['prev']>,
  side: LinkSide,
) => Channel | Promise<Channel>;

/**
 * An activation or gradient between stages: float32/int32, or (where the precision policy's
 * wire format is 2 bytes, backend/precision.ts) its 2-byte values.
 */
interface TensorMessage extends Message, NarrowWireFields {
  mb: number;
  tensor?: HostTensor;
}

/**
 * Sends t (disposed) to a neighbour stage. Where the policy's wire format is 2 bytes, a float32
 * tensor crosses in it (2 bytes per element): block boundaries are already in that format's
 * values (roundActivation), so nothing is lost. Counted as device-to-host bytes of this stage
 * (it leaves the device).
 */
async function sendTensor(
  ch: Channel | null,
  type: string,
  mb: number,
  t: tf.Tensor,
): Promise<void> {
  if (!ch) throw new Error(`stage has no neighbour to send ${type} to`);
  if (t.dtype === 'float32' && storesNarrow('wire')) {
    const shape = t.shape.slice();
    const wire = wireBuffers();
    let data: Uint16Array;
    try {
      const f32 = (await copyOfValues(t)) as Float32Array;
      data = narrowValues(f32, wire?.takeU16(f32.length));
      wire?.recycle(f32);
    } finally {
      t.dispose();
    }
    countTransfer('d2h', data.byteLength);
    ch.send({ type, mb, ...narrowWireFields(shape, data) }, [
      data.buffer as ArrayBuffer,
    ]);
    return;
  }
  const w = await toWire(t);
  countTransfer('d2h', w.data.byteLength);
  ch.send({ type, mb, tensor: w }, transferables([w]));
}

/**
 * A received activation or gradient as a device tensor; counted as host-to-device bytes. Its
 * arrays are this thread's alone, so the backend may recycle them for sends (serialize.ts
 * fromReceivedWire).
 */
function tensorOf(m: TensorMessage): tf.Tensor {
  const narrow = narrowWireOf(m);
  if (narrow) {
    countTransfer('h2d', narrow.data.byteLength);
    const wire = wireBuffers();
    const f32 = widenValues(narrow.data, wire?.takeF32(narrow.data.length));
    wire?.recycle(narrow.data);
    return fromReceivedWire({
      shape: narrow.shape,
      dtype: 'float32',
      data: f32,
    });
  }
  countTransfer('h2d', m.tensor!.data.byteLength);
  return fromReceivedWire(m.tensor!);
}

/** The next message `type` (an activation or gradient) from neighbour `ch`, as a device tensor with its micro-batch. */
async function recvTensor(
  ch: Channel | null,
  type: string,
): Promise<{ mb: number; t: tf.Tensor }> {
  if (!ch) throw new Error(`stage has no neighbour to receive ${type} from`);
  const m = await ch.recv<TensorMessage>(type);
  return { mb: m.mb, t: tensorOf(m) };
}

/** Each request of the coordinator ({@link StageApi}): its handler, from its arguments to its result. */
type Handlers = {
  [K in keyof StageApi]: (a: StageApi[K][0]) => Promise<StageApi[K][1]>;
};

/** A request of the coordinator's. */
interface Request extends Message {
  id: number;
  method: keyof StageApi;
  args: unknown;
}

/**
 * A device as the coordinator's requests see it: its stages' programs, its place in the
 * pipeline, its links to the neighbour devices and to its replicas, and the handler of each
 * request. Everything but the coordinator's channel is set by init.
 */
class StageHost {
  /** The programs of this device's stages, by stage index (ascending). */
  programs = new Map<number, StageProgram>();
  /** Each program's blocks, for routing optimizer state. */
  private rangeOf = new Map<number, StageInit['range']>();
  /** This device's index, and the device of each stage (empty: stage s on device s). */
  private device = 0;
  private placement: number[] = [];
  /** Devices in the pipeline (without a placement: unbounded, so no ring link). */
  private devices = Number.POSITIVE_INFINITY;
  private prev: Channel | null = null;
  private next: Channel | null = null;
  /** Data parallelism: this device's replica, and its ring links to the other replicas. */
  private replica = { index: 0, count: 1 };
  private replicaPrev: Channel | null = null;
  private replicaNext: Channel | null = null;
  /** What the executor sends and receives through. */
  private readonly links: StageLinks;
  readonly handlers: Handlers;
  private readonly main: Channel;
  private readonly resolve: LinkResolver;

  /** The CPUs this device's kernel team is bound to (undefined: not pinned). */
  private readonly cpus: readonly number[] | undefined;

  /**
   * A device with no stages yet; `main` is the coordinator's channel, `resolve` makes init's
   * links, `cpus` the CPUs its native kernel team is bound to at init (a thread device's own:
   * runtime/pinning.ts threadPinning; undefined: not pinned).
   */
  constructor(main: Channel, resolve: LinkResolver, cpus?: readonly number[]) {
    this.main = main;
    this.resolve = resolve;
    this.cpus = cpus;
    this.links = this.stageLinks();
    this.handlers = {
      init: (a) => this.init(a),
      step: (a) => this.step(a),
      getParams: () => this.getParams(),
      getOptimizerState: () => this.getOptimizerState(),
      setOptimizerState: (st) => this.setOptimizerState(st),
      dispose: async () => {
        this.disposeAll();
        return null;
      },
      shutdown: async () => {
        this.disposeAll();
        await releaseBackend();
        return null;
      },
    };
  }

  /** The link to the device of `stage` (a neighbour's), or null where the pipeline ends. */
  private channelTo(stage: number): Channel | null {
    const to = this.placement[stage] ?? stage;
    return linkSide(this.device, to, this.devices) === 'next'
      ? this.next
      : this.prev;
  }

  /** The link towards stage `to`; null where `to` is on no device (before the first or past the last stage). */
  private link(to: number): Channel | null {
    const exists =
      to >= 0 && (this.placement.length === 0 || to < this.placement.length);
    return exists ? this.channelTo(to) : null;
  }

  /**
   * The executor's links over this device's channels: activations and gradients to and from
   * the neighbour stages (`act:<stage>`, `grad:<stage>`), L2L's gradients and the gradient-norm
   * all-reduce over the coordinator's channel, the replicas' ring all-reduce.
   */
  private stageLinks(): StageLinks {
    const main = this.main;
    return {
      recvActivation: (stage) =>
        recvTensor(this.link(stage - 1), `act:${stage}`),
      sendActivation: (stage, mb, t) =>
        sendTensor(this.link(stage + 1), `act:${stage + 1}`, mb, t),
      recvGradient: (stage) =>
        recvTensor(this.link(stage + 1), `grad:${stage}`),
      pollGradient: (stage) => {
        const m = this.link(stage + 1)?.tryRecv<TensorMessage>(`grad:${stage}`);
        return m ? { mb: m.mb, t: tensorOf(m) } : null;
      },
      sendGradient: (stage, mb, t) =>
        sendTensor(this.link(stage - 1), `grad:${stage - 1}`, mb, t),
      pushGrads: (g) => {
        main.send(
          {
            type: 'grads',
            layer: g.layer,
            grads: g.grads,
            sumSquares: g.sumSquares,
          },
          Object.values(g.grads).map((a) => a.buffer as ArrayBuffer),
        );
      },
      allReduce: async (values) => {
        const n = this.replica.count;
        if (n <= 1) return;
        // a ring of two is one link, used both ways
        const to = this.replicaNext ?? this.replicaPrev;
        const from = this.replicaPrev ?? this.replicaNext;
        if (!to || !from)
          throw new Error('all_reduce_grads without links to the replicas');
        await ringAllReduce(values, this.replica.index, n, to, from);
      },
      reduceGradNorm: async (sumSquares) => {
        main.send({ type: 'norm', sumSquares });
        const m = await main.recv<Message & { scale: number }>('scale');
        return m.scale;
      },
    };
  }

  /** The programs, in stage order. Throws before init. */
  private need(): StageProgram[] {
    if (this.programs.size === 0) throw new Error('stage used before init');
    return [...this.programs.values()];
  }

  /** The optimizer slots of `slots` that belong to stage `index`'s blocks (`<block>.<name>`, or `aux<stage>.<name>`). */
  private slotsOf(
    slots: OptimizerState['slots'],
    index: number,
  ): OptimizerState['slots'] {
    const r = this.rangeOf.get(index)!;
    return Object.fromEntries(
      Object.entries(slots).filter(([key]) => {
        const prefix = key.slice(0, key.indexOf('.'));
        if (prefix.startsWith('aux')) return Number(prefix.slice(3)) === index;
        const block = Number(prefix);
        return block >= r.from && block < r.to;
      }),
    );
  }

  /** Frees every program's device memory and forgets the programs. */
  disposeAll(): void {
    for (const p of this.programs.values()) p.dispose();
    this.programs = new Map();
  }

  /**
   * init: starts the backend, loads the model, creates a program per stage (ascending), sets
   * the device's place, memory budget and links (prev, next, then the replicas'). Returns the
   * device's bytes.
   */
  private async init(a: StageInit): Promise<{ bytes: number }> {
    await initBackend(a.backend, {
      ...(a.backend === 'native' && a.threads ? { threads: a.threads } : {}),
      precision: a.precision ?? 'fp32',
    });
    // after the team has its size: members a larger team adds later inherit one CPU only. An
    // addon built before pinTeam existed (native/build not rebuilt) runs unpinned
    const lib = a.backend === 'native' ? nativeAddon() : null;
    if (this.cpus && typeof lib?.pinTeam === 'function')
      lib.pinTeam([...this.cpus]);
    const model = await loadModel(a.model, { initialValues: false }); // a model module is imported here, as on every device
    const specs = a.stages ?? [
      { index: a.index, range: a.range, params: a.params, stage: a.stage },
    ];
    this.programs = new Map();
    this.rangeOf = new Map();
    for (const sp of [...specs].sort((x, y) => x.index - y.index)) {
      const create = await loadStageKind(sp.stage);
      this.programs.set(
        sp.index,
        create(
          {
            index: sp.index,
            model,
            range: sp.range,
            params: new Map(Object.entries(sp.params)),
            optimizer: a.optimizer,
          },
          sp.stage.options,
        ),
      );
      this.rangeOf.set(sp.index, sp.range);
    }
    this.place(a);
    const resolve = this.resolve;
    this.prev = a.prev ? await resolve(a.prev, 'prev') : null;
    this.next = a.next ? await resolve(a.next, 'next') : null;
    this.replica = a.replica ?? { index: 0, count: 1 };
    this.replicaPrev = a.replicaPrev
      ? await resolve(a.replicaPrev, 'replica-prev')
      : null;
    this.replicaNext = a.replicaNext
      ? await resolve(a.replicaNext, 'replica-next')
      : null;
    resetPeakBytes();
    return { bytes: deviceBytes() };
  }

  /** Sets init's device index, the stages' placement and the device memory budget. */
  private place(a: StageInit): void {
    this.device = a.device ?? a.index;
    this.placement = a.placement ?? [];
    this.devices = this.placement.length
      ? Math.max(...this.placement) + 1
      : Number.POSITIVE_INFINITY;
    setDeviceBudget(a.deviceMemory, {
      stage: a.index,
      strategy: a.strategy,
      advice: a.oomAdvice,
    });
  }

  /**
   * step: runs the step's actions through the executor on this device's programs and reads
   * what they left on the device (losses, metrics, faults). On failure, frees the step's inputs
   * and labels, drops what the programs left unread and rethrows.
   */
  private async step(a: StageStep): Promise<StageStepResult> {
    const all = this.need();
    const t0 = performance.now();
    const startedAt = performance.timeOrigin + t0;
    startStep(all);
    const gpuBefore = gpuQueue()?.counts(); // webgpu: what the step asks of the GPU
    const replaysBefore = nativeReplays(); // native: captured steps replayed
    gpuQueue()?.beginStep();
    const inputs = a.inputs?.map(fromWire);
    const labels = a.labels?.map(fromWire);
    let trace: Awaited<ReturnType<typeof execute>>;
    try {
      trace = await execute(
        this.programs,
        a.actions,
        this.links,
        {
          inputs,
          labels,
          m: a.m,
          lr: a.lr,
          diagnose: a.diagnose,
          dropped: a.dropped,
          noise: a.noise,
          replicas: this.replica.count,
          lossScale: a.lossScale,
        },
        this.device,
      );
      for (const s of all) await s.flush?.(); // losses, metrics, faults: read off the device once, at the step's end
    } catch (e) {
      // a failed step frees the inputs and labels it was given: a stage may not have reached
      // them yet; those it took are freed by it or by zeroGrad, and freeing twice is harmless
      for (const t of [...(inputs ?? []), ...(labels ?? [])]) t?.dispose();
      for (const s of all) s.discard?.();
      this.pendingBusy = null;
      throw e;
    }
    const result = stepResult(all, trace, t0, startedAt);
    if (gpuBefore) Object.assign(result, await this.gpuReport(gpuBefore, t0));
    const replayed = nativeReplays() - replaysBefore;
    if (replayed > 0) result.replayed = replayed;
    return result;
  }

  /** webgpu with timestamp queries: the GPU time of the last step, until the next step reports it. */
  private pendingBusy: {
    times: Promise<PassTimes | null>;
    stepSeconds: number;
  } | null = null;

  /**
   * webgpu: what the step begun at `t0` (performance.now(), ms) asked of the GPU (counts since
   * `before`, the timestamps' read included), and, where the device has timestamp queries, the
   * previous step's busy time (this one's is read once the GPU has run it, without waiting).
   */
  private async gpuReport(
    before: GpuCounts,
    t0: number,
  ): Promise<Pick<StageStepResult, 'gpu' | 'gpuBusy'>> {
    const q = gpuQueue()!;
    const times = q.endStep();
    const after = q.counts();
    const prev = this.pendingBusy;
    this.pendingBusy = q.timesPasses
      ? { times, stepSeconds: (performance.now() - t0) / 1000 }
      : null;
    const gpu = gpuCountsSince(before, after);
    const busy = prev ? await prev.times : null;
    return busy === null || !prev
      ? { gpu }
      : {
          gpu,
          gpuBusy: {
            busySeconds: busy.seconds,
            stepSeconds: prev.stepSeconds,
            ...(busy.kernels ? { kernels: busy.kernels } : {}),
          },
        };
  }

  /** getParams: every program's parameters (host copies). Throws where a program keeps none on its device. */
  private async getParams(): Promise<Record<string, Float32Array>> {
    const out: Record<string, Float32Array> = {};
    for (const s of this.need()) {
      if (!s.getParams)
        throw new Error(`a ${s.kind} keeps no parameters on its device`);
      Object.assign(out, Object.fromEntries(await s.getParams()));
    }
    return out;
  }

  /** getOptimizerState: the programs' optimizer slots together (the first program's step). Throws where a program keeps none. */
  private async getOptimizerState(): Promise<OptimizerState> {
    const parts: OptimizerState[] = [];
    for (const s of this.need()) {
      if (!s.getOptimizerState)
        throw new Error(`a ${s.kind} keeps no optimizer state on its device`);
      parts.push(await s.getOptimizerState());
    }
    return {
      step: parts[0]!.step,
      slots: Object.assign({}, ...parts.map((p) => p.slots)),
    };
  }

  /** setOptimizerState: each program takes its own blocks' slots. Throws where a program keeps none, or before init. */
  private async setOptimizerState(st: OptimizerState): Promise<null> {
    for (const [index, s] of this.programs) {
      if (!s.setOptimizerState)
        throw new Error(`a ${s.kind} keeps no optimizer state on its device`);
      // each program takes its own blocks' slots (a device may run several stages)
      s.setOptimizerState(
        this.programs.size === 1
          ? st
          : { step: st.step, slots: this.slotsOf(st.slots, index) },
      );
    }
    this.need();
    return null;
  }
}

/** Starts a step's counts: the peak and transfer byte counters, and each program's losses, metrics and faults. */
function startStep(all: readonly StageProgram[]): void {
  resetPeakBytes();
  takeTransferBytes(); // this step's transfers only (not the init's or an evaluation's)
  for (const s of all) {
    s.losses.clear();
    s.metrics?.clear();
    if (s.faults) s.faults.length = 0;
  }
}

/**
 * The step's result: the losses and metrics (by micro-batch) of the device's last stage that
 * has any, every program's faults, the executor's `trace`, the device's bytes and transfers,
 * and the step's duration (ms since `t0`, a `performance.now()`) and start (`startedAt`, ms
 * since the epoch).
 */
function stepResult(
  all: readonly StageProgram[],
  trace: Awaited<ReturnType<typeof execute>>,
  t0: number,
  startedAt: number,
): StageStepResult {
  // the losses and metrics of the device's last stage that has any (the model's last
  // stage; under local parallelism, each device's one stage)
  const s = [...all].reverse().find((p) => p.losses.size > 0) ?? all[0]!;
  const losses = [...s.losses.entries()]
    .sort((x, y) => x[0] - y[0])
    .map(([, l]) => l);
  const metrics = s.metrics?.size
    ? [...s.metrics.entries()].sort((x, y) => x[0] - y[0]).map(([, v]) => v)
    : undefined;
  const faults = all.flatMap((p) => p.faults ?? []);
  return {
    losses,
    ...(metrics ? { metrics } : {}),
    ...(faults.length ? { faults } : {}),
    trace,
    peakBytes: peakBytes(),
    bytes: deviceBytes(),
    heapBytes: backendHeapBytes(),
    ...transferBytesOf(takeTransferBytes()),
    ms: performance.now() - t0,
    startedAt,
  };
}

/** The error reply to request `id`: the error's name, message and stack, and a failing schedule's marked actions. */
function errorReply(id: number, e: unknown): Message {
  const err = e as Error;
  const schedule = err instanceof ScheduleError ? err.schedule : undefined;
  return {
    type: 'reply',
    id,
    error: {
      name: err.name,
      message: err.message,
      stack: err.stack,
      schedule,
    },
  };
}

/**
 * Serves the coordinator's requests on `main` until the channel fails (the coordinator is gone)
 * and resolves then; `resolve` makes the neighbour links of `init`. `opts.cpus`: the CPUs the
 * device's native kernel team is bound to when it starts (a thread device's, runtime/pinning.ts;
 * a device process is bound through its OpenMP environment instead).
 */
export async function serveStage(
  main: Channel,
  resolve: LinkResolver,
  opts: { cpus?: readonly number[] } = {},
): Promise<void> {
  const host = new StageHost(main, resolve, opts.cpus);
  for (;;) {
    let req: Request;
    try {
      req = await main.recv<Request>('request');
    } catch {
      host.disposeAll(); // the coordinator is gone
      return;
    }
    try {
      const handler = host.handlers[req.method] as (
        a: unknown,
      ) => Promise<unknown>;
      if (!handler) throw new Error(`unknown worker method ${req.method}`);
      const result = await handler(req.args);
      main.send({ type: 'reply', id: req.id, result }, ownedBuffers(result));
    } catch (e) {
      main.send(errorReply(req.id, e));
      for (const p of host.programs.values()) p.reset();
    }
  }
}

/** The step's host/device transfers for its result: present only where the stage counted some. */
function transferBytesOf(t: {
  hostToDevice: number;
  deviceToHost: number;
}): Pick<StageStepResult, 'hostToDeviceBytes' | 'deviceToHostBytes'> {
  return t.hostToDevice > 0 || t.deviceToHost > 0
    ? { hostToDeviceBytes: t.hostToDevice, deviceToHostBytes: t.deviceToHost }
    : {};
}

/**
 * Ring all-reduce (Patarasuk & Yuan, 2009; as NCCL and Horovod): sums `values` element-wise
 * across the `n` replicas of a ring, in place. The elements (all arrays, end to end) are cut
 * into n chunks; n - 1 reduce-scatter rounds send one chunk to the next replica and add the
 * chunk received from the previous one, after which replica r holds the whole sum of chunk
 * r + 1; n - 1 all-gather rounds pass the summed chunks around. Each replica sends and
 * receives 2 (n - 1) / n of the bytes, whatever n. Every replica ends with the same values
 * (each chunk is summed once, on one replica, then copied).
 */
export async function ringAllReduce(
  values: Float32Array[],
  r: number,
  n: number,
  to: Channel,
  from: Channel,
): Promise<void> {
  const total = values.reduce((a, v) => a + v.length, 0);
  const bound = (c: number) => Math.floor((c * total) / n);
  /** Visits chunk c's elements: f(array, start, end, offset in the chunk). */
  const each = (
    c: number,
    f: (v: Float32Array, s: number, e: number, at: number) => void,
  ) => {
    const lo = bound(c);
    const hi = bound(c + 1);
    let base = 0;
    for (const v of values) {
      const s = Math.max(lo, base);
      const e = Math.min(hi, base + v.length);
      if (s < e) f(v, s - base, e - base, s - lo);
      base += v.length;
    }
  };
  const read = (c: number): Float32Array => {
    const out = new Float32Array(bound(c + 1) - bound(c));
    each(c, (v, s, e, at) => out.set(v.subarray(s, e), at));
    return out;
  };
  interface Chunk extends Message {
    data: Float32Array;
  }
  const exchange = async (send: number): Promise<Float32Array> => {
    const data = read(send);
    to.send({ type: 'allreduce', data }, [data.buffer as ArrayBuffer]);
    return (await from.recv<Chunk>('allreduce')).data;
  };
  const mod = (x: number) => ((x % n) + n) % n;
  for (let t = 0; t < n - 1; t++) {
    const got = await exchange(mod(r - t));
    each(mod(r - t - 1), (v, s, e, at) => {
      for (let i = s; i < e; i++) v[i]! += got[at + i - s]!;
    });
  }
  for (let t = 0; t < n - 1; t++) {
    const got = await exchange(mod(r + 1 - t));
    each(mod(r - t), (v, s, e, at) => v.set(got.subarray(at, at + e - s), s));
  }
}
