/**
 * The one coordinator of every strategy that drives worker devices: the pipelines of single,
 * gpipe and local (pipeline.ts) and L2L's relay, on one device or pipelined on K (l2l.ts). It
 * owns the devices (R data-parallel replicas of K devices, neighbours linked), builds each
 * step's messages (step-messages.ts: micro-batches, LayerDrop's skipped blocks, noise, loss
 * scale), runs one schedule at a time on every device, stops every device when one fails and
 * reports the run's root cause, and turns the devices' results into step reports and
 * evaluations (stage-results.ts).
 *
 * What differs between a pipeline and a relay is data plus a small set of hooks:
 * - the stage kind and its schedules ({@link PipelineKind}: a relay is a stage kind like the
 *   backprop and local ones, pipeline/relay-stage.ts, whose training schedule lists only the
 *   layers a step keeps, {@link PipelineKind.trainWithout});
 * - where the parameters live and what follows a stage's backward ({@link ParameterHome}): on
 *   the stages, which step their own optimizer once the coordinator has answered the gradient
 *   norm all-reduce (pipeline.ts StageParameters), or in L2L's parameter server, to which the
 *   coordinator hands every layer gradient the relay pushes (l2l.ts ServerParameters).
 */

import type { Precision } from '../backend/names.js';
import type { Batch } from '../data/batcher.js';
import type { HostParams } from '../model/init.js';
import type { ModelConfig } from '../model/model.js';
import type { LossScaleState } from '../optim/loss-scale.js';
import type { OptimizerConfig, OptimizerState } from '../optim/optimizer.js';
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

/**
 * What a strategy runs on its stages (see gpipe.ts backpropPipeline, local.ts localPipeline,
 * l2l.ts relayPipeline).
 */
export interface PipelineKind {
  /** The training schedule: per device, its actions for one mini-batch. */
  train: Schedule;
  /**
   * The training schedule of a step that skips the blocks `dropped` (LayerDrop), where the
   * schedule itself leaves them out (the relay neither loads, computes nor pushes them).
   * Absent: `train`, whose stages skip the blocks the step message names.
   */
  trainWithout?(dropped: ReadonlySet<number>): Schedule;
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

/** What a coordinator runs: the devices, the stages on them, their kind and the run's options. */
export interface CoordinatorOptions {
  /** Strategy name, for reports and messages. */
  name: string;
  backend: string;
  model: ModelConfig;
  /** Blocks of each stage. */
  ranges: StageRange[];
  /** Micro-batches M per replica. */
  microBatches: number;
  optimizer: OptimizerConfig;
  kind: PipelineKind;
  /** Device memory budget per device, bytes: a stage fails as soon as its engine holds more. */
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
   * r*M .. r*M+M-1 of the mini-batch cut in R*M). Where the replicas' gradients are summed is
   * the {@link ParameterHome}'s: over a ring of links (stages) or in the parameter server.
   */
  replicas?: number;
  /**
   * The run's seed (--seed): training steps given their step index draw their Dropout noise
   * from it, per example (model/noise.ts). Default 0.
   */
  seed?: number;
}

/**
 * What a step's home found: `sums`, each device's squared gradient norm where one was not
 * finite (a numeric fault to locate); `scaled`, f16's loss scale of the step and whether the
 * step was skipped.
 */
export interface StepFault {
  sums?: number[];
  scaled?: { scale: number; skipped: boolean };
}

/** One schedule run on every device: a training step, its diagnosis, an evaluation or a flush. */
export interface StepRun {
  schedule: Schedule;
  /** The mini-batch, or null (a flush). */
  batch: Batch | null;
  lr: number;
  /** A training step (or its diagnosis): the step's gradients go to the parameters' home. */
  training: boolean;
  /** Diagnose a numeric fault: nothing is updated (see pipeline/executor.ts). */
  diagnose: boolean;
  /** Blocks this step skips (LayerDrop). */
  dropped: readonly number[];
  /** The training step's index (Dropout's noise), if any. */
  step?: number;
}

/** A run as its parameters' home sees it: with its fault record and a way to stop the run. */
export interface HomeStep extends StepRun {
  fault: StepFault;
  /** Stops the strategy: every later call rejects with `e` (an optimizer thread failed). */
  fail(e: Error): void;
}

/** The devices of a coordinator, for its parameters' home. */
export interface CoordinatorDevices {
  /** Every device, replica after replica (replica r's device d is `all[r * k + d]`). */
  all: readonly Device[];
  /** Devices per replica, K. */
  k: number;
  /** The device (within a replica) of each stage. */
  placement: readonly number[];
  /** Blocks of each stage. */
  ranges: readonly StageRange[];
}

