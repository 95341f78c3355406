/**
 * What one training strategy is, in one place: each file under strategies/ (single.ts,
 * gpipe.ts, local.ts, l2l.ts) exports one {@link StrategySpec}, and everything that depends on
 * the strategy reads it from there: the trainer (partition and start), the device-memory check
 * before training (plan/budget.ts), `layerwise plan` (plan/plan.ts), the CLI's help and set-up
 * line, and the out-of-memory advice. The stage kind a strategy runs on its devices is named by
 * its runner (strategies/pipeline.ts, strategies/l2l.ts) as a module under pipeline/.
 */

import { availableParallelism } from 'node:os';
import type { TrainConfig } from '../config/config.js';
import type { StrategyFlags } from '../config/strategy-flags.js';
import type { ModelProfile } from '../cost/costs.js';
import type { PlanRequest, StrategyPlan } from '../cost/strategy-plan.js';
import type { HostParams } from '../model/init.js';
import type { Model } from '../model/model.js';
import type { StageRange } from '../partition/balance.js';
import type { Strategy } from './strategy.js';

/** Threads of each of `devices` devices: --threads, or the machine's cores divided among them (at least 1). */
export function threadsPerDevice(
  cfg: Pick<TrainConfig, 'threads'>,
  devices: number,
): number {
  return cfg.threads > 0
    ? cfg.threads
    : Math.max(1, Math.floor(availableParallelism() / devices));
}

/**
 * One strategy. Its answers to the configuration's shared checks (the default, --replicas, loss
 * scaling, --overlap, several stages per device) are the {@link StrategyFlags} it extends, which
 * strategies/index.ts registers with config/.
 */
export interface StrategySpec extends StrategyFlags {
  /** One line for help texts: what it does. */
  readonly help: string;
  /** Whether its updates equal single-device backprop's on the same seed and data (false: local parallelism). */
  readonly exact: boolean;
  /** Whether it runs on exactly one device (single); else on `--stages` devices (K >= 2 to plan, unless {@link anyStages}). */
  readonly oneDevice: boolean;
  /** Whether it also runs on one device, `--stages 1` (l2l: the relay alone; K: the pipelined relay). */
  readonly anyStages?: boolean;
  /** Whether every stage has a loss of its own (local parallelism): the metrics record each stage's, and a non-finite one is named by its stage. */
  readonly stageLosses?: boolean;
  /** Whether it skips the blocks --layer-drop draws (its submit honours `dropped`). */
  readonly layerDrop?: boolean;
  /**
   * Checks the resolved configuration's strategy-specific flags before anything is loaded.
   * Throws {@link LayerwiseError} naming the flag and the fix.
   */
  validate?(cfg: TrainConfig): void;
  /**
   * Stages its partition cuts the model into, for a strategy on several devices (default:
   * config's stageCount, the devices times the schedule's stages per device; gpipe: a schedule
   * file's own count). Throws {@link LayerwiseError} for a bad schedule file.
   */
  partitionStages?(cfg: TrainConfig): number;
  /** Starts the strategy on `ranges` (from strategies/index.ts resolveStages) with these initial parameters. */
  create(
    cfg: TrainConfig,
    model: Model,
    params: HostParams,
    ranges: StageRange[],
  ): Promise<Strategy>;
  /**
   * The device-memory prediction of a run: peak bytes per device (stage) for `cfg` on
   * `ranges`, from a profile at {@link microBatch} examples (plan/budget.ts profiles it).
   */
  readonly memory: {
    /** Examples per micro-batch of the run. */
    microBatch(cfg: TrainConfig): number;
    /** Whether the prediction needs `profile.auxHeads` at every stage's end but the last (local parallelism). */
    auxHeads?: boolean;
    predictPeakBytes(
      profile: ModelProfile,
      cfg: TrainConfig,
      ranges: readonly StageRange[],
    ): number[];
  };
  /** `layerwise plan`: the best settings of this strategy for the request (peak, step time, bubble). */
  plan(profile: ModelProfile, req: PlanRequest): StrategyPlan;
  /** The `layerwise train` flags that realise a plan of this strategy, e.g. `--strategy l2l --micro-batches 4 --stash host`. */
  flags(p: StrategyPlan): string;
  /** A note `layerwise plan` prints under its table when this strategy was planned (how to read its row). */
  readonly planNote?: string;
  /** What to try when a run of it does not fit its device-memory budget. */
  outOfMemoryAdvice(cfg: Pick<TrainConfig, 'stash'>): string;
  /** The CLI's line describing the run's set-up after the stage list, if any (`bytes`: the model's fp32 parameter bytes). */
  describeRun?(cfg: TrainConfig, bytes: number): string;
}
