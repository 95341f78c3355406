/**
 * Backpropagation over TF.js's gradient tape, op by op (tfjs-core tape.ts
 * `backpropagateGradients`, walked here rather than by `tf.grads` so that memory is freed as
 * the walk goes): the tape node type, the helpers the full backward ({@link backpropagate},
 * rematerialize.ts backwardRecorded) and the zero-bubble split backward (split-backward.ts)
 * share.
 *
 * Why not `tf.grads`: its walk keeps every op's output gradient and every saved activation
 * until the whole backward ends (they are freed by its enclosing tidy). For a Transformer block
 * that doubles the tape: the block's backward held 21 MiB of gradients above its 22 MiB tape
 * (charlm-small, 8 examples). {@link backpropagate} frees an op's saved tensors and its output
 * gradients as soon as its gradient has run (3 MiB above the tape, falling as the tape goes).
 * This relies on the tape's fields (`inputs`, `outputs`, `gradient`, `saved`), internal to
 * tfjs-core 4.x (pinned 4.22); rematerialize.test.ts and tape.test.ts pin the behaviour.
 */
import { UNREAD_OUTPUT_GRADIENTS } from '../backend/kernel-names.js';
import {
  keepSavedAtComputePrecision,
  widenSavedForGradient,
} from '../backend/low-precision.js';
import { unreadGradient } from '../backend/matmul-grad.js';
import { tf } from '../backend/tfjs.js';

/** The engine's tape fields (tfjs-core engine.ts, internal to 4.x): recording on and off, and the nodes recorded. */
export interface TapeEngine {
  startTape(): void;
  endTape(): void;
  state: { activeTape: TapeNode[] | null; gradientDepth: number };
}

/** This thread's TF.js engine, seen through its tape fields. */
export function tapeEngine(): TapeEngine {
  return tf.engine() as unknown as TapeEngine;
}

/** A tfjs tape node (`@tensorflow/tfjs-core` tape.ts `TapeNode`). */
export interface TapeNode {
  kernelName: string;
  inputs: Record<string, tf.Tensor>;
  outputs: tf.Tensor[];
  gradient?: (dys: (tf.Tensor | null)[]) => Record<string, () => tf.Tensor>;
  saved?: tf.Tensor[];
}

/** Frees a tape node's saved tensors (its gradient will not run again). */
export function release(node: TapeNode): void {
  node.saved?.forEach((t) => t.dispose());
  node.saved = [];
}

/** Whether a tape node's gradient is a customGrad's (all inputs' gradients made at once) rather than a registered, lazy one. */
export function eager(node: TapeNode): boolean {
  return tf.getGradient(node.kernelName) == null;
}

/** Adds `dx` into the gradient of `x` kept in `grads` (both tensors taken over). */
export function accumulate(
  grads: Map<number, tf.Tensor>,
  x: tf.Tensor,
  dx: tf.Tensor,
): void {
  const cur = grads.get(x.id);
  if (!cur) {
    grads.set(x.id, dx);
    return;
  }
  grads.set(x.id, tf.add(cur, dx));
  cur.dispose();
  dx.dispose();
}

/**
 * A node's output gradients so far, in output order: null for an output none reached (the
 * engine then makes zeros), except, when some output was reached, the outputs whose gradient
 * the kernel's gradient never reads (backend/kernel-names.ts UNREAD_OUTPUT_GRADIENTS), which
 * get a kept scalar placeholder, so that no zeros of the output's size are made on the host
 * and uploaded.
 */
export function dysOf(
  node: TapeNode,
  grads: Map<number, tf.Tensor>,
): (tf.Tensor | null)[] {
  const dys = node.outputs.map((o) => grads.get(o.id) ?? null);
  const unread = UNREAD_OUTPUT_GRADIENTS.get(node.kernelName);
  // a node none reached stays all null (its gradient is not run)
  if (!unread || dys.every((d) => d === null)) return dys;
  return dys.map((d, i) => d ?? (unread.includes(i) ? unreadGradient() : null));
}

/** Runs `node`'s gradient for the inputs `names` (in one tidy scope): their gradients, in order. */
export function gradientsOf(
  node: TapeNode,
  dys: (tf.Tensor | null)[],
  names: readonly string[],
): tf.Tensor[] {
  const gradient = node.gradient;
  if (!gradient)
    throw new Error(
      `Cannot compute gradient: gradient function not found for ${node.kernelName}.`,
    );
  // 2-byte copies of saved activations that the backend's kernels cannot read (webgpu's f16)
  // widened for this gradient; freed with the node's saved tensors (release)
  widenSavedForGradient(node.saved);
  return tf.tidy(() => {
    const g = gradient(dys);
    return names.map((name) => {
      if (!(name in g))
        throw new Error(
          `Cannot backprop through input ${name} of ${node.kernelName}.`,
        );
      return g[name]!();
    });
  });
}

/** Ids of `sources` and of every tensor the tape computed from them (walked in forward order). */
export function dependOn(
  tape: readonly TapeNode[],
  sources: readonly tf.Tensor[],
): Set<number> {
  const ids = new Set(sources.map((t) => t.id));
  for (const node of tape)
    if (Object.values(node.inputs).some((t) => ids.has(t.id)))
      for (const o of node.outputs) ids.add(o.id);
  return ids;
}

