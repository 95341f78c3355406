/**
 * The floor under a webgpu step's host time (issue 36): one training step's GPU commands recorded
 * (backend/webgpu-commands.ts), then encoded and submitted again with no TF.js, no tape and no
 * layerwise JS. What that replay costs the host is what a step costs when its commands are
 * captured once and re-issued (pipeline/captured-step.ts), against what the same step costs
 * through TF.js. Used by `npm run bench -- webgpu-host`, where the replay re-runs the step on the
 * buffers it used, its uploads and `writeBuffer`s left out: a measurement only, the stage's
 * values spoiled afterwards.
 */
import { gpuQueue } from '../backend/gpu-queue.js';
import { tf } from '../backend/tfjs.js';
import {
  type Device,
  type RecordedOp,
  recordCommands,
  replayCommands,
} from '../backend/webgpu-commands.js';
import { CAPTURE_ENV } from '../pipeline/captured-step.js';
import { median } from '../util/stats.js';

/**
 * Runs `f` with LAYERWISE_WEBGPU_CAPTURE (pipeline/captured-step.ts CAPTURE_ENV) set to 1 (`on`)
 * or 0, and restores it after (also when `f` throws): the devices `f` starts capture or not
 * (a worker thread copies the environment when it starts). For the benches and tests that
 * compare the two in one process.
 */
export async function withCapture<T>(
  on: boolean,
  f: () => Promise<T>,
): Promise<T> {
  const before = process.env[CAPTURE_ENV];
  process.env[CAPTURE_ENV] = on ? '1' : '0';
  try {
    return await f();
  } finally {
    if (before === undefined) delete process.env[CAPTURE_ENV];
    else process.env[CAPTURE_ENV] = before;
  }
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
  const caughtUp = () => q.caughtUp();
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
    [
      'begin',
      'pipeline',
      'bind',
      'dispatch',
      'end',
      'copy',
      'write',
      'submit',
    ].map((k) => [k, ops.filter((o) => o.op === k).length]),
  ) as ReplayCosts['ops'];
  return {
    ops: counts,
    host_ms_tfjs: hostTfjs,
    host_ms_replay: hostReplay,
    replay_error: error?.message ?? null,
  };
}
