/**
 * L2L, layer-to-layer relay training (Pudipeddi et al., 2020, arXiv 2002.05645), on one
 * device, or pipelined on K (`--stages K`: each device relays its own stage's layers from the
 * one parameter server while micro-batches flow through the stages on the gpipe or 1F1B
 * schedule; schedule/schedule.ts relayPipelineSchedule). Every parameter and all optimizer state live in host memory, in the eager parameter
 * server (src/param-server/server.ts); the device (one worker thread running a {@link RelayStage})
 * follows the relay schedule (schedule/schedule.ts relaySchedule): it uploads one layer at a
 * time from the server's shared memory, runs every micro-batch through it, and in backward
 * hands each layer's gradient to the server, which updates that layer in background threads
 * while the device works on the next one. The device therefore holds at most two layers'
 * parameters (the current one and the prefetched next), whatever the depth of the model.
 *
 * Same updates as single-device training on the same seed and data: the mini-batch gradient
 * is the mean over micro-batches, global-norm clipping uses every layer's gradient (the
 * server holds the step's gradients until the norm is known), and the host optimizer is the
 * device optimizer's math.
 *
 * The relay runs on the one coordinator of every strategy (coordinator.ts): the relay is its
 * stage kind ({@link relayPipeline}) and the parameter server its parameters' home
 * ({@link ServerParameters}: what the coordinator does with each pushed layer gradient).
 *
 * A failed step (a device or optimizer-thread error) stops the device and the parameter
 * server: the strategy cannot continue (some layers may have been updated and others not), and
 * every later call rejects with the first error. Resume from the last checkpoint instead.
 */

import type { Precision } from '../backend/names.js';
import { isNarrow, policyOf } from '../backend/precision.js';
import {
  lossScalingOf,
  microBatchSize,
  optimizerConfigOf,
  type TrainConfig,
} from '../config/config.js';
import { costsAt } from '../cost/costs.js';
import {
  predictRelayPeakBytes,
  predictRelayPipelinePeakBytes,
} from '../cost/memory.js';
import { better, divisors, type StrategyPlan } from '../cost/strategy-plan.js';
import {
  predictRelayPipelineStepTime,
  predictRelayStepTime,
  type StepTime,
} from '../cost/time.js';
import { paramKey, readByProducts } from '../model/block.js';
import type { HostParams } from '../model/init.js';
import type { Model, ModelConfig } from '../model/model.js';
import type { LossScaleState } from '../optim/loss-scale.js';
import type { OptimizerConfig, OptimizerState } from '../optim/optimizer.js';
import { ParameterServer, type ServerSpan } from '../param-server/server.js';
import { blockLayers } from '../param-server/store.js';
import {
  balanceByCost,
  type StageRange,
  stageRanges,
} from '../partition/balance.js';
import type { RelayOptions, StashPlace } from '../pipeline/relay-stage.js';
import type { Device } from '../runtime/device.js';
import { parseDevices } from '../runtime/devices.js';
import {
  evalSchedule,
  idealBubble,
  RELAY_PIPELINE_SCHEDULES,
  relayEvalSchedule,
  relayPipelineSchedule,
  relayPipelineTraining,
  relaySchedule,
  type Schedule,
  type ScheduleKind,
} from '../schedule/schedule.js';
import { check } from '../util/errors.js';
import { formatSize } from '../util/size.js';
import {
  Coordinator,
  type CoordinatorDevices,
  type CoordinatorOptions,
  type HomeStep,
  type ParameterHome,
  type PipelineKind,
  type StepRun,
} from './coordinator.js';
import { type StrategySpec, threadsPerDevice } from './spec.js';
import type { StepReport } from './strategy.js';

