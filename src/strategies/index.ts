/**
 * The strategy registry: every {@link StrategySpec}, in the order `layerwise plan` reports
 * them, and what turns a validated configuration into a running {@link Strategy}: the stage
 * ranges (balance) and the spec's `create`. Strategies stay thin: each is a choice of
 * partition, schedule, stage kind and micro-batching over the shared runtime.
 *
 * A new strategy is one file under strategies/ exporting its spec (plus its stage kind under
 * pipeline/ if it needs a new one), listed in {@link STRATEGY_SPECS}.
 */

import {
  microBatchSize,
  optimizerConfigOf,
  stageCount,
  type TrainConfig,
} from '../config/config.js';
import { paramCount } from '../model/block.js';
import type { HostParams } from '../model/init.js';
import type { Model } from '../model/model.js';
import {
  balanceByCost,
  type StageRange,
  stageRanges,
  validateBalance,
} from '../partition/balance.js';
import { LayerwiseError } from '../util/errors.js';
import { gpipe, readScheduleFile } from './gpipe.js';
import { l2l } from './l2l.js';
import { local } from './local.js';
import { single } from './single.js';
import { type StrategySpec, threadsPerDevice } from './spec.js';
import type { Strategy } from './strategy.js';

/** Every strategy, in the order they are reported. */
export const STRATEGY_SPECS: readonly StrategySpec[] = [
  single,
  gpipe,
  local,
  l2l,
];

/** The names of every strategy. */
export const STRATEGY_NAMES: readonly string[] = STRATEGY_SPECS.map(
  (s) => s.name,
);

/** The spec of strategy `name`. Throws {@link LayerwiseError} naming the valid ones. */
export function specOf(name: string): StrategySpec {
  const s = STRATEGY_SPECS.find((x) => x.name === name);
  if (!s)
    throw new LayerwiseError(
      `unknown strategy '${name}'; valid: ${STRATEGY_NAMES.join(', ')}`,
    );
  return s;
}

/**
 * Checks the strategy-specific flags of a resolved configuration (after config/config.ts
 * resolveConfig): the strategy exists and its spec's own checks pass. Throws {@link LayerwiseError}.
 */
export function validateStrategy(cfg: TrainConfig): void {
  const spec = specOf(cfg.strategy);
  if (cfg.layerDrop > 0 && !spec.layerDrop)
    throw new LayerwiseError(
      `--layer-drop runs on --strategy ${STRATEGY_SPECS.filter(
        (s) => s.layerDrop,
      )
        .map((s) => s.name)
        .join(
          ' or ',
        )} so far, not ${cfg.strategy}; drop --layer-drop or change --strategy`,
    );
  spec.validate?.(cfg);
}

/**
 * Each block's floating-point operations for one micro-batch of `microBatch` examples, along the
 * chain of the blocks' output shapes (Block.flops). A block without products (an embedding
 * lookup) counts its output elements, so that it still weighs something.
 */
export function blockFlops(model: Model, microBatch: number): number[] {
  let shape = model.inputShape(microBatch);
  return model.blocks.map((b) => {
    const f = b.flops(shape);
    const out = b.outputShape(shape);
    shape = out;
    const elems = out.reduce((a, d) => a * d, 1);
    return Math.max(1, Number.isFinite(f) ? f : 0, elems);
  });
}

/**
 * The stage ranges a configuration asks for: one range for a one-device strategy (single, l2l);
 * for the others the explicit --balance (validated against the model), the partition that
 * balances the blocks' FLOP counts (default: compute is what keeps a stage busy, see
 * {@link blockFlops}), the parameter count (--balance params), or for --balance time|memory
 * the one that balances `costs` (one per block, from {@link resolveStages}). Throws
 * {@link LayerwiseError} for an impossible balance, and an Error when time/memory costs are missing.
 */
export function planStages(
  cfg: TrainConfig,
  model: Model,
  costs?: readonly number[],
): StageRange[] {
  const n = model.blocks.length;
  if (specOf(cfg.strategy).oneDevice) return [{ from: 0, to: n }];
  // a schedule file says how many stages it places on the devices
  const k =
    cfg.strategy === 'gpipe' && cfg.scheduleFile !== undefined
      ? readScheduleFile(cfg, cfg.stages).placement.length
      : stageCount(cfg);
  if (k > n) {
    throw new LayerwiseError(
      k === cfg.stages
        ? `--stages ${cfg.stages} exceeds the model's ${n} blocks; use at most ${n} stages (or more --layers)`
        : `--stages ${cfg.stages} with --schedule ${cfg.schedule} makes ${k} stages (${k / cfg.stages} per device), more than the model's ${n} blocks; use at most ${Math.floor(n / (k / cfg.stages))} devices (or more --layers)`,
    );
  }
  if (cfg.balance === 'flops')
    return stageRanges(
      balanceByCost(
        blockFlops(
          model,
          Math.max(1, Math.floor(cfg.batchSize / cfg.microBatches)),
        ),
        k,
      ),
    );
  if (cfg.balance === 'params')
    return stageRanges(
      balanceByCost(
        model.blocks.map((b) => Math.max(1, paramCount(b))),
        k,
      ),
    );
  if (cfg.balance === 'time' || cfg.balance === 'memory') {
    if (!costs)
      throw new Error(
        `--balance ${cfg.balance} needs profiled block costs: use resolveStages`,
      );
    return stageRanges(balanceByCost(costs, k));
  }
  validateBalance(cfg.balance, n, k);
  return stageRanges(cfg.balance);
}

/**
 * Like {@link planStages}, but first profiles the blocks on cfg.backend (in this thread) when
 * --balance is 'time' or 'memory' (see cost/profile.ts), at the micro-batch size
 * batchSize / microBatches. Throws {@link LayerwiseError} for an impossible balance or an
 * unavailable backend.
 */
export async function resolveStages(
  cfg: TrainConfig,
  model: Model,
): Promise<StageRange[]> {
  if (
    specOf(cfg.strategy).oneDevice ||
    (cfg.balance !== 'time' && cfg.balance !== 'memory')
  )
    return planStages(cfg, model);
  planStages({ ...cfg, balance: 'params' }, model); // the stage count, before spending time profiling
  const { profiledBalanceCosts } = await import('../cost/profile.js');
  const costs = await profiledBalanceCosts(model, {
    kind: cfg.balance,
    backend: cfg.backend,
    microBatch: microBatchSize(cfg),
    stages: stageCount(cfg),
    shape: {
      m: cfg.microBatches,
      remat: cfg.remat,
      schedule: cfg.schedule,
      virtualStages: cfg.virtualStages,
    },
    optimizer: optimizerConfigOf(cfg),
    threads: threadsPerDevice(cfg, cfg.stages), // as each device will run its kernels
    precision: cfg.precision,
  });
  return planStages(cfg, model, costs);
}

/**
 * Starts the strategy a configuration names, with these initial parameters, on `ranges` if
 * given (e.g. from {@link resolveStages}), else on {@link resolveStages}' ranges. Throws
 * {@link LayerwiseError} for an unknown strategy or flags it rejects.
 */
export async function createStrategy(
  cfg: TrainConfig,
  model: Model,
  params: HostParams,
  given?: StageRange[],
): Promise<Strategy> {
  const spec = specOf(cfg.strategy);
  spec.validate?.(cfg);
  const ranges = given ?? (await resolveStages(cfg, model));
  return spec.create(cfg, model, params, ranges);
}
