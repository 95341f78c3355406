/**
 * The backprop stage kind (GPipe, 1F1B, and single-device training as one stage): a contiguous
 * range of a model's blocks with their parameters as device variables, the per-micro-batch
 * state of a training step, the accumulated gradients and the optimizer. The executor drives
 * it through {@link Stage.handlers}: forward, backward, optimizer_step.
 *
 * Loss convention: the mini-batch loss is the mean of the M micro-batch losses (micro-batches
 * have equal size), so the last stage backpropagates dL/dloss_i = 1/M and the accumulated
 * gradients equal those of the whole mini-batch on one device.
 */
import { tf } from '../backend/tfjs.js';
import {
  microBatchNoise,
  type NoiseContext,
  withNoise,
} from '../model/noise.js';
import { StepCapture } from './captured-step.js';
import { recordEvaluation } from './evaluation.js';
import type { Handlers, StepIO } from './executor.js';
import { type ActionOutputs, NativeStepCapture } from './native-capture.js';
import {
  backwardRecompute,
  backwardRecorded,
  disposeRecorded,
  type Recorded,
  recordForward,
} from './rematerialize.js';
import {
  backwardInput,
  backwardWeight,
  disposePending,
  type PendingWeightGrad,
} from './split-backward.js';
import type { StageContext } from './stage-kind.js';
import { StageParams } from './stage-params.js';
import { TrainableStage } from './trainable-stage.js';

/** No block skipped (evaluation, and training without --layer-drop). */
const NONE: ReadonlySet<number> = new Set();

interface MicroBatchState {
  /** The stage input (kept for re-materialization and for the input gradient). */
  input: tf.Tensor;
  labels?: tf.Tensor;
  /** Present when the forward activations were kept (no re-materialization). */
  recorded?: Recorded;
  /** Blocks this step skips (LayerDrop), as the forward ran them; the backward follows it. */
  dropped: ReadonlySet<number>;
  /** Where the micro-batch sits, for its Dropout noise: a re-computed forward draws the same. */
  noise?: NoiseContext;
  /** After its input part (I) of a split backward: the weight part's work, for its W. */
  pending?: PendingWeightGrad;
}

export class Stage extends TrainableStage {
  readonly kind = 'backprop stage';
  private readonly mbs = new Map<number, MicroBatchState>();
  /** Milliseconds the last {@link backward} spent re-computing its forward (0 if kept). */
  lastRecomputeMs = 0;

  /**
   * The captured forward and backward on webgpu, for a stage holding the whole model (on unless
   * LAYERWISE_WEBGPU_CAPTURE=0).
   */
  private readonly gpuCapture: StepCapture | null =
    this.isFirst && this.isLast && StepCapture.wanted()
      ? new StepCapture({ paramVars: this.params.vars })
      : null;
  /** The captured training step on native, for any stage (on unless LAYERWISE_NATIVE_CAPTURE=0). */
  protected readonly nativeCapture: NativeStepCapture | null =
    !this.gpuCapture && NativeStepCapture.wanted()
      ? new NativeStepCapture({ paramVars: this.params.vars })
      : null;
  /** The last training forward's loss tensor (last stage), for the native capture's recording. */
  private lastLoss: tf.Tensor | null = null;