/**
 * Where a coordinator's parameters (and optimizer state, and f16's loss scaler) live, and what
 * the coordinator does while a step runs, after the stages' backward: the hooks by which a
 * pipeline (parameters on the stages) and a relay (parameters in the parameter server) differ.
 */
export interface ParameterHome {
  /**
   * Whether replicas sum their gradients over a ring of links between them (an
   * all_reduce_grads before each reduce_grad_norm), rather than where the parameters live.
   */
  readonly replicaRing: boolean;
  /** Initial values of stage `stage`'s parameters to upload to its device ({} where the home keeps them). */
  stageParams(stage: number): Record<string, Float32Array>;
  /** The loss scale the run's messages carry (f16); undefined or 1: none. */
  lossScale(run: StepRun): number | undefined;
  /** Before the run's messages are sent (may throw: the run fails). */
  beginStep(run: HomeStep): void;
  /**
   * Beside the run, from when its messages are sent: what the devices ask of the coordinator
   * (the gradient-norm all-reduce, layer gradients to push). Resolves when all is answered;
   * rejects when a device fails.
   */
  serve(run: HomeStep, devices: CoordinatorDevices): Promise<void>;
  /** What a finished training step adds to its report (loss scale, server spans). */
  report(run: HomeStep): Partial<StepReport>;
  /** Waits until every update of the submitted steps is applied. */
  settle(): Promise<void>;
  getParams(devices: CoordinatorDevices): Promise<HostParams>;
  getOptimizerState(devices: CoordinatorDevices): Promise<OptimizerState>;
  setOptimizerState(
    s: OptimizerState,
    devices: CoordinatorDevices,
  ): Promise<void>;
  lossScaleState(): LossScaleState | undefined;
  setLossScaleState(s: LossScaleState): void;
  /** Stops what the home runs (the parameter server's threads); after the devices. */
  close(): Promise<void>;
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

/** The device of each stage of a coordinator's options: its placement, or stage s on device s. */
function placementOf(opts: CoordinatorOptions): number[] {
  const p = opts.placement ?? opts.ranges.map((_, s) => s);
  if (p.length !== opts.ranges.length)
    throw new Error(
      `a placement of ${p.length} stages for ${opts.ranges.length} stage ranges`,
    );
  return p;
}

const ignore = (): undefined => undefined;

/**
 * Runs a {@link PipelineKind}'s schedules on R replicas of K devices with its parameters in a
 * {@link ParameterHome} (see the module comment). A failing device stops every device (and
 * the home) and the step rejects with the run's root cause; a failure the home reports (an
 * optimizer thread's) stops everything too, and every later call rejects with it.
 */
export class Coordinator implements Strategy {
  readonly name: string;
  readonly devices: number;
  /** Devices of one replica K, and replicas R (devices = R*K). */
  protected readonly k: number;
  protected readonly replicas: number;
  private readonly train: Schedule;
  /** The device of each stage. */
  private readonly placement: number[];
  private closed = false;
  /** The first failure the home reported (an optimizer thread's), if any. */
  private failure: Error | null = null;
  /** Schedules sent to the stages that have not finished yet. */
  private readonly inflight = new Set<Promise<unknown>>();
  /** When the previous step or evaluation lets the next one start (steps run one at a time). */
  private queue: Promise<unknown> = Promise.resolve();

  protected constructor(
    private readonly opts: CoordinatorOptions,
    protected readonly workers: Device[],
    private readonly home: ParameterHome,
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
    this.train = this.withReplicas(opts.kind.train);
  }

  /**
   * Opens the devices (a worker thread each unless `opts.devices` says otherwise), links
   * neighbours (and each stage's replicas, where the home sums gradients over a ring), and
   * starts on each device its stages (kind, blocks, the home's initial parameters); `make`
   * builds the coordinator on them. Throws, after stopping the devices and the home, if any
   * fails to start.
   */
  protected static async start<C extends Coordinator>(
    opts: CoordinatorOptions,
    home: ParameterHome,
    make: (workers: Device[]) => C,
  ): Promise<C> {
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
    let workers: Device[] = [];
    let s: C;
    try {
      workers = await openDevices(specs, undefined, opts.threads);
      s = make(workers);
    } catch (e) {
      for (const w of workers) await w.terminate();
      await home.close();
      throw e;
    }
    try {
      await initDevices(opts, home, workers, specs, placement);
    } catch (e) {
      await s.close();
      throw e;
    }
    return s;
  }

  /** `schedule` with its replicas' gradient all-reduce, where the home sums them over a ring. */
  private withReplicas(schedule: Schedule): Schedule {
    return this.replicas > 1 && this.home.replicaRing
      ? withAllReduce(schedule)
      : schedule;
  }

  /** The devices, for the home. */
  private crew(): CoordinatorDevices {
    return {
      all: this.workers,
      k: this.k,
      placement: this.placement,
      ranges: this.opts.ranges,
    };
  }

