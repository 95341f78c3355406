/**
 * What a device runs, whatever it is (a worker thread: runtime/worker.ts; a process on this or
 * another host: runtime/device-server.ts): one TF.js engine with its own backend, its stages
 * (one, or several for interleaved and V-shape schedules: one program each), and the schedules
 * the coordinator sends for each step, exchanging activations and gradients directly with its
 * neighbour devices (MessagePorts between threads, gRPC links between processes; see
 * {@link LinkResolver}). A message names the stage it is for (`act:<stage>`,
 * `grad:<stage>`), so each stage has its own FIFO on a link several stages share.
 */
import {
  backendHeapBytes,
  initBackend,
  releaseBackend,
} from '../backend/index.js';
import { holdsBf16, roundToBf16, widenBf16 } from '../backend/low-precision.js';
import {
  countTransfer,
  deviceBytes,
  peakBytes,
  resetPeakBytes,
  setDeviceBudget,
  takeTransferBytes,
} from '../backend/memory.js';
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
import { loadStageKind } from '../pipeline/stage-kind.js';
import { linkSide } from '../schedule/schedule.js';
import { type Channel, type Message, ownedBuffers } from './channel.js';
import type {
  StageApi,
  StageInit,
  StageStep,
  StageStepResult,
} from './protocol.js';
import { fromWire, toWire, transferables } from './serialize.js';

/** Which link of a device: to the neighbour stages, or in the ring of its replicas. */
export type LinkSide = 'prev' | 'next' | 'replica-prev' | 'replica-next';

/** Turns StageInit's `prev` / `next` / `replicaPrev` / `replicaNext` (a MessagePort, or a gRPC link to open or to accept) into a channel. */
export type LinkResolver = (
  link: NonNullable<StageInit['prev']>,
  side: LinkSide,
) => Channel | Promise<Channel>;

/**
 * Serves the coordinator's requests on `main` until the channel fails (the coordinator is gone)
 * and resolves then; `resolve` makes the neighbour links of `init`.
 */
