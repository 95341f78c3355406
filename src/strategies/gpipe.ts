/**
 * GPipe pipeline parallelism (Huang et al., 2019, arXiv 1811.06965; torchgpipe): the blocks are
 * cut into K stages, one per device; the mini-batch is split into M micro-batches that flow
 * through the stages following a schedule (fill-drain or 1F1B) with re-materialization
 * (`--checkpoint always|except_last|never`); gradients accumulate over the micro-batches and
 * every stage steps its optimizer once per mini-batch, after an all-reduce of the gradient norm
 * for global clipping, so training equals single-device training. Runs on backprop stages
 * (pipeline/stage.ts) through the shared pipeline runner (pipeline.ts).
 */

import { readFileSync } from 'node:fs';
import {
  lossScalingOf,
  microBatchSize,
  optimizerConfigOf,
  scheduleName,
  stageCount,
  type TrainConfig,
} from '../config/config.js';
import {
  blockBalanceCosts,
  costsAt,
  optimizerSlots,
  type StepShape,
} from '../cost/costs.js';
import { predictPeakBytes, stagePeakBytes } from '../cost/memory.js';
import {
  better,
  divisors,
  plannedAs,
  type StrategyPlan,
} from '../cost/strategy-plan.js';
import type { Model } from '../model/model.js';
import {
  balanceByCost,
  balanceByStageCost,
  type StageRange,
  stageRanges,
} from '../partition/balance.js';
import { blockFlops } from '../partition/stages.js';
import { type DeviceSpec, parseDevices } from '../runtime/devices.js';
import { type LoadedSchedule, loadScheduleCsv } from '../schedule/csv.js';
import {
  type ComputeSchedule,
  computeSchedule,
  evalSchedule,
  lower,
  makeSchedule,
  placementOf,
  REMAT_MODES,
  type RematMode,
  SCHEDULE_KINDS,
  type Schedule,
  type ScheduleKind,
  stagesPerDevice,
} from '../schedule/schedule.js';
import { LayerwiseError } from '../util/errors.js';
import {
  type PipelineKind,
  PipelineStrategy,
  runOptionsOf,
} from './pipeline.js';
import { runThreads, type StrategySpec, threadsPerDevice } from './spec.js';

/**
 * Each device's share of a step's FLOPs (partition/stages.ts blockFlops at the micro-batch, its
 * stages' blocks summed over the schedule's placement): the stages are balanced by FLOPs, but a
 * V-shape puts the first and the last stage on device 0 (charlm-small's zbv K=3: the embedding
 * and the head, about 2% of a decoder block's FLOPs, where the other two devices hold two
 * decoder blocks each), and a schedule file may place stages as it likes. `placement` (the
 * device of each stage) defaults to the run's schedule's; a caller that has it passes it, so
 * that a schedule file is not read again.
 */
export function gpipeDeviceLoads(
  cfg: TrainConfig,
  model: Model,
  ranges: readonly StageRange[],
  placement = gpipeComputeSchedule(cfg, cfg.stages).placement,
): number[] {
  const flops = blockFlops(model, microBatchSize(cfg));
  const loads = new Array<number>(Math.max(...placement) + 1).fill(0);
  ranges.forEach((r, s) => {
    const d = placement[s] ?? s;
    for (let b = r.from; b < r.to; b++) loads[d]! += flops[b]!;
  });
  return loads;
}

/** `specs` with each device's `threads` set from `threads` (one per device) where it gives none of its own. */
function withThreads(
  specs: DeviceSpec[],
  threads: readonly number[],
): DeviceSpec[] {
  return specs.map((d, i) =>
    d.kind === 'thread' || d.kind === 'process'
      ? { ...d, threads: d.threads ?? threads[i] }
      : d,
  );
}

/** A compute-only schedule with the device of each of its stages (a schedule file's, or a generator's). */
export interface PlacedSchedule {
  compute: ComputeSchedule;
  placement: number[];
}

/**
 * A pipeline of backprop stages on k devices: schedule `kind` (a named one, its stages placed
 * by {@link placementOf}; `v` stages per device for interleaved 1F1B) or a placed compute-only
 * schedule (a schedule file's) of m micro-batches with re-materialization `remat`. single is
 * the case k = 1, m = 1, remat 'never'.
 */
