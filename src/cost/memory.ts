/**
 * Memory predictions, pure (no tensors, no threads): from per-block costs (costs.ts, measured
 * by cost/profile.ts) the peak device bytes of each stage for a partition, a number of
 * micro-batches M, a re-materialization mode and a schedule, for each stage kind (backprop,
 * local parallelism, the L2L relay). Time predictions are in time.ts.
 *
 * Memory is predicted by walking the stage's own action list (the schedule is data) and
 * keeping a running total of the bytes the stage's engine holds, the way {@link ../pipeline/stage.ts}
 * allocates and frees them:
 *
 * - always: parameters P and optimizer slots (AdamW 2P, SGD momentum P; created on the first
 *   step, so the model describes every step after it);
 * - the micro-batch inputs the stage holds: the first stage gets all M inputs at the start of
 *   the step, the last stage all M label tensors; other stages hold received activations until
 *   that micro-batch's backward (M in flight under fill-drain, at most K - s under 1F1B);
 * - a forward peaks at its transient (a block's intermediates live until the block's tidy
 *   ends, with the compacted tapes of the blocks before it: costs.ts forwardPeak) and keeps
 *   the tape's activations when it keeps them;
 * - a backward peaks at the kept tape plus its transient (new gradients, input gradient, the
 *   intermediate gradients still to be used); it frees each block's tape and intermediate
 *   gradients as it passes them (pipeline/tape.ts), so a stage's earlier blocks run theirs
 *   without the later blocks' tapes (costs.ts backwardPeak); a re-materialized backward first
 *   runs the forward again;
 * - accumulated gradients (P) from the first backward to the optimizer step, which peaks at
 *   its per-parameter temporaries.
 *
 * Per-block quantities add up over a stage's blocks (a stage's kept tape is the sum of its
 * blocks'; its forward and backward transients are walked block by block, costs.ts
 * forwardPeak and backwardPeak). Units: bytes and seconds throughout.
 *
 * Local parallelism ({@link predictLocalPeakBytes}) walks the
 * stage's local schedule the same way: each micro-batch is one local update (forward on the
 * tape through the stage's blocks and its auxiliary head, backward within the stage, one
 * optimizer step), so a stage holds its parameters and its head's, their optimizer slots, one
 * micro-batch's tape and backward transient, the micro-batch inputs and labels it was handed,
 * and with --overlap the stashed tail inputs waiting for the next stage's gradient.
 */

import type { StageRange } from '../partition/balance.js';
import {
  declarationOf,
  type LayerBytes,
  type MemoryWalk,
  type OpSpec,
  type StageBytes,
} from '../schedule/ops.js';
import {
  type Action,
  chainPlacement,
  computeSchedule,
  localSchedule,
  lower,
  placementOf,
  relayPipelineTraining,
  relaySchedule,
  type Schedule,
  type ScheduleKind,
  stagesPerDevice,
} from '../schedule/schedule.js';
import { LayerwiseError } from '../util/errors.js';
import {
  type LocalShape,
  localTotals,
  type MicroBatchCosts,
  type RelayShape,
  type StepShape,
  stageTotals,
} from './costs.js';

/**
 * Predicted peak device bytes of one stage during one training step (after the first step,
 * once the optimizer slots exist), by walking the stage's action list. `actions` is the
 * stage's list from a {@link Schedule}; `stage`/`stages` its index and the number of stages.
 */
export function stagePeakBytes(
  c: MicroBatchCosts,
  r: StageRange,
  stage: number,
  schedule: Schedule,
  slots: number,
): number {
  const t = stageTotals(c, r);
  const k = schedule.length;
  const actions = schedule[stage];
  const first = stage === 0;
  const last = stage === k - 1;
  const m = actions.filter((a) => a.op === 'forward').length;
  return walk(
    actions,
    t,
    { first, last, labelBytes: c.labelBytes },
    startBytes(c, t, first, last, m, slots),
  );
}

/**
 * What a backprop stage holds when a step starts: its parameters and optimizer slots, and the
 * first stage the M inputs, the last the M labels.
 */
function startBytes(
  c: MicroBatchCosts,
  t: StageBytes,
  first: boolean,
  last: boolean,
  m: number,
  slots: number,
): number {
  return (
    t.params * (1 + slots) +
    (t.paramCopies ?? 0) +
    (first ? m * t.inBytes : 0) +
    (last ? m * c.labelBytes : 0)
  );
}

const NO_BYTES: StageBytes = {
  params: 0,
  maxParam: 0,
  optTransient: 0,
  inBytes: 0,
  outBytes: 0,
  fwdPeak: 0,
  kept: 0,
  bwdPeak: 0,
};

type WalkOptions = Partial<
  Pick<
    MemoryWalk,
    | 'first'
    | 'last'
    | 'labelBytes'
    | 'grads'
    | 'tail'
    | 'sendsInputGrad'
    | 'layers'
    | 'firstLayer'
    | 'lastLayer'
    | 'hostStash'
  >
>;

/** A device's bytes during a walk, now and at their peak (shared by the walks of its stages). */
interface DeviceBytes {
  cur: number;
  peak: number;
  /** Records a peak of `cur + extra` (a transient). */
  bump(extra: number): void;
}

