/**
 * The planner behind `layerwise plan`, pure: given a model's profile (partition/profile.ts), a
 * device-memory budget, a number of devices K and a mini-batch size N, it predicts for each
 * strategy whether it fits, its peak device bytes per stage, its balance, micro-batches,
 * bubble and throughput, and recommends one.
 *
 * Strategies are planned by one function each in {@link PLANNERS}, so a new strategy (l2l:
 * a relay whose device holds one block at a time plus the parameter server's transfers) is one
 * more entry with its own memory model; nothing else changes.
 *
 * gpipe searches every number of micro-batches M dividing N (or the one given), every
 * re-materialization mode and both schedules (fill-drain, 1F1B), and three balances: by
 * profiled time, by exact minimum of the predicted stage peak, and by parameter count. Among
 * the candidates that fit it takes the fastest (ties: the smaller peak); when none fits, the
 * one with the smallest peak, to say by how much it misses.
 *
 * local (local parallelism, greedy: no --overlap) searches M and the same three balances, with
 * each stage's auxiliary head in its memory and time (the profile must carry the heads, see
 * plan/budget.ts profileAuxHeads). It computes other updates than backprop, so the
 * recommendation prefers the fastest strategy that fits among those that train exactly like
 * single-device backprop (single, gpipe), and names local when it is faster or when only it fits.
 */
import { check } from '../util/errors.js';
import { balanceByCost, balanceByStageCost, stageRanges, type StageRange } from '../partition/balance.js';
import {
  blockBalanceCosts, costsAt, localStagePeakBytes, localStageSeconds, predictLocalPeakBytes, predictLocalStepTime,
  predictPeakBytes, predictRelayPeakBytes, predictRelayStepTime, predictStepTime, stagePeakBytes,
  type LocalShape, type ModelProfile, type StepShape,
} from '../cost/cost-model.js';
import { formatSize } from '../util/size.js';
import { REMAT_MODES, SCHEDULE_KINDS, idealBubble, makeSchedule, type RematMode, type ScheduleKind } from '../schedule/schedule.js';

/** What the user asks: a budget per device, devices, mini-batch. */
export interface PlanRequest {
  /** Device memory budget per device, bytes. */
  deviceMemory: number;
  /** Devices (pipeline stages) available, K. */
  stages: number;
  /** Mini-batch size N, examples. */
  batchSize: number;
  /** Micro-batches M; default: search every divisor of N. */
  microBatches?: number;
  /** Optimizer slots per parameter (AdamW 2, SGD momentum 1; see optimizerSlots). */
  slots: number;
  /** Tokens per example, to report tokens/s (the context length for text models; 1 otherwise). */
  tokensPerExample?: number;
  /** Blocks' parameter counts, for the params balance (default: bytes / 4 from the profile). */
  paramCounts?: number[];
  /** Whether global-norm clipping is on (l2l: when the parameter server can start its updates); default true. */
  clip?: boolean;
}

/** The plan of one strategy. */
export interface StrategyPlan {
  strategy: string;
  /** Whether the strategy's updates equal single-device backprop's (false for local parallelism). */
  exact: boolean;
  /** Whether every stage's predicted peak is within the budget. */
  fits: boolean;
  stages: number;
  microBatches: number;
  remat: RematMode;
  schedule: ScheduleKind;
  /** Blocks per stage. */
  balance: number[];
  /** How the balance was chosen: 'time', 'memory', 'params' or 'whole model'. */
  balancedBy: string;
  /** Predicted peak device bytes per stage. */
  peakBytes: number[];
  /** Predicted seconds per step. */
  stepSeconds: number;
  /** Predicted idle fraction per stage. */
  bubble: number[];
  /** (K-1)/(M+K-1). */
  idealBubble: number;
  /** Predicted examples per second (and tokens per second). */
  examplesPerSecond: number;
  tokensPerSecond: number;
  /** Why it is not applicable, when it is not (e.g. more stages than blocks). */
  unavailable?: string;
  /** L2L: where the stash lives. */
  stash?: 'host' | 'device';
}

/** Plans of every strategy and the recommendation. */
export interface Plan {
  request: PlanRequest;
  strategies: StrategyPlan[];
  /** Name of the recommended strategy, or null when none fits. */
  recommended: string | null;
  /** One or two sentences: what to run, or what to change. */
  recommendation: string;
}

