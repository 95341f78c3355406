/**
 * The runner of every strategy whose model is cut into stages on worker-thread devices
 * (single, gpipe, local): one device (worker thread, own TF.js engine) per stage, neighbours
 * linked directly; each step splits the mini-batch into M micro-batches and sends every stage
 * its list of the schedule, which the stage's executor runs against the stage kind the
 * strategy names; an all-reduce of the gradient norm joins the stages when the schedule has
 * one. What differs between the strategies is data ({@link PipelineKind}): the schedules, the
 * stage kind, where labels go and whether stages run free across mini-batches.
 */

import type { Precision } from '../backend/names.js';
import { optimizerConfigOf, type TrainConfig } from '../config/config.js';
import type { Batch } from '../data/batcher.js';
import type { HostParams } from '../model/init.js';
import type { Model, ModelConfig } from '../model/model.js';
import {
  initialLossScale,
  type LossScaleState,
  lossScaleStep,
} from '../optim/loss-scale.js';
import {
  clipScale,
  type OptimizerConfig,
  type OptimizerState,
} from '../optim/optimizer.js';
import type { StageRange } from '../partition/balance.js';
import type { StageKindRef } from '../pipeline/stage-kind.js';
import { type Device, StageError } from '../runtime/device.js';
import {
  type DeviceOptions,
  type DeviceSpec,
  openDevices,
} from '../runtime/devices.js';
import { linkReplicas } from '../runtime/links.js';
import type { StageStepResult } from '../runtime/protocol.js';
import { copyWire, transferables } from '../runtime/serialize.js';
import {
  type Action,
  needsWrapLink,
  type Schedule,
} from '../schedule/schedule.js';
import { describeFaults } from './numeric-fault.js';
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

/** What a strategy runs on its stages (see gpipe.ts backpropPipeline, local.ts localPipeline). */
export interface PipelineKind {
  /** The training schedule: per stage, its actions for one mini-batch. */
  train: Schedule;
  /** The evaluation schedule (forward only). */
  eval: Schedule;
  /** Run after the last submitted step before evaluation or reading state, to collect outstanding work (local parallelism's free-running overlap). */
  flush?: Schedule;
  /** The stage kind of stage i of `stages`. */
  stage(i: number, stages: number): StageKindRef;
  /** Whether every stage gets the labels (local losses), not only the last. */
  labelsOnEveryStage: boolean;
  /** Whether the next mini-batch may be submitted as soon as the first stage is done with this one (stages run free). */
  freeRunning: boolean;
}

export interface PipelineOptions {
  /** Strategy name, for reports and messages. */
  name: string;
  backend: string;
  model: ModelConfig;
  /** Blocks of each stage. */
  ranges: StageRange[];
  microBatches: number;
  optimizer: OptimizerConfig;
  kind: PipelineKind;
  /** Device memory budget per stage, bytes: a stage fails as soon as its engine holds more. */
  deviceMemory?: number;
  /** What the out-of-memory message suggests. */
  oomAdvice?: string;
  /** Threads of each device's kernels (see initBackend). */
  threads?: number;
  /** Compute precision of every device's products (see initBackend); default fp32. */
  precision?: Precision;
  /** What each device is (runtime/devices.ts); default a worker thread each. */
  devices?: DeviceSpec[];
  /**
   * The device of each stage (schedule/schedule.ts placementOf: several stages per device for
   * interleaved and V-shape schedules); default stage s on device s.
   */
  placement?: number[];
  /**
   * Data-parallel replicas R (default 1): R copies of the pipeline, replica r on devices
   * r*K .. r*K+K-1 (`devices` lists all R*K), each on its 1/R of every mini-batch (micro-batches
   * r*M .. r*M+M-1 of the mini-batch cut in R*M); before the step, each stage's gradients are
   * summed across its replicas by a ring all-reduce (all_reduce_grads), so every replica makes
   * the same update, single-device training's on the whole mini-batch.
   */
  replicas?: number;
  /**
   * f16: dynamic loss scaling (optim/loss-scale.ts) from this initial scale: each step's
   * losses are scaled by the current scale, an overflowing step is skipped (nothing updated)
   * and the scale halved. Absent: no loss scaling.
   */
  lossScaling?: number;
  /**
   * The run's seed (--seed): training steps given their step index draw their Dropout noise
   * from it, per example (model/noise.ts). Default 0.
   */
  seed?: number;
}

