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
 * Local parallelism ({@link predictLocalPeakBytes}) walks the
 * stage's local schedule the same way: each micro-batch is one local update (forward on the
 * tape through the stage's blocks and its auxiliary head, backward within the stage, one
 * optimizer step), so a stage holds its parameters and its head's, their optimizer slots, one
 * micro-batch's tape and backward transient, the micro-batch inputs and labels it was handed,
 * and with --overlap the stashed tail inputs waiting for the next stage's gradient.
 */

import type { StageRange } from '../partition/balance.js';
import {
  localSchedule,
  makeSchedule,
  relaySchedule,
  type Schedule,
} from '../schedule/schedule.js';
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
  let cur =
    t.params * (1 + slots) +
    (first ? m * t.inBytes : 0) +
    (last ? m * c.labelBytes : 0);
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
        cur +=
          -t.kept -
          t.inBytes -
          (last ? c.labelBytes : t.outBytes) +
          t.params +
          (first ? 0 : t.inBytes);
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
export function predictPeakBytes(
  c: MicroBatchCosts,
  ranges: readonly StageRange[],
  shape: StepShape,
): number[] {
  const sched = makeSchedule(
    shape.schedule,
    shape.m,
    ranges.length,
    shape.remat,
  );
  return ranges.map((r, s) => stagePeakBytes(c, r, s, sched, shape.slots));
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
  let grads = tail ? tail.params : 0;
  let cur =
    t.params * (1 + shape.slots) +
    grads +
    m * c.labelBytes +
    (first ? m * t.inBytes : 0);
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
        cur +=
          -t.kept - t.inBytes - c.labelBytes + (sendsInputGrad ? t.inBytes : 0);
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
        // adding into the accumulated gradient: this micro-batch's gradients are all alive while
        // each parameter's sum is made (the accumulator frees them one parameter at a time)
        if (gradsStarted.has(a.layer)) bump(l.paramBytes + l.maxParamBytes);
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
