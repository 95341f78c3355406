/**
 * One pipeline stage on one device: a contiguous range of a model's blocks with their
 * parameters (as device variables), the per-micro-batch state of a training step, the
 * accumulated gradients and the optimizer. The executor drives it action by action.
 *
 * Loss convention: the mini-batch loss is the mean of the M micro-batch losses (micro-batches
 * have equal size), so the last stage backpropagates dL/dloss_i = 1/M and the accumulated
 * gradients equal those of the whole mini-batch on one device.
 */
import { tf } from '../backend/tfjs.js';
import type { HostParams } from '../model/init.js';
import type { Model } from '../model/model.js';
import { paramKey, sizeOf } from '../model/block.js';
import type { StageRange } from '../partition/balance.js';
import { DeviceOptimizer, type OptimizerConfig, type OptimizerState } from '../optim/optimizer.js';
import { backwardRecompute, backwardRecorded, disposeRecorded, recordForward, type Recorded } from './rematerialize.js';

interface MicroBatchState {
  /** The stage input (kept for re-materialization and for the input gradient). */
  input: tf.Tensor;
  labels?: tf.Tensor;
  /** Present when the forward activations were kept (no re-materialization). */
  recorded?: Recorded;
}

export class Stage {
  readonly params = new Map<string, tf.Variable>();
  /** Per block of this stage, its parameter names in the block and their keys. */
  protected readonly blockParams: Array<Array<[string, string]>> = [];
  protected readonly optimizer: DeviceOptimizer;
  protected grads = new Map<string, tf.Tensor>();
  private readonly mbs = new Map<number, MicroBatchState>();
  /** Loss of each micro-batch this step (last stage only). */
  readonly losses = new Map<number, number>();
  /** Milliseconds the last {@link backward} spent re-computing its forward (0 if kept). */
  lastRecomputeMs = 0;

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
    for (let b = range.from; b < range.to; b++) {
      const names: Array<[string, string]> = [];
      for (const spec of model.blocks[b].params) {
        const key = paramKey(b, spec.name);
        this.addParam(key, spec.shape, values);
        names.push([spec.name, key]);
      }
      this.blockParams.push(names);
    }
    this.optimizer = new DeviceOptimizer(optimizer);
  }

  /** Creates the device variable of parameter `key` from its host value. */
  protected addParam(key: string, shape: number[], values: HostParams): void {
    const v = values.get(key);
    if (!v) throw new Error(`no initial value for parameter ${key}`);
    if (v.length !== sizeOf(shape)) throw new Error(`parameter ${key} has ${v.length} values, expected shape [${shape}]`);
    const init = tf.tensor(v.slice(), shape, 'float32'); // copy: cpu keeps the array
    this.params.set(key, tf.variable(init, false)); // unnamed: several stages may share a thread
    init.dispose(); // the variable holds its own reference to the data
  }

  get isFirst(): boolean {
    return this.range.from === 0;
  }
  get isLast(): boolean {
    return this.range.to === this.model.blocks.length;
  }

  /** Parameter keys in a fixed order (the order of gradient lists). */
  protected keys(): string[] {
    return [...this.params.keys()];
  }

  /**
   * Applies blocks [from, to) of this stage to `x`, taking each parameter from `param(key)`.
   * `onBlock(b, input)` sees the input of every block.
   */
  protected applyBlocks(from: number, to: number, param: (key: string) => tf.Tensor, x: tf.Tensor, onBlock?: (b: number, input: tf.Tensor) => void): tf.Tensor {
    let h = x;
    for (let b = from; b < to; b++) {
      onBlock?.(b, h);
      const p: Record<string, tf.Tensor> = {};
      for (const [name, key] of this.blockParams[b - this.range.from]) p[name] = param(key);
      h = this.model.blocks[b].forward(p, h);
    }
    return h;
  }

  /** This stage's blocks applied in order, with parameters given positionally in {@link keys} order. */
  protected apply(paramList: tf.Tensor[], x: tf.Tensor): tf.Tensor {
    const keys = this.keys();
    const byKey = new Map(keys.map((k, i) => [k, paramList[i]]));
    return this.applyBlocks(this.range.from, this.range.to, (k) => byKey.get(k)!, x);
  }

  /** Adds gradients (in {@link keys} order; extra trailing entries ignored) to the accumulators; takes ownership. */
  protected accumulate(keys: string[], grads: tf.Tensor[]): void {
    keys.forEach((k, i) => {
      const prev = this.grads.get(k);
      if (prev) {
        this.grads.set(k, tf.add(prev, grads[i]));
        prev.dispose();
        grads[i].dispose();
      } else {
        this.grads.set(k, grads[i]);
      }
    });
  }

  /** Stage function for autodiff: (params..., x) -> output, or the scalar loss on the last stage. */
  private fn(labels?: tf.Tensor): (...args: tf.Tensor[]) => tf.Tensor {
    const n = this.params.size;
    return (...args) => {
      const out = this.apply(args.slice(0, n), args[n]);
      return this.isLast ? this.model.loss(out, labels!) : out;
    };
  }

  /**
   * Forward of micro-batch `mb`. `x`: the stage input ([B/M, T] int32 tokens or float32
   * activations), owned by the stage from now on. `labels` on the last stage. With `grad`
   * false nothing is kept (evaluation). Returns the output to send on (non-last stages), or
   * null on the last stage, which records the micro-batch loss in {@link losses}.
   */
  forward(mb: number, x: tf.Tensor, opts: { keep: boolean; grad: boolean; labels?: tf.Tensor }): tf.Tensor | null {
    const f = this.fn(opts.labels);
    const params = [...this.params.values()];
    if (!opts.grad) {
      const y = tf.tidy(() => f(...params, x));
      x.dispose();
      opts.labels?.dispose();
      return this.finish(mb, y);
    }
    const st: MicroBatchState = { input: x, labels: opts.labels };
    this.mbs.set(mb, st);
    if (opts.keep) {
      st.recorded = recordForward(() => f(...params, x));
      return this.isLast ? this.finish(mb, st.recorded.y, false) : tf.clone(st.recorded.y);
    }
    return this.finish(mb, tf.tidy(() => f(...params, x)));
  }

  protected finish(mb: number, y: tf.Tensor, dispose = true): tf.Tensor | null {
    if (!this.isLast) return y;
    this.losses.set(mb, y.dataSync()[0]);
    if (dispose) y.dispose();
    return null;
  }

  /**
   * Backward of micro-batch `mb`: `dy` is the gradient of its output ([B/M, ...] like the
   * output; ignored on the last stage, which uses 1/m). Accumulates the parameter gradients
   * and returns the gradient of the stage input (null on the first stage).
   */
  backward(mb: number, dy: tf.Tensor | null, m: number): tf.Tensor | null {
    const st = this.mbs.get(mb);
    if (!st) throw new Error(`backward of micro-batch ${mb} without its forward`);
    this.mbs.delete(mb);
    const seed = this.isLast ? tf.scalar(1 / m) : dy!;
    const params = [...this.params.values()];
    const wantInput = !this.isFirst;
    const xs = wantInput ? [...params, st.input] : params;
    const timing = { ms: 0 };
    let grads: tf.Tensor[];
    if (st.recorded) {
      grads = backwardRecorded(st.recorded, xs, seed);
    } else {
      const f = this.fn(st.labels);
      grads = backwardRecompute(wantInput ? f : (...ps) => f(...ps, st.input), xs, seed, timing);
    }
    this.lastRecomputeMs = timing.ms;
    seed.dispose();
    st.input.dispose();
    st.labels?.dispose();
    const keys = this.keys();
    this.accumulate(keys, grads);
    return wantInput ? grads[keys.length] : null;
  }

  /** Sum of squares of the accumulated gradients (this stage's share of the global norm). */
  gradSquaredNorm(): number {
    let s = 0;
    for (const g of this.grads.values()) s += tf.tidy(() => tf.sum(tf.square(g)).dataSync()[0]);
    return s;
  }

  /** Optimizer step with learning rate `lr` and global clipping scale; clears the gradients. */
  step(lr: number, scale: number): void {
    this.optimizer.apply(this.params, this.grads, lr, scale);
    this.zeroGrad();
  }

  /** Frees the accumulated gradients. */
  protected clearGrads(): void {
    for (const g of this.grads.values()) g.dispose();
    this.grads.clear();
  }

  /** Drops accumulated gradients and any per-micro-batch state. */
  zeroGrad(): void {
    this.clearGrads();
    for (const st of this.mbs.values()) {
      st.input.dispose();
      st.labels?.dispose();
      if (st.recorded) disposeRecorded(st.recorded);
    }
    this.mbs.clear();
  }

  /** Current parameter values on the host (fresh copies). */
  getParams(): HostParams {
    const out: HostParams = new Map();
    for (const [k, v] of this.params) out.set(k, (v.dataSync() as Float32Array).slice());
    return out;
  }

  getOptimizerState(): OptimizerState {
    return this.optimizer.getState();
  }

  setOptimizerState(s: OptimizerState): void {
    this.optimizer.setState(s, this.params);
  }

  dispose(): void {
    this.zeroGrad();
    this.optimizer.dispose();
    for (const v of this.params.values()) v.dispose();
    this.params.clear();
  }
}
