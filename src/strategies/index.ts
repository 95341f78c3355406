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
import { registerStrategies } from '../config/strategy-flags.js';
import type { HostParams } from '../model/init.js';
import type { Model } from '../model/model.js';
import type { StageRange } from '../partition/balance.js';
import {
  type PartitionRequest,
  partitionBlocks,
  partitionProfiled,
} from '../partition/stages.js';
import { LayerwiseError } from '../util/errors.js';
import { gpipe } from './gpipe.js';
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
// config/'s checks and --strategy's default read the specs' flags from there
registerStrategies(STRATEGY_SPECS);

/** Each block's FLOPs for a micro-batch (partition/stages.ts), as the default balance counts them. */
export { blockFlops } from '../partition/stages.js';

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
 * What a configuration asks its partition for (partition/stages.ts): the stages the spec cuts
 * the model into ({@link StrategySpec.partitionStages}, else config's stageCount), the devices
 * and schedule that place them, --balance, and the micro-batch (batch / M) the FLOP balance
 * counts at.
 */
function partitionRequest(
  cfg: TrainConfig,
  spec: StrategySpec,
): PartitionRequest {
  return {
    stages: spec.partitionStages?.(cfg) ?? stageCount(cfg),
    devices: cfg.stages,
    schedule: cfg.schedule,
    balance: cfg.balance,
    flopsMicroBatch: Math.max(1, Math.floor(cfg.batchSize / cfg.microBatches)),
  };
}

/**
 * The stage ranges a configuration asks for: one range for a one-device strategy (single, l2l);
 * for the others partition/stages.ts partitionBlocks on the configuration's request: the
 * explicit --balance, or the partition balancing the blocks' FLOP counts (default), parameter
 * count (--balance params), or for --balance time|memory `costs` (one per block, from
 * {@link resolveStages}). Throws {@link LayerwiseError} for an unknown strategy or an
 * impossible balance, and an Error when time/memory costs are missing.
 */
export function planStages(
  cfg: TrainConfig,
  model: Model,
  costs?: readonly number[],
): StageRange[] {
  const spec = specOf(cfg.strategy);
  if (spec.oneDevice) return [{ from: 0, to: model.blocks.length }];
  return partitionBlocks(model, partitionRequest(cfg, spec), costs);
}

/**
 * Like {@link planStages}, but first profiles the blocks on cfg.backend (in this thread) when
 * --balance is 'time' or 'memory' (see cost/profile.ts), at the micro-batch size
 * batchSize / (microBatches * replicas). Throws {@link LayerwiseError} for an impossible balance
 * or an unavailable backend.
 */
export async function resolveStages(
  cfg: TrainConfig,
  model: Model,
): Promise<StageRange[]> {
  const spec = specOf(cfg.strategy);
  if (spec.oneDevice) return [{ from: 0, to: model.blocks.length }];
  return partitionProfiled(model, partitionRequest(cfg, spec), async (kind) => {
    const { profiledBalanceCosts } = await import('../cost/profile.js');
    return profiledBalanceCosts(model, {
      kind,
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
  });
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