  lossScaleState(): LossScaleState | undefined {
    return this.home.lossScaleState();
  }

  setLossScaleState(s: LossScaleState): void {
    this.home.setLossScaleState(s);
  }

  /**
   * Sends one schedule to every stage (with the batch's micro-batches, if any) of every
   * replica (each on its share of the batch), the home serving the devices beside it. `first`
   * resolves when stage 0 is done, `all` when every stage is (results in device order). If a
   * stage fails, every device is stopped and both reject. Never throws.
   */
  private dispatch(run: StepRun): {
    first: Promise<unknown>;
    all: Promise<StageStepResult[]>;
    fault: StepFault;
  } {
    const fault: StepFault = {};
    const step: HomeStep = { ...run, fault, fail: (e) => void this.fail(e) };
    let calls: Promise<StageStepResult>[];
    let served: Promise<void>;
    try {
      if (this.failure) throw this.failure;
      this.home.beginStep(step);
      calls = this.sendSteps(step);
      served = this.home.serve(step, this.crew());
    } catch (e) {
      calls = [Promise.reject(e)];
      served = Promise.resolve();
    }
    served.catch(ignore); // a failing device is reported through the calls
    const all = this.collect(calls, served);
    all.catch(ignore); // handled by whoever awaits it; never an unhandled rejection
    const first = calls[0]!.catch(async (e) => {
      await all; // the strategy is stopped before `first` rejects, with the run's root cause
      throw e;
    });
    first.catch(ignore);
    this.inflight.add(all);
    all.finally(() => this.inflight.delete(all)).catch(ignore);
    return { first, all, fault };
  }

  /**
   * Calls 'step' on every device with the run's list for its device: replica r gets
   * micro-batches r*M .. r*M+M-1 of the batch cut in R*M (inputs to the first stage's device,
   * labels to the loss device's, or to every device where the kind wants them), the step's
   * learning rate, the home's loss scale, LayerDrop's dropped blocks and, for a training step
   * with its index, where its examples sit for the noise. Returns the calls, in device order.
   */
  private sendSteps(run: StepRun): Promise<StageStepResult>[] {
    const messages = stepMessages({
      schedule: run.schedule,
      batch: run.batch,
      m: this.opts.microBatches,
      k: this.k,
      replicas: this.replicas,
      lr: run.lr,
      inputDevice: this.placement[0]!,
      takesLabels: (d) =>
        d === this.lossDevice() || this.opts.kind.labelsOnEveryStage === true,
      copyLabels: copyWire,
      dropped: run.dropped,
      lossScale: this.home.lossScale(run),
      diagnose: run.diagnose,
      ...(run.training && run.step !== undefined
        ? { noise: { seed: this.opts.seed ?? 0, step: run.step } }
        : {}),
    });
    return this.workers.map((w, g) =>
      w.call('step', messages[g]!.step, transferables(messages[g]!.transfer)),
    );
  }

  /**
   * Waits for every stage's result of the step (`calls`, in device order) and for the home to
   * have served them (`served`). If a stage fails, stops every device and rejects with the
   * failure the home reported, else the run's root cause ({@link rootCause}).
   */
  private async collect(
    calls: Promise<StageStepResult>[],
    served: Promise<void>,
  ): Promise<StageStepResult[]> {
    const everything = Promise.all(calls);
    try {
      // a stage that fails before the home has served it rejects `everything`, which ends the wait
      await Promise.all([everything, served]);
      return await everything;
    } catch (e) {
      everything.catch(ignore);
      const root = this.failure ?? (await rootCause(calls, e));
      await this.close();
      throw this.failure ?? root;
    }
  }

  /** The home's failure (an optimizer thread's): every later call rejects with it. */
  private async fail(e: Error): Promise<void> {
    this.failure ??= e;
    await this.close();
  }

  /** The device of the model's last stage (within a replica): it computes the loss. */
  private lossDevice(): number {
    return this.placement[this.placement.length - 1]!;
  }

  /**
   * Runs the training step `run` again, diagnosing (every block's output, the loss and
   * every block's gradients checked; nothing updated), and throws the NumericFaultError that
   * names where the first non-finite value appeared.
   */
  private async locate(run: StepRun, sums: number[]): Promise<never> {
    const rs = await this.dispatch({ ...run, diagnose: true }).all;
    throw describeFaults(
      rs.flatMap((r) => r.faults ?? []),
      sums,
      this.opts.ranges,
      this.placement,
    );
  }

  /** Waits for every schedule still running; then runs the kind's flush schedule, if any. */
  private async drain(): Promise<void> {
    await Promise.all([...this.inflight]);
    if (this.opts.kind.flush)
      await this.dispatch({
        schedule: this.opts.kind.flush,
        batch: null,
        lr: 0,
        training: false,
        diagnose: false,
        dropped: [],
      }).all;
  }

