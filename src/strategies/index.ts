/**
 * Strategy registry: turns a validated training configuration into a running {@link Strategy}.
 * Strategies stay thin: each is a choice of partition, schedule and micro-batching over the
 * shared runtime.
 */
import { LayerwiseError } from '../util/errors.js';
import { paramCount } from '../model/block.js';
import type { HostParams } from '../model/init.js';
import type { Model } from '../model/model.js';
import { initAuxParams } from '../model/aux-head.js';
import { balanceByCost, stageRanges, validateBalance, type StageRange } from '../partition/balance.js';
import { optimizerConfigOf, type TrainConfig } from '../config/config.js';
import { PipelineStrategy } from './pipeline.js';
import { L2LStrategy } from './l2l.js';
import type { Strategy } from './strategy.js';

/**
 * The stage ranges a configuration asks for: one range for single; for gpipe the explicit
 * --balance (validated against the model), the partition that balances the parameter count
 * (default), or for --balance time|memory the one that balances `costs` (one per block, from
 * {@link resolveStages}). Throws {@link LayerwiseError} for an impossible balance, and an Error
 * when time/memory costs are missing.
 */
export function planStages(cfg: TrainConfig, model: Model, costs?: readonly number[]): StageRange[] {
  const n = model.blocks.length;
  if (cfg.strategy === 'single' || cfg.strategy === 'l2l') return [{ from: 0, to: n }];
  if (cfg.stages > n) {
    throw new LayerwiseError(`--stages ${cfg.stages} exceeds the model's ${n} blocks; use at most ${n} stages (or more --layers)`);
  }
  if (cfg.balance === 'params') return stageRanges(balanceByCost(model.blocks.map((b) => Math.max(1, paramCount(b))), cfg.stages));
  if (cfg.balance === 'time' || cfg.balance === 'memory') {
    if (!costs) throw new Error(`--balance ${cfg.balance} needs profiled block costs: use resolveStages`);
    return stageRanges(balanceByCost(costs, cfg.stages));
  }
  validateBalance(cfg.balance, n, cfg.stages);
  return stageRanges(cfg.balance);
}

/**
 * Like {@link planStages}, but first profiles the blocks on cfg.backend (in this thread) when
 * --balance is 'time' or 'memory' (see partition/profile.ts), at the micro-batch size
 * batchSize / microBatches. Throws {@link LayerwiseError} for an impossible balance or an
 * unavailable backend.
 */
export async function resolveStages(cfg: TrainConfig, model: Model): Promise<StageRange[]> {
  if (cfg.strategy === 'single' || cfg.strategy === 'l2l' || (cfg.balance !== 'time' && cfg.balance !== 'memory')) return planStages(cfg, model);
  planStages({ ...cfg, balance: 'params' }, model); // the stage count, before spending time profiling
  const { profiledBalanceCosts } = await import('../cost/profile.js');
  const costs = await profiledBalanceCosts(model, {
    kind: cfg.balance, backend: cfg.backend, microBatch: cfg.batchSize / cfg.microBatches, stages: cfg.stages,
    shape: { m: cfg.microBatches, remat: cfg.remat, schedule: cfg.schedule }, optimizer: optimizerConfigOf(cfg),
  });
  return planStages(cfg, model, costs);
}


/**
 * Starts the strategy a configuration names, with these initial parameters, on `ranges` if
 * given (e.g. from {@link resolveStages}), else on {@link resolveStages}' ranges.
 */
export async function createStrategy(cfg: TrainConfig, model: Model, params: HostParams, given?: StageRange[]): Promise<Strategy> {
  const optimizer = optimizerConfigOf(cfg);
  const ranges = given ?? await resolveStages(cfg, model);
  switch (cfg.strategy) {
    case 'single':
      // the reference: whole model on one device, plain backprop on the whole mini-batch
      return PipelineStrategy.create({
        name: 'single', backend: cfg.backend, model: model.config, ranges, microBatches: 1, remat: 'never', schedule: 'gpipe', optimizer,
        deviceMemory: cfg.deviceMemory,
      }, params);
    case 'gpipe':
      return PipelineStrategy.create({
        name: 'gpipe', backend: cfg.backend, model: model.config, ranges, microBatches: cfg.microBatches,
        remat: cfg.remat, schedule: cfg.schedule, optimizer, deviceMemory: cfg.deviceMemory,
      }, params);
    case 'local': {
      ranges.slice(0, -1).forEach((r, i) => {
        if (cfg.overlap >= r.to - r.from) {
          throw new LayerwiseError(`--overlap ${cfg.overlap} must be smaller than the ${r.to - r.from} blocks of stage ${i}; lower --overlap or give that stage more blocks with --balance`);
        }
      });
      // auxiliary heads start from the seed unless the parameters (a checkpoint) carry them
      const aux = initAuxParams(model, ranges.map((r) => r.to), cfg.seed);
      const all = new Map([...aux, ...params]);
      return PipelineStrategy.create({
        name: 'local', backend: cfg.backend, model: model.config, ranges, microBatches: cfg.microBatches,
        remat: 'never', schedule: 'gpipe', optimizer, local: { overlap: cfg.overlap, deterministic: cfg.deterministic },
        deviceMemory: cfg.deviceMemory,
      }, all);
    }
    case 'l2l':
      return L2LStrategy.create({
        backend: cfg.backend, model: model.config, microBatches: cfg.microBatches, optimizer, stash: cfg.stash,
        serverThreads: cfg.serverThreads, deviceMemory: cfg.deviceMemory,
      }, model, params);
    default:
      throw new LayerwiseError(`unknown strategy '${cfg.strategy as string}'`);
  }
}
