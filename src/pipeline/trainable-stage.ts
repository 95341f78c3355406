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
import type { Handlers, StageProgram } from './executor.js';
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
    return this.grads.sumSquares();
  }

  /** Applies the accumulated gradients with learning rate `lr` and clipping scale `scale`, then clears them. */
  protected applyGradients(lr: number, scale: number): void {
    this.optimizer.apply(this.params.vars, this.grads.asMap(), lr, scale);
    this.grads.clear();
  }

  abstract reset(): void;

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