function deviceBytesFrom(start: number): DeviceBytes {
  const b: DeviceBytes = {
    cur: start,
    peak: start,
    bump(extra) {
      b.peak = Math.max(b.peak, b.cur + extra);
    },
  };
  return b;
}

/**
 * Walks `actions` from `start` bytes, each action by its op's declared memory effect
 * (schedule/ops.ts `memory`), and returns the peak.
 */
function walk(
  actions: readonly Action[],
  t: StageBytes,
  opts: WalkOptions,
  start: number,
): number {
  const bytes = deviceBytesFrom(start);
  const w = newWalk(t, opts, bytes);
  for (const a of actions)
    (declarationOf(a.op) as OpSpec<typeof a.op>).memory(a, w);
  return bytes.peak;
}

/** A memory walk of one stage's terms whose bytes are `bytes` (shared by the stages of one device). */
function newWalk(
  t: StageBytes,
  opts: WalkOptions,
  bytes: DeviceBytes,
): MemoryWalk {
  return {
    get cur() {
      return bytes.cur;
    },
    set cur(x: number) {
      bytes.cur = x;
    },
    bump: (extra) => bytes.bump(extra),
    first: opts.first ?? false,
    last: opts.last ?? false,
    t,
    labelBytes: opts.labelBytes ?? 0,
    kept: new Set(),
    grads: opts.grads ?? 0,
    tail: opts.tail ?? null,
    sendsInputGrad: opts.sendsInputGrad ?? false,
    layers: opts.layers ?? [],
    firstLayer: opts.firstLayer ?? 0,
    lastLayer: opts.lastLayer ?? (opts.layers?.length ?? 0) - 1,
    hostStash: opts.hostStash ?? false,
    loaded: new Set(),
    gradsStarted: new Set(),
  };
}

/**
 * Predicted peak device bytes per device for a partition (`ranges`, one per stage, contiguous
 * and covering the model) and a step shape. Single-device training is the one-stage case with
 * M = 1 and checkpoint 'never'. A device running several stages (interleaved and V-shape
 * schedules) walks its list once, each action by its stage's terms, all of them adding to the
 * device's bytes. Throws {@link LayerwiseError} for an empty stage or bad M.
 */
export function predictPeakBytes(
  c: MicroBatchCosts,
  ranges: readonly StageRange[],
  shape: StepShape,
): number[] {
  const v = shape.virtualStages ?? 2;
  const placement = shape.compute
    ? (shape.placement ?? chainPlacement(ranges.length))
    : placementOf(
        shape.schedule,
        ranges.length / stagesPerDevice(shape.schedule, v),
        v,
      );
  if (placement.length !== ranges.length)
    throw new LayerwiseError(
      `a schedule of ${placement.length} stages for ${ranges.length} stage ranges`,
    );
  const devices = Math.max(...placement) + 1;
  const sched = lower(
    shape.compute ??
      computeSchedule(shape.schedule, shape.m, devices, shape.remat, v),
    placement,
    { step: 'all-reduce' },
  );
  if (devices === ranges.length)
    return ranges.map((r, s) => stagePeakBytes(c, r, s, sched, shape.slots));
  return sched.map((actions, d) => {
    const bytes = deviceBytesFrom(0);
    const walks = new Map<number, MemoryWalk>();
    placement.forEach((dev, s) => {
      if (dev !== d) return;
      const t = stageTotals(c, ranges[s]!);
      const first = s === 0;
      const last = s === ranges.length - 1;
      bytes.cur += startBytes(c, t, first, last, shape.m, shape.slots);
      walks.set(
        s,
        newWalk(t, { first, last, labelBytes: c.labelBytes }, bytes),
      );
    });
    bytes.peak = bytes.cur;
    for (const a of actions)
      (declarationOf(a.op) as OpSpec<typeof a.op>).memory(
        a,
        walks.get(a.stage)!,
      );
    return bytes.peak;
  });
}

/**
 * Predicted peak device bytes of stage `stage` (of `stages`, blocks `r`) under local parallelism, during one
 * mini-batch after the first (once the optimizer slots exist), by walking the stage's local
 * schedule (pipeline/local-stage.ts):
 *
 * - always: the stage's parameters and its auxiliary head's, and their optimizer slots;
 * - at the start of the mini-batch: the M labels (every stage gets them), and on the first
 *   stage the M inputs; each is freed by its micro-batch's update;
 * - a local update: the forward on the tape through the blocks, the head and the loss (their
 *   transients), the tape kept plus the copy of the output to send on, then the backward's
 *   transient; it leaves the gradients (parameter sized), the output until it is sent and, with
 *   overlap, the input gradient until it is sent back and the tail's input in the stash;
 * - overlap (`shape.overlap` > 0): the next stage's gradient is backpropagated through the
 *   stage's tail (re-computed from the stash) into the next update's gradients. The
 *   deterministic interleaving is walked; free-running overlap (`--deterministic` off) is
 *   predicted the same way, as if each gradient arrived one micro-batch later;
 * - a local step: the gradient norm (one parameter's temporaries) and the optimizer's
 *   transient; it frees the gradients.
 *
 * Throws {@link LayerwiseError} for an empty stage or bad M, and an Error when the costs lack
 * the stage's auxiliary head.
 */