/**
 * The options every pipeline takes from the run as they are: the backend, the model, the
 * stages' block ranges, the optimizer, the device-memory budget, the precision and the seed.
 * Each strategy adds what is its own (name, kind, micro-batches, devices, threads, advice).
 */
export function runOptionsOf(
  cfg: TrainConfig,
  model: Model,
  ranges: StageRange[],
): Pick<
  PipelineOptions,
  | 'backend'
  | 'model'
  | 'ranges'
  | 'optimizer'
  | 'deviceMemory'
  | 'precision'
  | 'seed'
> {
  return {
    backend: cfg.backend,
    model: model.config,
    ranges,
    optimizer: optimizerConfigOf(cfg),
    deviceMemory: cfg.deviceMemory,
    precision: cfg.precision,
    seed: cfg.seed,
  };
}

/** How long a failed step waits for the other stages' outcomes, to report the root cause, ms. */
const ROOT_CAUSE_WAIT_MS = 2000;

/**
 * The error to report for a failed step: a lost device (its process died, its link was cut:
 * a StageError the device handle raised, without a cause from inside the stage) rather than a
 * neighbour's complaint that its link to that device broke, which often arrives first.
 * Only after such a complaint, waits up to {@link ROOT_CAUSE_WAIT_MS} for another stage's
 * device-lost error (returned as soon as it arrives).
 */
async function rootCause(
  calls: ReadonlyArray<Promise<unknown>>,
  first: unknown,
): Promise<unknown> {
  // only a broken link points elsewhere; any other failure is its own cause
  if (!(first instanceof StageError) || first.causeName !== 'LinkLostError')
    return first;
  const isRoot = (e: unknown): boolean =>
    e instanceof StageError && e.causeName === undefined;
  // the first device-lost error among the other stages, as soon as one arrives (a stage still
  // waiting for its lost neighbour may never settle), else `first` once all have settled or
  // the wait is over
  const root = await Promise.race([
    ...calls.map((c) =>
      c.then(
        () => new Promise<never>(() => undefined),
        (e: unknown) => (isRoot(e) ? e : new Promise<never>(() => undefined)),
      ),
    ),
    Promise.allSettled(calls).then(() => first),
    new Promise<unknown>((r) =>
      setTimeout(() => r(first), ROOT_CAUSE_WAIT_MS).unref(),
    ),
  ]);
  return root;
}

/** The stage that owns a parameter key (`<block>.<name>` or `aux<stage>.<name>`). */
export function ownerStage(key: string, ranges: readonly StageRange[]): number {
  const prefix = key.slice(0, key.indexOf('.'));
  if (prefix.startsWith('aux')) return Number(prefix.slice(3));
  const block = Number(prefix);
  return ranges.findIndex((r) => block >= r.from && block < r.to);
}

/** The device of each stage of a pipeline's options: its placement, or stage s on device s. */
function placementOf(opts: PipelineOptions): number[] {
  const p = opts.placement ?? opts.ranges.map((_, s) => s);
  if (p.length !== opts.ranges.length)
    throw new Error(
      `a placement of ${p.length} stages for ${opts.ranges.length} stage ranges`,
    );
  return p;
}

/**
 * What a step's gradient-norm all-reduce found: `sums`, each device's squared gradient norm
 * where one was not finite (a numeric fault to locate); `scaled`, f16's loss scale of the step
 * and whether the step was skipped.
 */
type StepFault = {
  sums?: number[];
  scaled?: { scale: number; skipped: boolean };
};

export class PipelineStrategy implements Strategy {
  readonly name: string;
  readonly devices: number;
  /** Devices of one replica K, and replicas R (devices = R*K). */
  private readonly k: number;
  private readonly replicas: number;
  private readonly train: Schedule;
  /** f16's dynamic loss scale (null: no loss scaling). */
  private scaler: LossScaleState | null;
  /** The device of each stage. */
  private readonly placement: number[];
  private closed = false;
  /** Schedules sent to the stages that have not finished yet. */
  private readonly inflight = new Set<Promise<unknown>>();

  private constructor(
    private readonly opts: PipelineOptions,
    private readonly workers: Device[],
  ) {
    this.name = opts.name;
    this.devices = workers.length;
    this.placement = placementOf(opts);
    this.replicas = opts.replicas ?? 1;
    const k = workers.length / this.replicas;
    this.k = k;
    if (opts.kind.train.length !== k)
      throw new Error(
        `a schedule of ${opts.kind.train.length} stages for ${k} devices`,
      );
    this.train =
      this.replicas > 1 ? withAllReduce(opts.kind.train) : opts.kind.train;
    this.scaler =
      opts.lossScaling !== undefined
        ? initialLossScale(opts.lossScaling)
        : null;
  }