  /**
   * Waits for the submitted steps and evaluations (rejecting if the last failed), every
   * schedule still running and the flush, and for the home to apply every update.
   */
  protected async settle(): Promise<void> {
    if (this.failure) throw this.failure;
    await this.queue;
    await this.drain();
    await this.home.settle();
    if (this.failure) throw this.failure;
  }

  submit(
    batch: Batch,
    lr: number,
    dropped: readonly number[] = [],
    step?: number,
  ): Submission {
    const { trainWithout } = this.opts.kind;
    const run: StepRun = {
      // LayerDrop: a kind may leave the skipped blocks out of its schedule
      schedule:
        dropped.length && trainWithout
          ? this.withReplicas(trainWithout(new Set(dropped)))
          : this.train,
      batch,
      lr,
      training: true,
      diagnose: false,
      dropped,
      ...(step !== undefined ? { step } : {}),
    };
    const started = this.queue.catch(ignore).then(() => this.dispatch(run));
    const done = started.then(({ all, fault }) =>
      all.then((rs): Promise<StepReport> | StepReport =>
        fault.sums
          ? this.locate(run, fault.sums)
          : {
              // the bubble: each device's time waiting (neighbours, the norm, the server);
              // with replicas, the loss is the mean over every replica's micro-batches
              ...stepReport(rs, this.lossDevice(), this.k),
              ...this.home.report({ ...run, fault, fail: ignore }),
            },
      ),
    );
    // stages that run free: the first stage can take the next mini-batch while later ones finish
    const accepted = this.opts.kind.freeRunning
      ? started.then((d) => d.first)
      : done;
    this.queue = accepted;
    return submission(done, accepted);
  }

  async trainStep(batch: Batch, lr: number): Promise<StepReport> {
    return this.submit(batch, lr).done;
  }

  async evaluate(batches: Batch[]): Promise<Evaluation> {
    const ev = this.queue
      .catch(ignore)
      .then(() => this.drain())
      .then(() =>
        evaluateBatches(
          batches,
          // every replica evaluates its share of the batch
          async (b) =>
            mergeReplicas(
              await this.dispatch({
                schedule: this.opts.kind.eval,
                batch: b,
                lr: 0,
                training: false,
                diagnose: false,
                dropped: [],
              }).all,
              this.k,
            ),
          this.opts.kind.labelsOnEveryStage,
          this.lossDevice(),
        ),
      );
    this.queue = ev; // later steps wait for the evaluation (a device runs one schedule at a time)
    return ev;
  }

  async getParams(): Promise<HostParams> {
    await this.settle();
    return this.home.getParams(this.crew());
  }

  async getOptimizerState(): Promise<OptimizerState> {
    await this.settle();
    return this.home.getOptimizerState(this.crew());
  }

  async setOptimizerState(s: OptimizerState): Promise<void> {
    await this.settle();
    await this.home.setOptimizerState(s, this.crew());
  }

  async close(): Promise<void> {
    if (this.closed) return;
    this.closed = true;
    // one at a time: GPU drivers (Mesa under Dawn) crashed when two device threads tore down at once
    for (const w of this.workers) await w.terminate();
    await this.home.close();
  }
}

/**
 * Starts each device's stages: the stages `placement` puts on it, each with its blocks, kind
 * and the home's initial parameters (transferred), the run's backend, precision, model and
 * optimizer, its neighbour links and, with replicas, its replica (and its ring links where the
 * home sums gradients over them).
 */
async function initDevices(
  opts: CoordinatorOptions,
  home: ParameterHome,
  workers: Device[],
  specs: readonly DeviceSpec[],
  placement: number[],
): Promise<void> {
  const n = opts.ranges.length;
  const k = Math.max(...placement) + 1;
  const replicas = workers.length / k;
  const links = linkReplicas(
    workers,
    k,
    needsWrapLink(placement), // interleaved schedules past 2 devices: the last device sends to the first
    home.replicaRing,
  );
  await Promise.all(
    workers.map((w, g) => {
      const d = g % k; // the device within its replica
      const stages = placement
        .map((dev, i) => (dev === d ? i : -1))
        .filter((i) => i >= 0)
        .map((i) => ({
          index: i,
          range: opts.ranges[i]!,
          params: home.stageParams(i),
          stage: opts.kind.stage(i, n),
        }));
      const { prev, next, replicaPrev, replicaNext, transfer } = links[g]!;
      return w.call(
        'init',
        {
          ...stages[0]!,
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
                replica: { index: Math.floor(g / k), count: replicas },
                ...(home.replicaRing ? { replicaPrev, replicaNext } : {}),
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
