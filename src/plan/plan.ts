/**
 * The planner behind `layerwise plan`, pure: given a model's profile (cost/profile.ts), a
 * device-memory budget, a number of devices K and a mini-batch size N, it asks every strategy's
 * spec (strategies/*.ts, `plan`) for its best plan (whether it fits, its peak device bytes per
 * stage, balance, micro-batches, bubble and throughput) and recommends one.
 *
 * A new strategy is planned by its own spec; nothing here changes. Strategies whose updates
 * differ from backprop's (local parallelism: spec.exact false) are recommended only when they
 * are faster or when only they fit: the recommendation prefers the fastest strategy that fits
 * among those that train exactly like single-device backprop.
 */

import type { ModelProfile } from '../cost/costs.js';
import {
  type PlanRequest,
  type StrategyPlan,
  unavailable,
} from '../cost/strategy-plan.js';
import { STRATEGY_SPECS, specOf } from '../strategies/index.js';
import { check } from '../util/errors.js';
import { formatSize } from '../util/size.js';

export type { PlanRequest, StrategyPlan } from '../cost/strategy-plan.js';

/** Plans of every strategy and the recommendation. */
export interface Plan {
  request: PlanRequest;
  strategies: StrategyPlan[];
  /** Name of the recommended strategy, or null when none fits. */
  recommended: string | null;
  /** The recommended plan (a strategy may be planned with and without replicas). */
  recommendedPlan: StrategyPlan | null;
  /** One or two sentences: what to run, or what to change. */
  recommendation: string;
}

/**
 * Checks a request against a model of `n` blocks before anything is profiled. Throws
 * {@link LayerwiseError} for a budget or batch that is not positive, micro-batches that do not
 * divide the batch, or more stages than blocks.
 */
export function checkRequest(req: PlanRequest, n: number): void {
  check(
    req.deviceMemory > 0 && Number.isFinite(req.deviceMemory),
    `--device-memory must be a positive size, got ${req.deviceMemory} bytes`,
  );
  check(
    Number.isInteger(req.batchSize) && req.batchSize >= 1,
    `--batch-size must be an integer >= 1, got ${req.batchSize}`,
  );
  check(
    Number.isInteger(req.stages) && req.stages >= 1,
    `--stages must be an integer >= 1, got ${req.stages}`,
  );
  check(
    req.stages <= n,
    `--stages ${req.stages} exceeds the model's ${n} blocks; use at most ${n} stages (or more --layers)`,
  );
  if (req.microBatches !== undefined) {
    check(
      Number.isInteger(req.microBatches) &&
        req.microBatches >= 1 &&
        req.batchSize % req.microBatches === 0,
      `--micro-batches ${req.microBatches} must divide --batch-size ${req.batchSize}; pick a divisor of ${req.batchSize} (or leave it out to search them)`,
    );
  }
}

/**
 * Plans every strategy for the request and recommends the fastest that fits. Throws
 * {@link LayerwiseError} for an impossible request (see {@link checkRequest}).
 */
export function plan(profile: ModelProfile, req: PlanRequest): Plan {
  checkRequest(req, profile.blocks.length);
  const strategies = STRATEGY_SPECS.map((spec) => {
    if (!spec.oneDevice && !spec.anyStages && req.stages < 2)
      return unavailable(
        spec.name,
        spec.exact,
        'needs --stages 2 or more',
        req,
      );
    return spec.plan(profile, req);
  });
  strategies.push(...replicatedPlans(profile, req));
  const fitting = strategies.filter((s) => s.fits && !s.unavailable);
  // exact strategies (the same updates as single-device backprop) first; local only when none fits
  const pool = fitting.some((s) => s.exact)
    ? fitting.filter((s) => s.exact)
    : fitting;
  let recommended: StrategyPlan | null = null;
  for (const s of pool)
    if (!recommended || s.stepSeconds < recommended.stepSeconds)
      recommended = s;
  let recommendation: string;
  if (recommended) {
    const r = recommended;
    const others = fitting
      .filter((s) => s !== r)
      .map((s) => {
        const ratio = s.stepSeconds / r.stepSeconds;
        const speed =
          ratio < 1
            ? `and is predicted ${(1 / ratio).toFixed(2)}x faster`
            : `but is predicted ${ratio.toFixed(2)}x slower`;
        return `${label(s)} fits too ${speed}${s.exact ? '' : ` (${describe(s)}; it trains with local losses, not backprop's updates)`}`;
      });
    const rate =
      (req.tokensPerExample ?? 1) > 1
        ? `${Math.round(r.tokensPerSecond)} tokens/s`
        : `${Math.round(r.examplesPerSecond)} examples/s`;
    recommendation =
      `${label(r)} (${describe(r)}): predicted ${rate}, peak ${formatSize(maxOf(r.peakBytes))} of ${formatSize(req.deviceMemory)}` +
      (others.length ? `; ${others.join('; ')}` : '');
  } else {
    const avail = strategies.filter((s) => !s.unavailable);
    const least = avail.reduce((a, b) =>
      Math.max(...b.peakBytes) < Math.max(...a.peakBytes) ? b : a,
    );
    recommendation =
      `nothing fits ${formatSize(req.deviceMemory)} per device: the smallest predicted peak is ${formatSize(maxOf(least.peakBytes))} (${describe(least)}); ` +
      `use more --stages, a smaller --batch-size, or more --device-memory`;
  }
  return {
    request: req,
    strategies,
    recommended: recommended?.strategy ?? null,
    recommendedPlan: recommended,
    recommendation,
  };
}

/**
 * Data-parallel plans for K >= 2 devices: each strategy that runs on one device and updates
 * exactly (single, l2l), replicated K times (`--replicas K`), each replica on N/K of the
 * mini-batch: its best one-device plan for N/K, whose step then covers all N examples. The
 * gradient all-reduce is taken as free (threads exchange transferred buffers; for l2l the
 * parameter server sums the replicas' pushes).
 */
function replicatedPlans(
  profile: ModelProfile,
  req: PlanRequest,
): StrategyPlan[] {
  const r = req.stages;
  if (r < 2 || req.batchSize % r !== 0) return [];
  const share = req.batchSize / r;
  if (req.microBatches !== undefined && share % req.microBatches !== 0)
    return [];
  return STRATEGY_SPECS.filter(
    (spec) => spec.exact && (spec.oneDevice || spec.anyStages),
  ).map((spec) => {
    const p = spec.plan(profile, { ...req, stages: 1, batchSize: share });
    const perSecond =
      p.stepSeconds > 0 ? req.batchSize / p.stepSeconds : Infinity;
    return {
      ...p,
      replicas: r,
      examplesPerSecond: perSecond,
      tokensPerSecond: perSecond * (req.tokensPerExample ?? 1),
    };
  });
}

/** A plan's name in sentences: its strategy, with its replicas where more than one. */
export function label(p: StrategyPlan): string {
  return p.replicas ? `${p.strategy} x${p.replicas} replicas` : p.strategy;
}

function maxOf(xs: number[]): number {
  return Math.round(Math.max(...xs));
}

/** The training flags that realise a plan, e.g. `--strategy gpipe --stages 2 --micro-batches 8 --checkpoint except_last --schedule 1f1b --balance 3,2`. */
export function describe(p: StrategyPlan): string {
  const flags = specOf(p.strategy).flags(p);
  return p.replicas ? `${flags} --replicas ${p.replicas}` : flags;
}