  readonly handlers: Handlers = {
    forward: (a, io) => {
      const x = io.takeInput(a.mb);
      const labels = this.isLast ? io.takeLabels(a.mb) : undefined;
      // (a stage has webgpu's capture or native's, never both)
      const captured =
        this.gpuCapture && a.grad && labels ? this.gpuCapture : null;
      if (captured?.beforeForward(a.mb, io, a.keep, x, labels!)) return; // replayed in the backward
      const run = (): ActionOutputs => {
        const noise = microBatchNoise(io.noise, a.mb, x.shape[0]!);
        if (io.diagnose)
          this.diagnoseForward(a.mb, x, labels, io.dropped, noise);
        this.lastLoss = null;
        const y = this.forward(a.mb, x, {
          keep: a.keep,
          grad: a.grad,
          labels,
          dropped: io.dropped,
          noise,
        });
        if (captured) {
          const loss = this.mbs.get(a.mb)?.recorded?.y;
          if (loss) captured.afterForward(x, labels!, loss);
        }
        return { y, loss: this.lastLoss };
      };
      const act = { op: 'forward', mb: a.mb, keep: a.keep };
      const out = a.grad
        ? this.viaNativeCapture(act, io, { x, labels }, run)
        : run(); // evaluation: never captured
      if (out?.y) io.putOutput(a.mb, out.y);
    },
    backward: (a, io) => {
      const gpuReplayed = this.gpuCapture?.replayBackward();
      if (gpuReplayed) {
        this.grads.add(
          [...gpuReplayed.grads.keys()],
          [...gpuReplayed.grads.values()],
        );
        this.reads.scalar(gpuReplayed.loss, (v) => this.losses.set(a.mb, v));
        return;
      }
      this.backwardAction('backward', a.mb, io, (dy) => {
        const dx = this.backward(a.mb, dy, io.lossSeed, io.diagnose);
        this.gpuCapture?.afterBackward(this.grads.asMap(), io.lossSeed);
        return dx;
      });
    },
    backward_input: (a, io) => {
      this.gpuCapture?.drop(); // a split backward is not captured on webgpu
      this.backwardAction('backward_input', a.mb, io, (dy) =>
        this.backwardInput(a.mb, dy, io.lossSeed),
      );
    },
    backward_weight: (a, io) => {
      const act = { op: 'backward_weight', mb: a.mb, keep: false };
      this.viaNativeCapture(act, io, {}, () => {
        this.backwardWeight(a.mb, io.diagnose);
        return {};
      });
    },
    optimizer_step: (_a, io) => {
      this.nativeCapture?.endStep();
      this.step(io.lr, io.diagnose ? NaN : io.scale); // a diagnosis updates nothing
    },
  };

  /**
   * A backward or its input part (I) of micro-batch mb: takes the output's gradient (not on the
   * last stage), replays the action where the native capture covers this step, else runs `run`
   * (the stage's backward, giving the input's gradient or null) through TF.js, recorded; sends
   * the input's gradient back.
   */
  private backwardAction(
    op: 'backward' | 'backward_input',
    mb: number,
    io: StepIO,
    run: (dy: tf.Tensor | null) => tf.Tensor | null,
  ): void {
    const dy = this.isLast ? null : io.takeOutputGrad(mb);
    const act = { op, mb, keep: false };
    const out = this.viaNativeCapture(act, io, dy ? { dy } : {}, () => ({
      dx: run(dy),
    }));
    if (!out) return; // replayed, its results handed on
    if (out.dx) io.putInputGrad(mb, out.dx);
    io.phase('recompute', this.lastRecomputeMs);
  }

  /**
   * Stage function for autodiff: (params..., x) -> output, or the scalar loss on the last
   * stage; the params are those of the blocks not in `dropped`, which are skipped. With
   * `noise`, the blocks draw their training-time noise for that micro-batch (model/noise.ts).
   */
  private fn(
    labels?: tf.Tensor,
    dropped: ReadonlySet<number> = NONE,
    noise?: NoiseContext,
  ): (...args: tf.Tensor[]) => tf.Tensor {
    const keys = this.params.keys(dropped);
    return (...args) => {
      const x = args[keys.length];
      const y = withNoise(noise, () =>
        this.params.applyBlocks(
          this.range.from,
          this.range.to,
          x,
          StageParams.byKey(keys, args),
          undefined,
          dropped,
        ),
      );
      // every block of a middle stage skipped: an op on the tape, so autodiff sees y depend on x
      const out = y === x ? tf.clone(x) : y;
      return this.isLast ? this.model.loss(out, labels!) : out;
    };
  }