export interface L2LOptions {
  backend: string;
  /** The run's seed (--seed), for Dropout's per-example noise (model/noise.ts); default 0. */
  seed?: number;
  model: ModelConfig;
  /**
   * The layers (blocks) of each device's stage, contiguous and covering the model; default one
   * stage of every layer. More than one: the pipelined relay.
   */
  ranges?: StageRange[];
  /** The stage schedule of a pipelined relay (gpipe or 1f1b; default gpipe). */
  schedule?: ScheduleKind;
  /**
   * Data-parallel replicas R (default 1): R copies of the relay's devices, each on 1/R of every
   * mini-batch, all pushing to the one parameter server, which sums what they push (the L2L
   * paper's EPS) before it updates a layer.
   */
  replicas?: number;
  /** Micro-batches M: each layer runs the mini-batch in M pieces (bounds the device's activations). */
  microBatches: number;
  optimizer: OptimizerConfig;
  /** Where layer inputs wait between forward and backward. */
  stash: StashPlace;
  /** Worker threads of the parameter server's optimizer. */
  serverThreads: number;
  /** Device memory budget, bytes (the device fails as soon as its engine holds more). */
  deviceMemory?: number;
  /** Threads of the device's kernels (see initBackend). */
  threads?: number;
  /** Compute precision of the device's products (see initBackend); default fp32. */
  precision?: Precision;
  /** f16: the initial dynamic loss scale; the parameter server scales and unscales (absent: none). */
  lossScale?: number;
  /** Record the device GPU's spans in each step's trace (webgpu; costs about 0.5 ms per action, so only when a trace is written). */
  traceGpu?: boolean;
  /**
   * The parameter server takes over the SharedArrayBuffer-backed arrays of `params` (see
   * initParams' `shared`) instead of copying them: halves the host memory needed at start-up.
   * The caller must not use `params` afterwards.
   */
  adoptParams?: boolean;
}

/**
 * Parameters in L2L's eager parameter server (param-server/server.ts): the relay's devices
 * upload each layer from its shared memory and push each layer's gradient back, which the
 * coordinator hands to the server; the server sums the pushes that make up a layer's gradient
 * (per micro-batch on K > 1 devices, per replica: the L2L paper's EPS), clips with the global
 * norm, scales (f16) and updates the layer in its optimizer threads while the devices go on.
 * An optimizer thread's failure stops the run.
 */
class ServerParameters implements ParameterHome {
  /** The replicas meet in the server, not over links. */
  readonly replicaRing = false;

  /** `parts`: the pushes that make up one layer's gradient in a step. */
  constructor(
    private readonly server: ParameterServer,
    private readonly parts: number,
  ) {}

  stageParams(): Record<string, Float32Array> {
    return {};
  }

  lossScale(run: StepRun): number | undefined {
    return run.training ? this.server.lossScale : undefined;
  }

  /** A training step opens the server's step; a layer LayerDrop skips gets empty pushes. */
  beginStep(run: HomeStep): void {
    if (!run.training) return;
    this.server.beginStep(run.lr, this.parts);
    // a layer LayerDrop skips has no gradient: the server leaves it (and its AdamW state) as is
    for (const l of run.dropped)
      for (let i = 0; i < this.parts; i++) this.server.push(l, {}, 0);
  }

  /**
   * During training, hands each layer gradient the devices push (as many as each device's
   * schedule has push_grads) to the server; then, should an optimizer thread fail, stops the
   * run (a device would be left waiting for that layer).
   */
  async serve(run: HomeStep, devices: CoordinatorDevices): Promise<void> {
    if (!run.training) return;
    const { k } = devices;
    const pushesOf = run.schedule.map(
      (acts) => acts.filter((a) => a.op === 'push_grads').length,
    );
    await Promise.all(
      devices.all.map(async (w, g) => {
        for (let i = 0; i < pushesOf[g % k]!; i++) {
          const lg = await w.recvLayerGrads();
          this.server.push(lg.layer, lg.grads, lg.sumSquares);
        }
      }),
    );
    this.server.idle().catch((e: Error) => run.fail(e));
  }

  /** The server's updates finished since the last report and f16's verdict (at the step's last push). */
  report(): Partial<StepReport> {
    const scaled = this.server.lastLossScale;
    return {
      serverSpans: this.server.takeSpans(),
      ...(scaled
        ? {
            lossScale: scaled.scale,
            skipped: scaled.skipped,
            overflows: scaled.overflows,
          }
        : {}),
    };
  }

