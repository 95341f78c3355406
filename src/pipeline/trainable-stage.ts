/**
 * What the stage kinds that keep their parameters on the device share (backprop: stage.ts;
 * local parallelism: local-stage.ts): the parameters as variables, the gradients accumulated
 * over a step, the device optimizer, and the host-facing reads and writes of that state. The
 * L2L relay (relay-stage.ts) keeps none of it: its parameters and optimizer live in the
 * parameter server.
 */

import { tf } from '../backend/tfjs.js';
import type { HostParams } from '../model/init.js';
import type { Model } from '../model/model.js';
import { type NoiseContext, withNoise } from '../model/noise.js';
import {
  DeviceOptimizer,
  type OptimizerConfig,
  type OptimizerState,
} from '../optim/optimizer.js';
import type { StageRange } from '../partition/balance.js';
import type {
  Handlers,
  NumericFault,
  StageProgram,
  StepIO,
} from './executor.js';
import type {
  ActionInputs,
  ActionOutputs,
  CaptureAction,
  NativeStepCapture,
  ReplayedAction,
} from './native-capture.js';
import { PendingReads } from './pending-reads.js';
import { GradAccumulator, StageParams } from './stage-params.js';

export abstract class TrainableStage implements StageProgram {
  abstract readonly kind: string;
  abstract readonly handlers: Handlers;
  readonly params: StageParams;
  readonly grads = new GradAccumulator();
  protected readonly optimizer: DeviceOptimizer;
  /** Loss of each micro-batch this step. */
  readonly losses = new Map<number, number>();
  /** Evaluation metrics of each micro-batch (last stage, evaluation only). */
  readonly metrics = new Map<number, Record<string, number>>();
  /** Non-finite values found while diagnosing a step (see StepInputs.diagnose). */
  readonly faults: NumericFault[] = [];
  /** The stage's index in the pipeline (for fault reports). */
  index = 0;

  /**
   * @param model the whole model (every stage builds it from the same config)
   * @param range this stage's blocks [from, to)
   * @param values initial parameter values of (at least) this stage's blocks
   */
  constructor(
    readonly model: Model,
    readonly range: StageRange,
    values: HostParams,
    optimizer: OptimizerConfig,
  ) {
    this.params = new StageParams(model, range, values);
    this.optimizer = new DeviceOptimizer(optimizer);
  }

  get isFirst(): boolean {
    return this.range.from === 0;
  }
  get isLast(): boolean {
    return this.range.to === this.model.blocks.length;
  }

  /** Device values the step reads at its end (losses, metrics, diagnosis), see {@link flush}. */
  protected readonly reads = new PendingReads();

  /** The captured training step on native (pipeline/native-capture.ts), where this stage kind and run have one. */
  protected abstract readonly nativeCapture: NativeStepCapture | null;

  /**
   * A compute action of a training step through the native capture (where the stage has one):
   * replayed where the capture covers this step (its results handed on as micro-batch `mb`'s:
   * returns null), else `run` through TF.js (its addon calls recorded where the capture
   * records), returning its outputs for the handler to hand on.
   */
  protected viaNativeCapture(
    act: CaptureAction,
    io: StepIO,
    inputs: ActionInputs,
    run: () => ActionOutputs,
    mb = act.mb,
  ): ActionOutputs | null {
    const capture = this.nativeCapture;
    const replayed = capture?.replay(act, io, inputs);
    if (replayed) {
      this.handOn(mb, io, replayed);
      return null;
    }
    capture?.begin(act, io, inputs);
    const out = run();
    capture?.end(out, this.grads.asMap());
    return out;
  }

  /** Hands on a replayed action's results as the action's own: its output or input gradient, its loss, the step's gradients. */
  private handOn(mb: number, io: StepIO, r: ReplayedAction): void {
    if (r.y) io.putOutput(mb, r.y);
    if (r.dx) io.putInputGrad(mb, r.dx);
    if (r.loss) this.reads.scalar(r.loss, (v) => this.losses.set(mb, v));
    if (r.grads) this.grads.add([...r.grads.keys()], [...r.grads.values()]);
  }

  /** Reads what the step left pending on the device into {@link losses}, {@link metrics} and {@link faults}. */
  async flush(): Promise<void> {
    await this.reads.flush();
    this.faultGroups.clear();
  }

  /** Drops what a failed step left pending, unread. */
  discard(): void {
    this.reads.clear();
    this.faultGroups.clear();
  }

  /**
   * Sum of squares of the accumulated gradients (this stage's share of the global norm), read
   * in one readback with this step's losses so far (and whatever else is pending): on a GPU
   * one round trip, where the losses and then the sums were two, one after the other.
   */
  async gradSquaredNorm(): Promise<number> {
    const total = this.grads.squaresInto(this.reads);
    await this.reads.flush();
    // a non-finite loss makes the step a numeric fault even if its gradients happen to be finite
    for (const l of this.losses.values()) if (!Number.isFinite(l)) return NaN;
    return total();
  }

