/**
 * What the stage kinds that keep their parameters on the device share (backprop: stage.ts;
 * local parallelism: local-stage.ts): the parameters as variables, the gradients accumulated
 * over a step, the device optimizer, and the host-facing reads and writes of that state. The
 * L2L relay (relay-stage.ts) keeps none of it: its parameters and optimizer live in the
 * parameter server.
 */
import type { HostParams } from '../model/init.js';
import type { Model } from '../model/model.js';
import { DeviceOptimizer, type OptimizerConfig, type OptimizerState } from '../optim/optimizer.js';
import type { StageRange } from '../partition/balance.js';
import { tf } from '../backend/tfjs.js';
import type { Handlers, NumericFault, StageProgram } from './executor.js';
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
  constructor(readonly model: Model, readonly range: StageRange, values: HostParams, optimizer: OptimizerConfig) {
    this.params = new StageParams(model, range, values);
    this.optimizer = new DeviceOptimizer(optimizer);
  }

  get isFirst(): boolean {
    return this.range.from === 0;
  }
  get isLast(): boolean {
    return this.range.to === this.model.blocks.length;
  }

  /** Sum of squares of the accumulated gradients (this stage's share of the global norm). */
  gradSquaredNorm(): number {
    // a non-finite loss makes the step a numeric fault even if its gradients happen to be finite
    for (const l of this.losses.values()) if (!Number.isFinite(l)) return NaN;
    return this.grads.sumSquares();
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

  /** Records `t`'s first non-finite value as a fault (float tensors only); returns whether it had one. */
  protected checkFinite(t: tf.Tensor, fault: Omit<NumericFault, 'value' | 'stage' | 'blockName'>): boolean {
    if (t.dtype !== 'float32') return false;
    const ok = tf.tidy(() => tf.all(tf.isFinite(t)).dataSync()[0] === 1);
    if (ok) return false;
    const v = (t.dataSync() as Float32Array).find((x) => !Number.isFinite(x));
    this.faults.push({ ...fault, stage: this.index, blockName: this.model.blocks[fault.block]?.name ?? '?', value: String(v) });
    return true;
  }

  /**
   * Diagnosis of micro-batch `mb`'s forward: runs the stage's blocks one at a time on `x`
   * (without taking it) and records the first block whose output is not finite, or the loss
   * (last stage, with `labels`).
   */
  protected diagnoseForward(mb: number, x: tf.Tensor, labels?: tf.Tensor): void {
    tf.tidy(() => {
      if (this.checkFinite(x, { what: 'input', block: this.range.from, mb })) return;
      let h = x;
      for (let b = this.range.from; b < this.range.to; b++) {
        h = this.params.applyBlocks(b, b + 1, h);
        if (this.checkFinite(h, { what: 'activation', block: b, mb })) return;
      }
      if (this.isLast && labels) this.checkFinite(this.model.loss(h, labels), { what: 'loss', block: this.range.to - 1, mb });
    });
  }

  /** Diagnosis of micro-batch `mb`'s parameter gradients (by key, in `keys` order): records the last block with a non-finite one. */
  protected diagnoseGradients(mb: number, keys: readonly string[], grads: readonly tf.Tensor[]): void {
    for (let i = grads.length - 1; i >= 0; i--) {
      const block = Number(keys[i]!.slice(0, keys[i]!.indexOf('.')));
      if (!Number.isInteger(block)) continue;
      if (this.checkFinite(grads[i]!, { what: 'gradient', block, mb })) return;
    }
  }

  /** Current parameter values on the host (fresh copies). */
  getParams(): HostParams {
    return this.params.toHost();
  }

  getOptimizerState(): OptimizerState {
    return this.optimizer.getState();
  }

  setOptimizerState(s: OptimizerState): void {
    this.optimizer.setState(s, this.params.vars);
  }

  dispose(): void {
    this.reset();
    this.optimizer.dispose();
    this.params.dispose();
  }
}
