/**
 * The split backward of the zero-bubble schedules (Qi et al., "Zero Bubble Pipeline
 * Parallelism", ICLR 2024), on TF.js's autodiff: backpropagation through a recorded forward
 * tape (rematerialize.ts {@link recordForward}) in two passes, as PyTorch pipelining's
 * `backward_input_one_chunk` / `backward_weight_one_chunk` and Megatron's zero-bubble fork's
 * queue of deferred weight-gradient work:
 *
 * - {@link backwardInput} (I) walks the tape from the output back to the stage input and
 *   computes, op by op, only the gradients of the op inputs that depend on the stage input (for
 *   a dense layer y = x W: dx = dy W^T, not dW = x^T dy): what the previous stage waits for. For
 *   an op input that depends on the parameters only (a weight, or a value computed from weights
 *   alone) it keeps the op's output gradients and the tape (its saved activations), and returns
 *   the gradient of the stage input.
 * - {@link backwardWeight} (W), later, runs the kept gradient closures for those inputs
 *   (dW = x^T dy), backpropagates through the parameter-only ops to the parameters, and frees
 *   the tape.
 *
 * A stock op's gradient closures are lazy, one per input (tfjs-core tape.ts
 * `backpropagateGradients`), so I and W together run each of them once: the work of one full
 * backward, moved. A `tf.customGrad` op (the fused layer norm, GELU, attention) computes all
 * its input gradients in one kernel: I keeps its weight gradients (a layer norm's dgamma and
 * dbeta, [D] each) ready for W instead of running the kernel twice.
 */
import { tf } from '../backend/tfjs.js';
import type { Recorded } from './rematerialize.js';
import {
  accumulate,
  dependOn,
  dysOf,
  eager,
  gradientsOf,
  leadTo,
  release,
  type TapeNode,
} from './tape.js';

/** One op's deferred weight-gradient work: its output gradients and the inputs to differentiate, or their gradients already made. */
interface Deferred {
  node: TapeNode;
  /** Output gradients (owned), for a lazy op; null when `ready` holds the results. */
  dys: (tf.Tensor | null)[] | null;
  names: string[];
  /** A customGrad op's gradients of `names`, computed by I with the others (owned). */
  ready?: tf.Tensor[];
}

/** What an I kept for its W (tensors owned by it until {@link backwardWeight} or {@link disposePending}). */
export interface PendingWeightGrad {
  /** Op inputs that depend on the parameters only, with their output gradients (backward order). */
  deferred: Deferred[];
  /** The parameter-only part of the tape (forward order). */
  paramNodes: TapeNode[];
  /** The tape nodes W still runs (deferred lazy ops and parameter-only ops), whose saved tensors are freed once W is done; I freed the others'. */
  tape: TapeNode[];
  /** Ids of the tensors that depend on the parameters. */
  fromParams: Set<number>;
  /** The output's gradient (owned) when the output does not depend on the input (no input gradient wanted): all of the backward is W's. */
  seed?: { id: number; dy: tf.Tensor };
}

/**
 * Input-gradient pass (I) of a recorded forward `rec` (consumed: its tape moves into the
 * returned pending work, its output `rec.y` is freed). `input`: the stage input, `params`: the
 * parameters as the forward read them, `dy`: the gradient of `rec.y` (its shape; a scalar seed
 * for a loss; not taken). Returns the gradient of `input` (float32, its shape; null when
 * `wantInput` is false, e.g. int32 tokens) and the work {@link backwardWeight} finishes.
 * Throws tfjs's error for an op without a gradient (nothing is then kept: the tape is freed).
 */
