/**
 * Cost model of a training step, pure (no tensors, no threads): from per-block costs measured
 * by {@link ../partition/profile.ts} it predicts each stage's peak device bytes and the step's
 * time, bubble and throughput for a partition, a number of micro-batches M, a
 * re-materialization mode and a schedule.
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
 * - a forward peaks at its transient (all of a block's intermediates live until the block's
 *   tidy ends) and keeps the tape's activations when it keeps them;
 * - a backward peaks at the kept tape plus its transient (new gradients, input gradient,
 *   intermediate gradients); a re-materialized backward first runs the forward again;
 * - accumulated gradients (P) from the first backward to the optimizer step, which peaks at
 *   its per-parameter temporaries.
 *
 * Per-block quantities add up over a stage's blocks (checked on wasm and cpu: a stage's
 * forward transient, kept tape and backward transient are the sums of its blocks' within a few
 * percent). Units: bytes and seconds throughout.
 *
 * Local parallelism ({@link predictLocalPeakBytes}, {@link predictLocalStepTime}) walks the
 * stage's local schedule the same way: each micro-batch is one local update (forward on the
 * tape through the stage's blocks and its auxiliary head, backward within the stage, one
 * optimizer step), so a stage holds its parameters and its head's, their optimizer slots, one
 * micro-batch's tape and backward transient, the micro-batch inputs and labels it was handed,
 * and with --overlap the stashed tail inputs waiting for the next stage's gradient.
 */
import { LayerwiseError } from '../util/errors.js';
import type { OptimizerConfig } from '../optim/optimizer.js';
import { localSchedule, makeSchedule, relaySchedule, type RematMode, type Schedule, type ScheduleKind } from '../schedule/schedule.js';
import { simulate } from '../schedule/simulate.js';
import type { StageRange } from '../partition/balance.js';

/** What one block costs at one micro-batch size (bytes, seconds). */
export interface BlockCost {
  name: string;
  /** Bytes of the block's parameters (fp32). */
  paramBytes: number;
  /** Bytes of its largest parameter (the optimizer and the gradient sums work one at a time). */
  maxParamBytes: number;
  /** Peak bytes above params + slots + gradients during one optimizer step over the block. */
  optTransientBytes: number;
  /** Seconds of one optimizer step over the block's parameters. */
  optSeconds: number;
  /** Bytes of the block's input for one micro-batch. */
  inBytes: number;
  /** Bytes of the block's output for one micro-batch. */
  outBytes: number;
  /** Peak bytes above the level before, during the block's forward on the tape. */
  fwdPeakBytes: number;
  /** Bytes the forward keeps for backward (tape activations and output). */
  keptBytes: number;
  /** Peak bytes above the level with the tape kept, during the block's backward. */
  bwdPeakBytes: number;
  /** Seconds of one forward (on the tape). */
  fwdSeconds: number;
  /** Seconds of one backward from a kept tape (without re-computation). */
  bwdSeconds: number;
}

/** Every block's costs at one micro-batch size, and the label bytes of that micro-batch. */
export interface MicroBatchCosts {
  /** Examples per micro-batch these costs were measured or interpolated at. */
  batch: number;
  blocks: BlockCost[];
  /** Bytes of one micro-batch's labels (held by the last stage). */
  labelBytes: number;
  /**
   * Local parallelism: the costs of the auxiliary head (with the loss) on the output of block
   * `end - 1`, keyed by `end` (a stage's exclusive end), for the ends the profile has.
   */
  auxHeads?: Record<number, BlockCost>;
}

/** The size-dependent part of a block's costs, measured at one micro-batch size. */
export type BlockSizeCost = Pick<BlockCost, 'inBytes' | 'outBytes' | 'fwdPeakBytes' | 'keptBytes' | 'bwdPeakBytes' | 'fwdSeconds' | 'bwdSeconds'>;

