/**
 * What a strategy is predicted to cost for a request, as `layerwise plan` compares them: the
 * request (a device-memory budget, devices, mini-batch), one strategy's plan (fits or not, its
 * peak device bytes per stage, step time, bubble, throughput, and the settings that realise it),
 * and the pieces every strategy's planner shares. Each strategy's own planner lives in its spec
 * (strategies/*.ts); plan/plan.ts runs them all and recommends one. Pure.
 */
import type { StageRange } from '../partition/balance.js';
import {
  DEFAULT_SCHEDULE,
  idealBubble,
  type RematMode,
  type ScheduleKind,
} from '../schedule/schedule.js';
import { costsAt, type ModelProfile, type StepShape } from './costs.js';
import { predictPeakBytes } from './memory.js';
import { predictStepTime } from './time.js';

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
  /**
   * Data-parallel replicas R of the plan (absent: one): R copies of its devices, each on 1/R
   * of the mini-batch; its peaks are one replica's, its step time one replica's on its share
   * (the gradient all-reduce taken as free).
   */
  replicas?: number;
  /** How the plan table shows its re-materialization and schedule ('-' where they do not apply). */
  display: { remat: string; schedule: string };
}

/** A planner for one strategy: the best plan it has for the request, or an unavailable one. */
export type StrategyPlanner = (
  profile: ModelProfile,
  req: PlanRequest,
) => StrategyPlan;

/**
 * The plan of a backprop pipeline (single or gpipe) on `ranges` with step shape `shape`: the
 * peak bytes per stage walked over its schedule and the step time simulated.
 */
export function plannedAs(
  strategy: string,
  profile: ModelProfile,
  req: PlanRequest,
  ranges: StageRange[],
  shape: StepShape,
  balancedBy: string,
): StrategyPlan {
  const costs = costsAt(profile, req.batchSize / shape.m);
  const peakBytes = predictPeakBytes(costs, ranges, shape);
  const t = predictStepTime(costs, ranges, shape);
  const perSecond = t.seconds > 0 ? req.batchSize / t.seconds : Infinity;
  return {
    strategy,
    exact: true,
    fits: peakBytes.every((b) => b <= req.deviceMemory),
    // devices: a schedule may run several of the stages on each
    stages: peakBytes.length,
    microBatches: shape.m,
    remat: shape.remat,
    schedule: shape.schedule,
    balance: ranges.map((r) => r.to - r.from),
    balancedBy,
    peakBytes,
    stepSeconds: t.seconds,
    bubble: t.bubble,
    idealBubble: idealBubble(shape.m, peakBytes.length),
    examplesPerSecond: perSecond,
    tokensPerSecond: perSecond * (req.tokensPerExample ?? 1),
    display:
      ranges.length > 1
        ? { remat: shape.remat, schedule: shape.schedule }
        : { remat: '-', schedule: '-' },
  };
}

/** The divisors of n, ascending. */
export function divisors(n: number): number[] {
  const out: number[] = [];
  for (let d = 1; d <= n; d++) if (n % d === 0) out.push(d);
  return out;
}

/** Whether plan `a` beats `b`: fitting first, then faster (ties: smaller peak); among misses, the smaller peak. */
export function better(a: StrategyPlan, b: StrategyPlan): boolean {
  if (a.fits !== b.fits) return a.fits;
  const pa = Math.max(...a.peakBytes);
  const pb = Math.max(...b.peakBytes);
  if (!a.fits) return pa < pb || (pa === pb && a.stepSeconds < b.stepSeconds);
  return (
    a.stepSeconds < b.stepSeconds * (1 - 1e-9) ||
    (Math.abs(a.stepSeconds - b.stepSeconds) <= b.stepSeconds * 1e-9 && pa < pb)
  );
}

/** A plan for a strategy that cannot run this request (`why`, e.g. 'needs --stages 2 or more'). */
export function unavailable(
  strategy: string,
  exact: boolean,
  why: string,
  req: PlanRequest,
): StrategyPlan {
  return {
    strategy,
    exact,
    display: { remat: '-', schedule: '-' },
    fits: false,
    stages: req.stages,
    microBatches: 0,
    remat: 'never',
    schedule: DEFAULT_SCHEDULE,
    balance: [],
    balancedBy: '-',
    peakBytes: [],
    stepSeconds: NaN,
    bubble: [],
    idealBubble: NaN,
    examplesPerSecond: 0,
    tokensPerSecond: 0,
    unavailable: why,
  };
}
