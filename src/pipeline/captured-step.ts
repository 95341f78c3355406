/**
 * A captured step on webgpu (issue 36; as CUDA graphs capture a stream): a backprop stage that
 * holds the whole model, training one micro-batch a step (single-device training), records the
 * GPU commands of its forward and backward through TF.js, and once two steps in a row recorded
 * the same commands on the same buffers, re-issues that recording in later steps instead of
 * running TF.js's programs: the step's tokens and labels written into the buffers the recording
 * uploaded them to, everything else as recorded. The optimizer step, the gradient norm and the
 * reads still run through TF.js, on the gradients and loss the replay leaves (tensors made on
 * the recording's buffers without copies). On a GPU the step is bound by the host's ~200 us a
 * TF.js program (bench/results/gpu-h200-2026-11-26.md); a replayed forward and backward cost about a tenth of
 * that (bench/webgpu-replay.ts).
 *
 * Why it is exact: a TF.js program reads nothing but its bound buffers and uniforms, and with
 * AdamW in place (backend/webgpu-multi.ts), the pool's first-made order and the kept bind groups
 * and uniforms (backend/webgpu-host.ts) a step binds exactly the buffers of the step before:
 * the two recordings compared show it, command by command. The buffers the recording uses are
 * kept out of TF.js's pool while the capture stands (webgpu-host.ts holdBuffers), so nothing
 * else is handed them between replays. The only values a replay writes are the step's own
 * uploads: its tokens, its labels and its loss seed (a new loss scale needs no new recording);
 * a recording that uploads anything else (Dropout's masks, a small op TF.js ran on the CPU), reads
 * or writes a buffer is not captured. The capture is dropped and recorded anew when a step
 * differs: the parameters' buffers (a checkpoint restored), the batch's shapes, LayerDrop, a
 * diagnosing step, several micro-batches; or when a replay fails. A model drawing noise on the
 * GPU has uniforms that change every step, so no two of its recordings match. A replayed step
 * counts the bytes its recording reached above the step's start as device bytes for the replay's
 * span (backend/memory.ts), so its peak and the `--device-memory` budget read as a recorded
 * step's.
 *
 * On by default on webgpu since H100 runs showed it (2026-11-28): the same losses, charlm-small
 * 111,428 -> 137,381 tokens/s and 23.7 -> 7.1 ms of host a step
 * (bench/results/gpu-h100-2026-11-28-before*.md), 155,050 -> 210,396 after the column sums'
 * rewrite (bench/results/gpu.md);
 * LAYERWISE_WEBGPU_CAPTURE=0 turns it off. Off in kernel-times runs
 * (LAYERWISE_WEBGPU_KERNEL_TIMES=1: a replay's passes carry no kernel names).
 */
import { gpuQueue, KERNEL_TIMES_ENV } from '../backend/gpu-queue.js';
import {
  countPrivateBytes,
  deviceBytes,
  peakBytes,
} from '../backend/memory.js';
import { tf } from '../backend/tfjs.js';
import {
  isRead,
  isUpload,
  type RecordedOp,
  type Recording,
  replayCommands,
  sameCommand,
  startRecording,
} from '../backend/webgpu-commands.js';
import {
  buffersOfBindGroup,
  holdBuffers,
  unholdBuffers,
} from '../backend/webgpu-host.js';
import type { StepIO } from './executor.js';

/**
 * Whether a training forward of micro-batch `mb` with `io` (its activations kept where `keep`) is
 * a step webgpu's captured step covers: the only micro-batch of a step that skips no block and
 * diagnoses nothing.
 */
export function capturesStep(mb: number, io: StepIO, keep: boolean): boolean {
  return (
    keep && mb === 0 && io.m === 1 && io.dropped.size === 0 && !io.diagnose
  );
}

/** The environment variable that turns captured steps off (value 0); on where unset. */
export const CAPTURE_ENV = 'LAYERWISE_WEBGPU_CAPTURE';

/** The parts of tfjs-backend-webgpu 4.22's WebGPUBackend used here. */
interface Backend {
  device: object;
  tensorMap: {
    get(
      dataId: object,
    ): { resource?: unknown; values?: ArrayBufferView | null } | undefined;
  };
}

