/**
 * The costs a prediction starts from, pure: what each block costs at a micro-batch size
 * (parameter, activation and transient bytes; forward, backward and optimizer seconds), as
 * cost/profile.ts measures them, interpolated to any micro-batch size ({@link costsAt}), and
 * the shapes of a step (micro-batches, re-materialization, schedule, optimizer slots). The
 * predictions themselves: memory.ts (peak device bytes) and time.ts (step time and bubble).
 * Units: bytes and seconds throughout.
 */

import type { OptimizerConfig } from '../optim/optimizer.js';
import type { StageRange } from '../partition/balance.js';
import {
  type ComputeSchedule,
  type RematMode,
  type ScheduleKind,
  scheduleSpec,
} from '../schedule/schedule.js';
import { LayerwiseError } from '../util/errors.js';

/** What one block costs at one micro-batch size (bytes, seconds). */
export interface BlockCost {
  name: string;
  /** Bytes of the block's parameters (fp32). */
  paramBytes: number;
  /**
   * Where the precision policy keeps parameter copies (backend/precision.ts storage.params,
   * 2 bytes per element): bytes of the copies of the parameters that products read, held
   * besides the float32 parameters where those live on the device (single, pipelines, local)
   * and shipped instead of them by the L2L relay. 0 or absent where it keeps none (fp32).
   */
  deviceCopyBytes?: number;
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
  /**
   * Bytes the block's backward still holds when it reaches the block's input, above the level
   * before its forward: its parameter and input gradients. The backward frees the block's tape
   * and intermediate gradients as it goes (pipeline/tape.ts backpropagate), so a stage's earlier
   * blocks run their backward without the later blocks' tapes. Undefined (a block without
   * parameters, or profiles from before): nothing freed, its tape plus its whole backward peak.
   */
  bwdHeldBytes?: number;
  /** Seconds of one forward (on the tape). */
  fwdSeconds: number;
  /** Seconds of one backward from a kept tape (without re-computation). */
  bwdSeconds: number;
  /**
   * Of {@link bwdSeconds}, the input-gradient part's (I of a zero-bubble split backward; the
   * weight part W is the rest), measured by timing a split backward's two parts. Undefined
   * (older profiles): half.
   */
  bwdInputSeconds?: number;
  /**
   * Bytes a split backward's input part leaves for its weight part (the weight products' saved
   * inputs and output gradients; pipeline/split-backward.ts), measured between the two.
   * Undefined (older profiles, or a block without parameters): the whole tape, {@link keptBytes}.
   */
  weightHeldBytes?: number;
  /** Peak bytes of a split backward's input part above the kept tape (no parameter gradients made). Undefined: {@link bwdPeakBytes}. */
  bwdInputPeakBytes?: number;
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
export type BlockSizeCost = Pick<
  BlockCost,
  | 'inBytes'
  | 'outBytes'
  | 'fwdPeakBytes'
  | 'keptBytes'
  | 'bwdPeakBytes'
  | 'bwdHeldBytes'
  | 'fwdSeconds'
  | 'bwdSeconds'
  | 'bwdInputSeconds'
  | 'weightHeldBytes'
  | 'bwdInputPeakBytes'
>;

/** A model's profile: size-independent block costs plus measurements at a few micro-batch sizes. */
export interface ModelProfile {
  /** Backend the profile was measured on. */
  backend: string;
  blocks: Array<
    Pick<
      BlockCost,
      | 'name'
      | 'paramBytes'
      | 'deviceCopyBytes'
      | 'maxParamBytes'
      | 'optTransientBytes'
      | 'optSeconds'
    >
  >;
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
  /** Stages per device of interleaved-1f1b (--virtual-stages; default 2). */
  virtualStages?: number;
  /** A compute-only schedule (a --schedule-file's) walked instead of {@link schedule}'s, with its placement (default stage s on device s). */
  compute?: ComputeSchedule;
  /** The device of each stage of {@link compute}. */
  placement?: number[];
  /** Optimizer state per parameter, in parameter sizes (see {@link optimizerSlots}). */
  slots: number;
}

/** Optimizer state in units of the parameters' size: AdamW 2 (m, v), SGD with momentum 1, plain SGD 0. */
export function optimizerSlots(
  opt: Pick<OptimizerConfig, 'kind' | 'momentum'>,
): number {
  if (opt.kind === 'adamw') return 2;
  return opt.momentum > 0 ? 1 : 0;
}

const SIZE_KEYS: ReadonlyArray<keyof BlockSizeCost> = [
  'inBytes',
  'outBytes',
  'fwdPeakBytes',
  'keptBytes',
  'bwdPeakBytes',
  'bwdHeldBytes',
  'fwdSeconds',
  'bwdSeconds',
  'bwdInputSeconds',
  'weightHeldBytes',
  'bwdInputPeakBytes',
];

/**
 * The costs of every block at micro-batch size `batch` (examples): measured values where the
 * profile has that size, else linear interpolation between the two nearest measured sizes
 * (linear extrapolation beyond them, never below 0; with one measured size, proportional
 * scaling). Bytes of activations are linear in the batch; times nearly so.
 * Throws {@link LayerwiseError} for a non-positive batch or an empty profile.
 */
export function costsAt(profile: ModelProfile, batch: number): MicroBatchCosts {
  if (!(batch > 0))
    throw new LayerwiseError(`micro-batch size must be positive, got ${batch}`);
  const sizes = profile.sizes;
  if (sizes.length === 0)
    throw new LayerwiseError(
      'the profile has no measured micro-batch size; profile at least one',
    );
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
    return Math.max(
      0,
      a + ((b - a) * (batch - lo.batch)) / (hi.batch - lo.batch),
    );
  };
  const blocks = profile.blocks.map((b, j) => {
    const out = { ...b } as BlockCost;
    for (const k of SIZE_KEYS) {
      const [a, b2] = [lo.blocks[j][k], hi.blocks[j][k]];
      if (a !== undefined && b2 !== undefined) out[k] = at(a, b2);
    }
    return out;
  });
  const out: MicroBatchCosts = {
    batch,
    blocks,
    labelBytes: at(lo.labelBytes, hi.labelBytes),
  };
  if (profile.auxHeads) {
    out.auxHeads = Object.fromEntries(
      Object.entries(profile.auxHeads).map(([end, h]) => [
        end,
        costsAt(h, batch).blocks[0],
      ]),
    );
  }
  return out;
}