export async function serveStage(
  main: Channel,
  resolve: LinkResolver,
): Promise<void> {
  /** The programs of this device's stages, by stage index (ascending). */
  let programs = new Map<number, StageProgram>();
  /** Each program's blocks, for routing optimizer state. */
  let rangeOf = new Map<number, StageInit['range']>();
  /** This device's index, and the device of each stage (empty: stage s on device s). */
  let device = 0;
  let placement: number[] = [];
  /** Devices in the pipeline (without a placement: unbounded, so no ring link). */
  let devices = Number.POSITIVE_INFINITY;
  let prev: Channel | null = null;
  let next: Channel | null = null;
  /** Data parallelism: this device's replica, and its ring links to the other replicas. */
  let replica = { index: 0, count: 1 };
  let replicaPrev: Channel | null = null;
  let replicaNext: Channel | null = null;

  const deviceOf = (stage: number) => placement[stage] ?? stage;
  /** The link to the device of `stage` (a neighbour's), or null where the pipeline ends. */
  function channelTo(stage: number): Channel | null {
    return linkSide(device, deviceOf(stage), devices) === 'next' ? next : prev;
  }
  /** Where stage `to` is on no device (before the first or past the last stage): no link. */
  const exists = (to: number) =>
    to >= 0 && (placement.length === 0 || to < placement.length);

  /** An activation or gradient between stages: float32/int32, or (bf16 runs) its bf16 values. */
  interface TensorMessage extends Message {
    mb: number;
    tensor?: HostTensor;
    bf16?: { shape: number[]; data: Uint16Array };
  }

  /**
   * Sends t (disposed) to a neighbour stage. In a bf16 run a float32 tensor crosses as bf16 (2
   * bytes per element): block boundaries are already bf16 values (roundActivation), so nothing
   * is lost. Counted as device-to-host bytes of this stage (it leaves the device).
   */
  async function sendTensor(
    ch: Channel | null,
    type: string,
    mb: number,
    t: tf.Tensor,
  ): Promise<void> {
    if (!ch) throw new Error(`stage has no neighbour to send ${type} to`);
    if (t.dtype === 'float32' && holdsBf16()) {
      const shape = t.shape.slice();
      let data: Uint16Array;
      try {
        const v = (await t.data()) as Float32Array;
        data = new Uint16Array(v.length);
        roundToBf16(v, data);
      } finally {
        t.dispose();
      }
      countTransfer('d2h', data.byteLength);
      ch.send({ type, mb, bf16: { shape, data } }, [
        data.buffer as ArrayBuffer,
      ]);
      return;
    }
    const w = await toWire(t);
    countTransfer('d2h', w.data.byteLength);
    ch.send({ type, mb, tensor: w }, transferables([w]));
  }

  /** A received activation or gradient as a device tensor; counted as host-to-device bytes. */
  function tensorOf(m: TensorMessage): tf.Tensor {
    if (m.bf16) {
      countTransfer('h2d', m.bf16.data.byteLength);
      const f32 = new Float32Array(m.bf16.data.length);
      widenBf16(m.bf16.data, f32);
      return fromWire({ shape: m.bf16.shape, dtype: 'float32', data: f32 });
    }
    countTransfer('h2d', m.tensor!.data.byteLength);
    return fromWire(m.tensor!);
  }

  async function recvTensor(
    ch: Channel | null,
    type: string,
  ): Promise<{ mb: number; t: tf.Tensor }> {
    if (!ch) throw new Error(`stage has no neighbour to receive ${type} from`);
    const m = await ch.recv<TensorMessage>(type);
    return { mb: m.mb, t: tensorOf(m) };
  }

  const link = (to: number) => (exists(to) ? channelTo(to) : null);
  const links: StageLinks = {
    recvActivation: (stage) => recvTensor(link(stage - 1), `act:${stage}`),
    sendActivation: (stage, mb, t) =>
      sendTensor(link(stage + 1), `act:${stage + 1}`, mb, t),
    recvGradient: (stage) => recvTensor(link(stage + 1), `grad:${stage}`),
    pollGradient(stage) {
      const m = link(stage + 1)?.tryRecv<TensorMessage>(`grad:${stage}`);
      return m ? { mb: m.mb, t: tensorOf(m) } : null;
    },
    sendGradient: (stage, mb, t) =>
      sendTensor(link(stage - 1), `grad:${stage - 1}`, mb, t),
    pushGrads(g) {
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
    async allReduce(values) {
      const n = replica.count;
      if (n <= 1) return;
      // a ring of two is one link, used both ways
      const to = replicaNext ?? replicaPrev;
      const from = replicaPrev ?? replicaNext;
      if (!to || !from)
        throw new Error('all_reduce_grads without links to the replicas');
      await ringAllReduce(values, replica.index, n, to, from);
    },
    async reduceGradNorm(sumSquares) {
      main.send({ type: 'norm', sumSquares });
      const m = await main.recv<Message & { scale: number }>('scale');
      return m.scale;
    },
  };

  function need(): StageProgram[] {
    if (programs.size === 0) throw new Error('stage used before init');
    return [...programs.values()];
  }

  /** The optimizer slots of `slots` that belong to stage `index`'s blocks (`<block>.<name>`, or `aux<stage>.<name>`). */
  function slotsOf(
    slots: OptimizerState['slots'],
    index: number,
  ): OptimizerState['slots'] {
    const r = rangeOf.get(index)!;
    return Object.fromEntries(
      Object.entries(slots).filter(([key]) => {
        const prefix = key.slice(0, key.indexOf('.'));
        if (prefix.startsWith('aux')) return Number(prefix.slice(3)) === index;
        const block = Number(prefix);
        return block >= r.from && block < r.to;
      }),
    );
  }

  function disposeAll(): void {
    for (const p of programs.values()) p.dispose();
    programs = new Map();
  }

  const handlers: {
    [K in keyof StageApi]: (a: StageApi[K][0]) => Promise<StageApi[K][1]>;
  } = {
    async init(a: StageInit) {
      await initBackend(a.backend, {
        ...(a.backend === 'native' && a.threads ? { threads: a.threads } : {}),
        precision: a.precision ?? 'fp32',
      });
      const model = await loadModel(a.model, { initialValues: false }); // a model module is imported here, as on every device
      const specs = a.stages ?? [
        { index: a.index, range: a.range, params: a.params, stage: a.stage },
      ];
      programs = new Map();
      rangeOf = new Map();
      for (const sp of [...specs].sort((x, y) => x.index - y.index)) {
        const create = await loadStageKind(sp.stage);
        programs.set(
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
        rangeOf.set(sp.index, sp.range);
      }
      device = a.device ?? a.index;
      placement = a.placement ?? [];
      devices = placement.length
        ? Math.max(...placement) + 1
        : Number.POSITIVE_INFINITY;
      setDeviceBudget(a.deviceMemory, {
        stage: a.index,
        strategy: a.strategy,
        advice: a.oomAdvice,
      });
      prev = a.prev ? await resolve(a.prev, 'prev') : null;
      next = a.next ? await resolve(a.next, 'next') : null;
      replica = a.replica ?? { index: 0, count: 1 };
      replicaPrev = a.replicaPrev
        ? await resolve(a.replicaPrev, 'replica-prev')
        : null;
      replicaNext = a.replicaNext
        ? await resolve(a.replicaNext, 'replica-next')
        : null;
      resetPeakBytes();
      return { bytes: deviceBytes() };
    },
    async step(a: StageStep) {
      const all = need();
      const t0 = performance.now();
      const startedAt = performance.timeOrigin + t0;
      resetPeakBytes();
      takeTransferBytes(); // this step's transfers only (not the init's or an evaluation's)
      for (const s of all) {
        s.losses.clear();
        s.metrics?.clear();
        if (s.faults) s.faults.length = 0;
      }
      const inputs = a.inputs?.map(fromWire);
      const labels = a.labels?.map(fromWire);
      let trace: Awaited<ReturnType<typeof execute>>;
      try {
        trace = await execute(
          programs,
          a.actions,
          links,
          {
            inputs,
            labels,
            m: a.m,
            lr: a.lr,
            diagnose: a.diagnose,
            dropped: a.dropped,
            noise: a.noise,
            replicas: replica.count,
            lossScale: a.lossScale,
          },
          device,
        );
        for (const s of all) await s.flush?.(); // losses, metrics, faults: read off the device once, at the step's end
      } catch (e) {
        // a failed step frees the inputs and labels it was given: a stage may not have reached
        // them yet; those it took are freed by it or by zeroGrad, and freeing twice is harmless
        for (const t of [...(inputs ?? []), ...(labels ?? [])]) t?.dispose();
        for (const s of all) s.discard?.();
        throw e;
      }
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
      const r: StageStepResult = {
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
      return r;
    },
    async getParams() {
      const out: Record<string, Float32Array> = {};
      for (const s of need()) {
        if (!s.getParams)
          throw new Error(`a ${s.kind} keeps no parameters on its device`);
        Object.assign(out, Object.fromEntries(await s.getParams()));
      }
      return out;
    },
    async getOptimizerState() {
      const parts: OptimizerState[] = [];
      for (const s of need()) {
        if (!s.getOptimizerState)
          throw new Error(`a ${s.kind} keeps no optimizer state on its device`);
        parts.push(await s.getOptimizerState());
      }
      return {
        step: parts[0]!.step,
        slots: Object.assign({}, ...parts.map((p) => p.slots)),
      };
    },
    async setOptimizerState(st) {
      for (const [index, s] of programs) {
        if (!s.setOptimizerState)
          throw new Error(`a ${s.kind} keeps no optimizer state on its device`);
        // each program takes its own blocks' slots (a device may run several stages)
        s.setOptimizerState(
          programs.size === 1
            ? st
            : { step: st.step, slots: slotsOf(st.slots, index) },
        );
      }
      need();
      return null;
    },
    async dispose() {
      disposeAll();
      return null;
    },
    async shutdown() {
      disposeAll();
      await releaseBackend();
      return null;
    },
  };

  interface Request extends Message {
    id: number;
    method: keyof StageApi;
    args: unknown;
  }

  for (;;) {
    let req: Request;
    try {
      req = await main.recv<Request>('request');
    } catch {
      disposeAll(); // the coordinator is gone
      return;
    }
    try {
      const handler = handlers[req.method] as (a: unknown) => Promise<unknown>;
      if (!handler) throw new Error(`unknown worker method ${req.method}`);
      const result = await handler(req.args);
      main.send({ type: 'reply', id: req.id, result }, ownedBuffers(result));
    } catch (e) {
      const err = e as Error;
      const schedule = err instanceof ScheduleError ? err.schedule : undefined;
      main.send({
        type: 'reply',
        id: req.id,
        error: {
          name: err.name,
          message: err.message,
          stack: err.stack,
          schedule,
        },
      });
      for (const p of programs.values()) p.reset();
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