/** What a recorded forward and backward did, by buffer. */
interface Captured {
  ops: RecordedOp[];
  /** Upload i's bytes: the step's tokens, its labels, or its loss seed (a float32 scalar). */
  roles: Array<'x' | 'labels' | 'seed'>;
  /** The bytes of the tokens' and the labels' uploads. */
  bytes: { x: number; labels: number };
  x: { shape: number[]; dtype: string };
  labels: { shape: number[]; dtype: string };
  /** The parameters' buffers, in the stage's key order. */
  params: object[];
  /** The gradients' buffers and shapes by key, and the loss's buffer. */
  grads: Map<string, { buffer: object; shape: number[] }>;
  loss: object;
  /**
   * Bytes above the device's level at the recording's start that the recorded step reached at
   * its peak (its activations and gradients, bytes): a replay holds the same in the held
   * buffers, outside any tensor, and counts them for its span (backend/memory.ts).
   */
  transientBytes: number;
}

/** What the stage hands the capture: its parameters' variables (whose buffers a replay must find unchanged). */
export interface CaptureHost {
  readonly paramVars: ReadonlyMap<string, tf.Variable>;
}

/**
 * The capture of one stage's forward and backward (see the module's comment). The stage calls
 * it around its forward and backward handlers; each method says what the stage does next.
 */
export class StepCapture {
  /** The recording in progress (between a forward and its backward). */
  private recording: {
    rec: Recording;
    x: tf.Tensor;
    labels: tf.Tensor;
    xBuffer?: unknown;
    labelsBuffer?: unknown;
    loss?: unknown;
    /** The device's bytes at the recording's start (backend/memory.ts deviceBytes). */
    base: number;
  } | null = null;
  /** The last step's recording, to compare the next with. */
  private last: Captured | null = null;
  /** The capture replayed, its buffers held. */
  private ready: Captured | null = null;
  /** A replayed step's batch and loss seed, between its forward and backward. */
  private pending: {
    x: Uint8Array;
    labels: Uint8Array;
    seed: Uint8Array;
  } | null = null;
  /** The replays' staging buffers, one per upload (backend/webgpu-commands.ts replayCommands). */
  private staging: object[] = [];

  constructor(private readonly host: CaptureHost) {}

  /**
   * Whether captured steps are on: this thread's backend is webgpu, LAYERWISE_WEBGPU_CAPTURE is
   * not 0, and kernels are not being timed (LAYERWISE_WEBGPU_KERNEL_TIMES=1). A browser page,
   * which has no environment, captures.
   */
  static wanted(): boolean {
    const env = (globalThis as { process?: { env?: Record<string, string> } })
      .process?.env;
    return (
      env?.[CAPTURE_ENV] !== '0' &&
      env?.[KERNEL_TIMES_ENV] !== '1' &&
      gpuQueue() !== null
    );
  }

  private get backend(): Backend {
    return tf.backend() as unknown as Backend;
  }

  /** Whether a training forward of micro-batch `mb` with `io` is a step this capture covers. */
  private bufferOf(t: tf.Tensor): unknown {
    return this.backend.tensorMap.get(t.dataId)?.resource;
  }

  private paramBuffers(): unknown[] {
    return [...this.host.paramVars.values()].map((v) => this.bufferOf(v));
  }

  /**
   * The training forward of a stage holding the whole model, before it runs: true where this
   * step is replayed (x and labels taken: disposed, their values kept for the backward; the stage
   * skips its forward), false where the stage runs its forward (recorded where the step is one
   * the capture covers: call {@link afterForward} once it ran).
   */
  beforeForward(
    mb: number,
    io: StepIO,
    keep: boolean,
    x: tf.Tensor,
    labels: tf.Tensor,
  ): boolean {
    if (!capturesStep(mb, io, keep)) {
      this.drop();
      return false;
    }
    const c = this.ready;
    if (c) {
      const xs = this.backend.tensorMap.get(x.dataId)?.values;
      const ls = this.backend.tensorMap.get(labels.dataId)?.values;
      const params = this.paramBuffers();
      if (
        xs &&
        ls &&
        sameShape(x, c.x) &&
        sameShape(labels, c.labels) &&
        xs.byteLength === c.bytes.x &&
        ls.byteLength === c.bytes.labels &&
        params.every((b, i) => b === c.params[i])
      ) {
        this.pending = {
          x: bytesOf(xs),
          labels: bytesOf(ls),
          seed: bytesOf(new Float32Array([io.lossSeed])),
        };
        x.dispose();
        labels.dispose();
        return true;
      }
      this.drop();
    }
    // record this step's forward and backward: TF.js's queued commands submitted first, so that
    // the recording starts with a new command encoder
    gpuQueue()!.flush();
    this.recording = {
      rec: startRecording(this.backend.device),
      x,
      labels,
      base: deviceBytes(),
    };
    return false;
  }

