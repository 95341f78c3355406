/**
 * Local parallelism (Laskin et al., 2020, arXiv 2012.03837; Belilovsky et al., 2020, Decoupled
 * Greedy Learning): each stage gets an auxiliary head and a local loss and makes one local
 * update per micro-batch; only activations (and labels) travel forward, no gradient crosses a
 * stage boundary unless `--overlap n` lets a stage's loss also train the last n blocks of the
 * stage before. Stages run free across mini-batches. It changes the algorithm, so it is judged
 * on the loss it reaches, not on equality with single. Runs on local-parallelism stages
 * (pipeline/local-stage.ts) through the shared pipeline runner (pipeline.ts).
 */

import { optimizerConfigOf } from '../config/config.js';
import { costsAt, type LocalShape, optimizerSlots } from '../cost/costs.js';
import { localStagePeakBytes, predictLocalPeakBytes } from '../cost/memory.js';
import {
  better,
  divisors,
  type StrategyPlan,
  unavailable,
} from '../cost/strategy-plan.js';
import { localStageSeconds, predictLocalStepTime } from '../cost/time.js';
import { initAuxParams } from '../model/aux-head.js';
import {
  balanceByCost,
  balanceByStageCost,
  stageRanges,
} from '../partition/balance.js';
import type { LocalRole } from '../pipeline/local-stage.js';
import { parseDevices } from '../runtime/devices.js';
import {
  evalSchedule,
  flushSchedule,
  localSchedule,
} from '../schedule/schedule.js';
import { LayerwiseError } from '../util/errors.js';
import {
  type PipelineKind,
  PipelineStrategy,
  runOptionsOf,
} from './pipeline.js';
import { type StrategySpec, threadsPerDevice } from './spec.js';

/**
 * A pipeline of local-parallelism stages: m local updates per mini-batch on each of k stages;
 * `overlap` blocks of each stage's tail also trained by the next stage's loss, at a fixed
 * interleaving (`deterministic`) or as the gradients arrive (then flushed before evaluation).
 */
export function localPipeline(
  m: number,
  k: number,
  overlap: number,
  deterministic: boolean,
): PipelineKind {
  return {
    train: localSchedule(m, k, overlap, deterministic),
    eval: evalSchedule(m, k),
    flush: overlap > 0 && !deterministic ? flushSchedule(k) : undefined,
    stage: (i, stages) => ({
      module: 'pipeline/local-stage.js',
      options: {
        stage: i,
        overlapTail: i < stages - 1 ? overlap : 0,
        sendsInputGrad: overlap > 0 && i > 0,
      } satisfies LocalRole,
    }),
    labelsOnEveryStage: true,
    freeRunning: true,
  };
}