  /** The accumulated gradients' values, by key in sorted order (for the replicas' all-reduce). */
  async gradientValues(): Promise<Float32Array[]> {
    return this.grads.values();
  }

  /** Replaces the accumulated gradients (same keys and order as {@link gradientValues}) by `values`. */
  setGradientValues(values: readonly Float32Array[]): void {
    this.grads.replace(values);
  }

  /**
   * Applies the accumulated gradients with learning rate `lr` and clipping scale `scale`, then
   * clears them. A non-finite scale means the step had a numeric fault: nothing is updated.
   */
  protected applyGradients(lr: number, scale: number): void {
    if (!Number.isFinite(scale)) {
      this.grads.clear();
      return;
    }
    this.optimizer.apply(this.params.vars, this.grads.asMap(), lr, scale);
    this.grads.clear();
  }

  abstract reset(): void;

  /**
   * Checks `t` (float tensors only) for non-finite values, read at the step's end: the first
   * check of a `group` that finds one becomes a fault, with that value.
   */
  protected checkFinite(
    t: tf.Tensor,
    fault: Omit<NumericFault, 'value' | 'stage' | 'blockName'>,
    group: string,
  ): void {
    if (t.dtype !== 'float32') return;
    // [all finite (1/0), the first non-finite value]
    const probe = tf.tidy(() => {
      const flat = tf.reshape(t, [-1]);
      const bad = tf.logicalNot(tf.isFinite(flat));
      const first = flat.size
        ? tf.gather(flat, tf.argMax(tf.cast(bad, 'int32')))
        : tf.scalar(0);
      return tf.stack([
        tf.cast(tf.logicalNot(tf.any(bad)), 'float32'),
        tf.reshape(first, []),
      ]);
    });
    this.reads.read(probe, ([ok, value]) => {
      if (ok === 1 || this.faultGroups.has(group)) return;
      this.faultGroups.add(group);
      this.faults.push({
        ...fault,
        stage: this.index,
        blockName: this.model.blocks[fault.block]?.name ?? '?',
        value: String(value),
      });
    });
  }

  /** Groups of checks that already found their fault this step. */
  private readonly faultGroups = new Set<string>();

  /**
   * Diagnosis of micro-batch `mb`'s forward: runs the stage's blocks one at a time on `x`
   * (without taking it) and records the first block whose output is not finite, or the loss
   * (last stage, with `labels`), drawing the forward's Dropout noise (`noise`) as it did.
   */
  protected diagnoseForward(
    mb: number,
    x: tf.Tensor,
    labels?: tf.Tensor,
    dropped?: ReadonlySet<number>,
    noise?: NoiseContext,
  ): void {
    const group = `forward ${mb}`;
    tf.tidy(() =>
      withNoise(noise, () => {
        this.checkFinite(
          x,
          { what: 'input', block: this.range.from, mb },
          group,
        );
        let h = x;
        for (let b = this.range.from; b < this.range.to; b++) {
          if (dropped?.has(b)) continue; // skipped this step (LayerDrop)
          h = this.params.applyBlocks(b, b + 1, h);
          this.checkFinite(h, { what: 'activation', block: b, mb }, group);
        }
        if (this.isLast && labels)
          this.checkFinite(
            this.model.loss(h, labels),
            { what: 'loss', block: this.range.to - 1, mb },
            group,
          );
      }),
    );
  }

  /** Diagnosis of micro-batch `mb`'s parameter gradients (by key, in `keys` order): records the last block with a non-finite one. */
  protected diagnoseGradients(
    mb: number,
    keys: readonly string[],
    grads: readonly tf.Tensor[],
  ): void {
    for (let i = grads.length - 1; i >= 0; i--) {
      const block = Number(keys[i]!.slice(0, keys[i]!.indexOf('.')));
      if (!Number.isInteger(block)) continue;
      this.checkFinite(
        grads[i]!,
        { what: 'gradient', block, mb },
        `gradients ${mb}`,
      );
    }
  }

  /** Current parameter values on the host (fresh copies). */
  getParams(): Promise<HostParams> {
    return this.params.toHost();
  }

  getOptimizerState(): Promise<OptimizerState> {
    return this.optimizer.getState();
  }

  setOptimizerState(s: OptimizerState): void {
    this.optimizer.setState(s, this.params.vars);
  }

  dispose(): void {
    this.reset();
    this.nativeCapture?.dispose();
    this.optimizer.dispose();
    this.params.dispose();
  }
}