  /** After a recorded forward: `loss` the forward's loss tensor (read at the step's end). */
  afterForward(x: tf.Tensor, labels: tf.Tensor, loss: tf.Tensor): void {
    const r = this.recording;
    if (!r) return;
    r.xBuffer = this.bufferOf(x);
    r.labelsBuffer = this.bufferOf(labels);
    r.loss = this.bufferOf(loss);
  }

  /**
   * The backward of micro-batch 0: where its forward was replayed, replays the recording with
   * the step's batch and returns the gradients by key (tensors on the recording's buffers, not
   * copied: the stage accumulates and the optimizer reads them as any) and the loss tensor (to
   * read at the step's end); null where the stage runs its backward.
   */
  replayBackward(): {
    grads: Map<string, tf.Tensor>;
    loss: tf.Tensor;
  } | null {
    const c = this.ready;
    const p = this.pending;
    if (!c || !p) return null;
    this.pending = null;
    const q = gpuQueue()!;
    q.flush(); // what TF.js queued goes first
    // the device holds the recorded step's activations and gradients in the held buffers while
    // the replay runs: counted as the recorded step counted its tensors (its peak, checked
    // against --device-memory), then given back before the gradients become tensors again
    countPrivateBytes(c.transientBytes);
    countPrivateBytes(-c.transientBytes);
    let replayed: ReturnType<typeof replayCommands>;
    try {
      replayed = replayCommands(this.backend.device, c.ops, {
        inputs: {
          upload: (i) => p[c.roles[i]!],
          write: (_, recorded) => recorded,
        },
        staging: this.staging,
        onEncoder: (e) => q.timePasses(e), // the GPU's busy time counts the replay's passes
      });
    } catch (e) {
      this.drop(); // the next step runs through TF.js, and records anew
      throw e;
    }
    q.countReplayed(replayed); // GpuCounts.replays: summary.json's replayed_steps
    const onBuffer = (buffer: object, shape: number[]) =>
      tf.tensor(
        { buffer: buffer as GPUBuffer, zeroCopy: true },
        shape,
        'float32',
      );
    return {
      grads: new Map(
        [...c.grads].map(([k, g]) => [k, onBuffer(g.buffer, g.shape)]),
      ),
      loss: onBuffer(c.loss, []),
    };
  }

  /**
   * After a recorded backward: `grads` the stage's accumulated gradients by key, `lossSeed` the
   * step's. Ends the recording; where it repeats the last step's, the capture is ready (its
   * buffers held) and the next step is replayed.
   */
  afterBackward(grads: ReadonlyMap<string, tf.Tensor>, lossSeed: number): void {
    const r = this.recording;
    if (!r) return;
    this.recording = null;
    gpuQueue()!.flush(); // the backward's last commands into the recording
    const ops = r.rec.stop();
    const c = this.captured(
      r,
      ops,
      grads,
      bytesOf(new Float32Array([lossSeed])),
    );
    if (!c) {
      this.last = null;
      return;
    }
    if (this.last && sameCapture(this.last, c)) {
      const buffers = usedBuffers(c);
      if (buffers && holdBuffers(this.backend, this, buffers)) {
        this.ready = c;
        this.last = null;
        return;
      }
    }
    this.last = c;
  }

