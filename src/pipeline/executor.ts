/**
 * The one executor: interprets a stage's action list (see schedule/schedule.ts) against a
 * {@link Stage} and the stage's links to its neighbours. Every schedule (GPipe fill-drain,
 * 1F1B, evaluation) runs through this loop; strategies only choose the lists.
 */
import type { tf } from '../backend/tfjs.js';
import type { Action } from '../schedule/schedule.js';
import { LocalStage } from './local-stage.js';
import { RelayStage, type LayerGrads } from './relay-stage.js';
import type { Stage } from './stage.js';

/** How a stage talks to the rest of the pipeline. */
export interface StageLinks {
  /** Next activation from the previous stage (FIFO). */
  recvActivation(): Promise<{ mb: number; t: tf.Tensor }>;
  /** Sends an activation to the next stage; the tensor is disposed by the link. */
  sendActivation(mb: number, t: tf.Tensor): void;
  /** Next output gradient from the next stage (FIFO). */
  recvGradient(): Promise<{ mb: number; t: tf.Tensor }>;
  /** An output gradient from the next stage if one has arrived, else null. */
  pollGradient(): { mb: number; t: tf.Tensor } | null;
  /** Sends an input gradient to the previous stage; the tensor is disposed by the link. */
  sendGradient(mb: number, t: tf.Tensor): void;
  /** All-reduce of squared gradient norms: returns the global clipping scale. */
  reduceGradNorm(sumSquares: number): Promise<number>;
  /** L2L: hands a layer's accumulated gradient to the parameter server (buffers are transferred). */
  pushGrads?(g: LayerGrads): void;
}

/** What one step of the executor is given. */
export interface StepInputs {
  /** First stage: the inputs of each micro-batch. */
  inputs?: tf.Tensor[];
  /** The labels of each micro-batch: on the last stage, and on every stage for local parallelism. */
  labels?: tf.Tensor[];
  /** Number of micro-batches M. */
  m: number;
  /** Learning rate of this step. */
  lr: number;
}

/**
 * One executed action: op, micro-batch and its start/end in ms since the step began. A
 * backward with re-materialization gives two spans: `recompute` (its forward run again) and
 * `backward`.
 */
export interface TraceSpan {
  /** The op, `recompute`, or for L2L's load_layer `wait_params` (waiting for the parameter server) and `upload`. */
  label: string;
  op: Action['op'];
  mb: number;
  /** L2L: the layer the action works on. */
  layer?: number;
  start: number;
  end: number;
}

/**
 * Runs `actions` in order. Receives must match the schedule's micro-batch order (channels are
 * FIFO); a mismatch is a schedule bug and throws. Returns the trace of the step.
 */