  /**
   * Forward of micro-batch `mb`. `x`: the stage input ([B/M, T] int32 tokens or float32
   * activations), owned by the stage from now on. `labels` on the last stage. With `grad`
   * false nothing is kept (evaluation). Returns the output to send on (non-last stages), or
   * null on the last stage, which records the micro-batch loss in {@link losses}. Training
   * skips the blocks in `dropped` (LayerDrop); evaluation runs every block.
   */
  forward(
    mb: number,
    x: tf.Tensor,
    opts: {
      keep: boolean;
      grad: boolean;
      labels?: tf.Tensor;
      dropped?: ReadonlySet<number>;
      /** Where the micro-batch sits, for training-time noise (Dropout); absent: none. */
      noise?: NoiseContext;
    },
  ): tf.Tensor | null {
    const dropped = opts.grad ? (opts.dropped ?? NONE) : NONE;
    const noise = opts.grad ? opts.noise : undefined;
    const f = this.fn(opts.labels, dropped, noise);
    const params = this.params.list(this.params.keys(dropped));
    if (!opts.grad) {
      try {
        if (this.isLast) {
          // evaluation: the loss and the metrics of the model's output
          const out = tf.tidy(() =>
            this.params.applyBlocks(this.range.from, this.range.to, x),
          );
          recordEvaluation(
            this.reads,
            this.model,
            out,
            opts.labels!,
            (loss, metrics) => {
              this.losses.set(mb, loss);
              this.metrics.set(mb, metrics);
            },
          );
          out.dispose();
          return null;
        }
        return this.finish(
          mb,
          tf.tidy(() => f(...params, x)),
        );
      } finally {
        x.dispose();
        opts.labels?.dispose();
      }
    }
    const st: MicroBatchState = {
      input: x,
      labels: opts.labels,
      dropped,
      noise,
    };
    this.mbs.set(mb, st);
    if (opts.keep) {
      st.recorded = recordForward(() => f(...params, x));
      return this.isLast
        ? this.finish(mb, st.recorded.y, false)
        : tf.clone(st.recorded.y);
    }
    return this.finish(
      mb,
      tf.tidy(() => f(...params, x)),
    );
  }

  private finish(mb: number, y: tf.Tensor, dispose = true): tf.Tensor | null {
    if (!this.isLast) return y;
    this.lastLoss = y;
    // read at the step's end; a kept y (the recorded forward's) is read through a clone
    this.reads.scalar(dispose ? y : tf.clone(y), (v) => this.losses.set(mb, v));
    return null;
  }

  /**
   * Backward of micro-batch `mb`: `dy` is the gradient of its output ([B/M, ...] like the
   * output; ignored on the last stage, which seeds `lossSeed`, 1/M times the loss scale).
   * Accumulates the parameter gradients
   * and returns the gradient of the stage input (null on the first stage).
   */
  backward(
    mb: number,
    dy: tf.Tensor | null,
    lossSeed: number,
    diagnose = false,
  ): tf.Tensor | null {
    const st = this.mbs.get(mb);
    if (!st)
      throw new Error(`backward of micro-batch ${mb} without its forward`);
    this.mbs.delete(mb);
    const seed = this.isLast ? tf.scalar(lossSeed) : dy!;
    const keys = this.params.keys(st.dropped);
    const params = this.params.list(keys);
    const wantInput = !this.isFirst;
    const xs = wantInput ? [...params, st.input] : params;
    if (xs.length === 0) {
      // a first stage without parameters (a user model's Flatten, say): nothing to differentiate
      if (st.recorded) disposeRecorded(st.recorded);
      seed.dispose();
      st.input.dispose();
      st.labels?.dispose();
      return null;
    }
    const timing = { ms: 0 };
    let grads: tf.Tensor[];
    try {
      if (st.recorded) {
        grads = backwardRecorded(st.recorded, xs, seed);
      } else {
        const f = this.fn(st.labels, st.dropped, st.noise);
        grads = backwardRecompute(
          wantInput ? f : (...ps) => f(...ps, st.input),
          xs,
          seed,
          timing,
        );
      }
    } finally {
      seed.dispose();
      st.input.dispose();
      st.labels?.dispose();
    }
    this.lastRecomputeMs = timing.ms;
    if (diagnose) this.diagnoseGradients(mb, keys, grads.slice(0, keys.length));
    this.grads.add(keys, grads);
    return wantInput ? grads[keys.length] : null;
  }