  settle(): Promise<void> {
    return this.server.idle();
  }

  getParams(): Promise<HostParams> {
    return this.server.getParams();
  }

  getOptimizerState(): Promise<OptimizerState> {
    return this.server.getOptimizerState();
  }

  setOptimizerState(s: OptimizerState): Promise<void> {
    return this.server.setOptimizerState(s);
  }

  lossScaleState(): LossScaleState | undefined {
    return this.server.lossScaleState();
  }

  setLossScaleState(s: LossScaleState): void {
    this.server.setLossScaleState(s);
  }

  close(): Promise<void> {
    return this.server.close();
  }
}

/**
 * The relay as a stage kind: each device relays its stage's layers (pipeline/relay-stage.ts)
 * on one device in the relay's layer-major order (each layer uploaded once per pass), on K the
 * stage schedule's micro-batches through each stage's layers; a step's schedule lists only
 * the layers it keeps (LayerDrop).
 */
export function relayPipeline(
  layers: number,
  ranges: readonly StageRange[],
  opts: { microBatches: number; schedule?: ScheduleKind },
  relay: RelayOptions,
): PipelineKind {
  const m = opts.microBatches;
  const k = ranges.length;
  const trainWithout = (dropped: ReadonlySet<number>): Schedule =>
    k === 1
      ? relaySchedule(layers, m, dropped)
      : relayPipelineTraining(opts.schedule ?? 'gpipe', m, ranges, dropped);
  return {
    train: trainWithout(new Set()),
    trainWithout,
    eval:
      k === 1
        ? relayEvalSchedule(layers, m)
        : relayPipelineSchedule(evalSchedule(m, k), ranges),
    stage: () => ({ module: 'pipeline/relay-stage.js', options: relay }),
    labelsOnEveryStage: false,
    freeRunning: false,
  };
}

/**
 * L2L: the coordinator (coordinator.ts) running the relay stage kind ({@link relayPipeline})
 * with its parameters in the parameter server ({@link ServerParameters}).
 */
export class L2LStrategy extends Coordinator {
  private constructor(
    opts: CoordinatorOptions,
    workers: Device[],
    home: ServerParameters,
    private readonly server: ParameterServer,
  ) {
    super(opts, workers, home);
  }

  /**
   * Starts the parameter server (its optimizer threads, with `params` copied into shared host
   * memory, or adopted with `adoptParams`) and the device workers (one per range and replica,
   * each replica's neighbours linked). Throws (after stopping them all) if any fails to start.
   */
  static async create(
    opts: L2LOptions,
    model: Model,
    params: HostParams,
  ): Promise<L2LStrategy> {
    const { layers, shapes } = blockLayers(model.blocks);
    const server = await ParameterServer.create({
      params,
      layers,
      shapes,
      optimizer: opts.optimizer,
      threads: opts.serverThreads,
      adopt: opts.adoptParams,
      lowPrecision: lowPrecisionKeys(model, opts.precision),
      precision: opts.precision,
      lossScale: opts.lossScale,
    });
    const ranges = opts.ranges ?? [{ from: 0, to: layers.length }];
    const k = ranges.length;
    const replicas = opts.replicas ?? 1;
    const m = opts.microBatches;
    const relay: RelayOptions = {
      layout: server.layout,
      stash: opts.stash,
      traceGpu: opts.traceGpu,
      // the server takes the norm of what it sums (or scales) itself
      deviceNorm: k === 1 && replicas === 1 && opts.lossScale === undefined,
    };
    const run: CoordinatorOptions = {
      name: 'l2l',
      backend: opts.backend,
      model: opts.model,
      ranges,
      microBatches: m,
      optimizer: opts.optimizer,
      kind: relayPipeline(layers.length, ranges, opts, relay),
      deviceMemory: opts.deviceMemory,
      oomAdvice: l2l.outOfMemoryAdvice({ stash: opts.stash }),
      threads: opts.threads,
      precision: opts.precision,
      replicas,
      seed: opts.seed,
    };
    // the pushes that make up a layer's gradient: per micro-batch on K > 1, per replica
    const home = new ServerParameters(server, (k === 1 ? 1 : m) * replicas);
    return Coordinator.start(
      run,
      home,
      (workers) => new L2LStrategy(run, workers, home, server),
    );
  }

