/**
 * Time predictions, pure: from per-block costs (costs.ts) the time of one training step, its
 * bubble per stage and each stage's busy seconds, for the backprop pipeline (by simulating its
 * schedule, schedule/simulate.ts), local parallelism (stages run free: the slowest stage sets
 * the pace) and the L2L relay (device work plus the parameter server's updates it cannot hide).
 * Communication is taken as free. Memory predictions are in memory.ts. Units: seconds.
 */

import type { StageRange } from '../partition/balance.js';
import {
  chainPlacement,
  lower,
  makeSchedule,
  relayPipelineTraining,
  type ScheduleKind,
  stagesPerDevice,
} from '../schedule/schedule.js';
import { opCost, simulate } from '../schedule/simulate.js';
import {
  type BlockCost,
  type LocalShape,
  localTotals,
  type MicroBatchCosts,
  type RelayShape,
  type StepShape,
  stageTotals,
} from './costs.js';

/** Predicted time of one step: wall seconds, per-stage busy seconds and idle (bubble) fraction. */
export interface StepTime {
  /** Wall seconds of one training step (the schedule's makespan). */
  seconds: number;
  /** Per device: fraction of the step it waits (the bubble). */
  bubble: number[];
  /** Per device: seconds of compute. */
  busySeconds: number[];
}

/**
 * Predicted step time: simulates the schedule with each stage's forward, backward (plus the
 * forward again for micro-batches that are re-materialized) and optimizer times. Communication
 * is taken as free (neighbouring worker threads exchange transferred buffers). Throws
 * {@link LayerwiseError} for an empty stage or bad M.
 */
export function predictStepTime(
  c: MicroBatchCosts,
  ranges: readonly StageRange[],
  shape: Omit<StepShape, 'slots'>,
): StepTime {
  const v = shape.virtualStages ?? 2;
  const sched = shape.compute
    ? lower(shape.compute, shape.placement ?? chainPlacement(ranges.length), {
        step: 'all-reduce',
      })
    : makeSchedule(
        shape.schedule,
        shape.m,
        ranges.length / stagesPerDevice(shape.schedule, v),
        shape.remat,
        v,
      );
  const totals = ranges.map((r) => stageTotals(c, r));
  // per stage: the micro-batches whose forward keeps its activations
  const keptBy = ranges.map(() => new Set<number>());
  for (const a of sched.flat())
    if (a.op === 'forward' && a.keep) keptBy[a.stage]!.add(a.mb);
  // each action's seconds by its op's declared cost (schedule/ops.ts), from its stage's totals
  const terms = totals.map((t, s) => ({
    fwd: t.fwd,
    bwd: t.bwd,
    bwdInput: t.bwdInput,
    opt: t.opt,
    recomputes: (mb: number) => !keptBy[s]!.has(mb),
    tail: 0,
    layer: () => ({ fwd: 0, bwd: 0 }),
  }));
  const sim = simulate(sched, (_d, a) => opCost(a, terms[a.stage]));
  // per device (several stages may share one)
  const busy = new Array<number>(sched.length).fill(0);
  for (const e of sim.events) busy[e.device] += e.end - e.start;
  return { seconds: sim.makespan, bubble: sim.bubble, busySeconds: busy };
}

/**
 * Predicted busy seconds of local stage `stage` (of `stages`, blocks `r`) per mini-batch: M local updates (forward and
 * backward through the blocks and the head) and M optimizer steps, plus with overlap the
 * tail's re-computed forward and its backward per micro-batch.
 */
export function localStageSeconds(
  c: MicroBatchCosts,
  r: StageRange,
  stage: number,
  stages: number,
  shape: LocalShape,
): number {
  const last = stage === stages - 1;
  const t = localTotals(c, r, last);
  const overlap = shape.overlap ?? 0;
  const tail =
    !last && overlap > 0
      ? stageTotals(c, { from: r.to - overlap, to: r.to })
      : null;
  return shape.m * (t.fwd + t.bwd + t.opt + (tail ? tail.fwd + tail.bwd : 0));
}

/**
 * Predicted time of one mini-batch under local parallelism. Stages run free across
 * mini-batches (no gradient crosses a stage boundary, and the first stage takes the next
 * mini-batch as soon as it is done), so in the steady state a mini-batch takes as long as the
 * slowest stage's work on it; the others idle for the difference (their bubble).
 * Communication is taken as free. Throws like {@link predictLocalPeakBytes}.
 */
