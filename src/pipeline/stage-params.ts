/**
 * The pieces every stage kind builds on: a stage's parameters as device variables with the
 * blocks that use them ({@link StageParams}), and the gradients it accumulates over the
 * micro-batches of a step ({@link GradAccumulator}). Backprop and local-parallelism stages own
 * both; the L2L relay stage, whose parameters live in the parameter server, only accumulates.
 */

import { SUM_SQUARES_KERNEL } from '../backend/kernel-names.js';
import { roundActivation } from '../backend/low-precision.js';
import { tf } from '../backend/tfjs.js';
import { paramKey, sizeOf } from '../model/block.js';
import type { HostParams } from '../model/init.js';
import type { Model } from '../model/model.js';
import type { StageRange } from '../partition/balance.js';
import { PendingReads } from './pending-reads.js';
import { compactRecording } from './tape.js';

/**
 * Device variables for the blocks [range.from, range.to) of a model (keys `<block>.<name>`),
 * plus any extra parameter a stage kind adds (an auxiliary head's `aux<s>.<name>`).
 */
export class StageParams {
  /** Variables by parameter key, in creation order (the order of positional gradient lists). */
  readonly vars = new Map<string, tf.Variable>();
  /** Per block of the stage, its parameters' names in the block and keys. */
  private readonly blockKeys: Array<Array<[string, string]>> = [];

  /**
   * @param values initial values of (at least) these blocks' parameters, host arrays by key
   * @throws Error when a value is missing or has the wrong number of elements
   */
  constructor(
    readonly model: Model,
    readonly range: StageRange,
    values: HostParams,
  ) {
    for (let b = range.from; b < range.to; b++) {
      const names: Array<[string, string]> = [];
      for (const spec of model.blocks[b].params) {
        const key = paramKey(b, spec.name);
        this.add(key, spec.shape, values);
        names.push([spec.name, key]);
      }
      this.blockKeys.push(names);
    }
  }

  /** Creates the device variable of parameter `key` (shape `shape`) from its host value. */
  add(key: string, shape: number[], values: HostParams): void {
    const v = values.get(key);
    if (!v) throw new Error(`no initial value for parameter ${key}`);
    if (v.length !== sizeOf(shape))
      throw new Error(
        `parameter ${key} has ${v.length} values, expected shape [${shape}]`,
      );
    const init = tf.tensor(v.slice(), shape, 'float32'); // copy: cpu keeps the array
    this.vars.set(key, tf.variable(init, false)); // unnamed: several stages may share a thread
    init.dispose(); // the variable holds its own reference to the data
  }

  get size(): number {
    return this.vars.size;
  }

  /**
   * Parameter keys in creation order, less those of the blocks (model indices) in `dropped`
   * (LayerDrop: a skipped block has no gradient and is not stepped).
   */
  keys(dropped?: ReadonlySet<number>): string[] {
    const all = [...this.vars.keys()];
    if (!dropped?.size) return all;
    return all.filter((k) => !dropped.has(Number(k.slice(0, k.indexOf('.')))));
  }

  /** The variables of `keys`, in that order. */
  list(keys: readonly string[] = this.keys()): tf.Variable[] {
    return keys.map((k) => this.vars.get(k)!);
  }

  /** Keys of the parameters of blocks [from, to) (model block indices within the stage). */
  keysOfBlocks(from: number, to: number): string[] {
    return this.blockKeys
      .slice(from - this.range.from, to - this.range.from)
      .flatMap((bp) => bp.map(([, key]) => key));
  }

  /**
   * Applies blocks [from, to) of this stage to `x`, taking each parameter from `param(key)`
   * (the variables by default; autodiff passes its own tensors). `onBlock(b, input)` sees the
   * input of every block it applies; blocks in `skip` (LayerDrop) are left out, as identities.
   */
  applyBlocks(
    from: number,
    to: number,
    x: tf.Tensor,
    param: (key: string) => tf.Tensor = (k) => this.vars.get(k)!,
    onBlock?: (b: number, input: tf.Tensor) => void,
    skip?: ReadonlySet<number>,
  ): tf.Tensor {
    let h = x;
    for (let b = from; b < to; b++) {
      if (skip?.has(b)) continue; // LayerDrop: the block is the identity this step
      onBlock?.(b, h);
      const p: Record<string, tf.Tensor> = {};
      for (const [name, key] of this.blockKeys[b - this.range.from])
        p[name] = param(key);
      const input = h;
      // one tidy scope per block: its intermediates go when it ends (what a recorded backward
      // needs, its tape keeps), and a recording compacts the block's part of the tape now
      h = tf.tidy(() => {
        const y = this.model.blocks[b].forward(p, input);
        // each block boundary in the policy's activation format, where L2L stashes and stages send it
        return b < this.model.blocks.length - 1 ? roundActivation(y) : y;
      });
      compactRecording();
    }
    return h;
  }

  /** Looks tensors given positionally in the order of `keys` up by key. */
  static byKey(
    keys: readonly string[],
    tensors: readonly tf.Tensor[],
  ): (key: string) => tf.Tensor {
    const m = new Map(keys.map((k, i) => [k, tensors[i]]));
    return (k) => m.get(k)!;
  }

  /** Current values on the host (fresh copies). */
  async toHost(): Promise<HostParams> {
    const out: HostParams = new Map();
    const values = await Promise.all(
      [...this.vars.values()].map((v) => v.data() as Promise<Float32Array>),
    );
    [...this.vars.keys()].forEach((k, i) => out.set(k, values[i]!.slice()));
    return out;
  }