/** A model's profile: size-independent block costs plus measurements at a few micro-batch sizes. */
export interface ModelProfile {
  /** Backend the profile was measured on. */
  backend: string;
  blocks: Array<Pick<BlockCost, 'name' | 'paramBytes' | 'maxParamBytes' | 'optTransientBytes' | 'optSeconds'>>;
  /** Measurements by micro-batch size, sorted by `batch`, at least one. */
  sizes: Array<{ batch: number; labelBytes: number; blocks: BlockSizeCost[] }>;
  /**
   * Local parallelism: the auxiliary head after block `end - 1`, keyed by `end`, profiled as a
   * one-block model (the head and the loss, on that activation, with its input gradient) at
   * the same micro-batch sizes. See plan/budget.ts profileAuxHeads.
   */
  auxHeads?: Record<number, ModelProfile>;
}

/** How a step is run: micro-batches, re-materialization, schedule and optimizer slots. */
export interface StepShape {
  /** Micro-batches M per mini-batch. */
  m: number;
  remat: RematMode;
  schedule: ScheduleKind;
  /** Optimizer state per parameter, in parameter sizes (see {@link optimizerSlots}). */
  slots: number;
}

/** Optimizer state in units of the parameters' size: AdamW 2 (m, v), SGD with momentum 1, plain SGD 0. */
export function optimizerSlots(opt: Pick<OptimizerConfig, 'kind' | 'momentum'>): number {
  if (opt.kind === 'adamw') return 2;
  return opt.momentum > 0 ? 1 : 0;
}

const SIZE_KEYS: ReadonlyArray<keyof BlockSizeCost> = ['inBytes', 'outBytes', 'fwdPeakBytes', 'keptBytes', 'bwdPeakBytes', 'fwdSeconds', 'bwdSeconds'];

/**
 * The costs of every block at micro-batch size `batch` (examples): measured values where the
 * profile has that size, else linear interpolation between the two nearest measured sizes
 * (linear extrapolation beyond them, never below 0; with one measured size, proportional
 * scaling). Bytes of activations are linear in the batch; times nearly so.
 * Throws {@link LayerwiseError} for a non-positive batch or an empty profile.
 */
export function costsAt(profile: ModelProfile, batch: number): MicroBatchCosts {
  if (!(batch > 0)) throw new LayerwiseError(`micro-batch size must be positive, got ${batch}`);
  const sizes = profile.sizes;
  if (sizes.length === 0) throw new LayerwiseError('the profile has no measured micro-batch size; profile at least one');
  let lo = sizes[0];
  let hi = sizes[sizes.length - 1];
  const exact = sizes.find((s) => s.batch === batch);
  if (exact) lo = hi = exact;
  else if (sizes.length > 1) {
    let i = sizes.findIndex((s) => s.batch > batch);
    if (i <= 0) i = i === 0 ? 1 : sizes.length - 1; // below the smallest: first pair; above the largest: last pair
    lo = sizes[i - 1];
    hi = sizes[i];
  }
  const at = (a: number, b: number): number => {
    if (lo === hi) return lo.batch === batch ? a : (a * batch) / lo.batch;
    return Math.max(0, a + ((b - a) * (batch - lo.batch)) / (hi.batch - lo.batch));
  };
  const blocks = profile.blocks.map((b, j) => {
    const out = { ...b } as BlockCost;
    for (const k of SIZE_KEYS) out[k] = at(lo.blocks[j][k], hi.blocks[j][k]);
    return out;
  });
  const out: MicroBatchCosts = { batch, blocks, labelBytes: at(lo.labelBytes, hi.labelBytes) };
  if (profile.auxHeads) {
    out.auxHeads = Object.fromEntries(Object.entries(profile.auxHeads).map(([end, h]) => [end, costsAt(h, batch).blocks[0]]));
  }
  return out;
}

function sum(xs: number[]): number {
  return xs.reduce((a, b) => a + b, 0);
}

/** Sums of a stage's block costs. */
function stageTotals(c: MicroBatchCosts, r: StageRange) {
  const bl = c.blocks.slice(r.from, r.to);
  if (bl.length === 0) throw new LayerwiseError(`stage [${r.from}, ${r.to}) holds no block of the model's ${c.blocks.length}; every stage needs at least 1 block`);
  return {
    params: sum(bl.map((b) => b.paramBytes)),
    maxParam: Math.max(...bl.map((b) => b.maxParamBytes)),
    optTransient: Math.max(...bl.map((b) => b.optTransientBytes)),
    inBytes: bl[0].inBytes,
    outBytes: bl[bl.length - 1].outBytes,
    fwdPeak: sum(bl.map((b) => b.fwdPeakBytes)),
    kept: sum(bl.map((b) => b.keptBytes)),
    bwdPeak: sum(bl.map((b) => b.bwdPeakBytes)),
    fwd: sum(bl.map((b) => b.fwdSeconds)),
    bwd: sum(bl.map((b) => b.bwdSeconds)),
    opt: sum(bl.map((b) => b.optSeconds)),
  };
}