export function backpropPipeline(
  m: number,
  k: number,
  remat: RematMode,
  kind: ScheduleKind | PlacedSchedule,
  v = 2,
): PipelineKind {
  const placement =
    typeof kind === 'string' ? placementOf(kind, k, v) : kind.placement;
  return {
    train:
      typeof kind === 'string'
        ? makeSchedule(kind, m, k, remat, v)
        : lower(kind.compute, kind.placement, { step: 'all-reduce' }),
    eval: evalSchedule(m, k, placement),
    stage: () => ({ module: 'pipeline/stage.js' }),
    labelsOnEveryStage: false,
    freeRunning: false,
  };
}

/**
 * Reads and checks `cfg.scheduleFile` (PyTorch pipelining's compute-only CSV, schedule/csv.ts)
 * for a run on `k` devices: the file's own checks (every F and B, or I and W, once per stage
 * and micro-batch, dependencies, no deadlock; its rows place the stages, several per device
 * for interleaved and V-shape schedules), then `k` devices and `cfg.microBatches`
 * micro-batches. Throws {@link LayerwiseError} naming the
 * problem and the fix (for the file's own faults: the action, with the grid marked
 * `<-- ERROR HERE`).
 */
export function readScheduleFile(cfg: TrainConfig, k: number): LoadedSchedule {
  const path = cfg.scheduleFile!;
  let text: string;
  try {
    text = readFileSync(path, 'utf8');
  } catch (e) {
    const code = (e as NodeJS.ErrnoException).code;
    throw new LayerwiseError(
      `--schedule-file ${path}: ${code === 'ENOENT' ? 'no such file' : code === 'EISDIR' ? 'a folder, not a file' : (e as Error).message}; write one with 'layerwise schedule --schedule 1f1b --stages ${k} --micro-batches ${cfg.microBatches} --format csv > F.csv'`,
    );
  }
  let loaded: LoadedSchedule;
  try {
    loaded = loadScheduleCsv(text, cfg.remat);
  } catch (e) {
    if (e instanceof LayerwiseError)
      throw new LayerwiseError(`--schedule-file ${path}: ${e.message}`);
    throw e;
  }
  const { placement, m } = loaded;
  const devices = Math.max(...placement) + 1;
  if (devices !== k)
    throw new LayerwiseError(
      `--schedule-file ${path} has ${devices} devices (rows) and the run ${k}; pass --stages ${devices}`,
    );
  if (m !== cfg.microBatches)
    throw new LayerwiseError(
      `--schedule-file ${path} has ${m} micro-batches and the run ${cfg.microBatches}; pass --micro-batches ${m}`,
    );
  return loaded;
}

/**
 * The compute-only training schedule of a gpipe run on `k` devices, with its placement: its
 * --schedule-file's (checked), else its --schedule's.
 */
export function gpipeComputeSchedule(
  cfg: TrainConfig,
  k: number,
): PlacedSchedule {
  if (cfg.scheduleFile !== undefined) {
    const f = readScheduleFile(cfg, k);
    return { compute: f.compute, placement: f.placement };
  }
  return {
    compute: computeSchedule(
      cfg.schedule,
      cfg.microBatches,
      k,
      cfg.remat,
      cfg.virtualStages,
    ),
    placement: placementOf(cfg.schedule, k, cfg.virtualStages),
  };
}