export function backwardInput(
  rec: Recorded,
  input: tf.Tensor,
  params: readonly tf.Tensor[],
  dy: tf.Tensor,
  wantInput: boolean,
): { dx: tf.Tensor | null; pending: PendingWeightGrad } {
  const tape = rec.tape;
  rec.tape = [];
  // which tensors depend on the stage input, and which on the parameters (forward order); with
  // no input gradient wanted (a first stage's tokens) every gradient is W's: I has no consumer
  const fromX = dependOn(tape, wantInput ? [input] : []);
  const fromP = dependOn(tape, params);
  const toY = leadTo(tape, rec.y);
  const grads = new Map<number, tf.Tensor>([[rec.y.id, dy.clone()]]);
  const pending: PendingWeightGrad = {
    deferred: [],
    paramNodes: [],
    tape,
    fromParams: fromP,
  };
  try {
    for (let i = tape.length - 1; i >= 0; i--) {
      const node = tape[i]!;
      if (!node.outputs.some((o) => toY.has(o.id))) {
        release(node);
        continue;
      }
      if (!node.outputs.some((o) => fromX.has(o.id))) {
        if (node.outputs.some((o) => fromP.has(o.id)))
          pending.paramNodes.unshift(node);
        continue;
      }
      const dys = dysOf(node, grads);
      const now: string[] = [];
      const later: string[] = [];
      for (const [name, t] of Object.entries(node.inputs)) {
        if (fromX.has(t.id)) now.push(name);
        else if (fromP.has(t.id) && toY.has(t.id)) later.push(name);
      }
      if (later.length > 0 && eager(node)) {
        // one kernel makes every input's gradient: keep the weight ones for W
        const all = gradientsOf(node, dys, [...now, ...later]);
        now.forEach((name, j) =>
          accumulate(grads, node.inputs[name]!, all[j]!),
        );
        pending.deferred.push({
          node,
          dys: null,
          names: later,
          ready: all.slice(now.length),
        });
      } else {
        if (now.length > 0) {
          const dxs = gradientsOf(node, dys, now);
          now.forEach((name, j) =>
            accumulate(grads, node.inputs[name]!, dxs[j]!),
          );
        }
        if (later.length > 0)
          pending.deferred.push({
            node,
            dys: dys.map((d) => (d ? d.clone() : null)),
            names: later,
          });
      }
      // what W does not read goes as soon as I is past it: the saved tensors of an op whose
      // gradients are all made (a GELU's input, the attention probabilities...)
      if (later.length === 0 || eager(node)) release(node);
      for (const o of node.outputs) {
        grads.get(o.id)?.dispose();
        grads.delete(o.id);
      }
    }
  } catch (e) {
    for (const g of grads.values()) g.dispose();
    disposePending(pending);
    rec.y.dispose();
    throw e;
  }
  const dx = wantInput ? (grads.get(input.id) ?? tf.zerosLike(input)) : null;
  // W keeps only its products' inputs (x for dW = x^T dy) with the deferred output gradients,
  // and the parameter-only ops' tapes
  const keep = new Set<TapeNode>(pending.paramNodes);
  for (const d of pending.deferred) if (d.dys) keep.add(d.node);
  for (const node of tape) if (!keep.has(node)) release(node);
  pending.tape = tape.filter((node) => keep.has(node));
  if (!fromX.has(rec.y.id)) {
    pending.seed = { id: rec.y.id, dy: grads.get(rec.y.id)! };
    grads.delete(rec.y.id);
  }
  for (const [id, g] of grads) if (id !== input.id || !wantInput) g.dispose();
  rec.y.dispose();
  return { dx, pending };
}

/**
 * Weight-gradient pass (W) of an I's `pending` work (consumed): the deferred gradients of the
 * parameter-only op inputs, then backpropagation through the parameter-only ops. Returns one
 * gradient per `params` entry (float32, the parameter's shape; zeros for a parameter the output
 * does not depend on) and frees the tape's saved tensors. Throws tfjs's error for an op without
 * a gradient (the pending work is freed).
 */
export function backwardWeight(
  pending: PendingWeightGrad,
  params: readonly tf.Tensor[],
): tf.Tensor[] {
  const grads = new Map<number, tf.Tensor>();
  if (pending.seed) grads.set(pending.seed.id, pending.seed.dy);
  pending.seed = undefined;
  try {
    for (const d of pending.deferred) {
      const dxs = d.ready ?? gradientsOf(d.node, d.dys!, d.names);
      d.ready = undefined;
      d.names.forEach((name, j) =>
        accumulate(grads, d.node.inputs[name]!, dxs[j]!),
      );
      for (const t of d.dys ?? []) t?.dispose();
      d.dys = null;
    }
    pending.deferred = [];
    for (let i = pending.paramNodes.length - 1; i >= 0; i--) {
      const node = pending.paramNodes[i]!;
      const dys = dysOf(node, grads);
      if (dys.every((d) => d === null)) continue;
      const names = Object.entries(node.inputs)
        .filter(([, t]) => pending.fromParams.has(t.id))
        .map(([name]) => name);
      const dxs = gradientsOf(node, dys, names);
      names.forEach((name, j) =>
        accumulate(grads, node.inputs[name]!, dxs[j]!),
      );
      for (const o of node.outputs) {
        grads.get(o.id)?.dispose();
        grads.delete(o.id);
      }
    }
    return params.map((p) => {
      const g = grads.get(p.id);
      grads.delete(p.id);
      return g ?? tf.zerosLike(p);
    });
  } finally {
    for (const g of grads.values()) g.dispose();
    disposePending(pending);
  }
}

/** Frees what an I kept for its W without computing it (a reset, a failed step). */
export function disposePending(pending: PendingWeightGrad): void {
  for (const d of pending.deferred) {
    for (const t of d.dys ?? []) t?.dispose();
    for (const t of d.ready ?? []) t.dispose();
  }
  pending.deferred = [];
  pending.seed?.dy.dispose();
  pending.seed = undefined;
  for (const node of pending.tape) release(node);
  pending.tape = [];
  pending.paramNodes = [];
}
