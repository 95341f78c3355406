/**
 * The device-memory budget of a training run (`--device-memory`), checked before training:
 * the model's blocks are profiled on the run's backend (in this thread, cost/profile.ts)
 * and the memory model (cost/memory.ts) predicts each device's peak bytes for the
 * run's actual shape (strategy, micro-batches, re-materialization, schedule, optimizer slots).
 * A run whose prediction exceeds the budget fails with {@link DeviceOutOfMemoryError} before
 * any file is written or any worker started. While running, the stage workers' exact byte
 * counter enforces the same budget (backend/memory.ts setDeviceBudget).
 *
 * Predictions are made by each strategy's spec (strategies/*.ts, `memory`). Loading this
 * module loads TF.js, so the trainer imports it only when a budget is given.
 */

import { DeviceOutOfMemoryError } from '../backend/out-of-memory.js';
import { tf } from '../backend/tfjs.js';
import { optimizerConfigOf, type TrainConfig } from '../config/config.js';
import type { ModelProfile } from '../cost/costs.js';
import { type ProfileOptions, profileModel } from '../cost/profile.js';
import { auxHead } from '../model/aux-head.js';
import type { Block } from '../model/block.js';
import type { Model } from '../model/model.js';
import type { StageRange } from '../partition/balance.js';
import { specOf } from '../strategies/index.js';

/** What {@link checkDeviceBudget} found. */
export interface BudgetCheck {
  /** The budget, bytes (cfg.deviceMemory), or undefined when none was given (prediction only). */
  budget?: number;
  strategy: string;
  /** Predicted peak device bytes per stage. */
  predicted: number[];
  /** Examples per micro-batch predicted for. */
  microBatch: number;
  /** Seconds spent profiling. */
  profileSeconds: number;
}

/**
 * The micro-batch sizes (examples) to profile at for a run at micro-batch size `b`: `b` itself.
 * (Two small sizes extrapolated to `b` are cheaper but no longer exact: a backward that frees
 * as it goes peaks at different moments at different sizes, so its transient is only piecewise
 * affine in the batch; from sizes 1 and 2, charlm-small's relay at 8 examples was predicted
 * 0.8 MiB, 2%, under its measured peak.) One block at a time at `b` never needs more device
 * memory than the run itself.
 */
export function budgetProfileSizes(b: number): number[] {
  return [b];
}

/**
 * Profiles the auxiliary heads of local parallelism (model/aux-head.ts) that sit after blocks
 * `end - 1` for each of `ends` (exclusive ends of stages; 0 < end < blocks), in this thread,
 * on `opts.backend`: each head with the model's loss as a one-block model on the activation of
 * that block, with the gradient of its input (as in a local update). Heads of the same shape on
 * the same activation shape are profiled once. Returns one-block profiles keyed by end (bytes,
 * seconds), for `ModelProfile.auxHeads`. Throws {@link LayerwiseError} like profileModel.
 */
export async function profileAuxHeads(
  model: Model,
  ends: readonly number[],
  opts: ProfileOptions,
): Promise<Record<number, ModelProfile>> {
  const out: Record<number, ModelProfile> = {};
  const byKey = new Map<string, ModelProfile>();
  for (const end of [...new Set(ends)]) {
    if (!(Number.isInteger(end) && end > 0 && end < model.blocks.length))
      throw new RangeError(
        `an auxiliary head sits after a block that is not the last; got end ${end} of ${model.blocks.length} blocks`,
      );
    let shape = model.inputShape(1);
    for (let b = 0; b < end; b++) shape = model.blocks[b].outputShape(shape);
    const head = auxHead(model, 0, end);
    const key = JSON.stringify([
      shape.slice(1),
      head.params.map((p) => p.shape),
    ]);
    let p = byKey.get(key);
    if (!p) {
      // the head as the second block of a model whose first block only passes its input on, so
      // that the head's backward computes its input gradient, as in a local update
      const pass: Block = {
        name: 'input',
        params: [],
        outputShape: (s) => s,
        forward: (_p, x) => tf.clone(x),
        flops: () => 0,
      };
      const headModel: Model = {
        config: model.config,
        blocks: [pass, head],
        inputDtype: 'float32',
        inputShape: (n) => [n, ...shape.slice(1)],
        loss: model.loss,
      };
      const full = await profileModel(headModel, opts);
      p = {
        backend: full.backend,
        blocks: [full.blocks[1]],
        sizes: full.sizes.map((s) => ({
          batch: s.batch,
          labelBytes: s.labelBytes,
          blocks: [s.blocks[1]],
        })),
      };
      byKey.set(key, p);
    }
    out[end] = p;
  }
  return out;
}

/**
 * Predicts the peak device bytes of the run `cfg` of `model` on `ranges` (from
 * strategies/index.ts resolveStages) and checks them against cfg.deviceMemory (bytes). Profiles
 * the model's blocks on cfg.backend in this thread once (one cheap pass at small micro-batch
 * sizes, see {@link budgetProfileSizes}; about a second for charlm-small on wasm), and asks the
 * strategy's spec for the peaks.
 * Throws {@link DeviceOutOfMemoryError} `device out of memory: needs X, budget Y (stage S of
 * STRATEGY, predicted); try ...` naming the stage with the largest predicted peak when it
 * exceeds the budget, and {@link LayerwiseError} for an unavailable backend.
 */
export async function checkDeviceBudget(
  cfg: TrainConfig,
  model: Model,
  ranges: StageRange[],
): Promise<BudgetCheck> {
  const spec = specOf(cfg.strategy);
  const budget = cfg.deviceMemory;
  const microBatch = spec.memory.microBatch(cfg);
  const t0 = performance.now();
  const opts: ProfileOptions = {
    backend: cfg.backend,
    precision: cfg.precision, // the blocks' peaks include the policy's parameter copies
    microBatchSizes: budgetProfileSizes(microBatch),
    optimizer: optimizerConfigOf(cfg),
    repeats: 1,
    warmup: 0,
    seed: cfg.seed,
  };
  const profile = await profileModel(model, opts);
  if (spec.memory.auxHeads && ranges.length > 1)
    profile.auxHeads = await profileAuxHeads(
      model,
      ranges.slice(0, -1).map((r) => r.to),
      opts,
    );
  const predicted = spec.memory.predictPeakBytes(profile, cfg, ranges);
  const profileSeconds = (performance.now() - t0) / 1000;
  if (budget !== undefined) {
    const worst = predicted.reduce((w, b, i) => (b > predicted[w] ? i : w), 0);
    if (predicted[worst] > budget) {
      throw new DeviceOutOfMemoryError({
        needs: predicted[worst],
        budget,
        stage: worst,
        strategy: cfg.strategy,
        how: 'predicted',
        advice: spec.outOfMemoryAdvice(cfg),
      });
    }
  }
  return {
    budget,
    strategy: cfg.strategy,
    predicted,
    microBatch,
    profileSeconds,
  };
}
