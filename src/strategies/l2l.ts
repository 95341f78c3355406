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
import type { Batch } from '../data/batcher.js';
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
import { StageWorker } from '../runtime/device.js';
import { parseDevices } from '../runtime/devices.js';
import { linkNeighbours } from '../runtime/links.js';
import type { StageStepResult } from '../runtime/protocol.js';
import { transferables } from '../runtime/serialize.js';
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
import { type StrategySpec, threadsPerDevice } from './spec.js';
import {
  evaluateBatches,
  mergeReplicas,
  stepReport,
  submission,
} from './stage-results.js';
import { stepMessages } from './step-messages.js';
import type {
  Evaluation,
  StepReport,
  Strategy,
  Submission,
} from './strategy.js';

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

export class L2LStrategy implements Strategy {
  readonly name = 'l2l';
  readonly devices: number;
  private readonly train: Schedule;
  private readonly layers: number;
  private readonly ranges: StageRange[];
  /** Devices of one replica (its stages) K, and the replicas R: devices = R*K, replica r on r*K .. r*K+K-1. */
  private readonly k: number;
  private readonly replicas: number;
  /** The previous step; steps run one after another on the one device. */
  private last: Promise<unknown> = Promise.resolve();
  private failure: Error | null = null;
  private closed = false;

  private constructor(
    private readonly opts: L2LOptions,
    model: Model,
    private readonly workers: StageWorker[],
    private readonly server: ParameterServer,
  ) {
    this.layers = model.blocks.length;
    this.ranges = opts.ranges ?? [{ from: 0, to: this.layers }];
    this.k = this.ranges.length;
    this.replicas = opts.replicas ?? 1;
    this.devices = this.k * this.replicas;
    this.train = this.trainSchedule(new Set());
  }

  /**
   * The training schedule without the layers in `dropped`: on one device the relay's
   * layer-major order (each layer uploaded once per pass); on K, the stage schedule's
   * micro-batches through each stage's layers.
   */
  private trainSchedule(dropped: ReadonlySet<number>): Schedule {
    const m = this.opts.microBatches;
    if (this.k === 1) return relaySchedule(this.layers, m, dropped);
    return relayPipelineTraining(
      this.opts.schedule ?? 'gpipe',
      m,
      this.ranges,
      dropped,
    );
  }

  private evalSchedule(): Schedule {
    const m = this.opts.microBatches;
    if (this.k === 1) return relayEvalSchedule(this.layers, m);
    return relayPipelineSchedule(evalSchedule(m, this.k), this.ranges);
  }

  /**
   * Starts the parameter server (its optimizer threads, with `params` copied into shared host
   * memory, or adopted with `adoptParams`) and the device workers (one per range, neighbours
   * linked). Throws (after stopping them all) if any fails to start.
   */
  static async create(
    opts: L2LOptions,
    model: Model,
    params: HostParams,
  ): Promise<L2LStrategy> {
    const { layers, shapes } = blockLayers(model.blocks);
    // a policy with parameter copies: the products' weights also live as such copies in the
    // server (backend/precision.ts storage.params), shipped as such
    const lowPrecision = isNarrow(policyOf(opts.precision ?? 'fp32'), 'params')
      ? new Set(
          model.blocks.flatMap((b, bi) =>
            b.params
              .filter(readByProducts)
              .map((spec) => paramKey(bi, spec.name)),
          ),
        )
      : undefined;
    const server = await ParameterServer.create({
      params,
      layers,
      shapes,
      optimizer: opts.optimizer,
      threads: opts.serverThreads,
      adopt: opts.adoptParams,
      lowPrecision,
      lossScale: opts.lossScale,
    });
    const ranges = opts.ranges ?? [{ from: 0, to: layers.length }];
    const k = ranges.length;
    const replicas = opts.replicas ?? 1;
    const workers = Array.from(
      { length: k * replicas },
      (_, g) => new StageWorker(g),
    );
    const s = new L2LStrategy(opts, model, workers, server);
    try {
      // each replica's pipeline links; the replicas meet in the parameter server, not over links
      const links = Array.from({ length: replicas }, (_, r) =>
        linkNeighbours(workers.slice(r * k, (r + 1) * k)),
      ).flat();
      await Promise.all(
        workers.map((w, g) => {
          const d = g % k;
          const { prev, next, transfer } = links[g]!;
          return w.call(
            'init',
            {
              index: d,
              backend: opts.backend,
              threads: opts.threads,
              precision: opts.precision,
              model: opts.model,
              range: ranges[d]!,
              params: {},
              optimizer: opts.optimizer,
              stage: {
                module: 'pipeline/relay-stage.js',
                options: {
                  layout: server.layout,
                  stash: opts.stash,
                  traceGpu: opts.traceGpu,
                  // the server takes the norm of what it sums (or scales) itself
                  deviceNorm:
                    k === 1 && replicas === 1 && opts.lossScale === undefined,
                } satisfies RelayOptions,
              },
              deviceMemory: opts.deviceMemory,
              strategy: 'l2l',
              oomAdvice: l2l.outOfMemoryAdvice({ stash: opts.stash }),
              prev,
              next,
              ...(replicas > 1
                ? { replica: { index: Math.floor(g / k), count: replicas } }
                : {}),
            },
            transfer,
          );
        }),
      );
    } catch (e) {
      await s.close();
      throw e;
    }
    return s;
  }