  /** f16: the loss scaler's state (for checkpoints); undefined without loss scaling. */
  lossScaleState(): LossScaleState | undefined {
    return this.scaler ? { ...this.scaler } : undefined;
  }

  /** f16: continues from a checkpoint's loss scaler state (ignored without loss scaling). */
  setLossScaleState(s: LossScaleState): void {
    if (this.scaler) this.scaler = { ...s };
  }

  /**
   * Starts one device per stage, links neighbours (runtime/links.ts, whatever the devices are)
   * and uploads each stage's initial parameters. Throws (after stopping the workers) if any stage fails to start.
   */
  static async create(
    opts: PipelineOptions,
    params: HostParams,
  ): Promise<PipelineStrategy> {
    const n = opts.ranges.length;
    const placement = placementOf(opts);
    const k = Math.max(...placement) + 1;
    const replicas = opts.replicas ?? 1;
    const specs =
      opts.devices ??
      Array.from({ length: k * replicas }, () => ({ kind: 'thread' as const }));
    if (specs.length !== k * replicas)
      throw new Error(
        `${specs.length} devices for ${replicas} replica(s) of ${k} devices`,
      );
    // interleaved schedules past 2 devices: the last device sends to the first
    const wrap = needsWrapLink(placement);
    const workers = await openDevices(specs, undefined, opts.threads);
    const s = new PipelineStrategy(opts, workers);
    try {
      const links = linkReplicas(workers, k, wrap);
      await Promise.all(
        workers.map((w, g) => {
          const d = g % k; // the device within its replica
          const r = Math.floor(g / k);
          const stages = placement
            .map((dev, i) => (dev === d ? i : -1))
            .filter((i) => i >= 0)
            .map((i) => {
              const own: Record<string, Float32Array> = {};
              for (const [key, v] of params)
                if (ownerStage(key, opts.ranges) === i) own[key] = v.slice();
              return {
                index: i,
                range: opts.ranges[i]!,
                params: own,
                stage: opts.kind.stage(i, n),
              };
            });
          const first = stages[0]!;
          const { prev, next, replicaPrev, replicaNext, transfer } = links[g]!;
          return w.call(
            'init',
            {
              ...first,
              backend: (specs[g] as DeviceOptions).backend ?? opts.backend,
              threads: (specs[g] as DeviceOptions).threads ?? opts.threads,
              precision: opts.precision,
              model: opts.model,
              optimizer: opts.optimizer,
              ...(stages.length > 1 || opts.placement
                ? { stages, device: d, placement }
                : {}),
              prev,
              next,
              ...(replicas > 1
                ? {
                    replica: { index: r, count: replicas },
                    replicaPrev,
                    replicaNext,
                  }
                : {}),
              deviceMemory: opts.deviceMemory,
              strategy: opts.name,
              oomAdvice: opts.oomAdvice,
            },
            [
              ...stages.flatMap((st) =>
                Object.values(st.params).map((a) => a.buffer as ArrayBuffer),
              ),
              ...transfer,
            ],
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
   * Sends one schedule to every stage (with the batch's micro-batches, if any) of every
   * replica (each on its share of the batch); all-reduces the gradient norm when the schedule
   * has a reduce_grad_norm. `first` resolves when stage 0 is done, `all` when every stage is
   * (results in device order). If a stage fails, every worker is stopped and both reject.
   */
  private dispatch(
    schedule: Schedule,
    batch: Batch | null,
    lr: number,
    diagnose = false,
    dropped?: readonly number[],
    stepIndex?: number,
  ): {
    first: Promise<unknown>;
    all: Promise<StageStepResult[]>;
    fault: StepFault;
  } {
    const fault: StepFault = {};
    const calls = this.sendSteps(
      schedule,
      batch,
      lr,
      diagnose,
      dropped,
      stepIndex,
    );
    const reduce = schedule.some((acts) =>
      acts.some((a) => a.op === 'reduce_grad_norm'),
    );
    const all = this.collect(calls, reduce, diagnose, fault);
    all.catch(() => undefined); // handled by whoever awaits it; never an unhandled rejection
    const first = calls[0].catch(async (e) => {
      await all; // the strategy is stopped before `first` rejects, with the run's root cause
      throw e;
    });
    first.catch(() => undefined);
    this.inflight.add(all);
    all.finally(() => this.inflight.delete(all)).catch(() => undefined);
    return { first, all, fault };
  }

  /**
   * Calls 'step' on every worker with `schedule`'s list for its device: replica r gets
   * micro-batches r*M .. r*M+M-1 of the batch cut in R*M (inputs to the first stage's device,
   * labels to the loss device's, or to every device where the kind wants them), the step's
   * learning rate, loss scale (f16; 1 when diagnosing), LayerDrop's dropped blocks and, for a
   * training step with its index, where its examples sit for the noise. Returns the calls, in
   * device order.
   */
  private sendSteps(
    schedule: Schedule,
    batch: Batch | null,
    lr: number,
    diagnose: boolean,
    dropped: readonly number[] | undefined,
    stepIndex: number | undefined,
  ): Promise<StageStepResult>[] {
    const messages = stepMessages({
      schedule,
      batch,
      m: this.opts.microBatches,
      k: this.k,
      replicas: this.replicas,
      lr,
      inputDevice: this.placement[0]!,
      takesLabels: (d) =>
        d === this.lossDevice() || this.opts.kind.labelsOnEveryStage === true,
      copyLabels: copyWire,
      dropped,
      // f16: this step's loss scale (a diagnosis reruns a step at scale 1)
      lossScale: this.scaler && !diagnose ? this.scaler.scale : 1,
      diagnose,
      ...(stepIndex !== undefined
        ? { noise: { seed: this.opts.seed ?? 0, step: stepIndex } }
        : {}),
    });
    return this.workers.map((w, g) =>
      w.call('step', messages[g]!.step, transferables(messages[g]!.transfer)),
    );
  }

  /**
   * Waits for every stage's result of the step (`calls`, in device order); where the schedule
   * has a reduce_grad_norm (`reduce`), first answers the stages' squared gradient norms with
   * the scale ({@link answerNorms}, recording in `fault` what it found). If a stage fails, stops
   * every worker and rejects with the run's root cause ({@link rootCause}).
   */
  private async collect(
    calls: Promise<StageStepResult>[],
    reduce: boolean,
    diagnose: boolean,
    fault: StepFault,
  ): Promise<StageStepResult[]> {
    const everything = Promise.all(calls);
    try {
      if (reduce) {
        const norms = Promise.all(
          this.workers.map((w) => w.recvGradNorm()),
        ).then((sq) => this.answerNorms(sq, diagnose, fault));
        norms.catch(() => undefined); // a failing stage is reported through `everything`
        // a stage that fails before its norm rejects `everything`, which ends the wait
        await Promise.race([norms, everything]);
      }
      return await everything;
    } catch (e) {
      everything.catch(() => undefined);
      const root = await rootCause(calls, e);
      await this.close();
      throw root;
    }
  }

  /**
   * Sends every worker the step's clipping scale from the stages' squared gradient norms `sq`
   * (one per device, in device order; replicas hold the same sums, so replica 0's count): NaN
   * where any is not finite (or when diagnosing), so that no stage updates; under f16 loss
   * scaling, the scaler's verdict (an overflow skips the step and halves the scale). Records in
   * `fault` the per-device sums of a numeric fault and the loss scale used.
   */
  private answerNorms(sq: number[], diagnose: boolean, fault: StepFault): void {
    // replicas hold the same summed gradients: the norm is replica 0's stages'
    const own = sq.slice(0, this.k);
    // a non-finite loss or gradient anywhere (each stage's sum of squares is NaN or
    // Infinity then): no stage updates (scale NaN), and submit() locates the fault
    const total = sq.every(Number.isFinite)
      ? own.reduce((a, b) => a + b, 0)
      : Number.NaN;
    const clip = (x: number) => clipScale(x, this.opts.optimizer.clipNorm);
    let scale: number;
    if (this.scaler && !diagnose) {
      // f16: an overflow skips the step and halves the scale; otherwise the gradients
      // are unscaled in the clipping factor
      const o = lossScaleStep(this.scaler, total, clip);
      fault.scaled = { scale: this.scaler.scale, skipped: o.skip };
      this.scaler = o.next;
      if (o.fault) fault.sums = own;
      scale = o.gradScale;
    } else {
      if (!Number.isFinite(total)) fault.sums = own;
      scale = Number.isFinite(total) && !diagnose ? clip(total) : NaN;
    }
    for (const w of this.workers) w.sendScale(scale);
  }

  /** The device of the model's last stage (within a replica): it computes the loss. */
  private lossDevice(): number {
    return this.placement[this.placement.length - 1]!;
  }

  /**
   * Runs the training step on `batch` again, diagnosing (every block's output, the loss and
   * every block's gradients checked; nothing updated), and throws the NumericFaultError that
   * names where the first non-finite value appeared.
   */
  private async locate(
    batch: Batch,
    lr: number,
    sums: number[],
    dropped?: readonly number[],
    step?: number,
  ): Promise<never> {
    const rs = await this.dispatch(this.train, batch, lr, true, dropped, step)
      .all;
    throw describeFaults(
      rs.flatMap((r) => r.faults ?? []),
      sums,
      this.opts.ranges,
      this.placement,
    );
  }

  /** Waits for every submitted step; then runs the kind's flush schedule, if any. */
  private async settle(): Promise<void> {
    await Promise.all([...this.inflight]);
    if (this.opts.kind.flush)
      await this.dispatch(this.opts.kind.flush, null, 0).all;
  }

  submit(
    batch: Batch,
    lr: number,
    dropped?: readonly number[],
    step?: number,
  ): Submission {
    const { first, all, fault } = this.dispatch(
      this.train,
      batch,
      lr,
      false,
      dropped,
      step,
    );
    const done = all.then((rs) =>
      fault.sums
        ? this.locate(batch, lr, fault.sums, dropped, step)
        : {
            // with replicas, the loss is the mean over every replica's micro-batches
            ...stepReport(rs, this.lossDevice(), this.k),
            ...(fault.scaled
              ? {
                  lossScale: fault.scaled.scale,
                  skipped: fault.scaled.skipped,
                  overflows: this.scaler!.overflows,
                }
              : {}),
          },
    );
    // stages that run free: the first stage can take the next mini-batch while later ones finish
    return submission(done, this.opts.kind.freeRunning ? first : done);
  }

  async trainStep(batch: Batch, lr: number): Promise<StepReport> {
    return this.submit(batch, lr).done;
  }

  async evaluate(batches: Batch[]): Promise<Evaluation> {
    await this.settle();
    return evaluateBatches(
      batches,
      // every replica evaluates its share of the batch
      async (b) =>
        mergeReplicas(
          await this.dispatch(this.opts.kind.eval, b, 0).all,
          this.k,
        ),
      this.opts.kind.labelsOnEveryStage,
      this.lossDevice(),
    );
  }

  async getParams(): Promise<HostParams> {
    await this.settle();
    // every replica holds the same parameters: replica 0's
    const parts = await Promise.all(
      this.workers.slice(0, this.k).map((w) => w.call('getParams', null)),
    );
    return new Map(parts.flatMap((p) => Object.entries(p)));
  }

  async getOptimizerState(): Promise<OptimizerState> {
    await this.settle();
    const parts = await Promise.all(
      this.workers
        .slice(0, this.k)
        .map((w) => w.call('getOptimizerState', null)),
    );
    return {
      step: parts[0].step,
      slots: Object.assign({}, ...parts.map((p) => p.slots)),
    };
  }

  async setOptimizerState(s: OptimizerState): Promise<void> {
    await this.settle();
    await Promise.all(
      this.workers.map((w, i) => {
        const slots: OptimizerState['slots'] = {};
        for (const [key, v] of Object.entries(s.slots))
          if (this.placement[ownerStage(key, this.opts.ranges)] === i % this.k)
            slots[key] = v;
        return w.call('setOptimizerState', { step: s.step, slots });
      }),
    );
  }

  async close(): Promise<void> {
    if (this.closed) return;
    this.closed = true;
    // one at a time: GPU drivers (Mesa under Dawn) crashed when two device threads tore down at once
    for (const w of this.workers) await w.terminate();
  }
}

/**
 * A schedule whose devices sum their stages' gradients across the replicas before the norm
 * all-reduce and the step: an all_reduce_grads before each device's reduce_grad_norm.
 */
function withAllReduce(schedule: Schedule): Schedule {
  return schedule.map((acts) =>
    acts.flatMap((a): Action[] =>
      a.op === 'reduce_grad_norm'
        ? [{ op: 'all_reduce_grads', stage: a.stage }, a]
        : [a],
    ),
  );
}