export function localStagePeakBytes(
  c: MicroBatchCosts,
  r: StageRange,
  stage: number,
  stages: number,
  shape: LocalShape,
): number {
  const k = stages;
  const first = stage === 0;
  const last = stage === k - 1;
  const overlap = shape.overlap ?? 0;
  const actions = localSchedule(shape.m, k, overlap, true)[stage];
  const t = localTotals(c, r, last);
  const tailN = !last && overlap > 0 ? overlap : 0;
  const tail =
    tailN > 0 ? stageTotals(c, { from: r.to - tailN, to: r.to }) : null;
  const sendsInputGrad = overlap > 0 && !first;
  const m = shape.m;
  // bytes of accumulated gradients: with overlap, the tail's from the previous mini-batch's
  // last micro-batch (applied at this mini-batch's first step)
  const grads = tail ? tail.params : 0;
  return walk(
    actions,
    t,
    { first, last, labelBytes: c.labelBytes, grads, tail, sendsInputGrad },
    t.params * (1 + shape.slots) +
      (t.paramCopies ?? 0) +
      grads +
      m * c.labelBytes +
      (first ? m * t.inBytes : 0),
  );
}

/**
 * Predicted peak device bytes per stage under local parallelism (see {@link localStagePeakBytes}),
 * for a partition `ranges` (contiguous, covering the model) and a step shape. Throws
 * {@link LayerwiseError} for an empty stage or bad M, and an Error when the costs lack an
 * auxiliary head of a stage but the last.
 */
export function predictLocalPeakBytes(
  c: MicroBatchCosts,
  ranges: readonly StageRange[],
  shape: LocalShape,
): number[] {
  return ranges.map((r, s) =>
    localStagePeakBytes(c, r, s, ranges.length, shape),
  );
}

/**
 * Predicted peak device bytes of an L2L relay step, by walking {@link relaySchedule}'s action
 * list the way pipeline/relay-stage.ts allocates and frees: the step's M input and label
 * tensors; the parameters of the loaded layers (at most the current and the prefetched one);
 * for each forward, the block's transient and its output (kept when the stash is on the device,
 * downloaded at once when it is in host memory, where its input is uploaded again for the
 * backward); for each backward, the re-computed tape, the backward transient, the layer's
 * accumulated gradient (from its first micro-batch to its push) and the input gradients of
 * all M micro-batches. No optimizer state: it lives in the parameter server. Bytes.
 */
export function predictRelayPeakBytes(
  c: MicroBatchCosts,
  shape: RelayShape,
): number {
  const n = c.blocks.length;
  return walkRelay(
    c,
    relaySchedule(n, shape.m),
    [{ from: 0, to: n }],
    shape,
  )[0]!;
}

/**
 * Predicted peak device bytes of each device of a pipelined relay (L2L on K devices, one stage
 * of layers `ranges[d]` each), by walking each device's list of
 * schedule/schedule.ts relayPipelineTraining as {@link predictRelayPeakBytes} walks the relay:
 * besides the relay's terms, a stage holds the activations it received (its first layer's
 * input) and its output until it is sent, and the gradients received and sent back. Device 0
 * starts with the M inputs, the last device with the M labels. Bytes, per device.
 */
export function predictRelayPipelinePeakBytes(
  c: MicroBatchCosts,
  ranges: readonly StageRange[],
  shape: RelayShape & { schedule: ScheduleKind },
): number[] {
  return walkRelay(
    c,
    relayPipelineTraining(shape.schedule, shape.m, ranges),
    ranges,
    shape,
  );
}

/**
 * Walks relay schedule `sched` (device d relaying layers `ranges[d]`) by each op's memory
 * effect: the layers' bytes, the stage's boundary (its first layer's input, its last layer's
 * output) for the sends and receives, device 0 starting with the M inputs and the last device
 * with the M labels. Peak bytes per device.
 */
function walkRelay(
  c: MicroBatchCosts,
  sched: Schedule,
  ranges: readonly StageRange[],
  shape: RelayShape,
): number[] {
  // a relay with 2-byte parameter copies ships the matrices as those: 2 bytes per element instead of 4
  const layers: LayerBytes[] = c.blocks.map((b) => ({
    ...b,
    loadedBytes: b.paramBytes - (b.deviceCopyBytes ?? 0),
  }));
  const k = ranges.length;
  return ranges.map((r, d) => {
    const t: StageBytes = {
      ...NO_BYTES,
      inBytes: c.blocks[r.from]!.inBytes,
      outBytes: c.blocks[r.to - 1]!.outBytes,
    };
    return walk(
      sched[d]!,
      t,
      {
        labelBytes: c.labelBytes,
        layers,
        firstLayer: r.from,
        lastLayer: r.to - 1,
        hostStash: shape.stash === 'host',
      },
      (d === 0 ? shape.m * c.blocks[0]!.inBytes : 0) +
        (d === k - 1 ? shape.m * c.labelBytes : 0),
    );
  });
}