/** A planner for one strategy: the best plan it has for the request, or an unavailable one. */
export type StrategyPlanner = (profile: ModelProfile, req: PlanRequest) => StrategyPlan;

function plannedAs(strategy: string, profile: ModelProfile, req: PlanRequest, ranges: StageRange[], shape: StepShape, balancedBy: string): StrategyPlan {
  const costs = costsAt(profile, req.batchSize / shape.m);
  const peakBytes = predictPeakBytes(costs, ranges, shape);
  const t = predictStepTime(costs, ranges, shape);
  const perSecond = t.seconds > 0 ? req.batchSize / t.seconds : Infinity;
  return {
    strategy, exact: true, fits: peakBytes.every((b) => b <= req.deviceMemory), stages: ranges.length, microBatches: shape.m,
    remat: shape.remat, schedule: shape.schedule, balance: ranges.map((r) => r.to - r.from), balancedBy,
    peakBytes, stepSeconds: t.seconds, bubble: t.bubble, idealBubble: idealBubble(shape.m, ranges.length),
    examplesPerSecond: perSecond, tokensPerSecond: perSecond * (req.tokensPerExample ?? 1),
  };
}

/** Single device: the whole model, M = 1, activations kept (the reference). */
export const planSingle: StrategyPlanner = (profile, req) =>
  plannedAs('single', profile, req, [{ from: 0, to: profile.blocks.length }], { m: 1, remat: 'never', schedule: 'gpipe', slots: req.slots }, 'whole model');

/** The divisors of n, ascending. */
export function divisors(n: number): number[] {
  const out: number[] = [];
  for (let d = 1; d <= n; d++) if (n % d === 0) out.push(d);
  return out;
}

function better(a: StrategyPlan, b: StrategyPlan): boolean {
  if (a.fits !== b.fits) return a.fits;
  const pa = Math.max(...a.peakBytes);
  const pb = Math.max(...b.peakBytes);
  if (!a.fits) return pa < pb || (pa === pb && a.stepSeconds < b.stepSeconds);
  return a.stepSeconds < b.stepSeconds * (1 - 1e-9) || (Math.abs(a.stepSeconds - b.stepSeconds) <= b.stepSeconds * 1e-9 && pa < pb);
}

/** GPipe on K stages: searches M, re-materialization, schedule and balance (see the module doc). */
export const planGpipe: StrategyPlanner = (profile, req) => {
  const n = profile.blocks.length;
  const k = req.stages;
  const ms = req.microBatches !== undefined ? [req.microBatches] : divisors(req.batchSize);
  const params = req.paramCounts ?? profile.blocks.map((b) => b.paramBytes / 4);
  let best: StrategyPlan | null = null;
  for (const m of ms) {
    const costs = costsAt(profile, req.batchSize / m);
    for (const remat of REMAT_MODES) {
      for (const schedule of SCHEDULE_KINDS) {
        const shape: StepShape = { m, remat, schedule, slots: req.slots };
        const sched = makeSchedule(schedule, m, k, remat);
        const balances: Array<[string, number[]]> = [
          ['time', balanceByCost(blockBalanceCosts(costs, 'time', shape, k), k)],
          ['memory', balanceByStageCost(n, k, (s, from, to) => stagePeakBytes(costs, { from, to }, s, sched, req.slots))],
          ['params', balanceByCost(params.map((p) => Math.max(1, p)), k)],
        ];
        for (const [by, balance] of balances) {
          const p = plannedAs('gpipe', profile, req, stageRanges(balance), shape, by);
          if (!best || better(p, best)) best = p;
        }
      }
    }
  }
  return best!;
};

/**
 * Local parallelism (greedy) on K stages: searches M and the balance (by each stage's predicted
 * busy time, by its predicted peak, and by parameter count), each stage with its auxiliary head.
 * Stages run free, so a mini-batch takes the slowest stage's time. Unavailable when the profile
 * has no auxiliary heads.
 */