export function sum(xs: number[]): number {
  return xs.reduce((a, b) => a + b, 0);
}

/**
 * What a block's backward leaves above the level with its tape kept: its
 * {@link BlockCost.bwdHeldBytes} less the tape it freed (negative when it freed more than it
 * made), or all of its backward's peak where the profile does not say.
 */
export const heldAfterBackward = (
  b: Pick<BlockCost, 'bwdPeakBytes' | 'bwdHeldBytes' | 'keptBytes'>,
): number =>
  b.bwdHeldBytes !== undefined ? b.bwdHeldBytes - b.keptBytes : b.bwdPeakBytes;

/**
 * Peak bytes above the level before one forward through `blocks` (model order) on the tape:
 * each block's intermediates go when it ends (pipeline/stage-params.ts applyBlocks), so each
 * runs with the tapes of the blocks before it only.
 */
export function forwardPeak(
  blocks: ReadonlyArray<Pick<BlockCost, 'fwdPeakBytes' | 'keptBytes'>>,
): number {
  let kept = 0;
  let peak = 0;
  for (const b of blocks) {
    peak = Math.max(peak, kept + b.fwdPeakBytes);
    kept += b.keptBytes;
  }
  return peak;
}

/**
 * Peak bytes above the kept tape (all blocks') during one backward through `blocks` (model
 * order): they run last to first, and each runs with what the ones after it still hold, their
 * tapes freed.
 */
export function backwardPeak(
  blocks: ReadonlyArray<
    Pick<BlockCost, 'bwdPeakBytes' | 'bwdHeldBytes' | 'keptBytes'>
  >,
): number {
  let held = 0;
  let peak = 0;
  for (let i = blocks.length - 1; i >= 0; i--) {
    peak = Math.max(peak, held + blocks[i]!.bwdPeakBytes);
    held += heldAfterBackward(blocks[i]!);
  }
  return peak;
}

/**
 * Peak bytes above the kept tape during a split backward's input part through `blocks` (model
 * order): they run last to first, each one's I with what it transiently needs, the blocks after
 * it having already let go of what their W does not read.
 */
export function inputBackwardPeak(
  blocks: ReadonlyArray<
    Pick<
      BlockCost,
      'bwdPeakBytes' | 'bwdInputPeakBytes' | 'keptBytes' | 'weightHeldBytes'
    >
  >,
): number {
  let freed = 0;
  let peak = 0;
  for (let i = blocks.length - 1; i >= 0; i--) {
    const b = blocks[i]!;
    peak = Math.max(peak, (b.bwdInputPeakBytes ?? b.bwdPeakBytes) - freed);
    freed += b.keptBytes - (b.weightHeldBytes ?? b.keptBytes);
  }
  return peak;
}