  /** Waits for the last step and the parameter server's updates; the spans not yet reported. */
  async drainServerSpans(): Promise<ServerSpan[]> {
    await this.settle();
    return this.server.takeSpans();
  }
}

/**
 * Under a policy with parameter copies, the keys of the parameters the products read: their
 * weights also live as such copies in the server (backend/precision.ts storage.params),
 * shipped as such. Undefined otherwise.
 */
function lowPrecisionKeys(
  model: Model,
  precision: Precision | undefined,
): Set<string> | undefined {
  if (!isNarrow(policyOf(precision ?? 'fp32'), 'params')) return undefined;
  return new Set(
    model.blocks.flatMap((b, bi) =>
      b.params.filter(readByProducts).map((spec) => paramKey(bi, spec.name)),
    ),
  );
}

/**
 * The l2l strategy: the relay above on one device, or pipelined on `--stages K` devices (each
 * relaying its stage's layers), the model and optimizer in host memory.
 */
export const l2l: StrategySpec = {
  name: 'l2l',
  help: 'L2L layer-to-layer relay: parameters and optimizer in host memory (the eager parameter server), one layer at a time on a device; --stages K pipelines K relaying devices',
  exact: true,
  oneDevice: false,
  anyStages: true,
  layerDrop: true,
  validate(cfg) {
    const k = cfg.stages;
    check(
      cfg.devices === undefined ||
        parseDevices(cfg.devices, k, cfg.replicas).every(
          (d) => d.kind === 'thread',
        ),
      `--strategy l2l keeps its parameter server in memory it shares with its devices, worker threads; drop --devices ${cfg.devices}`,
    );
    check(
      k === 1 || RELAY_PIPELINE_SCHEDULES.includes(cfg.schedule),
      `--strategy l2l --stages ${k} pipelines its relay on --schedule ${RELAY_PIPELINE_SCHEDULES.join(' or ')}, not ${cfg.schedule} (a relayed layer's backward is not split, and each device relays one stage)`,
    );
  },
  create: (cfg, model, params, ranges) =>
    L2LStrategy.create(
      {
        backend: cfg.backend,
        model: model.config,
        ranges,
        schedule: cfg.schedule,
        replicas: cfg.replicas,
        microBatches: cfg.microBatches,
        optimizer: optimizerConfigOf(cfg),
        stash: cfg.stash,
        serverThreads: cfg.serverThreads,
        deviceMemory: cfg.deviceMemory,
        threads: threadsPerDevice(cfg, cfg.stages * cfg.replicas),
        precision: cfg.precision,
        seed: cfg.seed,
        lossScale: lossScalingOf(cfg),
        traceGpu: cfg.trace !== undefined,
      },
      model,
      params,
    ),
  memory: {
    microBatch: microBatchSize,
    // parameters and optimizer state live in host memory, so the optimizer's slots do not count
    predictPeakBytes: (profile, cfg, ranges) => {
      const costs = costsAt(profile, microBatchSize(cfg));
      const shape = { m: cfg.microBatches, stash: cfg.stash };
      return ranges.length > 1
        ? predictRelayPipelinePeakBytes(costs, ranges, {
            ...shape,
            schedule: cfg.schedule,
          })
        : [predictRelayPeakBytes(costs, shape)];
    },
  },
  /**
   * Searches M and the stash place. Its peak holds about one layer's parameters and gradient
   * plus one layer boundary's activations (host stash), so it fits where nothing else does; its
   * time adds the re-computation of every layer, and the step waits for the parameter server
   * when its host optimizer is slower than the device (cost/time.ts).
   */
  plan(profile, req) {
    const ms =
      req.microBatches !== undefined
        ? [req.microBatches]
        : divisors(req.batchSize);
    let best: StrategyPlan | null = null;
    const n = profile.blocks.length;
    /** A relay plan from its shape, predicted peaks and step time (the rest is the relay's). */
    const consider = (
      shape: Pick<
        StrategyPlan,
        | 'stages'
        | 'microBatches'
        | 'schedule'
        | 'balance'
        | 'balancedBy'
        | 'idealBubble'
        | 'stash'
      > & { display: string },
      peakBytes: number[],
      t: StepTime,
    ) => {
      const perSecond = t.seconds > 0 ? req.batchSize / t.seconds : Infinity;
      const p: StrategyPlan = {
        ...shape,
        strategy: 'l2l',
        exact: true,
        fits: peakBytes.every((b) => b <= req.deviceMemory),
        remat: 'always',
        peakBytes,
        stepSeconds: t.seconds,
        bubble: t.bubble,
        examplesPerSecond: perSecond,
        tokensPerSecond: perSecond * (req.tokensPerExample ?? 1),
        display: { remat: 'always', schedule: shape.display },
      };
      if (!best || better(p, best)) best = p;
    };
    for (const m of ms) {
      const costs = costsAt(profile, req.batchSize / m);
      // the pipelined relay on the request's K devices: layers balanced by time, gpipe or 1F1B
      if (req.stages >= 2 && req.stages <= n) {
        const k = req.stages;
        const balance = balanceByCost(
          costs.blocks.map((b) => 2 * b.fwdSeconds + b.bwdSeconds),
          k,
        );
        const ranges = stageRanges(balance);
        for (const schedule of RELAY_PIPELINE_SCHEDULES)
          for (const stash of ['host', 'device'] as const) {
            const shape = { m, stash, schedule };
            consider(
              {
                stages: k,
                microBatches: m,
                schedule,
                balance,
                balancedBy: 'time',
                idealBubble: idealBubble(m, k),
                stash,
                display: `${schedule} relay, stash ${stash}`,
              },
              predictRelayPipelinePeakBytes(costs, ranges, shape),
              predictRelayPipelineStepTime(costs, ranges, shape),
            );
          }
      }
      for (const stash of ['host', 'device'] as const)
        consider(
          {
            stages: 1,
            microBatches: m,
            schedule: 'gpipe',
            balance: [n],
            balancedBy: 'one layer at a time',
            idealBubble: 0,
            stash,
            display: `relay, stash ${stash}`,
          },
          [predictRelayPeakBytes(costs, { m, stash })],
          predictRelayStepTime(costs, { m, stash, clip: req.clip ?? true }),
        );
    }
    return best!;
  },
  planNote:
    "l2l's step is the device's work (every layer re-computed in backward) plus the part of the parameter server's host updates that the device's work does not hide",
  flags: (p) =>
    `--strategy l2l --micro-batches ${p.microBatches} --stash ${p.stash}` +
    (p.stages > 1
      ? ` --stages ${p.stages} --schedule ${p.schedule} --balance ${p.balance.join(',')}`
      : ''),
  outOfMemoryAdvice: (cfg) =>
    `try a smaller --batch-size or more --micro-batches${cfg.stash === 'host' ? '' : ', or --stash host'}`,
  describeRun(cfg: TrainConfig, bytes: number) {
    const slots = cfg.optimizer === 'adamw' ? 2 : 1;
    return (
      `l2l${cfg.stages > 1 ? ` on ${cfg.stages} pipelined devices (schedule ${cfg.schedule})` : ''}${cfg.replicas > 1 ? `, ${cfg.replicas} replicas` : ''}: ${cfg.microBatches} micro-batch(es) of ${microBatchSize(cfg)}, stash in ${cfg.stash} memory; ` +
      `the parameter server holds ${formatSize(bytes * (1 + slots))} of parameters and optimizer state in host memory (${cfg.serverThreads} optimizer thread(s))`
    );
  },
};
