/**
 * What a device runs, whatever it is (a worker thread: runtime/worker.ts; a process on this or
 * another host: runtime/device-server.ts): one TF.js engine with its own backend, one stage,
 * and the schedules the coordinator sends for each step, exchanging activations and gradients
 * directly with its neighbour stages (MessagePorts between threads, gRPC links between
 * processes; see {@link LinkResolver}).
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
import {
  execute,
  ScheduleError,
  type StageLinks,
  type StageProgram,
} from '../pipeline/executor.js';
import { loadStageKind } from '../pipeline/stage-kind.js';
import { type Channel, type Message, ownedBuffers } from './channel.js';
import type {
  StageApi,
  StageInit,
  StageStep,
  StageStepResult,
} from './protocol.js';
import { fromWire, toWire, transferables } from './serialize.js';

/** Turns StageInit's `prev` / `next` (a MessagePort, or a gRPC link to open or to accept) into a channel. */
export type LinkResolver = (
  link: NonNullable<StageInit['prev']>,
  side: 'prev' | 'next',
) => Channel | Promise<Channel>;

/**
 * Serves the coordinator's requests on `main` until the channel fails (the coordinator is gone)
 * and resolves then; `resolve` makes the neighbour links of `init`.
 */
export async function serveStage(
  main: Channel,
  resolve: LinkResolver,
): Promise<void> {
  let stage: StageProgram | null = null;
  let stageIndex = 0;
  let prev: Channel | null = null;
  let next: Channel | null = null;

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

  const links: StageLinks = {
    recvActivation: () => recvTensor(prev, 'act'),
    sendActivation: (mb, t) => sendTensor(next, 'act', mb, t),
    recvGradient: () => recvTensor(next, 'grad'),
    pollGradient() {
      const m = next?.tryRecv<TensorMessage>('grad');
      return m ? { mb: m.mb, t: tensorOf(m) } : null;
    },
    sendGradient: (mb, t) => sendTensor(prev, 'grad', mb, t),
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
    async reduceGradNorm(sumSquares) {
      main.send({ type: 'norm', sumSquares });
      const m = await main.recv<Message & { scale: number }>('scale');
      return m.scale;
    },
  };

  function need(): StageProgram {
    if (!stage) throw new Error('stage used before init');
    return stage;
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
      const create = await loadStageKind(a.stage);
      stage = create(
        {
          index: a.index,
          model,
          range: a.range,
          params: new Map(Object.entries(a.params)),
          optimizer: a.optimizer,
        },
        a.stage.options,
      );
      stageIndex = a.index;
      setDeviceBudget(a.deviceMemory, {
        stage: a.index,
        strategy: a.strategy,
        advice: a.oomAdvice,
      });
      prev = a.prev ? await resolve(a.prev, 'prev') : null;
      next = a.next ? await resolve(a.next, 'next') : null;
      resetPeakBytes();
      return { bytes: deviceBytes() };
    },
    async step(a: StageStep) {
      const s = need();
      const t0 = performance.now();
      const startedAt = performance.timeOrigin + t0;
      resetPeakBytes();
      takeTransferBytes(); // this step's transfers only (not the init's or an evaluation's)
      s.losses.clear();
      s.metrics?.clear();
      if (s.faults) s.faults.length = 0;
      const inputs = a.inputs?.map(fromWire);
      const labels = a.labels?.map(fromWire);
      let trace: Awaited<ReturnType<typeof execute>>;
      try {
        trace = await execute(
          s,
          a.actions,
          links,
          {
            inputs,
            labels,
            m: a.m,
            lr: a.lr,
            diagnose: a.diagnose,
            dropped: a.dropped,
          },
          stageIndex,
        );
        await s.flush?.(); // losses, metrics, faults: read off the device once, at the step's end
      } catch (e) {
        // a failed step frees the inputs and labels it was given: a stage may not have reached
        // them yet; those it took are freed by it or by zeroGrad, and freeing twice is harmless
        for (const t of [...(inputs ?? []), ...(labels ?? [])]) t?.dispose();
        s.discard?.();
        throw e;
      }
      const losses = [...s.losses.entries()]
        .sort((x, y) => x[0] - y[0])
        .map(([, l]) => l);
      const metrics = s.metrics?.size
        ? [...s.metrics.entries()].sort((x, y) => x[0] - y[0]).map(([, v]) => v)
        : undefined;
      const r: StageStepResult = {
        losses,
        ...(metrics ? { metrics } : {}),
        ...(s.faults?.length ? { faults: [...s.faults] } : {}),
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
      const s = need();
      if (!s.getParams)
        throw new Error(`a ${s.kind} keeps no parameters on its device`);
      return Object.fromEntries(await s.getParams());
    },
    async getOptimizerState() {
      const s = need();
      if (!s.getOptimizerState)
        throw new Error(`a ${s.kind} keeps no optimizer state on its device`);
      return await s.getOptimizerState();
    },
    async setOptimizerState(st) {
      const s = need();
      if (!s.setOptimizerState)
        throw new Error(`a ${s.kind} keeps no optimizer state on its device`);
      s.setOptimizerState(st);
      return null;
    },
    async dispose() {
      stage?.dispose();
      stage = null;
      return null;
    },
    async shutdown() {
      stage?.dispose();
      stage = null;
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
      (stage as StageProgram | null)?.dispose(); // the coordinator is gone
      stage = null;
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
      (stage as StageProgram | null)?.reset();
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