/** Sums of a stage's block costs (blocks [r.from, r.to)). Throws {@link LayerwiseError} for an empty stage. */
export function stageTotals(c: MicroBatchCosts, r: StageRange) {
  const bl = c.blocks.slice(r.from, r.to);
  if (bl.length === 0)
    throw new LayerwiseError(
      `stage [${r.from}, ${r.to}) holds no block of the model's ${c.blocks.length}; every stage needs at least 1 block`,
    );
  return {
    params: sum(bl.map((b) => b.paramBytes)),
    paramCopies: sum(bl.map((b) => b.deviceCopyBytes ?? 0)),
    maxParam: Math.max(...bl.map((b) => b.maxParamBytes)),
    optTransient: Math.max(...bl.map((b) => b.optTransientBytes)),
    inBytes: bl[0].inBytes,
    outBytes: bl[bl.length - 1].outBytes,
    fwdPeak: forwardPeak(bl),
    kept: sum(bl.map((b) => b.keptBytes)),
    weightHeld: sum(bl.map((b) => b.weightHeldBytes ?? b.keptBytes)),
    bwdInputPeak: inputBackwardPeak(bl),
    bwdPeak: backwardPeak(bl),
    fwd: sum(bl.map((b) => b.fwdSeconds)),
    bwd: sum(bl.map((b) => b.bwdSeconds)),
    bwdInput: sum(bl.map((b) => b.bwdInputSeconds ?? b.bwdSeconds / 2)),
    opt: sum(bl.map((b) => b.optSeconds)),
  };
}

/**
 * Per-block costs to balance on, for {@link ../partition/balance.ts balanceByCost}:
 * - 'time': forward + backward seconds, plus the forward again weighted by the fraction of
 *   micro-batches that are re-materialized;
 * - 'memory': bytes the block adds to its stage's peak: parameters, gradients and optimizer
 *   slots, plus the tape of the micro-batches kept at once and its backward transient.
 */
export function blockBalanceCosts(
  c: MicroBatchCosts,
  kind: 'time' | 'memory',
  shape: StepShape,
  stages: number,
): number[] {
  const m = shape.m;
  const recomputed =
    shape.remat === 'always' ? m : shape.remat === 'except_last' ? m - 1 : 0;
  if (kind === 'time')
    return c.blocks.map(
      (b) => b.fwdSeconds * (1 + recomputed / m) + b.bwdSeconds,
    );
  const inFlight = scheduleSpec(shape.schedule).inFlight(stages, m); // as the schedule declares it
  const keptAtOnce = shape.remat === 'never' ? inFlight : 1;
  return c.blocks.map(
    (b) =>
      b.paramBytes * (2 + shape.slots) +
      (b.deviceCopyBytes ?? 0) +
      b.keptBytes * keptAtOnce +
      b.bwdPeakBytes +
      b.inBytes * inFlight,
  );
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
export function localTotals(c: MicroBatchCosts, r: StageRange, last: boolean) {
  const t = stageTotals(c, r);
  if (last) return t;
  const h = c.auxHeads?.[r.to];
  if (!h)
    throw new Error(
      `no auxiliary head costs after block ${r.to - 1} in the profile; profile the heads (plan/budget.ts profileAuxHeads) for local parallelism`,
    );
  return {
    ...t,
    params: t.params + h.paramBytes,
    paramCopies: t.paramCopies + (h.deviceCopyBytes ?? 0),
    maxParam: Math.max(t.maxParam, h.maxParamBytes),
    optTransient: Math.max(t.optTransient, h.optTransientBytes),
    fwdPeak: t.fwdPeak + h.fwdPeakBytes,
    kept: t.kept + h.keptBytes,
    bwdPeak: Math.max(h.bwdPeakBytes, heldAfterBackward(h) + t.bwdPeak), // the head's backward runs first
    fwd: t.fwd + h.fwdSeconds,
    bwd: t.bwd + h.bwdSeconds,
    opt: t.opt + h.optSeconds,
  };
}

/** How an L2L relay step runs (strategies/l2l.ts). */
export interface RelayShape {
  /** Micro-batches M per mini-batch: each layer runs them one after another. */
  m: number;
  /** Where layer inputs wait between forward and backward. */
  stash: 'host' | 'device';
}