/**
 * Predicted peak device bytes of one stage during one training step (after the first step,
 * once the optimizer slots exist), by walking the stage's action list. `actions` is the
 * stage's list from a {@link Schedule}; `stage`/`stages` its index and the number of stages.
 */
export function stagePeakBytes(c: MicroBatchCosts, r: StageRange, stage: number, schedule: Schedule, slots: number): number {
  const t = stageTotals(c, r);
  const k = schedule.length;
  const actions = schedule[stage];
  const first = stage === 0;
  const last = stage === k - 1;
  const m = actions.filter((a) => a.op === 'forward').length;
  let cur = t.params * (1 + slots) + (first ? m * t.inBytes : 0) + (last ? m * c.labelBytes : 0);
  let peak = cur;
  const bump = (extra: number) => {
    peak = Math.max(peak, cur + extra);
  };
  const kept = new Set<number>();
  let haveGrads = false;
  for (const a of actions) {
    switch (a.op) {
      case 'recv_act':
        cur += t.inBytes;
        break;
      case 'forward':
        bump(t.fwdPeak);
        if (a.keep) {
          cur += t.kept; // the output is part of the tape; the copy sent on shares its data
          kept.add(a.mb);
        } else if (!last) {
          cur += t.outBytes; // output held until sent
        }
        break;
      case 'send_act':
        if (!kept.has(a.mb)) cur -= t.outBytes;
        break;
      case 'recv_grad':
        cur += t.outBytes;
        break;
      case 'backward':
        if (!kept.has(a.mb)) {
          bump(t.fwdPeak); // re-materialization: the forward again, on the tape
          cur += t.kept;
        }
        kept.delete(a.mb);
        bump(t.bwdPeak);
        cur += -t.kept - t.inBytes - (last ? c.labelBytes : t.outBytes) + t.params + (first ? 0 : t.inBytes);
        if (haveGrads) {
          bump(t.maxParam); // adding the new gradients into the accumulated ones, one at a time
          cur -= t.params;
        }
        haveGrads = true;
        break;
      case 'send_grad':
        cur -= t.inBytes;
        break;
      case 'reduce_grad_norm':
        bump(t.maxParam);
        break;
      case 'optimizer_step':
        bump(t.optTransient);
        if (haveGrads) cur -= t.params;
        haveGrads = false;
        break;
    }
  }
  return peak;
}

/**
 * Predicted peak device bytes per stage for a partition (`ranges`, one per stage, contiguous
 * and covering the model) and a step shape. Single-device training is the one-stage case with
 * M = 1 and checkpoint 'never'. Throws {@link LayerwiseError} for an empty stage or bad M.
 */
export function predictPeakBytes(c: MicroBatchCosts, ranges: readonly StageRange[], shape: StepShape): number[] {
  const sched = makeSchedule(shape.schedule, shape.m, ranges.length, shape.remat);
  return ranges.map((r, s) => stagePeakBytes(c, r, s, sched, shape.slots));
}

/** Predicted time of one step: wall seconds, per-stage busy seconds and idle (bubble) fraction. */
export interface StepTime {
  /** Wall seconds of one training step (the schedule's makespan). */
  seconds: number;
  /** Per stage: fraction of the step it waits (the bubble). */
  bubble: number[];
  /** Per stage: seconds of compute. */
  busySeconds: number[];
}

/**
 * Predicted step time: simulates the schedule with each stage's forward, backward (plus the
 * forward again for micro-batches that are re-materialized) and optimizer times. Communication
 * is taken as free (neighbouring worker threads exchange transferred buffers). Throws
 * {@link LayerwiseError} for an empty stage or bad M.
 */
