/**
 * The runner of every strategy whose model is cut into stages on worker-thread devices
 * (single, gpipe, local), on the one coordinator (coordinator.ts) with the parameters on the
 * stages: each device uploads its stages' parameters at start, steps them with its own
 * optimizer, and the coordinator answers each step's gradient-norm all-reduce (with f16's
 * dynamic loss scaling) before the stages step. What differs between the strategies is data
 * ({@link PipelineKind}): the schedules, the stage kind, where labels go and whether stages
 * run free across mini-batches.
 */

import { optimizerConfigOf, type TrainConfig } from '../config/config.js';
import type { HostParams } from '../model/init.js';
import type { Model } from '../model/model.js';
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
import {
  Coordinator,
  type CoordinatorDevices,
  type CoordinatorOptions,
  type HomeStep,
  ownerStage,
  type ParameterHome,
  type StepFault,
  type StepRun,
} from './coordinator.js';
import type { StepReport } from './strategy.js';

export { ownerStage, type PipelineKind } from './coordinator.js';

export interface PipelineOptions extends CoordinatorOptions {
  /**
   * f16: dynamic loss scaling (optim/loss-scale.ts) from this initial scale: each step's
   * losses are scaled by the current scale, an overflowing step is skipped (nothing updated)
   * and the scale halved. Absent: no loss scaling.
   */
  lossScaling?: number;
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

/**
 * Parameters on the stages: each stage's device holds its parameters, optimizer state and
 * optimizer (every replica the same); the coordinator answers the stages' squared gradient
 * norms with the step's clipping scale (the global norm over every stage, clipping as on one
 * device) and keeps f16's dynamic loss scaler. Replicas sum their gradients over a ring of
 * links before the norm (all_reduce_grads).
 */
class StageParameters implements ParameterHome {
  readonly replicaRing = true;
  /** f16's dynamic loss scale (null: no loss scaling). */
  private scaler: LossScaleState | null;

  constructor(
    private readonly params: HostParams,
    private readonly ranges: readonly StageRange[],
    private readonly clipNorm: OptimizerConfig['clipNorm'],
    lossScaling: number | undefined,
  ) {
    this.scaler =
      lossScaling !== undefined ? initialLossScale(lossScaling) : null;
  }

  /** A copy of the initial values of the parameters stage `stage` owns (transferred). */
  stageParams(stage: number): Record<string, Float32Array> {
    const own: Record<string, Float32Array> = {};
    for (const [key, v] of this.params)
      if (ownerStage(key, this.ranges) === stage) own[key] = v.slice();
    return own;
  }

  /** f16: this step's loss scale (a diagnosis reruns a step at scale 1). */
  lossScale(run: StepRun): number {
    return this.scaler && !run.diagnose ? this.scaler.scale : 1;
  }

  beginStep(): void {}

  /**
   * Where the schedule has a reduce_grad_norm: waits for every device's squared gradient
   * norm and answers them ({@link answerNorms}).
   */
  async serve(run: HomeStep, devices: CoordinatorDevices): Promise<void> {
    if (
      !run.schedule.some((acts) =>
        acts.some((a) => a.op === 'reduce_grad_norm'),
      )
    )
      return;
    const sq = await Promise.all(devices.all.map((w) => w.recvGradNorm()));
    this.answerNorms(sq, run, devices);
  }