export const gpipe: StrategySpec = {
  name: 'gpipe',
  help: 'GPipe: K stages on K devices, M micro-batches, re-materialization; the same updates as single',
  exact: true,
  oneDevice: false,
  layerDrop: true,
  placesStages: true,
  validate(cfg) {
    // a bad file stops the run here, before anything is written or started
    if (cfg.scheduleFile !== undefined) readScheduleFile(cfg, cfg.stages);
  },
  // a schedule file says how many stages it places on the devices
  partitionStages: (cfg) =>
    cfg.scheduleFile !== undefined
      ? readScheduleFile(cfg, cfg.stages).placement.length
      : stageCount(cfg),
  deviceLoads: (cfg, model, ranges) => gpipeDeviceLoads(cfg, model, ranges),
  create: (cfg, model, params, ranges) => {
    const placed = gpipeComputeSchedule(cfg, cfg.stages);
    if (placed.placement.length !== ranges.length)
      throw new LayerwiseError(
        `the schedule has ${placed.placement.length} stages and the partition ${ranges.length}: give --balance one block count per stage`,
      );
    return PipelineStrategy.create(
      {
        name: 'gpipe',
        ...runOptionsOf(cfg, model, ranges),
        microBatches: cfg.microBatches,
        kind: backpropPipeline(cfg.microBatches, cfg.stages, cfg.remat, placed),
        placement: placed.placement,
        threads: threadsPerDevice(cfg, cfg.stages * cfg.replicas),
        devices: withThreads(
          parseDevices(cfg.devices, cfg.stages, cfg.replicas),
          runThreads(
            cfg,
            false,
            gpipeDeviceLoads(cfg, model, ranges, placed.placement),
          ),
        ),
        replicas: cfg.replicas,
        lossScaling: lossScalingOf(cfg),
        oomAdvice: gpipe.outOfMemoryAdvice(cfg),
      },
      params,
    );
  },
  memory: {
    microBatch: microBatchSize,
    predictPeakBytes: (profile, cfg, ranges) =>
      predictPeakBytes(costsAt(profile, microBatchSize(cfg)), ranges, {
        m: cfg.microBatches,
        remat: cfg.remat,
        schedule: cfg.schedule,
        virtualStages: cfg.virtualStages,
        ...(cfg.scheduleFile !== undefined
          ? gpipeComputeSchedule(cfg, cfg.stages)
          : {}),
        slots: optimizerSlots(optimizerConfigOf(cfg)),
      }),
  },
  /**
   * Searches every number of micro-batches M dividing N (or the one given), every
   * re-materialization mode, every schedule (those with several stages per device where the
   * model has blocks enough; interleaved with V = 2) and three balances: by profiled
   * time, by exact minimum of the predicted stage peak, and by parameter count. Among the
   * candidates that fit it takes the fastest (ties: the smaller peak); when none fits, the one
   * with the smallest peak, to say by how much it misses.
   */
  plan(profile, req) {
    const n = profile.blocks.length;
    const k = req.stages;
    const ms =
      req.microBatches !== undefined
        ? [req.microBatches]
        : divisors(req.batchSize);
    const params =
      req.paramCounts ?? profile.blocks.map((b) => b.paramBytes / 4);
    let best: StrategyPlan | null = null;
    for (const m of ms) {
      const costs = costsAt(profile, req.batchSize / m);
      for (const remat of REMAT_MODES) {
        for (const schedule of SCHEDULE_KINDS) {
          // several stages per device (interleaved with V = 2, the V-shapes): k times as many
          // stages to balance, and a model with at least that many blocks
          const per = stagesPerDevice(schedule);
          const stages = k * per;
          if (stages > n) continue;
          const shape: StepShape = { m, remat, schedule, slots: req.slots };
          let sched: Schedule;
          try {
            sched = makeSchedule(schedule, m, k, remat);
          } catch (e) {
            if (e instanceof LayerwiseError) continue; // e.g. dualpipev with M < 2K
            throw e;
          }
          const balances: Array<[string, number[]]> = [
            [
              'time',
              balanceByCost(
                blockBalanceCosts(costs, 'time', shape, stages),
                stages,
              ),
            ],
            // the exact memory balance walks one stage per device
            ...(per === 1
              ? ([
                  [
                    'memory',
                    balanceByStageCost(n, k, (s, from, to) =>
                      stagePeakBytes(costs, { from, to }, s, sched, req.slots),
                    ),
                  ],
                ] as Array<[string, number[]]>)
              : []),
            [
              'params',
              balanceByCost(
                params.map((p) => Math.max(1, p)),
                stages,
              ),
            ],
          ];
          for (const [by, balance] of balances) {
            const p = plannedAs(
              'gpipe',
              profile,
              req,
              stageRanges(balance),
              shape,
              by,
            );
            if (!best || better(p, best)) best = p;
          }
        }
      }
    }
    return best!;
  },
  flags: (p) =>
    `--strategy gpipe --stages ${p.stages} --micro-batches ${p.microBatches} --checkpoint ${p.remat} --schedule ${p.schedule} --balance ${p.balance.join(',')}`,
  outOfMemoryAdvice: () => 'try --strategy l2l, or more --stages',
  describeRun: (cfg) =>
    `${cfg.replicas > 1 ? `${cfg.replicas} replicas, each ` : ''}micro-batches ${cfg.microBatches} of ${microBatchSize(cfg)}, schedule ${scheduleName(cfg)}, checkpoint (re-materialization) ${cfg.remat}`,
};