export const planLocal: StrategyPlanner = (profile, req) => {
  const n = profile.blocks.length;
  const k = req.stages;
  const heads = profile.auxHeads ?? {};
  const missing = Array.from({ length: n - 1 }, (_, i) => i + 1).filter((end) => !heads[end]);
  if (missing.length) return unavailable('local', 'needs the auxiliary heads profiled', req);
  const ms = req.microBatches !== undefined ? [req.microBatches] : divisors(req.batchSize);
  const params = req.paramCounts ?? profile.blocks.map((b) => b.paramBytes / 4);
  let best: StrategyPlan | null = null;
  for (const m of ms) {
    const costs = costsAt(profile, req.batchSize / m);
    const shape: LocalShape = { m, slots: req.slots, overlap: 0 };
    const balances: Array<[string, number[]]> = [
      ['time', balanceByStageCost(n, k, (s, from, to) => localStageSeconds(costs, { from, to }, s, k, shape))],
      ['memory', balanceByStageCost(n, k, (s, from, to) => localStagePeakBytes(costs, { from, to }, s, k, shape))],
      ['params', balanceByCost(params.map((p) => Math.max(1, p)), k)],
    ];
    for (const [by, balance] of balances) {
      const ranges = stageRanges(balance);
      const peakBytes = predictLocalPeakBytes(costs, ranges, shape);
      const t = predictLocalStepTime(costs, ranges, shape);
      const perSecond = t.seconds > 0 ? req.batchSize / t.seconds : Infinity;
      const p: StrategyPlan = {
        strategy: 'local', exact: false, fits: peakBytes.every((b) => b <= req.deviceMemory), stages: k, microBatches: m,
        remat: 'never', schedule: 'gpipe', balance, balancedBy: by, peakBytes, stepSeconds: t.seconds, bubble: t.bubble,
        idealBubble: 0, examplesPerSecond: perSecond, tokensPerSecond: perSecond * (req.tokensPerExample ?? 1),
      };
      if (!best || better(p, best)) best = p;
    }
  }
  return best!;
};

/**
 * L2L on one device: searches M and the stash place. Its peak holds about one layer's
 * parameters and gradient plus one layer boundary's activations (host stash), so it fits where
 * nothing else does; its time adds the re-computation of every layer, and the step waits for
 * the parameter server when its host optimizer is slower than the device (partition/memory-model.ts).
 */
export const planL2L: StrategyPlanner = (profile, req) => {
  const ms = req.microBatches !== undefined ? [req.microBatches] : divisors(req.batchSize);
  let best: StrategyPlan | null = null;
  for (const m of ms) {
    const costs = costsAt(profile, req.batchSize / m);
    for (const stash of ['host', 'device'] as const) {
      const peak = predictRelayPeakBytes(costs, { m, stash });
      const t = predictRelayStepTime(costs, { m, stash, clip: req.clip ?? true });
      const perSecond = t.seconds > 0 ? req.batchSize / t.seconds : Infinity;
      const p: StrategyPlan = {
        strategy: 'l2l', exact: true, fits: peak <= req.deviceMemory, stages: 1, microBatches: m, remat: 'always', schedule: 'gpipe',
        balance: [profile.blocks.length], balancedBy: 'one layer at a time', peakBytes: [peak], stepSeconds: t.seconds, bubble: t.bubble,
        idealBubble: 0, examplesPerSecond: perSecond, tokensPerSecond: perSecond * (req.tokensPerExample ?? 1), stash,
      };
      if (!best || better(p, best)) best = p;
    }
  }
  return best!;
};

/**
 * Planners by strategy name, in the order they are reported. gpipe and local need K >= 2
 * devices and at most one stage per block; single and l2l use one.
 */
export const PLANNERS: Record<string, StrategyPlanner> = { single: planSingle, gpipe: planGpipe, local: planLocal, l2l: planL2L };

function unavailable(strategy: string, why: string, req: PlanRequest): StrategyPlan {
  return {
    strategy, exact: strategy !== 'local', fits: false, stages: req.stages, microBatches: 0, remat: 'never', schedule: 'gpipe', balance: [], balancedBy: '-',
    peakBytes: [], stepSeconds: NaN, bubble: [], idealBubble: NaN, examplesPerSecond: 0, tokensPerSecond: 0, unavailable: why,
  };
}

/**
 * Checks a request against a model of `n` blocks before anything is profiled. Throws
 * {@link LayerwiseError} for a budget or batch that is not positive, micro-batches that do not
 * divide the batch, or more stages than blocks.
 */