  /**
   * Input part (I) of micro-batch `mb`'s split backward (zero-bubble schedules; see
   * split-backward.ts): `dy` as in {@link backward}. Re-computes the forward if it kept nothing,
   * returns the gradient of the stage input (null on the first stage) and keeps the
   * weight-gradient work, with the tape it needs, for {@link backwardWeight}. Throws when the
   * micro-batch had no forward or already ran its I.
   */
  backwardInput(
    mb: number,
    dy: tf.Tensor | null,
    lossSeed: number,
  ): tf.Tensor | null {
    const st = this.mbs.get(mb);
    if (!st || st.pending)
      throw new Error(
        `backward_input of micro-batch ${mb} ${st ? 'twice' : 'without its forward'}`,
      );
    const seed = this.isLast ? tf.scalar(lossSeed) : dy!;
    const params = this.params.list(this.params.keys(st.dropped));
    const wantInput = !this.isFirst;
    const t0 = performance.now();
    try {
      const rec =
        st.recorded ??
        recordForward(() =>
          this.fn(st.labels, st.dropped, st.noise)(...params, st.input),
        );
      this.lastRecomputeMs = st.recorded ? 0 : performance.now() - t0;
      st.recorded = undefined;
      const { dx, pending } = backwardInput(
        rec,
        st.input,
        params,
        seed,
        wantInput,
      );
      st.pending = pending;
      return dx;
    } finally {
      seed.dispose();
      st.input.dispose();
      st.labels?.dispose();
    }
  }

  /**
   * Weight part (W) of micro-batch `mb`'s split backward: its parameter gradients from what its
   * {@link backwardInput} kept, accumulated; the kept tape is freed. Throws when I has not run.
   */
  backwardWeight(mb: number, diagnose = false): void {
    const st = this.mbs.get(mb);
    if (!st?.pending)
      throw new Error(
        `backward_weight of micro-batch ${mb} before its backward_input`,
      );
    this.mbs.delete(mb);
    const keys = this.params.keys(st.dropped);
    const grads = backwardWeight(st.pending, this.params.list(keys));
    if (diagnose) this.diagnoseGradients(mb, keys, grads);
    this.grads.add(keys, grads);
  }

  /** Optimizer step with learning rate `lr` and global clipping scale; clears the gradients and the step's state. */
  step(lr: number, scale: number): void {
    this.applyGradients(lr, scale);
    this.reset();
  }

  override dispose(): void {
    this.gpuCapture?.dispose();
    super.dispose();
  }

  /** Drops accumulated gradients and any per-micro-batch state. */
  reset(): void {
    this.gpuCapture?.resetStep();
    this.nativeCapture?.resetStep();
    this.grads.clear();
    for (const st of this.mbs.values()) {
      if (st.pending) {
        disposePending(st.pending); // input and labels went with its I
        continue;
      }
      st.input.dispose();
      st.labels?.dispose();
      if (st.recorded) disposeRecorded(st.recorded);
    }
    this.mbs.clear();
  }
}

/** The backprop stage kind, as a device worker creates it (see stage-kind.ts). */
export function createStage(ctx: StageContext): Stage {
  const stage = new Stage(ctx.model, ctx.range, ctx.params, ctx.optimizer);
  stage.index = ctx.index;
  return stage;
}
