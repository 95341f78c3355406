/**
 * The floor under a webgpu step's host time (issue 36): one training step's GPU commands, recorded
 * as Dawn receives them (compute passes, pipelines, bind groups, dispatches, buffer copies,
 * submits), then encoded and submitted again with no TF.js, no tape and no layerwise JS. What that
 * replay costs the host is what a step would cost if its commands were captured once and
 * re-issued (as CUDA graphs do), against what the same step costs through TF.js. The replay
 * re-runs the step on the buffers it used, so it is a measurement only: the stage's values are
 * spoiled afterwards. Used by `npm run bench -- webgpu-host`.
 */
import { gpuQueue } from '../backend/gpu-queue.js';
import { tf } from '../backend/tfjs.js';
import { median } from '../util/stats.js';

/** The parts of Dawn's objects recorded or replayed here. */
interface Pass {
  setPipeline(p: object): void;
  setBindGroup(i: number, g: object, ...rest: unknown[]): void;
  dispatchWorkgroups(x: number, y?: number, z?: number): void;
  end(): void;
}
interface Encoder {
  beginComputePass(d?: object): Pass;
  copyBufferToBuffer(
    src: { usage: number },
    srcOffset: number,
    dst: { usage: number },
    dstOffset: number,
    size: number,
  ): void;
  finish(): object;
}
interface Device {
  createCommandEncoder(d?: object): Encoder;
  queue: { submit(buffers: object[]): void };
  pushErrorScope(filter: 'validation'): void;
  popErrorScope(): Promise<{ message: string } | null>;
}

/** One recorded command. */
export type RecordedOp =
  | { op: 'begin' }
  | { op: 'pipeline'; pipeline: object }
  | { op: 'bind'; index: number; group: object; rest: unknown[] }
  | { op: 'dispatch'; x: number; y?: number; z?: number }
  | { op: 'end' }
  | {
      op: 'copy';
      args: Parameters<Encoder['copyBufferToBuffer']>;
    }
  | { op: 'submit' };

const MAP_READ = 0x01;
const MAP_WRITE = 0x02;

/**
 * Records the commands `device` receives while `run` runs (`run` must submit all it records; the
 * op list starts at the first command encoder made after the call). Copies from or to mappable
 * buffers are recorded but not replayed (uploads' staging buffers are destroyed once used, reads'
 * are mapped). Restores the device's methods before returning.
 */
export function recordCommands(device: object, run: () => void): RecordedOp[] {
  const d = device as Device;
  const ops: RecordedOp[] = [];
  const create = d.createCommandEncoder;
  const submit = d.queue.submit;
  d.createCommandEncoder = (desc?: object) => {
    const e = create.call(d, desc);
    const begin = e.beginComputePass.bind(e);
    e.beginComputePass = (pd?: object) => {
      ops.push({ op: 'begin' });
      const p = begin(pd);
      const [setPipeline, setBindGroup, dispatch, end] = [
        p.setPipeline.bind(p),
        p.setBindGroup.bind(p),
        p.dispatchWorkgroups.bind(p),
        p.end.bind(p),
      ];
      p.setPipeline = (pipeline) => {
        ops.push({ op: 'pipeline', pipeline });
        setPipeline(pipeline);
      };
      p.setBindGroup = (index, group, ...rest) => {
        ops.push({ op: 'bind', index, group, rest });
        setBindGroup(index, group, ...rest);
      };
      p.dispatchWorkgroups = (x, y, z) => {
        ops.push({ op: 'dispatch', x, y, z });
        dispatch(x, y, z);
      };
      p.end = () => {
        ops.push({ op: 'end' });
        end();
      };
      return p;
    };
    const copy = e.copyBufferToBuffer.bind(e);
    e.copyBufferToBuffer = (...args) => {
      ops.push({ op: 'copy', args });
      copy(...args);
    };
    return e;
  };
  d.queue.submit = (buffers: object[]) => {
    if (buffers.length > 0) ops.push({ op: 'submit' });
    submit.call(d.queue, buffers);
  };
  try {
    run();
  } finally {
    d.createCommandEncoder = create;
    d.queue.submit = submit;
  }
  return ops;
}

/**
 * Whether two recorded commands are the same command on the same objects (pipeline, bind group,
 * buffers: by identity) with the same numbers: what a step must repeat of the step before for
 * its recording to stand for it.
 */
