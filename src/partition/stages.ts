/**
 * A run's partition: which blocks each of its stages holds, from a {@link PartitionRequest}
 * (the stage count, the --balance, the micro-batch the FLOP count is taken at). The strategies'
 * registry (strategies/index.ts planStages, resolveStages) turns a configuration into one
 * request; everything after that is here. Pure: profiled costs come from the caller.
 */

import { paramCount } from '../model/block.js';
import type { Model } from '../model/model.js';
import { LayerwiseError } from '../util/errors.js';
import {
  balanceByCost,
  type StageRange,
  stageRanges,
  validateBalance,
} from './balance.js';

/** Automatic balances: by the blocks' FLOP counts (the default), parameter count, or profiled time or memory. */
export const BALANCE_KINDS = ['flops', 'params', 'time', 'memory'] as const;
export type BalanceKind = (typeof BALANCE_KINDS)[number];

/** The balances that need the blocks profiled on the backend (cost/profile.ts). */
export type ProfiledBalance = Extract<BalanceKind, 'time' | 'memory'>;

/** What a partition is asked for. */
export interface PartitionRequest {
  /** Stages to cut the blocks into: the devices times the stages each runs, or a schedule file's count. */
  stages: number;
  /** Devices the stages run on (`--stages`), named with {@link schedule} when the stages exceed the blocks. */
  devices: number;
  /** The schedule placing the stages on the devices (its `--schedule` name). */
  schedule: string;
  /** `--balance`: blocks per stage, or the cost to balance. */
  balance: readonly number[] | BalanceKind;
  /** Examples per micro-batch at which the FLOP balance counts each block (at least 1). */
  flopsMicroBatch: number;
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

/** Throws {@link LayerwiseError} when the request has more stages than the model has blocks. */
function checkStageCount(req: PartitionRequest, n: number): void {
  const k = req.stages;
  if (k <= n) return;
  throw new LayerwiseError(
    k === req.devices
      ? `--stages ${req.devices} exceeds the model's ${n} blocks; use at most ${n} stages (or more --layers)`
      : `--stages ${req.devices} with --schedule ${req.schedule} makes ${k} stages (${k / req.devices} per device), more than the model's ${n} blocks; use at most ${Math.floor(n / (k / req.devices))} devices (or more --layers)`,
  );
}

/**
 * The stage ranges of a request: the explicit balance (validated against the model), the
 * partition that balances the blocks' FLOP counts (the default: compute is what keeps a stage
 * busy, see {@link blockFlops}), the parameter count ('params'), or for 'time' and 'memory' the
 * one that balances `costs` (one per block, profiled: see {@link partitionProfiled}). Throws
 * {@link LayerwiseError} for more stages than blocks or an impossible balance, and an Error when
 * time or memory costs are missing.
 */
export function partitionBlocks(
  model: Model,
  req: PartitionRequest,
  costs?: readonly number[],
): StageRange[] {
  const n = model.blocks.length;
  const k = req.stages;
  checkStageCount(req, n);
  const { balance } = req;
  if (balance === 'flops')
    return stageRanges(
      balanceByCost(blockFlops(model, req.flopsMicroBatch), k),
    );
  if (balance === 'params')
    return stageRanges(
      balanceByCost(
        model.blocks.map((b) => Math.max(1, paramCount(b))),
        k,
      ),
    );
  if (balance === 'time' || balance === 'memory') {
    if (!costs)
      throw new Error(
        `--balance ${balance} needs profiled block costs: use resolveStages`,
      );
    return stageRanges(balanceByCost(costs, k));
  }
  validateBalance(balance, n, k);
  return stageRanges(balance);
}

/**
 * Like {@link partitionBlocks}, but for a 'time' or 'memory' balance first checks the stage
 * count, then asks `profile` for the blocks' costs of that kind (one per block; cost/profile.ts
 * measures them on the run's backend) and balances them. Throws as {@link partitionBlocks}, and
 * whatever `profile` throws.
 */
export async function partitionProfiled(
  model: Model,
  req: PartitionRequest,
  profile: (kind: ProfiledBalance) => Promise<readonly number[]>,
): Promise<StageRange[]> {
  if (req.balance !== 'time' && req.balance !== 'memory')
    return partitionBlocks(model, req);
  partitionBlocks(model, { ...req, balance: 'params' }); // the stage count, before spending time profiling
  return partitionBlocks(model, req, await profile(req.balance));
}