export function predictLocalStepTime(
  c: MicroBatchCosts,
  ranges: readonly StageRange[],
  shape: LocalShape,
): StepTime {
  const busy = ranges.map((r, s) =>
    localStageSeconds(c, r, s, ranges.length, shape),
  );
  const seconds = Math.max(...busy);
  return {
    seconds,
    bubble: busy.map((b) => (seconds > 0 ? 1 - b / seconds : 0)),
    busySeconds: busy,
  };
}

/**
 * Host AdamW update rate of the parameter server, parameters per second: the lower end of the
 * one-thread rates measured on this 2-core machine (bench/results/param-server.md: 66-134 M/s under
 * load, 134 M/s idle). Used to predict when the device waits for the server.
 */
export const HOST_UPDATE_PARAMS_PER_SECOND = 1e8;

/**
 * Predicted time of an L2L relay step, seconds. The device runs every layer but the last
 * forward once per micro-batch (F), and every layer's re-computation and backward once per
 * micro-batch (B). The parameter server updates all parameters at `hostRate` parameters per
 * second (default {@link HOST_UPDATE_PARAMS_PER_SECOND}) in the background, and the device
 * waits only for what does not fit in the time it has:
 * - with clipping (`shape.clip`, the default), no update starts before the backward ends, and
 *   the updates run in forward order during the next step's forward: the device waits
 *   max(0, server - F);
 * - without clipping, each layer's update starts when its gradient arrives, from the last
 *   layer down, during the rest of the backward: the device waits max(0, server - (B - B_last)).
 * Transfers between host and device are taken as free (on wasm and cpu they are memory
 * copies), and so is the host stash's round trip, so the plan does not prefer the device
 * stash for speed even where it measured faster. `bubble` is the predicted wait's fraction of
 * the step.
 */
export function predictRelayStepTime(
  c: MicroBatchCosts,
  shape: RelayShape & { clip?: boolean },
  hostRate = HOST_UPDATE_PARAMS_PER_SECOND,
): StepTime {
  const n = c.blocks.length;
  const fwd = c.blocks
    .slice(0, n - 1)
    .reduce((s, l) => s + shape.m * l.fwdSeconds, 0);
  const bwdOf = (l: BlockCost) => shape.m * (l.fwdSeconds + l.bwdSeconds);
  const bwd = c.blocks.reduce((s, l) => s + bwdOf(l), 0);
  const device = fwd + bwd;
  const server = c.blocks.reduce((s, l) => s + l.paramBytes / 4, 0) / hostRate;
  const wait = Math.max(
    0,
    server - ((shape.clip ?? true) ? fwd : bwd - bwdOf(c.blocks[n - 1])),
  );
  const seconds = device + wait;
  return {
    seconds,
    bubble: [seconds > 0 ? wait / seconds : 0],
    busySeconds: [device],
  };
}

/**
 * Predicted time of a pipelined relay step (L2L on K devices, one stage of layers `ranges[d]`
 * each), seconds: simulates schedule/schedule.ts relayPipelineTraining with each layer's
 * forward and backward (re-computation included) per micro-batch, transfers taken as free.
 * The parameter server's updates (all parameters at `hostRate`) overlap the next step's
 * forward as in {@link predictRelayStepTime} with clipping: the step grows by what they
 * exceed the first device's forward. `bubble` is each device's idle fraction.
 */
export function predictRelayPipelineStepTime(
  c: MicroBatchCosts,
  ranges: readonly StageRange[],
  shape: RelayShape & { schedule: ScheduleKind },
  hostRate = HOST_UPDATE_PARAMS_PER_SECOND,
): StepTime {
  const sched = relayPipelineTraining(shape.schedule, shape.m, ranges);
  const terms = {
    fwd: 0,
    bwd: 0,
    opt: 0,
    recomputes: () => false,
    tail: 0,
    layer: (l: number) => ({
      fwd: c.blocks[l]!.fwdSeconds,
      bwd: c.blocks[l]!.fwdSeconds + c.blocks[l]!.bwdSeconds,
    }),
  };
  const sim = simulate(sched, (_d, a) => opCost(a, terms));
  const busy = new Array<number>(sched.length).fill(0);
  for (const e of sim.events) busy[e.device] += e.end - e.start;
  const r0 = ranges[0]!;
  const firstForward =
    shape.m *
    c.blocks.slice(r0.from, r0.to).reduce((a, l) => a + l.fwdSeconds, 0);
  const server = c.blocks.reduce((s, l) => s + l.paramBytes / 4, 0) / hostRate;
  const wait = Math.max(0, server - firstForward);
  const seconds = sim.makespan + wait;
  return {
    seconds,
    bubble: busy.map((b) => (seconds > 0 ? 1 - b / seconds : 0)),
    busySeconds: busy,
  };
}