export function sameCommand(o: RecordedOp, p: RecordedOp): boolean {
  if (o.op !== p.op) return false;
  switch (o.op) {
    case 'pipeline':
      return o.pipeline === (p as typeof o).pipeline;
    case 'bind': {
      const q = p as typeof o;
      return (
        o.index === q.index &&
        o.group === q.group &&
        o.rest.length === q.rest.length &&
        o.rest.every((x, k) => x === q.rest[k])
      );
    }
    case 'dispatch': {
      const q = p as typeof o;
      return o.x === q.x && o.y === q.y && o.z === q.z;
    }
    case 'copy':
      return o.args.every((x, k) => x === (p as typeof o).args[k]);
    default:
      return true;
  }
}

/** Encodes and submits `ops` again on `device` (see {@link recordCommands} for the copies left out). */
export function replayCommands(
  device: object,
  ops: readonly RecordedOp[],
): void {
  const d = device as Device;
  let e = d.createCommandEncoder();
  let pass: Pass | null = null;
  const close = () => {
    pass?.end();
    pass = null;
  };
  for (const o of ops)
    switch (o.op) {
      case 'begin':
        close();
        pass = e.beginComputePass();
        break;
      case 'pipeline':
        pass!.setPipeline(o.pipeline);
        break;
      case 'bind':
        pass!.setBindGroup(o.index, o.group, ...o.rest);
        break;
      case 'dispatch':
        pass!.dispatchWorkgroups(o.x, o.y, o.z);
        break;
      case 'end':
        close();
        break;
      case 'copy': {
        const [src, , dst] = o.args;
        if (src.usage & MAP_WRITE || dst.usage & MAP_READ) break;
        close();
        e.copyBufferToBuffer(...o.args);
        break;
      }
      case 'submit':
        close();
        d.queue.submit([e.finish()]);
        e = d.createCommandEncoder();
        break;
    }
  close();
  d.queue.submit([e.finish()]);
}

/** What {@link replayCosts} measured. */
export interface ReplayCosts {
  /** The recorded step's commands by kind. */
  ops: Record<RecordedOp['op'], number>;
  /**
   * Host ms of a step through TF.js, median of the timed steps: the wall time of the synchronous
   * step with the GPU idle when it starts (this thread's CPU clock, /proc's schedstat, moves in
   * scheduler ticks: too coarse for a replay's millisecond).
   */
  host_ms_tfjs: number;
  /** Host ms of encoding and submitting the recorded step again, the same way, median of as many replays. */
  host_ms_replay: number;
  /** Dawn's validation errors during the replays (null: none). */
  replay_error: string | null;
}

/**
 * Runs `step` (one synchronous training step on this thread's webgpu backend) `warmup` times,
 * then `steps` timed times, records one more, and replays it `steps` times: the host ms of each,
 * with the GPU caught up between steps (not counted). Spoils the stage's values (see the module's
 * comment).
 * @throws Error where this thread's backend is not webgpu.
 */
export async function replayCosts(
  step: () => void,
  warmup: number,
  steps: number,
): Promise<ReplayCosts> {
  const q = gpuQueue();
  if (!q)
    throw new Error('replayCosts: needs the webgpu backend on this thread');
  const device = (tf.backend() as unknown as { device: Device }).device;
  // the GPU done with everything submitted (Dawn's Node bindings deliver it in a polled turn)
  const caughtUp = async () => {
    let finished = false;
    void q.submit().done.then(() => {
      finished = true;
    });
    while (!finished) await q.poll();
  };
  const timed = async (f: () => void) => {
    const out: number[] = [];
    for (let i = 0; i < steps; i++) {
      const t0 = performance.now();
      f();
      out.push(performance.now() - t0);
      await caughtUp();
    }
    return median(out);
  };
  for (let i = 0; i < warmup; i++) {
    step();
    await caughtUp();
  }
  const hostTfjs = await timed(step);
  const ops = recordCommands(device, () => {
    step();
    q.flush();
  });
  await caughtUp();
  device.pushErrorScope('validation');
  const hostReplay = await timed(() => replayCommands(device, ops));
  const error = await device.popErrorScope();
  const counts = Object.fromEntries(
    ['begin', 'pipeline', 'bind', 'dispatch', 'end', 'copy', 'submit'].map(
      (k) => [k, ops.filter((o) => o.op === k).length],
    ),
  ) as ReplayCosts['ops'];
  return {
    ops: counts,
    host_ms_tfjs: hostTfjs,
    host_ms_replay: hostReplay,
    replay_error: error?.message ?? null,
  };
}
