/**
 * Re-materialization (activation checkpointing, Chen et al., 2016; GPipe section 2.3;
 * torchgpipe's checkpoint.py), on TF.js's autodiff.
 *
 * TF.js computes gradients in one call (`tf.grads` runs f's forward on a tape and backprops at
 * once), so on its own it can only *recompute*: keep the stage input, run forward again at
 * backward time. That is {@link backwardRecompute}, used by `--checkpoint always` and for
 * every micro-batch but the last under `except_last`.
 *
 * To really *keep* the forward activations (`--checkpoint never`) this module splits the
 * engine's gradient call in two: {@link recordForward} runs the forward with the engine's tape
 * on and takes the tape (its nodes hold the saved activations), and {@link backwardRecorded}
 * later backpropagates through that tape (tape.ts backpropagate: op by op, freeing each op's
 * saved tensors and output gradients as soon as its gradient has run).
 * This relies on the engine's tape fields (`startTape`, `endTape`, `state.activeTape`), which
 * are internal to tfjs-core 4.x; the tests in rematerialize.test.ts pin that behaviour.
 */
import * as tf from '@tensorflow/tfjs-core';
import {
  backpropagate,
  compactTape,
  release,
  type TapeNode,
  tapeEngine,
} from './tape.js';

/** A forward pass whose activations are kept on the device until {@link backwardRecorded}. */
export interface Recorded {
  /** Output of the forward function. */
  y: tf.Tensor;
  /** The engine's tape nodes of the forward; each holds the activations its gradient needs. */
  tape: TapeNode[];
}

/**
 * Runs `f` with the gradient tape on and keeps the tape (and with it the activations) for a
 * later backward, compacted (tape.ts compactTape: inputs saved only for their shapes are not
 * kept; with the precision policy's 2-byte activations, the products' saved activations are
 * kept in that format). Must not be called inside
 * another gradient computation.
 */
export function recordForward(f: () => tf.Tensor): Recorded {
  const e = tapeEngine();
  if (e.state.gradientDepth !== 0)
    throw new Error('recordForward cannot run inside a gradient computation');
  e.startTape();
  let y: tf.Tensor;
  let tape: TapeNode[];
  try {
    y = tf.tidy(f);
  } finally {
    tape = e.state.activeTape ?? [];
    e.endTape();
    e.state.activeTape = null;
  }
  compactTape(tape);
  return { y, tape };
}

/**
 * Backward of a recorded forward: gradients of rec.y (weighted by `dy`, same shape as rec.y)
 * with respect to `xs`, which must have been inputs of the recorded forward. Frees the kept
 * activations and rec.y. Throws when some x does not influence y.
 */
export function backwardRecorded(
  rec: Recorded,
  xs: tf.Tensor[],
  dy: tf.Tensor,
): tf.Tensor[] {
  const tape = rec.tape;
  rec.tape = [];
  try {
    return backpropagate(tape, rec.y, xs, dy);
  } finally {
    rec.y.dispose(); // created outside the backward's scope, so not freed by it
  }
}

/** Frees a recorded forward that will never be backpropagated (for example after an error). */
export function disposeRecorded(rec: Recorded): void {
  for (const node of rec.tape) release(node);
  rec.tape = [];
  rec.y.dispose();
}

/**
 * Backward by re-materialization: runs `f(...xs)` again on the tape ({@link recordForward})
 * and backpropagates `dy` through it ({@link backwardRecorded}); the same math as `tf.grads`,
 * split so the recompute can be timed. Returns the gradients with respect to `xs`; the
 * recomputed activations are freed before returning. `timing.ms` receives the milliseconds
 * spent re-computing the forward.
 */
export function backwardRecompute(
  f: (...xs: tf.Tensor[]) => tf.Tensor,
  xs: tf.Tensor[],
  dy: tf.Tensor,
  timing?: { ms: number },
): tf.Tensor[] {
  const t0 = performance.now();
  const rec = recordForward(() => f(...xs));
  if (timing) timing.ms = performance.now() - t0;
  return backwardRecorded(rec, xs, dy);
}