export const local: StrategySpec = {
  name: 'local',
  help: 'local parallelism: a local loss (auxiliary head) per stage, stages update on their own, only activations travel',
  exact: false,
  oneDevice: false,
  stageLosses: true,
  overlap: true,
  refusesReplicas: "local parallelism's stages update on their own",
  refusesLossScaling: 'its stages step on their own losses',
  async create(cfg, model, params, ranges) {
    ranges.slice(0, -1).forEach((r, i) => {
      if (cfg.overlap >= r.to - r.from) {
        throw new LayerwiseError(
          `--overlap ${cfg.overlap} must be smaller than the ${r.to - r.from} blocks of stage ${i}; lower --overlap or give that stage more blocks with --balance`,
        );
      }
    });
    // auxiliary heads start from the seed unless the parameters (a checkpoint) carry them
    const aux = initAuxParams(
      model,
      ranges.map((r) => r.to),
      cfg.seed,
    );
    return PipelineStrategy.create(
      {
        name: 'local',
        ...runOptionsOf(cfg, model, ranges),
        microBatches: cfg.microBatches,
        kind: localPipeline(
          cfg.microBatches,
          ranges.length,
          cfg.overlap,
          cfg.deterministic,
        ),
        threads: threadsPerDevice(cfg, ranges.length),
        devices: parseDevices(cfg.devices, ranges.length),
        oomAdvice: local.outOfMemoryAdvice(cfg),
      },
      new Map([...aux, ...params]),
    );
  },
  memory: {
    microBatch: (cfg) => cfg.batchSize / cfg.microBatches,
    auxHeads: true,
    predictPeakBytes: (profile, cfg, ranges) =>
      predictLocalPeakBytes(
        costsAt(profile, cfg.batchSize / cfg.microBatches),
        ranges,
        {
          m: cfg.microBatches,
          slots: optimizerSlots(optimizerConfigOf(cfg)),
          overlap: cfg.overlap,
        },
      ),
  },
  /**
   * Greedy (no --overlap) on K stages: searches M and the balance (by each stage's predicted
   * busy time, by its predicted peak, and by parameter count), each stage with its auxiliary
   * head. Stages run free, so a mini-batch takes the slowest stage's time. Unavailable when the
   * profile has no auxiliary heads.
   */
  plan(profile, req) {
    const n = profile.blocks.length;
    const k = req.stages;
    const heads = profile.auxHeads ?? {};
    const missing = Array.from({ length: n - 1 }, (_, i) => i + 1).filter(
      (end) => !heads[end],
    );
    if (missing.length)
      return unavailable(
        'local',
        false,
        'needs the auxiliary heads profiled',
        req,
      );
    const ms =
      req.microBatches !== undefined
        ? [req.microBatches]
        : divisors(req.batchSize);
    const params =
      req.paramCounts ?? profile.blocks.map((b) => b.paramBytes / 4);
    let best: StrategyPlan | null = null;
    for (const m of ms) {
      const costs = costsAt(profile, req.batchSize / m);
      const shape: LocalShape = { m, slots: req.slots, overlap: 0 };
      const balances: Array<[string, number[]]> = [
        [
          'time',
          balanceByStageCost(n, k, (s, from, to) =>
            localStageSeconds(costs, { from, to }, s, k, shape),
          ),
        ],
        [
          'memory',
          balanceByStageCost(n, k, (s, from, to) =>
            localStagePeakBytes(costs, { from, to }, s, k, shape),
          ),
        ],
        [
          'params',
          balanceByCost(
            params.map((p) => Math.max(1, p)),
            k,
          ),
        ],
      ];
      for (const [by, balance] of balances) {
        const ranges = stageRanges(balance);
        const peakBytes = predictLocalPeakBytes(costs, ranges, shape);
        const t = predictLocalStepTime(costs, ranges, shape);
        const perSecond = t.seconds > 0 ? req.batchSize / t.seconds : Infinity;
        const p: StrategyPlan = {
          strategy: 'local',
          exact: false,
          fits: peakBytes.every((b) => b <= req.deviceMemory),
          stages: k,
          microBatches: m,
          remat: 'never',
          schedule: 'gpipe',
          balance,
          balancedBy: by,
          peakBytes,
          stepSeconds: t.seconds,
          bubble: t.bubble,
          idealBubble: 0,
          examplesPerSecond: perSecond,
          tokensPerSecond: perSecond * (req.tokensPerExample ?? 1),
          display: { remat: '-', schedule: '-' },
        };
        if (!best || better(p, best)) best = p;
      }
    }
    return best!;
  },
  planNote:
    "local parallelism trains each stage on its own auxiliary loss (not backprop's updates; its stages run free, so its step is the slowest stage's); it is recommended only when nothing exact fits",
  flags: (p) =>
    `--strategy local --stages ${p.stages} --micro-batches ${p.microBatches} --balance ${p.balance.join(',')}`,
  outOfMemoryAdvice: () =>
    'try --strategy l2l, more --stages, or more --micro-batches',
  describeRun: (cfg) =>
    `local parallelism: ${cfg.microBatches} micro-batch(es) of ${cfg.batchSize / cfg.microBatches}, one local update each; ` +
    `${cfg.overlap ? `overlap ${cfg.overlap}` : 'greedy'}, ${cfg.deterministic ? 'deterministic' : 'free-running'}`,
};