export function predictStepTime(c: MicroBatchCosts, ranges: readonly StageRange[], shape: Omit<StepShape, 'slots'>): StepTime {
  const sched = makeSchedule(shape.schedule, shape.m, ranges.length, shape.remat);
  const totals = ranges.map((r) => stageTotals(c, r));
  const keptBy = sched.map((acts) => new Set(acts.flatMap((a) => (a.op === 'forward' && a.keep ? [a.mb] : []))));
  const sim = simulate(sched, (s, a) => {
    const t = totals[s];
    if (a.op === 'forward') return t.fwd;
    if (a.op === 'backward') return t.bwd + (keptBy[s].has(a.mb) ? 0 : t.fwd);
    if (a.op === 'optimizer_step') return t.opt;
    return 0;
  });
  const busy = new Array<number>(ranges.length).fill(0);
  for (const e of sim.events) busy[e.stage] += e.end - e.start;
  return { seconds: sim.makespan, bubble: sim.bubble, busySeconds: busy };
}

/**
 * Per-block costs to balance on, for {@link ../partition/balance.ts balanceByCost}:
 * - 'time': forward + backward seconds, plus the forward again weighted by the fraction of
 *   micro-batches that are re-materialized;
 * - 'memory': bytes the block adds to its stage's peak: parameters, gradients and optimizer
 *   slots, plus the tape of the micro-batches kept at once and its backward transient.
 */
export function blockBalanceCosts(c: MicroBatchCosts, kind: 'time' | 'memory', shape: StepShape, stages: number): number[] {
  const m = shape.m;
  const recomputed = shape.remat === 'always' ? m : shape.remat === 'except_last' ? m - 1 : 0;
  if (kind === 'time') return c.blocks.map((b) => b.fwdSeconds * (1 + recomputed / m) + b.bwdSeconds);
  const inFlight = shape.schedule === '1f1b' ? Math.min(stages, m) : m;
  const keptAtOnce = shape.remat === 'never' ? inFlight : 1;
  return c.blocks.map((b) => b.paramBytes * (2 + shape.slots) + b.keptBytes * keptAtOnce + b.bwdPeakBytes + b.inBytes * inFlight);
}

/** How a step of local parallelism runs. */
export interface LocalShape {
  /** Micro-batches M per mini-batch (one local update each). */
  m: number;
  /** Optimizer state per parameter, in parameter sizes (see {@link optimizerSlots}). */
  slots: number;
  /** --overlap: blocks at the end of each stage but the last also trained by the next stage's loss (default 0). */
  overlap?: number;
}