  /**
   * What a recording shows, or null where it cannot be replayed: a read or a `writeBuffer` inside
   * it, a buffer not known, or an upload that is not the batch's tokens, its labels or its loss
   * seed (`seed`: the seed's float32 bytes). Any other upload would be a value the host computed
   * for this step (Dropout's masks, a small op TF.js ran on the CPU), which a replay cannot know.
   */
  private captured(
    r: NonNullable<StepCapture['recording']>,
    ops: RecordedOp[],
    grads: ReadonlyMap<string, tf.Tensor>,
    seed: Uint8Array,
  ): Captured | null {
    if (!r.xBuffer || !r.labelsBuffer || !r.loss) return null;
    const roles: Captured['roles'] = [];
    const bytes = { x: -1, labels: -1 };
    for (const o of ops) {
      if (o.op === 'write') return null; // a step's own values written: not known here
      if (o.op !== 'copy') continue;
      if (isRead(o)) return null; // a read inside the step
      if (!isUpload(o)) continue;
      if (!o.data) return null;
      const dst = o.args[2];
      const role =
        dst === r.xBuffer
          ? 'x'
          : dst === r.labelsBuffer
            ? 'labels'
            : sameBytes(o.data, seed)
              ? 'seed'
              : null;
      if (!role || roles.includes(role)) return null;
      roles.push(role);
      if (role !== 'seed') bytes[role] = o.data.byteLength;
    }
    if (bytes.x < 0 || bytes.labels < 0) return null;
    const byKey = new Map<string, { buffer: object; shape: number[] }>();
    for (const [k, g] of grads) {
      const buffer = this.bufferOf(g);
      if (!buffer || g.dtype !== 'float32') return null;
      byKey.set(k, { buffer: buffer as object, shape: [...g.shape] });
    }
    const params = this.paramBuffers();
    if (params.some((b) => !b)) return null;
    return {
      ops,
      roles,
      bytes,
      x: { shape: [...r.x.shape], dtype: r.x.dtype },
      labels: { shape: [...r.labels.shape], dtype: r.labels.dtype },
      params: params as object[],
      grads: byKey,
      loss: r.loss as object,
      // the step's peak (from its start, backend/memory.ts resetPeakBytes) above the level here
      transientBytes: Math.max(0, peakBytes() - r.base),
    };
  }

  /** Drops a replayed step's batch (a failed step); the capture stays. */
  resetStep(): void {
    this.pending = null;
    if (this.recording) {
      this.recording.rec.stop();
      this.recording = null;
    }
  }

  /**
   * Drops the capture (its buffers back to the pool, its staging buffers freed: a new capture's
   * uploads may differ) and any recording: the next covered step records anew.
   */
  drop(): void {
    this.resetStep();
    this.last = null;
    if (this.ready) {
      this.ready = null;
      unholdBuffers(this.backend, this);
    }
    // a destroyed buffer lives on in Dawn until the submitted work that uses it has run
    for (const b of this.staging) (b as { destroy(): void }).destroy();
    this.staging = [];
  }

  /** Drops the capture and frees its staging buffers. */
  dispose(): void {
    this.drop();
  }
}

const sameShape = (t: tf.Tensor, s: { shape: number[]; dtype: string }) =>
  t.dtype === s.dtype &&
  t.shape.length === s.shape.length &&
  t.shape.every((n, i) => n === s.shape[i]);

const bytesOf = (v: ArrayBufferView) =>
  new Uint8Array(v.buffer, v.byteOffset, v.byteLength);

const sameBytes = (a: Uint8Array, b: Uint8Array) =>
  a.byteLength === b.byteLength && a.every((v, k) => v === b[k]);

/** Whether two recordings are the same step: the same commands on the same buffers, uploads to the same places (the batch's bytes aside). */
function sameCapture(a: Captured, b: Captured): boolean {
  if (
    a.ops.length !== b.ops.length ||
    a.loss !== b.loss ||
    a.roles.join() !== b.roles.join() ||
    a.params.length !== b.params.length ||
    a.params.some((p, i) => p !== b.params[i]) ||
    a.grads.size !== b.grads.size
  )
    return false;
  for (const [k, g] of a.grads) {
    const h = b.grads.get(k);
    if (!h || h.buffer !== g.buffer || h.shape.join() !== g.shape.join())
      return false;
  }
  return a.ops.every((o, i) => {
    const p = b.ops[i]!;
    if (o.op === 'copy' && o.data)
      // an upload (each one the batch's or the seed: captured() checked): the same place
      return (
        p.op === 'copy' &&
        p.data !== undefined &&
        o.args.slice(1).every((x, k) => x === p.args[k + 1])
      );
    return sameCommand(o, p);
  });
}

/** Every buffer a recording binds or copies (uploads' staging buffers aside), or null where a bind group's are not known. */
function usedBuffers(c: Captured): Set<object> | null {
  const out = new Set<object>();
  for (const o of c.ops) {
    if (o.op === 'bind') {
      const bs = buffersOfBindGroup(o.group);
      if (!bs) return null;
      for (const b of bs) out.add(b);
    } else if (o.op === 'copy') {
      const [src, , dst] = o.args;
      if (!isUpload(o)) out.add(src);
      out.add(dst);
    }
  }
  for (const g of c.grads.values()) out.add(g.buffer);
  out.add(c.loss);
  return out;
}
