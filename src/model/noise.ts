/**
 * Training-time noise (Dropout and its kin) drawn per example from the run's seed, so that a
 * micro-batch of a pipeline, a relay or a replica draws exactly the mask single-device training
 * draws for the same examples, and a re-materialized forward draws the mask its first forward
 * did. TF.js's own Dropout draws one mask for the whole tensor from an unseeded generator, which
 * no split of the batch can reproduce.
 *
 * A stage states where its micro-batch sits ({@link NoiseContext}: the run's seed, the step and
 * the mini-batch index of the micro-batch's first example) around the forward it runs, with
 * {@link withNoise}; a block that draws noise reads it with {@link currentNoise} and gives each
 * example row its own stream, {@link exampleStream}(seed, step, example, layer). No context
 * (evaluation, sampling, profiling): the block runs in inference mode, without noise.
 */
import { Rng } from '../util/rng.js';

/** Where the micro-batch a forward runs on sits in the run, for drawing its noise. */
export interface NoiseContext {
  /** The run's seed (--seed). */
  seed: number;
  /** The training step, 0-based. */
  step: number;
  /** Index in the mini-batch (all replicas together) of the micro-batch's first example. */
  example: number;
}

/** Where a step's micro-batches sit: as {@link NoiseContext}, with the replica's first example. */
export interface StepNoise {
  seed: number;
  step: number;
  /** Mini-batch index of this replica's first example (0 without replicas). */
  offset: number;
}

/** The context of micro-batch `mb` of `rows` examples of a step, or undefined (no noise). */
export function microBatchNoise(
  step: StepNoise | undefined,
  mb: number,
  rows: number,
): NoiseContext | undefined {
  return step
    ? { seed: step.seed, step: step.step, example: step.offset + mb * rows }
    : undefined;
}

let current: NoiseContext | undefined;

/**
 * Runs `f` with `ctx` as the noise context (undefined: none), restoring the one before after
 * (also when `f` throws). Synchronous: the blocks' forwards are.
 */
export function withNoise<T>(ctx: NoiseContext | undefined, f: () => T): T {
  const before = current;
  current = ctx;
  try {
    return f();
  } finally {
    current = before;
  }
}

/** The noise context of the forward running now, or undefined (inference mode). */
export function currentNoise(): NoiseContext | undefined {
  return current;
}

/**
 * The random stream of one example row of one noise layer: seeded by (seed, step, example
 * index in the mini-batch, layer index in the model) alone, so it is the same whichever
 * micro-batch, stage, device or replica holds the example.
 */
export function exampleStream(
  ctx: NoiseContext,
  row: number,
  layer: number,
): Rng {
  let h = Math.imul((ctx.seed >>> 0) + 0x632be5ab, 0x9e3779b1);
  h = Math.imul(h ^ (ctx.step + 1), 0x85ebca6b);
  h = Math.imul(h ^ (ctx.example + row + 1), 0xc2b2ae35);
  h = Math.imul(h ^ (layer + 1), 0x27d4eb2f);
  return new Rng((h ^ (h >>> 15)) >>> 0);
}