/** A stage of local parallelism: its blocks' totals plus its auxiliary head (none on the last stage). */
function localTotals(c: MicroBatchCosts, r: StageRange, last: boolean) {
  const t = stageTotals(c, r);
  if (last) return t;
  const h = c.auxHeads?.[r.to];
  if (!h) throw new Error(`no auxiliary head costs after block ${r.to - 1} in the profile; profile the heads (plan/budget.ts profileAuxHeads) for local parallelism`);
  return {
    ...t,
    params: t.params + h.paramBytes,
    maxParam: Math.max(t.maxParam, h.maxParamBytes),
    optTransient: Math.max(t.optTransient, h.optTransientBytes),
    fwdPeak: t.fwdPeak + h.fwdPeakBytes,
    kept: t.kept + h.keptBytes,
    bwdPeak: t.bwdPeak + h.bwdPeakBytes,
    fwd: t.fwd + h.fwdSeconds,
    bwd: t.bwd + h.bwdSeconds,
    opt: t.opt + h.optSeconds,
  };
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
export function localStagePeakBytes(c: MicroBatchCosts, r: StageRange, stage: number, stages: number, shape: LocalShape): number {
  const k = stages;
  const first = stage === 0;
  const last = stage === k - 1;
  const overlap = shape.overlap ?? 0;
  const actions = localSchedule(shape.m, k, overlap, true)[stage];
  const t = localTotals(c, r, last);
  const tailN = !last && overlap > 0 ? overlap : 0;
  const tail = tailN > 0 ? stageTotals(c, { from: r.to - tailN, to: r.to }) : null;
  const sendsInputGrad = overlap > 0 && !first;
  const m = shape.m;
  // bytes of accumulated gradients: with overlap, the tail's from the previous mini-batch's
  // last micro-batch (applied at this mini-batch's first step)
  let grads = tail ? tail.params : 0;
  let cur = t.params * (1 + shape.slots) + grads + m * c.labelBytes + (first ? m * t.inBytes : 0);
  let peak = cur;
  const bump = (extra: number) => {
    peak = Math.max(peak, cur + extra);
  };
  /** New gradients of `bytes` added to the accumulators: a sum per parameter, one at a time. */
  const accumulate = (bytes: number, maxParam: number) => {
    cur += bytes;
    if (grads > 0) {
      bump(maxParam);
      cur -= Math.min(bytes, grads);
    }
    grads = Math.max(grads, bytes);
  };
  for (const a of actions) {
    switch (a.op) {
      case 'recv_act':
        cur += t.inBytes;
        break;
      case 'local_update': {
        const out = last ? 0 : t.outBytes; // the copy of the output to send on
        const stash = tail ? tail.inBytes : 0; // the tail's input, kept for the overlap
        bump(t.fwdPeak);
        cur += t.kept + out + stash;
        bump(t.bwdPeak);
        // the tape is freed; the input and labels are disposed; the input gradient stays when it is sent back
        cur += -t.kept - t.inBytes - c.labelBytes + (sendsInputGrad ? t.inBytes : 0);
        accumulate(t.params, t.maxParam);
        break;
      }
      case 'send_act':
        cur -= t.outBytes;
        break;
      case 'send_grad':
        cur -= t.inBytes;
        break;
      case 'recv_grad':
        cur += t.outBytes;
        break;
      case 'overlap_backward':
        if (tail) {
          bump(tail.fwdPeak); // the tail again, on the tape, from its stashed input
          bump(tail.kept + tail.bwdPeak);
          accumulate(tail.params, tail.maxParam);
          cur -= tail.inBytes + t.outBytes; // the stash entry and the received gradient
        }
        break;
      case 'local_step':
        bump(t.maxParam); // the gradient norm, one parameter at a time
        bump(t.optTransient);
        cur -= grads;
        grads = 0;
        break;
      default:
        break;
    }
  }
  return peak;
}

/**
 * Predicted peak device bytes per stage under local parallelism (see {@link localStagePeakBytes}),
 * for a partition `ranges` (contiguous, covering the model) and a step shape. Throws
 * {@link LayerwiseError} for an empty stage or bad M, and an Error when the costs lack an
 * auxiliary head of a stage but the last.
 */
export function predictLocalPeakBytes(c: MicroBatchCosts, ranges: readonly StageRange[], shape: LocalShape): number[] {
  return ranges.map((r, s) => localStagePeakBytes(c, r, s, ranges.length, shape));
}

/**
 * Predicted busy seconds of local stage `stage` (of `stages`, blocks `r`) per mini-batch: M local updates (forward and
 * backward through the blocks and the head) and M optimizer steps, plus with overlap the
 * tail's re-computed forward and its backward per micro-batch.
 */
export function localStageSeconds(c: MicroBatchCosts, r: StageRange, stage: number, stages: number, shape: LocalShape): number {
  const last = stage === stages - 1;
  const t = localTotals(c, r, last);
  const overlap = shape.overlap ?? 0;
  const tail = !last && overlap > 0 ? stageTotals(c, { from: r.to - overlap, to: r.to }) : null;
  return shape.m * (t.fwd + t.bwd + t.opt + (tail ? tail.fwd + tail.bwd : 0));
}

/**
 * Predicted time of one mini-batch under local parallelism. Stages run free across
 * mini-batches (no gradient crosses a stage boundary, and the first stage takes the next
 * mini-batch as soon as it is done), so in the steady state a mini-batch takes as long as the
 * slowest stage's work on it; the others idle for the difference (their bubble).
 * Communication is taken as free. Throws like {@link predictLocalPeakBytes}.
 */
export function predictLocalStepTime(c: MicroBatchCosts, ranges: readonly StageRange[], shape: LocalShape): StepTime {
  const busy = ranges.map((r, s) => localStageSeconds(c, r, s, ranges.length, shape));
  const seconds = Math.max(...busy);
  return { seconds, bubble: busy.map((b) => (seconds > 0 ? 1 - b / seconds : 0)), busySeconds: busy };
}

/** How an L2L relay step runs (strategies/l2l.ts). */
export interface RelayShape {
  /** Micro-batches M per mini-batch: each layer runs them one after another. */
  m: number;
  /** Where layer inputs wait between forward and backward. */
  stash: 'host' | 'device';
}

/**
 * Host AdamW update rate of the parameter server, parameters per second: the lower end of the
 * one-thread rates measured on this 2-core machine (bench/results/param-server.md: 66-134 M/s under
 * load, 134 M/s idle). Used to predict when the device waits for the server.
 */
export const HOST_UPDATE_PARAMS_PER_SECOND = 1e8;

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
export function predictRelayPeakBytes(c: MicroBatchCosts, shape: RelayShape): number {
  const n = c.blocks.length;
  const b = c.blocks;
  const host = shape.stash === 'host';
  let cur = shape.m * (b[0].inBytes + c.labelBytes);
  let peak = cur;
  const bump = (extra: number) => {
    peak = Math.max(peak, cur + extra);
  };
  const loaded = new Set<number>();
  const gradsStarted = new Set<number>();
  for (const a of relaySchedule(n, shape.m)[0]) {
    switch (a.op) {
      case 'load_layer':
      case 'prefetch_layer':
        if (!loaded.has(a.layer)) {
          loaded.add(a.layer);
          cur += b[a.layer].paramBytes;
        }
        break;
      case 'release_layer':
        if (loaded.delete(a.layer)) cur -= b[a.layer].paramBytes;
        break;
      case 'layer_forward': {
        const l = b[a.layer];
        if (host && a.layer > 0) cur += l.inBytes; // uploaded from the host stash
        bump(l.fwdPeakBytes);
        if (host) {
          bump(l.outBytes); // the output, downloaded to the host stash and freed
          if (a.layer > 0) cur -= l.inBytes;
        } else {
          cur += l.outBytes; // the output stays on the device as the next layer's stashed input
        }
        break;
      }
      case 'layer_backward': {
        const l = b[a.layer];
        const last = a.layer === n - 1;
        if (host && a.layer > 0) cur += l.inBytes;
        bump(l.fwdPeakBytes); // re-computation on the tape
        cur += l.keptBytes;
        bump(l.bwdPeakBytes);
        cur -= l.keptBytes;
        if (gradsStarted.has(a.layer)) bump(l.maxParamBytes); // adding into the accumulated gradient
        else {
          gradsStarted.add(a.layer);
          cur += l.paramBytes;
        }
        if (a.layer > 0) cur += l.inBytes; // the input gradient, for the layer below
        if (!last) cur -= l.outBytes; // the incoming gradient is freed
        cur -= l.inBytes; // the stashed input (layer 0: the micro-batch's tokens)
        if (last) cur -= c.labelBytes;
        break;
      }
      case 'push_grads': {
        const l = b[a.layer];
        bump(l.maxParamBytes); // the sum of squares, one parameter at a time
        if (gradsStarted.delete(a.layer)) cur -= l.paramBytes;
        break;
      }
      default:
        break;
    }
  }
  return peak;
}

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
export function predictRelayStepTime(c: MicroBatchCosts, shape: RelayShape & { clip?: boolean }, hostRate = HOST_UPDATE_PARAMS_PER_SECOND): StepTime {
  const n = c.blocks.length;
  const fwd = c.blocks.slice(0, n - 1).reduce((s, l) => s + shape.m * l.fwdSeconds, 0);
  const bwdOf = (l: BlockCost) => shape.m * (l.fwdSeconds + l.bwdSeconds);
  const bwd = c.blocks.reduce((s, l) => s + bwdOf(l), 0);
  const device = fwd + bwd;
  const server = c.blocks.reduce((s, l) => s + l.paramBytes / 4, 0) / hostRate;
  const wait = Math.max(0, server - ((shape.clip ?? true) ? fwd : bwd - bwdOf(c.blocks[n - 1])));
  const seconds = device + wait;
  return { seconds, bubble: [seconds > 0 ? wait / seconds : 0], busySeconds: [device] };
}