/** Ids of `y` and of every tensor the tape computed it from (walked in backward order). */
export function leadTo(tape: readonly TapeNode[], y: tf.Tensor): Set<number> {
  const ids = new Set([y.id]);
  for (let i = tape.length - 1; i >= 0; i--)
    if (tape[i]!.outputs.some((o) => ids.has(o.id)))
      for (const t of Object.values(tape[i]!.inputs)) ids.add(t.id);
  return ids;
}

/**
 * The full backward of a recorded forward (`tape`, consumed: every node's saved tensors are
 * freed), output `y` with gradient `dy` (y's shape; a scalar seed for a loss; not taken):
 * returns the gradient of each of `xs` (float32, each x's shape). Walks the tape from the
 * output back, and after each op frees its saved tensors and its output gradients (unless an
 * output is one of `xs`), so that the backward holds only the gradients still to be used,
 * where `tf.grads` holds all of them to the end. The same gradients as `tf.grads` (each op's
 * gradient runs once, on the same inputs, accumulated in the same order). Throws tfjs's error
 * when some x does not influence y, or for an op without a gradient (nothing is then kept).
 */
export function backpropagate(
  tape: TapeNode[],
  y: tf.Tensor,
  xs: readonly tf.Tensor[],
  dy: tf.Tensor,
): tf.Tensor[] {
  const wanted = new Set(xs.map((x) => x.id));
  // the ops on a path from some x to y: their inputs from xs that lead to y get gradients
  const fromX = dependOn(tape, xs);
  const toY = leadTo(tape, y);
  const grads = new Map<number, tf.Tensor>([[y.id, dy.clone()]]);
  try {
    for (let i = tape.length - 1; i >= 0; i--) {
      const node = tape[i]!;
      const names = Object.entries(node.inputs)
        .filter(([, t]) => fromX.has(t.id) && toY.has(t.id))
        .map(([name]) => name);
      const dys = dysOf(node, grads);
      if (names.length > 0 && dys.some((d) => d !== null)) {
        const dxs = gradientsOf(node, dys, names);
        names.forEach((name, j) =>
          accumulate(grads, node.inputs[name]!, dxs[j]!),
        );
      }
      release(node);
      for (const o of node.outputs)
        if (!wanted.has(o.id)) {
          grads.get(o.id)?.dispose();
          grads.delete(o.id);
        }
    }
    return xs.map((x) => {
      const g = grads.get(x.id);
      if (!g)
        throw new Error(
          'Cannot compute gradient of y=f(x) with respect to x. Make sure that the f you passed encloses all operations that lead from x to y.',
        );
      grads.delete(x.id);
      return g;
    });
  } finally {
    for (const g of grads.values()) g.dispose();
    for (const node of tape) release(node);
  }
}

/**
 * Kernels whose registered gradient reads its saved inputs' shapes only (tfjs-core 4.22
 * gradients/Reshape_grad, Add_grad, Sub_grad, Sum_grad): their saved tensors can give way to
 * {@link SavedShape}s, so that an activation saved only for its shape (a residual branch's
 * output, a reshaped product) is not kept until the backward.
 */
const SHAPE_ONLY_GRADIENTS: ReadonlySet<string> = new Set([
  'Reshape',
  'Add',
  'Sub',
  'Sum',
]);

/**
 * What a shape-only gradient reads of a saved tensor: its shape, rank, size and dtype, and
 * nothing else (no data; disposing it does nothing).
 */
class SavedShape {
  readonly rank: number;
  readonly size: number;
  constructor(
    readonly shape: number[],
    readonly dtype: tf.DataType,
  ) {
    this.rank = shape.length;
    this.size = tf.util.sizeFromShape(shape);
  }
  dispose(): void {}
}

/** How many nodes of a recording's tape (by its array) are compacted already. */
const compactedUpTo = new WeakMap<TapeNode[], number>();

/**
 * Shrinks what a recorded forward's tape keeps for its backward, without changing a gradient:
 * the saved inputs of {@link SHAPE_ONLY_GRADIENTS} kernels become {@link SavedShape}s (their
 * data freed unless something else holds it), and where the precision policy stores activations
 * in 2 bytes the products' saved activations become such copies (backend/low-precision.ts
 * keepSavedAtComputePrecision). Compacts the
 * nodes not compacted yet ({@link compactRecording} may have done the earlier ones).
 */
export function compactTape(tape: TapeNode[]): void {
  const nodes = tape.slice(compactedUpTo.get(tape) ?? 0);
  compactedUpTo.set(tape, tape.length);
  for (const node of nodes) {
    if (!SHAPE_ONLY_GRADIENTS.has(node.kernelName) || !node.saved) continue;
    if (tf.getGradient(node.kernelName) == null) continue;
    // in place: the node's gradient closure holds this very array (tfjs engine addTapeNode)
    const saved = node.saved;
    saved.forEach((t, i) => {
      if (t instanceof SavedShape) return;
      saved[i] = new SavedShape(
        t.shape.slice(),
        t.dtype,
      ) as unknown as tf.Tensor;
      t.dispose();
    });
  }
  keepSavedAtComputePrecision(nodes);
}

/**
 * During a recorded forward (rematerialize.ts recordForward), {@link compactTape} on the nodes
 * recorded since the last call: pipeline/stage-params.ts calls it after each block, whose
 * intermediates its own tidy scope has freed, so a stage's forward holds its earlier blocks'
 * tapes compacted (and with 2-byte activations takes their products' operands from the
 * conversions just made).
 * Does nothing outside a recording.
 */
export function compactRecording(): void {
  const state = tapeEngine().state;
  if (state.activeTape && state.gradientDepth > 0)
    compactTape(state.activeTape);
}
