/**
 * Strategy registry: turns a validated training configuration into a running {@link Strategy}.
 * Strategies stay thin: each is a choice of partition, schedule and micro-batching over the
 * shared runtime.
 */
import { LayerwiseError } from '../errors.js';
import { paramCount } from '../model/block.js';
import type { HostParams } from '../model/init.js';
import type { Model } from '../model/model.js';
import { defaultOptimizerConfig } from '../optim/optimizer.js';
import { balanceByCost, stageRanges, validateBalance, type StageRange } from '../partition/balance.js';
import type { TrainConfig } from '../train/config.js';
import { PipelineStrategy } from './pipeline.js';
import type { Strategy } from './strategy.js';

/**
 * The stage ranges a configuration asks for: one range for single; for gpipe the explicit
 * --balance (validated against the model) or, by default, the partition that balances the
 * parameter count. Throws {@link LayerwiseError} for an impossible balance.
 */
export function planStages(cfg: TrainConfig, model: Model): StageRange[] {
  const n = model.blocks.length;
  if (cfg.strategy === 'single') return [{ from: 0, to: n }];
  if (cfg.stages > n) {
    throw new LayerwiseError(`--stages ${cfg.stages} exceeds the model's ${n} blocks; use at most ${n} stages (or more --layers)`);
  }
  if (cfg.balance === 'params') return stageRanges(balanceByCost(model.blocks.map((b) => Math.max(1, paramCount(b))), cfg.stages));
  validateBalance(cfg.balance, n, cfg.stages);
  return stageRanges(cfg.balance);
}

/** Starts the strategy a configuration names, with these initial parameters. */
export async function createStrategy(cfg: TrainConfig, model: Model, params: HostParams): Promise<Strategy> {
  const optimizer = { ...defaultOptimizerConfig(cfg.optimizer), clipNorm: cfg.clipNorm };
  if (cfg.weightDecay !== undefined) optimizer.weightDecay = cfg.weightDecay;
  const ranges = planStages(cfg, model);
  switch (cfg.strategy) {
    case 'single':
      // the reference: whole model on one device, plain backprop on the whole mini-batch
      return PipelineStrategy.create({
        name: 'single', backend: cfg.backend, model: model.config, ranges, microBatches: 1, checkpoint: 'never', schedule: 'gpipe', optimizer,
      }, params);
    case 'gpipe':
      return PipelineStrategy.create({
        name: 'gpipe', backend: cfg.backend, model: model.config, ranges, microBatches: cfg.microBatches,
        checkpoint: cfg.checkpoint, schedule: cfg.schedule, optimizer,
      }, params);
    default:
      throw new LayerwiseError(`unknown strategy '${cfg.strategy as string}'`);
  }
}