export function checkRequest(req: PlanRequest, n: number): void {
  check(req.deviceMemory > 0 && Number.isFinite(req.deviceMemory), `--device-memory must be a positive size, got ${req.deviceMemory} bytes`);
  check(Number.isInteger(req.batchSize) && req.batchSize >= 1, `--batch-size must be an integer >= 1, got ${req.batchSize}`);
  check(Number.isInteger(req.stages) && req.stages >= 1, `--stages must be an integer >= 1, got ${req.stages}`);
  check(req.stages <= n, `--stages ${req.stages} exceeds the model's ${n} blocks; use at most ${n} stages (or more --layers)`);
  if (req.microBatches !== undefined) {
    check(Number.isInteger(req.microBatches) && req.microBatches >= 1 && req.batchSize % req.microBatches === 0,
      `--micro-batches ${req.microBatches} must divide --batch-size ${req.batchSize}; pick a divisor of ${req.batchSize} (or leave it out to search them)`);
  }
}

/**
 * Plans every strategy for the request and recommends the fastest that fits. Throws
 * {@link LayerwiseError} for an impossible request (see {@link checkRequest}).
 */
export function plan(profile: ModelProfile, req: PlanRequest): Plan {
  checkRequest(req, profile.blocks.length);
  const strategies = Object.entries(PLANNERS).map(([name, planner]) => {
    if (name !== 'single' && name !== 'l2l' && req.stages < 2) return unavailable(name, 'needs --stages 2 or more', req);
    return planner(profile, req);
  });
  const fitting = strategies.filter((s) => s.fits && !s.unavailable);
  // exact strategies (the same updates as single-device backprop) first; local only when none fits
  const pool = fitting.some((s) => s.exact) ? fitting.filter((s) => s.exact) : fitting;
  let recommended: StrategyPlan | null = null;
  for (const s of pool) if (!recommended || s.stepSeconds < recommended.stepSeconds) recommended = s;
  let recommendation: string;
  if (recommended) {
    const r = recommended;
    const others = fitting.filter((s) => s !== r).map((s) => {
      const ratio = s.stepSeconds / r.stepSeconds;
      const speed = ratio < 1 ? `and is predicted ${(1 / ratio).toFixed(2)}x faster` : `but is predicted ${ratio.toFixed(2)}x slower`;
      return `${s.strategy} fits too ${speed}${s.exact ? '' : ` (${describe(s)}; it trains with local losses, not backprop's updates)`}`;
    });
    const rate = (req.tokensPerExample ?? 1) > 1 ? `${Math.round(r.tokensPerSecond)} tokens/s` : `${Math.round(r.examplesPerSecond)} examples/s`;
    recommendation = `${r.strategy} (${describe(r)}): predicted ${rate}, peak ${formatSize(maxOf(r.peakBytes))} of ${formatSize(req.deviceMemory)}` +
      (others.length ? `; ${others.join('; ')}` : '');
  } else {
    const avail = strategies.filter((s) => !s.unavailable);
    const least = avail.reduce((a, b) => (Math.max(...b.peakBytes) < Math.max(...a.peakBytes) ? b : a));
    recommendation = `nothing fits ${formatSize(req.deviceMemory)} per device: the smallest predicted peak is ${formatSize(maxOf(least.peakBytes))} (${describe(least)}); ` +
      `use more --stages, a smaller --batch-size, or more --device-memory`;
  }
  return { request: req, strategies, recommended: recommended?.strategy ?? null, recommendation };
}

function maxOf(xs: number[]): number {
  return Math.round(Math.max(...xs));
}

/** The training flags that realise a plan, e.g. `--strategy gpipe --stages 2 --micro-batches 8 --checkpoint except_last --schedule 1f1b --balance 3,2`. */
export function describe(p: StrategyPlan): string {
  if (p.strategy === 'single') return '--strategy single';
  if (p.strategy === 'l2l') return `--strategy l2l --micro-batches ${p.microBatches} --stash ${p.stash}`;
  if (p.strategy === 'local') return `--strategy local --stages ${p.stages} --micro-batches ${p.microBatches} --balance ${p.balance.join(',')}`;
  return `--strategy ${p.strategy} --stages ${p.stages} --micro-batches ${p.microBatches} --checkpoint ${p.remat} --schedule ${p.schedule} --balance ${p.balance.join(',')}`;
}
