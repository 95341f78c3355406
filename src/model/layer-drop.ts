/**
 * Dynamic architectures from the L2L paper's eager parameter server ("dynamic neural
 * architecture approaches by varying layers across iterations"): which blocks a training step
 * skips.
 *
 * - `constant`: LayerDrop (Fan et al., "Reducing Transformer Depth on Demand with Structured
 *   Dropout", ICLR 2020): every block but the first and the last is skipped with probability P,
 *   independently, each step.
 * - `progressive`: Progressive Layer Dropping (Zhang & He, "Accelerating Training of
 *   Transformer-Based Language Models with Progressive Layer Dropping", NeurIPS 2020; DeepSpeed's
 *   PLD): the keep probability theta(t) = (1 - theta_bar) exp(-gamma t) + theta_bar falls over
 *   steps from 1 to theta_bar = 1 - P, and deeper blocks keep less: droppable block l of L keeps
 *   with probability 1 - (l / L)(1 - theta(t)).
 *
 * A skipped block is the identity (its input passes on; the model's blocks between the first
 * and the last must keep their input's shape), is not computed, gets no gradient and is not
 * stepped by the optimizer. The pattern depends only on the run's seed and the step, so every
 * strategy draws the same one and a resumed run draws what the uninterrupted one did (nothing
 * to save but the configuration). Evaluation and sampling run every block, as the papers do.
 * Pure: no tensors.
 */
import { LayerwiseError } from '../util/errors.js';
import { Rng } from '../util/rng.js';
import type { Model } from './model.js';

export type LayerDropSchedule = 'constant' | 'progressive';
export const LAYER_DROP_SCHEDULES: readonly LayerDropSchedule[] = [
  'constant',
  'progressive',
];

/** PLD's decay rate gamma of theta(t) per step (DeepSpeed's default). */
export const PLD_GAMMA = 0.001;

/** What a run's --layer-drop flags say. */
export interface LayerDropOptions {
  /** Drop probability P in [0, 1): constant's per block; progressive's 1 - theta_bar. */
  p: number;
  schedule: LayerDropSchedule;
  /** The run's seed (--seed). */
  seed: number;
}

/**
 * Probability that droppable block `l` (1-based, of `L`: the model's blocks 1..L, between the
 * first and the last) is kept at step `step` (0-based).
 */
export function keepProbability(
  o: LayerDropOptions,
  l: number,
  L: number,
  step: number,
): number {
  if (o.schedule === 'constant') return 1 - o.p;
  const thetaBar = 1 - o.p;
  const theta = (1 - thetaBar) * Math.exp(-PLD_GAMMA * step) + thetaBar;
  return 1 - (l / L) * (1 - theta);
}

/**
 * The blocks (model indices, ascending) training step `step` (0-based) of a model of `blocks`
 * blocks skips: each of blocks 1..blocks-2 with probability 1 - {@link keepProbability}, drawn
 * from a generator seeded by (seed, step) alone. Empty with P = 0.
 */
export function droppedBlocks(
  o: LayerDropOptions,
  step: number,
  blocks: number,
): number[] {
  if (o.p <= 0 || blocks < 3) return [];
  // a seed per (run seed, step): mixed so that neighbouring steps draw unrelated patterns
  const rng = new Rng(
    (Math.imul(o.seed >>> 0, 0x9e3779b1) ^
      Math.imul(step + 1, 0x85ebca6b) ^
      0x2545f491) >>>
      0,
  );
  const L = blocks - 2;
  const out: number[] = [];
  for (let l = 1; l <= L; l++)
    if (rng.next() >= keepProbability(o, l, L, step)) out.push(l);
  return out;
}

/**
 * Checks that `model` can skip its blocks 1..n-2: each keeps its input's shape (a skipped block
 * passes its input on). Throws {@link LayerwiseError} naming the first block that does not.
 */
export function checkLayerDrop(model: Model): void {
  let shape = model.inputShape(1);
  model.blocks.forEach((b, i) => {
    const out = b.outputShape(shape);
    if (
      i > 0 &&
      i < model.blocks.length - 1 &&
      out.join(',') !== shape.join(',')
    )
      throw new LayerwiseError(
        `--layer-drop skips blocks by passing their input on, but block ${i} (${b.name}) turns [${shape.join(', ')}] into [${out.join(', ')}]; use it with models whose middle blocks keep their input's shape (transformers such as the charlm presets), or drop --layer-drop`,
      );
    shape = out;
  });
  if (model.blocks.length < 3)
    throw new LayerwiseError(
      `--layer-drop never skips the first and the last block, and this model has ${model.blocks.length}; use a deeper model (--layers) or drop --layer-drop`,
    );
}