  dispose(): void {
    for (const v of this.vars.values()) v.dispose();
    this.vars.clear();
  }
}

/** sum(g^2) in double for a g whose float32 squares overflow: Infinity only if some |g| is. */
async function scaledSumSquares(g: tf.Tensor): Promise<number> {
  const m = tf.tidy(() => tf.max(tf.abs(g)));
  const top = (await m.data())[0]!;
  m.dispose();
  if (top === 0 || !Number.isFinite(top)) return top;
  const s = tf.tidy(() => tf.sum(tf.square(tf.div(g, top))));
  const scaled = (await s.data())[0]!;
  s.dispose();
  return scaled * top * top;
}

/** Parameter gradients summed over the micro-batches of a step, by parameter key. */
export class GradAccumulator {
  private readonly grads = new Map<string, tf.Tensor>();

  get size(): number {
    return this.grads.size;
  }

  /** Adds `grads[i]` to the sum of `keys[i]` (entries past `keys` are ignored); takes ownership of the added ones. */
  add(keys: readonly string[], grads: readonly tf.Tensor[]): void {
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

  get(key: string): tf.Tensor | undefined {
    return this.grads.get(key);
  }

  /** The keys of the sums, sorted (the order of {@link values} and {@link replace}). */
  private sortedKeys(): string[] {
    return [...this.grads.keys()].sort();
  }

  /**
   * Host copies of the sums, by key in sorted order (read asynchronously, all at once: on a GPU
   * in one readback, {@link PendingReads}).
   */
  async values(): Promise<Float32Array[]> {
    const keys = this.sortedKeys();
    const out: Float32Array[] = [];
    const reads = new PendingReads();
    keys.forEach((k, i) =>
      reads.read(tf.clone(this.grads.get(k)!), (v) => {
        out[i] = (v as Float32Array).slice();
      }),
    );
    await reads.flush();
    return out;
  }

  /** Replaces each sum (keys in sorted order, as {@link values} gave them) by the given values. Throws for a count or size mismatch. */
  replace(values: readonly Float32Array[]): void {
    const keys = this.sortedKeys();
    if (values.length !== keys.length)
      throw new Error(
        `${values.length} gradient values for ${keys.length} accumulated gradients`,
      );
    keys.forEach((k, i) => {
      const old = this.grads.get(k)!;
      if (values[i]!.length !== old.size)
        throw new Error(
          `gradient '${k}': ${values[i]!.length} values for ${old.size} elements`,
        );
      this.grads.set(k, tf.tensor(values[i]!, old.shape, 'float32'));
      old.dispose();
    });
  }

  entries(): IterableIterator<[string, tf.Tensor]> {
    return this.grads.entries();
  }

  /** The sums as a map (for the optimizer); still owned by the accumulator. */
  asMap(): ReadonlyMap<string, tf.Tensor> {
    return this.grads;
  }

  /**
   * Sum of squares of every accumulated element (a stage's share of the global norm): the sums
   * of {@link squaredSums} read, then {@link totalSquares}.
   */
  async sumSquares(): Promise<number> {
    const reads = new PendingReads();
    const total = this.squaresInto(reads);
    await reads.flush();
    return total();
  }

  /**
   * Puts the sums of {@link squaredSums} on `reads` (to go with the other values read there,
   * in one readback on a GPU) and returns what gives the sum of squares ({@link totalSquares})
   * once `reads` is flushed: 0 without gradients. The gradients must not change in between.
   */
  squaresInto(reads: PendingReads): () => Promise<number> {
    const sums = this.squaredSums();
    let values: ArrayLike<number> = [];
    if (sums) reads.read(sums, (v) => (values = v));
    return () => this.totalSquares(values);
  }

  /**
   * Each accumulated gradient's float32 sum of squares, as one float32 tensor [gradients] in
   * key order, or null without gradients: one kernel for all (backend/kernel-names.ts
   * SUM_SQUARES_KERNEL: on webgpu one dispatch, not a square and a sum a gradient), to read in
   * one readback (a round trip on a GPU), alone or with the step's other reads
   * (pipeline/pending-reads.ts). The caller disposes it.
   */
  squaredSums(): tf.Tensor | null {
    const grads = [...this.grads.values()];
    return grads.length > 0
      ? (tf
          .engine()
          .runKernel(
            SUM_SQUARES_KERNEL,
            grads as unknown as tf.NamedTensorMap,
          ) as tf.Tensor)
      : null;
  }

  /**
   * The stage's sum of squares from {@link squaredSums}'s values, added in double. A float32
   * sum of squares that overflowed while every element is finite (|g| above 1.8e19: an absurd
   * learning rate's step) is recomputed scaled by the largest |g| (sum((g / m)^2) m^2, in
   * double), so only a non-finite element makes the result non-finite (Infinity, or NaN for a
   * NaN element).
   * @throws Error when `sums` does not hold one value a gradient.
   */
  async totalSquares(sums: ArrayLike<number>): Promise<number> {
    const grads = [...this.grads.values()];
    if (sums.length !== grads.length)
      throw new Error(
        `${sums.length} sums of squares for ${grads.length} gradients`,
      );
    let total = 0;
    for (let i = 0; i < sums.length; i++) {
      const v = sums[i]!;
      total += v === Infinity ? await scaledSumSquares(grads[i]!) : v;
    }
    return total;
  }

  /** Frees every sum. */
  clear(): void {
    for (const g of this.grads.values()) g.dispose();
    this.grads.clear();
  }
}
