/**
 * A stage of local parallelism (Laskin et al., 2020, "Parallel Training of Deep Networks with
 * Local Updates"; Belilovsky et al., 2020, Decoupled Greedy Learning): the stage's blocks plus
 * an auxiliary head give it a local loss; every micro-batch is one local update (forward,
 * backward through this stage only, optimizer step). The gradient stops at the stage input,
 * so stages never wait for gradients from later stages.
 *
 * Overlapping local updates (`--overlap n`): the next stage's local loss also trains the last
 * n blocks of this stage. The next stage sends the gradient of its input; this stage
 * backpropagates it through its last n blocks only (re-computing them from their stashed
 * input) and adds the result to the gradients of its next local step.
 */

import { tf } from '../backend/tfjs.js';
import { auxHead, auxKey } from '../model/aux-head.js';
import type { Block } from '../model/block.js';
import type { HostParams } from '../model/init.js';
import type { Model } from '../model/model.js';
import {
  microBatchNoise,
  type NoiseContext,
  withNoise,
} from '../model/noise.js';
import { clipScale, type OptimizerConfig } from '../optim/optimizer.js';
import type { StageRange } from '../partition/balance.js';
import { recordEvaluation } from './evaluation.js';
import type { Handlers } from './executor.js';
import { NativeStepCapture } from './native-capture.js';
import {
  backwardRecompute,
  backwardRecorded,
  recordForward,
} from './rematerialize.js';
import type { StageContext } from './stage-kind.js';
import { StageParams } from './stage-params.js';
import { TrainableStage } from './trainable-stage.js';

/** How a local stage sits in the pipeline. */
export interface LocalRole {
  /** Index of this stage. */
  stage: number;
  /** Blocks at the end of this stage that the next stage's loss also trains (0: greedy). */
  overlapTail: number;
  /** Whether to compute and send the gradient of the input (the previous stage overlaps). */
  sendsInputGrad: boolean;
}

export class LocalStage extends TrainableStage {
  readonly kind = 'local-parallelism stage';
  /** The auxiliary head (null on the last stage, which uses the model's own loss). */
  readonly head: Block | null;
  private readonly headParams: Array<[string, string]> = [];
  /**
   * Inputs of the tail blocks of updates whose overlap gradient has not arrived yet, oldest
   * first. Gradients arrive in the order the activations were sent (the next stage works in
   * order), possibly from an earlier mini-batch, so they are matched first-in first-out.
   */
  private readonly tailStash: Array<{
    mb: number;
    input: tf.Tensor;
    noise?: NoiseContext;
  }> = [];
  private readonly clipNorm: number;
  /**
   * The captured local update on native (on unless LAYERWISE_NATIVE_CAPTURE=0), for a stage
   * without an overlapped tail: that tail's backward comes whenever the next stage's gradient
   * does, at no fixed place in the stage's steps.
   */
  protected readonly nativeCapture: NativeStepCapture | null;

  readonly handlers: Handlers = {
    local_update: (a, io) => {
      const x = io.takeInput(a.mb);
      const labels = io.takeLabels(a.mb);
      // a local step is one update: the capture keys it as its step's only action
      const act = { op: 'local_update', mb: 0, keep: true };
      const run = () => {
        const noise = microBatchNoise(io.noise, a.mb, x.shape[0]!);
        const { out, dx, loss } = this.update(a.mb, x, labels, noise);
        return { y: out, dx, loss };
      };
      const out = this.viaNativeCapture(act, io, { x, labels }, run, a.mb);
      if (out?.y) io.putOutput(a.mb, out.y);
      if (out?.dx) io.putInputGrad(a.mb, out.dx);
    },
    overlap_backward: (a, io) =>
      this.overlapBackward(a.mb, io.takeOutputGrad(a.mb)),
    local_step: (_a, io) => {
      this.nativeCapture?.endStep();
      return this.localStep(io.lr);
    },
    forward: (a, io) => {
      if (a.grad)
        throw new Error(
          'a local stage trains with local_update, not forward (forward is for evaluation)',
        );
      const out = this.evalForward(
        a.mb,
        io.takeInput(a.mb),
        io.takeLabels(a.mb),
      );
      if (out) io.putOutput(a.mb, out);
    },
  };

  constructor(
    model: Model,
    range: StageRange,
    values: HostParams,
    optimizer: OptimizerConfig,
    readonly role: LocalRole,
  ) {
    super(model, range, values, optimizer);
    this.clipNorm = optimizer.clipNorm;
    const tail = role.overlapTail;
    if (!Number.isInteger(tail) || tail < 0 || tail >= range.to - range.from) {
      throw new Error(
        `overlap ${tail} must be smaller than stage ${role.stage}'s ${range.to - range.from} blocks`,
      );
    }
    this.nativeCapture =
      tail === 0 && NativeStepCapture.wanted()
        ? new NativeStepCapture({ paramVars: this.params.vars })
        : null;
    this.head = this.isLast ? null : auxHead(model, role.stage, range.to);
    for (const spec of this.head?.params ?? []) {
      const key = auxKey(role.stage, spec.name);
      this.params.add(key, spec.shape, values);
      this.headParams.push([spec.name, key]);
    }
  }

  /** Loss of this stage for output `h`: the auxiliary head's, or the model's on the last stage. */
  private localLoss(
    h: tf.Tensor,
    labels: tf.Tensor,
    param: (key: string) => tf.Tensor,
  ): tf.Scalar {
    if (!this.head) return this.model.loss(h, labels);
    const p = Object.fromEntries(
      this.headParams.map(([name, key]) => [name, param(key)]),
    );
    return this.model.loss(this.head.forward(p, h), labels);
  }