  /**
   * Runs one schedule on the devices; during training, forwards each layer gradient to the
   * parameter server. Rejects with the strategy's first failure: an optimizer thread's failure
   * stops the devices too, and the cause is reported, not the stop.
   */
  private async run(
    schedule: Schedule,
    batch: Batch,
    lr: number,
    training: boolean,
    dropped: readonly number[] = [],
    step?: number,
  ): Promise<StageStepResult[]> {
    try {
      return await this.runOnDevice(
        schedule,
        batch,
        lr,
        training,
        dropped,
        step,
      );
    } catch (e) {
      throw this.failure ?? e;
    }
  }

  private async runOnDevice(
    schedule: Schedule,
    batch: Batch,
    lr: number,
    training: boolean,
    dropped: readonly number[],
    step: number | undefined,
  ): Promise<StageStepResult[]> {
    if (this.failure) throw this.failure;
    const m = this.opts.microBatches;
    const k = this.k;
    const replicas = this.replicas; // each on its share of the batch
    // each device's pushes, as its schedule says (a pipelined relay pushes per micro-batch)
    const pushesOf = schedule.map(
      (acts) => acts.filter((a) => a.op === 'push_grads').length,
    );
    // the pushes that make up a layer's gradient: per micro-batch on K > 1, per replica
    const parts = (k === 1 ? 1 : m) * replicas;
    if (training) {
      this.server.beginStep(lr, parts);
      // a layer LayerDrop skips has no gradient: the server leaves it (and its AdamW state) as is
      for (const l of dropped)
        for (let i = 0; i < parts; i++) this.server.push(l, {}, 0);
    }
    const messages = stepMessages({
      schedule,
      batch,
      m,
      k,
      replicas,
      lr,
      inputDevice: 0,
      takesLabels: (d) => d === k - 1,
      dropped,
      ...(training && step !== undefined
        ? { noise: { seed: this.opts.seed ?? 0, step } }
        : {}),
      ...(training ? { lossScale: this.server.lossScale } : {}),
    });
    const calls = this.workers.map((w, g) =>
      w.call('step', messages[g]!.step, transferables(messages[g]!.transfer)),
    );
    const all = Promise.all(calls);
    if (!training) return this.stopOnFailure(all);
    const pushes = Promise.all(
      this.workers.map(async (w, g) => {
        for (let i = 0; i < pushesOf[g % k]!; i++) {
          const lg = await w.recvLayerGrads();
          this.server.push(lg.layer, lg.grads, lg.sumSquares);
        }
      }),
    ).then(() => {
      // a failing optimizer thread would leave a device waiting for a layer: stop everything
      this.server.idle().catch((e: Error) => this.fail(e));
    });
    pushes.catch(() => undefined); // a failing device is reported through `all`
    const [rs] = await this.stopOnFailure(Promise.all([all, pushes]));
    return rs;
  }

  /** A failing device leaves its neighbours waiting for it: stop every device, then reject. */
  private async stopOnFailure<T>(p: Promise<T>): Promise<T> {
    try {
      return await p;
    } catch (e) {
      if (this.devices > 1) await this.close();
      throw e;
    }
  }

  private async fail(e: Error): Promise<void> {
    this.failure ??= e;
    await this.close();
  }

  submit(
    batch: Batch,
    lr: number,
    dropped: readonly number[] = [],
    step?: number,
  ): Submission {
    // LayerDrop: the relay loads, computes and pushes only the layers this step keeps
    const done = this.last
      .catch(() => undefined)
      .then(async () => {
        const schedule = dropped.length
          ? this.trainSchedule(new Set(dropped))
          : this.train;
        const rs = await this.run(schedule, batch, lr, true, dropped, step);
        const scaled = this.server.lastLossScale; // f16: decided at the step's last push
        return {
          // the bubble: the time a device waited for the parameter server or its neighbours;
          // with replicas, the loss is the mean over every replica's micro-batches
          ...stepReport(rs, this.k - 1, this.k),
          serverSpans: this.server.takeSpans(),
          ...(scaled
            ? {
                lossScale: scaled.scale,
                skipped: scaled.skipped,
                overflows: scaled.overflows,
              }
            : {}),
        };
      });
    done.catch(async () => {
      await this.close();
    });
    this.last = done;
    return submission(done);
  }

  trainStep(batch: Batch, lr: number): Promise<StepReport> {
    return this.submit(batch, lr).done;
  }

  async evaluate(batches: Batch[]): Promise<Evaluation> {
    const ev = this.last
      .catch(() => undefined)
      .then(() => {
        const sched = this.evalSchedule();
        return evaluateBatches(
          batches,
          async (b) =>
            mergeReplicas(await this.run(sched, b, 0, false), this.k),
          false,
        );
      });
    this.last = ev; // later steps wait for the evaluation (a device runs one schedule at a time)
    return ev;
  }

  /** Waits for the last step and for the parameter server to apply every update. */
  private async settle(): Promise<void> {
    await this.last;
    await this.server.idle();
    if (this.failure) throw this.failure;
  }

  async drainServerSpans(): Promise<ServerSpan[]> {
    await this.settle();
    return this.server.takeSpans();
  }

  async getParams(): Promise<HostParams> {
    await this.settle();
    return this.server.getParams();
  }

  async getOptimizerState(): Promise<OptimizerState> {
    await this.settle();
    return this.server.getOptimizerState();
  }

  async setOptimizerState(s: OptimizerState): Promise<void> {
    await this.settle();
    await this.server.setOptimizerState(s);
  }

  lossScaleState(): LossScaleState | undefined {
    return this.server.lossScaleState();
  }

  setLossScaleState(s: LossScaleState): void {
    this.server.setLossScaleState(s);
  }

  async close(): Promise<void> {
    if (this.closed) return;
    this.closed = true;
    await Promise.all([
      ...this.workers.map((w) => w.terminate()),
      this.server.close(),
    ]);
  }
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