  /**
   * Sends every device the step's clipping scale from the stages' squared gradient norms `sq`
   * (one per device, in device order; replicas hold the same sums, so replica 0's count): NaN
   * where any is not finite (or when diagnosing), so that no stage updates; under f16 loss
   * scaling, the scaler's verdict (an overflow skips the step and halves the scale). Records in
   * the run's fault the per-device sums of a numeric fault and the loss scale used.
   */
  private answerNorms(
    sq: number[],
    run: HomeStep,
    devices: CoordinatorDevices,
  ): void {
    const fault: StepFault = run.fault;
    // replicas hold the same summed gradients: the norm is replica 0's stages'
    const own = sq.slice(0, devices.k);
    // a non-finite loss or gradient anywhere (each stage's sum of squares is NaN or
    // Infinity then): no stage updates (scale NaN), and the coordinator locates the fault
    const total = sq.every(Number.isFinite)
      ? own.reduce((a, b) => a + b, 0)
      : Number.NaN;
    const clip = (x: number) => clipScale(x, this.clipNorm);
    let scale: number;
    if (this.scaler && !run.diagnose) {
      // f16: an overflow skips the step and halves the scale; otherwise the gradients
      // are unscaled in the clipping factor
      const o = lossScaleStep(this.scaler, total, clip);
      fault.scaled = { scale: this.scaler.scale, skipped: o.skip };
      this.scaler = o.next;
      if (o.fault) fault.sums = own;
      scale = o.gradScale;
    } else {
      if (!Number.isFinite(total)) fault.sums = own;
      scale = Number.isFinite(total) && !run.diagnose ? clip(total) : NaN;
    }
    for (const w of devices.all) w.sendScale(scale);
  }

  report(run: HomeStep): Partial<StepReport> {
    const s = run.fault.scaled;
    return s
      ? {
          lossScale: s.scale,
          skipped: s.skipped,
          overflows: this.scaler!.overflows,
        }
      : {};
  }

  async settle(): Promise<void> {}

  async getParams(devices: CoordinatorDevices): Promise<HostParams> {
    // every replica holds the same parameters: replica 0's
    const parts = await Promise.all(
      devices.all.slice(0, devices.k).map((w) => w.call('getParams', null)),
    );
    return new Map(parts.flatMap((p) => Object.entries(p)));
  }

  async getOptimizerState(
    devices: CoordinatorDevices,
  ): Promise<OptimizerState> {
    const parts = await Promise.all(
      devices.all
        .slice(0, devices.k)
        .map((w) => w.call('getOptimizerState', null)),
    );
    return {
      step: parts[0].step,
      slots: Object.assign({}, ...parts.map((p) => p.slots)),
    };
  }

  /** Sends each device (of every replica) the slots of the stages it runs. */
  async setOptimizerState(
    s: OptimizerState,
    devices: CoordinatorDevices,
  ): Promise<void> {
    await Promise.all(
      devices.all.map((w, i) => {
        const slots: OptimizerState['slots'] = {};
        for (const [key, v] of Object.entries(s.slots))
          if (
            devices.placement[ownerStage(key, devices.ranges)] ===
            i % devices.k
          )
            slots[key] = v;
        return w.call('setOptimizerState', { step: s.step, slots });
      }),
    );
  }

  /** f16: the loss scaler's state (for checkpoints); undefined without loss scaling. */
  lossScaleState(): LossScaleState | undefined {
    return this.scaler ? { ...this.scaler } : undefined;
  }

  /** f16: continues from a checkpoint's loss scaler state (ignored without loss scaling). */
  setLossScaleState(s: LossScaleState): void {
    if (this.scaler) this.scaler = { ...s };
  }

  async close(): Promise<void> {}
}

/**
 * A pipeline: the coordinator (coordinator.ts) with its parameters on the stages
 * ({@link StageParameters}).
 */
export class PipelineStrategy extends Coordinator {
  /**
   * Starts one device per stage (or per `placement`'s device), links neighbours
   * (runtime/links.ts, whatever the devices are; replicas in a ring) and uploads each stage's
   * initial parameters `params`. Throws (after stopping the devices) if any stage fails to
   * start.
   */
  static async create(
    opts: PipelineOptions,
    params: HostParams,
  ): Promise<PipelineStrategy> {
    const home = new StageParameters(
      params,
      opts.ranges,
      opts.optimizer.clipNorm,
      opts.lossScaling,
    );
    return Coordinator.start(
      opts,
      home,
      (workers) => new PipelineStrategy(opts, workers, home),
    );
  }
}