  /**
   * One local update's forward and backward for micro-batch `mb`: x is the stage input
   * ([b, ...], owned from now on), labels [b, T] or [b]. Accumulates the gradients of the local
   * loss for this stage's parameters (blocks and head), records the loss in {@link losses}, and
   * returns the output to send on (null on the last stage), the input gradient (when the
   * previous stage overlaps, else null) and the loss (a float32 scalar, read at the step's end).
   * `noise`: where the micro-batch sits, for its Dropout
   * noise (model/noise.ts); absent: none.
   */
  update(
    mb: number,
    x: tf.Tensor,
    labels: tf.Tensor,
    noise?: NoiseContext,
  ): { out: tf.Tensor | null; dx: tf.Tensor | null; loss: tf.Tensor } {
    const keys = this.params.keys();
    const params = this.params.list(keys);
    const wantX = this.role.sendsInputGrad;
    const tailFrom = this.range.to - this.role.overlapTail;
    let out: tf.Tensor | null = null;
    let tailIn: tf.Tensor | null = null;
    const f = (...args: tf.Tensor[]) => {
      const param = StageParams.byKey(keys, args);
      const input = wantX ? args[keys.length] : x;
      const h = withNoise(noise, () =>
        this.params.applyBlocks(
          this.range.from,
          this.range.to,
          input,
          param,
          (b, hin) => {
            if (this.role.overlapTail > 0 && b === tailFrom)
              tailIn = tf.keep(tf.clone(hin));
          },
        ),
      );
      if (!this.isLast) out = tf.keep(tf.clone(h));
      return this.localLoss(h, labels, param);
    };
    let value: tf.Tensor;
    let grads: tf.Tensor[];
    const seed = tf.scalar(1);
    try {
      const xs = wantX ? [...params, x] : params;
      const rec = recordForward(() => f(...xs));
      value = tf.clone(rec.y);
      try {
        grads = backwardRecorded(rec, xs, seed);
      } catch (e) {
        value.dispose();
        throw e;
      }
    } finally {
      seed.dispose();
      x.dispose();
      labels.dispose();
    }
    this.reads.scalar(value, (v) => this.losses.set(mb, v));
    this.grads.add(keys, grads);
    if (tailIn) this.tailStash.push({ mb, input: tailIn, noise });
    return { out, dx: wantX ? grads[keys.length]! : null, loss: value };
  }

  /**
   * Overlap: backpropagates `dy`, the next stage's gradient of its input for micro-batch `mb`,
   * through this stage's last `overlapTail` blocks (recomputed from their stashed input) and
   * adds the parameter gradients to the next local step's.
   */
  overlapBackward(mb: number, dy: tf.Tensor): void {
    const oldest = this.tailStash.shift();
    if (!oldest)
      throw new Error(
        `overlap gradient for micro-batch ${mb}, but no update is waiting for one`,
      );
    if (oldest.mb !== mb)
      throw new Error(
        `overlap gradient for micro-batch ${mb} while the oldest waiting update is ${oldest.mb}`,
      );
    const tailIn = oldest.input;
    const from = this.range.to - this.role.overlapTail;
    const tailKeys = this.params.keysOfBlocks(from, this.range.to);
    const f = (...ps: tf.Tensor[]) =>
      withNoise(oldest.noise, () =>
        this.params.applyBlocks(
          from,
          this.range.to,
          tailIn,
          StageParams.byKey(tailKeys, ps),
        ),
      );
    let grads: tf.Tensor[];
    try {
      grads = backwardRecompute(f, this.params.list(tailKeys), dy);
    } finally {
      tailIn.dispose();
      dy.dispose();
    }
    this.grads.add(tailKeys, grads);
  }

  /** Updates still waiting for their overlap gradient from the next stage (what drain_grads waits for). */
  pendingGradients(): number {
    return this.tailStash.length;
  }

  /** Local optimizer step: clipping by this stage's own gradient norm, then the update. */
  async localStep(lr: number): Promise<void> {
    const scale = clipScale(
      this.clipNorm > 0 ? await this.grads.sumSquares() : 0,
      this.clipNorm,
    );
    this.applyGradients(lr, scale);
  }

  /**
   * Evaluation forward of micro-batch `mb` (x and labels owned from now on): records the local
   * (auxiliary or final) loss in {@link losses} and returns the output for the next stage (null
   * on the last stage).
   */
  evalForward(mb: number, x: tf.Tensor, labels: tf.Tensor): tf.Tensor | null {
    const out = tf.tidy(() => {
      const h = this.params.applyBlocks(this.range.from, this.range.to, x);
      if (this.isLast) {
        recordEvaluation(this.reads, this.model, h, labels, (loss, metrics) => {
          this.losses.set(mb, loss);
          this.metrics.set(mb, metrics);
        });
      } else {
        this.reads.scalar(
          this.localLoss(h, labels, (k) => this.params.vars.get(k)!),
          (v) => this.losses.set(mb, v),
        );
      }
      return h;
    });
    x.dispose();
    labels.dispose();
    if (!this.isLast) return out;
    out.dispose();
    return null;
  }

  /**
   * Drops the accumulated gradients (after a failed step). Stashed tail inputs stay: their
   * overlap gradients may still arrive from the next stage.
   */
  reset(): void {
    this.nativeCapture?.resetStep();
    this.grads.clear();
  }

  override dispose(): void {
    for (const t of this.tailStash) t.input.dispose();
    this.tailStash.length = 0;
    super.dispose();
  }
}

/** The local-parallelism stage kind, as a device worker creates it (options: its {@link LocalRole}). */
export function createStage(ctx: StageContext, role: unknown): LocalStage {
  return new LocalStage(
    ctx.model,
    ctx.range,
    ctx.params,
    ctx.optimizer,
    role as LocalRole,
  );
}