export async function execute(stage: Stage, actions: readonly Action[], links: StageLinks, inp: StepInputs): Promise<TraceSpan[]> {
  const t0 = performance.now();
  const trace: TraceSpan[] = [];
  const pendingIn = new Map<number, tf.Tensor>();
  const pendingOut = new Map<number, tf.Tensor>();
  const pendingGradIn = new Map<number, tf.Tensor>();
  const pendingGradOut = new Map<number, tf.Tensor>();
  let scale = 1;
  const expect = (got: number, want: number, what: string) => {
    if (got !== want) throw new Error(`stage received the ${what} of micro-batch ${got} while its schedule expects ${want}`);
  };
  for (const a of actions) {
    const start = performance.now() - t0;
    const mb = 'mb' in a ? a.mb : -1;
    const layer = 'layer' in a ? { layer: a.layer } : {};
    switch (a.op) {
      case 'recv_act': {
        const { mb: got, t } = await links.recvActivation();
        expect(got, a.mb, 'activation');
        pendingIn.set(a.mb, t);
        break;
      }
      case 'forward': {
        const x = stage.isFirst ? inp.inputs![a.mb] : pendingIn.get(a.mb);
        if (!x) throw new Error(`forward of micro-batch ${a.mb} has no input`);
        pendingIn.delete(a.mb);
        const y = stage.forward(a.mb, x, { keep: a.keep, grad: a.grad, labels: inp.labels?.[a.mb] });
        if (y) pendingOut.set(a.mb, y);
        break;
      }
      case 'send_act':
        links.sendActivation(a.mb, take(pendingOut, a.mb, 'send_act'));
        break;
      case 'recv_grad': {
        const { mb: got, t } = await links.recvGradient();
        expect(got, a.mb, 'gradient');
        pendingGradIn.set(a.mb, t);
        break;
      }
      case 'backward': {
        const dy = stage.isLast ? null : take(pendingGradIn, a.mb, 'backward');
        const dx = stage.backward(a.mb, dy, inp.m);
        if (dx) pendingGradOut.set(a.mb, dx);
        if (stage.lastRecomputeMs > 0) {
          trace.push({ label: 'recompute', op: a.op, mb, start, end: start + stage.lastRecomputeMs });
          trace.push({ label: a.op, op: a.op, mb, start: start + stage.lastRecomputeMs, end: performance.now() - t0 });
          continue;
        }
        break;
      }
      case 'send_grad':
        links.sendGradient(a.mb, take(pendingGradOut, a.mb, 'send_grad'));
        break;
      case 'reduce_grad_norm':
        scale = await links.reduceGradNorm(stage.gradSquaredNorm());
        break;
      case 'optimizer_step':
        stage.step(inp.lr, scale);
        break;
      case 'local_update': {
        const x = stage.isFirst ? inp.inputs![a.mb] : take(pendingIn, a.mb, 'local_update');
        const { out, dx } = local(stage, a.op).update(a.mb, x, inp.labels![a.mb]);
        if (out) pendingOut.set(a.mb, out);
        if (dx) pendingGradOut.set(a.mb, dx);
        break;
      }
      case 'overlap_backward':
        local(stage, a.op).overlapBackward(a.mb, take(pendingGradIn, a.mb, 'overlap_backward'));
        break;
      case 'poll_grads':
        for (let g = links.pollGradient(); g; g = links.pollGradient()) local(stage, a.op).overlapBackward(g.mb, g.t);
        break;
      case 'drain_grads':
        while (local(stage, a.op).pendingOverlap > 0) {
          const g = await links.recvGradient();
          local(stage, a.op).overlapBackward(g.mb, g.t);
        }
        break;
      case 'local_step':
        local(stage, a.op).localStep(inp.lr);
        break;
      case 'load_layer': {
        const r = relay(stage, a.op);
        await r.load(a.layer);
        if (r.lastWaitMs > 0) {
          trace.push({ label: 'wait_params', op: a.op, mb, ...layer, start, end: start + r.lastWaitMs });
          trace.push({ label: 'upload', op: a.op, mb, ...layer, start: start + r.lastWaitMs, end: performance.now() - t0 });
          continue;
        }
        break;
      }
      case 'prefetch_layer':
        relay(stage, a.op).prefetch(a.layer);
        break;
      case 'layer_forward':
        relay(stage, a.op).layerForward(a.layer, a.mb, a.grad, inp);
        break;
      case 'layer_backward':
        relay(stage, a.op).layerBackward(a.layer, a.mb, inp);
        break;
      case 'push_grads': {
        if (!links.pushGrads) throw new Error('push_grads needs a link to the parameter server');
        links.pushGrads(relay(stage, a.op).takeLayerGrads(a.layer));
        break;
      }
      case 'release_layer':
        relay(stage, a.op).release(a.layer);
        break;
    }
    trace.push({ label: a.op, op: a.op, mb, ...layer, start, end: performance.now() - t0 });
  }
  return trace;
}

function take(m: Map<number, tf.Tensor>, mb: number, what: string): tf.Tensor {
  const t = m.get(mb);
  if (!t) throw new Error(`${what} of micro-batch ${mb}: nothing to use (schedule out of order)`);
  m.delete(mb);
  return t;
}

function local(stage: Stage, op: string): LocalStage {
  if (!(stage instanceof LocalStage)) throw new Error(`${op} needs a local-parallelism stage`);
  return stage;
}

function relay(stage: Stage, op: string): RelayStage {
  if (!(stage instanceof RelayStage)) throw new Error(`${op} needs an L2L relay stage`);
  return stage;
}
