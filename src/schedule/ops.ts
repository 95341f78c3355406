/**
 * What every op of a schedule means, declared once per op ({@link OPS}): how it prints, whether
 * the executor's core runs it (communication) or a stage kind's handler (compute), whether its
 * time counts as waiting (the bubble), which communication the lowering pass adds around it
 * ({@link ./schedule.ts lower}), its simulation rule (data dependencies and readiness,
 * {@link ./simulate.ts simulate}), its memory effect (the bytes a stage's engine gains, frees
 * and peaks at, walked by cost/memory.ts) and its cost (seconds, from a stage's terms, used by
 * simulate's default costs and cost/time.ts). PyTorch pipelining keeps the same knowledge in
 * its `_comp_type_to_function_map` and `_perform_action`, whose last line rejects an action
 * nobody declared; here the table's type names every op of {@link Action}, so an op without a
 * declaration does not compile, and {@link declarationOf} throws for one that arrives at run
 * time (a schedule file, a stage kind's handler table: pipeline/stage-kind.ts checks each
 * table when the kind is loaded). Pure: no tensors.
 *
 * The handlers themselves are in pipeline/ (executor.ts for the core ops; stage.ts,
 * local-stage.ts and relay-stage.ts for each stage kind's compute ops), which sits above this
 * folder: a declaration is data the executor, the simulator and the predictions all read.
 */
import type { Action } from './schedule.js';

/**
 * Ops the executor's core runs itself (communication: point-to-point messages, the
 * gradient-norm all-reduce, taking overlap gradients); every other op is compute, run by a
 * stage kind's handler. Each declaration's `core` must agree (checked when this module loads).
 */
export const CORE_OPS = [
  'recv_act',
  'send_act',
  'recv_grad',
  'send_grad',
  'reduce_grad_norm',
  'all_reduce_grads',
  'poll_grads',
  'drain_grads',
] as const;
export type CoreOp = (typeof CORE_OPS)[number];

/** Every op name. */
export type Op = Action['op'];
/** The action type of one op, e.g. `ActionOf<'layer_forward'>` has `stage`, `layer`, `mb` and `grad`. */
export type ActionOf<K extends Op> = Extract<Action, { op: K }>;

/** A message on the simulated channels: its micro-batch and the time it was sent (s). */
export interface SimMessage {
  mb: number;
  t: number;
}

/** What the simulator tracks per (virtual) stage. */
export interface SimStage {
  /** Micro-batches whose input arrived (received, or handed over by a stage on the same device). */
  received: Set<number>;
  forwarded: Set<number>;
  /** Micro-batches whose output gradient arrived (received or handed over). */
  gradIn: Set<number>;
  /** Micro-batches whose input gradient was computed (a full backward, or the input part). */
  backwarded: Set<number>;
  /** Micro-batches whose input part (I) ran and whose weight part (W) has not. */
  weightPending: Set<number>;
  /** Micro-batches whose activation this stage sent on. */
  sentAct: Set<number>;
  /** local_update actions since the last local_step. */
  updates: number;
  /** Relay: the layers this stage's actions name, ascending (a pipelined relay's stage: its range, less dropped layers). */
  layers: readonly number[];
  /** Relay: the model's last layer (the largest layer any stage names): its loss is computed in its backward. */
  lastLayer: number;
  /** Relay: whether the stage trains (has a layer_backward). */
  trains: boolean;
  loaded: Set<number>;
  /** Relay: per layer, micro-batch -> the forward's grad flag. */
  layerFwd: Map<number, Map<number, boolean>>;
  layerBwd: Map<number, Set<number>>;
  /** Relay: layers whose gradients were pushed at least once this step. */
  pushed: Set<number>;
  /** Relay: per layer, backwards since its last push (their gradient is still on the device). */
  unpushed: Map<number, number>;
}

/** What a simulation rule sees of the simulation when its action is next on its device. */
export interface SimContext {
  /** The action's stage, its state and the number of stages in the schedule. */
  readonly stage: number;
  readonly st: SimStage;
  readonly stages: number;
  /** Micro-batches M of the schedule (the largest index + 1). */
  readonly m: number;
  /** The device's clock (s); a rule that waits for a message raises it to the message's time. */
  ready: number;
  /** A poll_grads that goes ahead now with what has arrived (the simulation is otherwise stuck). */
  readonly force: boolean;
  /** Throws the simulation's error for this action. */
  fail(why: string): never;
  /** The state of another stage (for hand-overs between stages on one device). */
  stateOf(stage: number): SimStage;
  /** Whether `stage` runs on the same device as this action. */
  local(stage: number): boolean;
  /** Channel of activations from `stage` to `stage + 1`, FIFO. */
  actChannel(stage: number): SimMessage[];
  /** Channel of gradients from `stage + 1` to `stage`, FIFO. */
  gradChannel(stage: number): SimMessage[];
  /** Whether the device of `stage` has run up to this device's clock (or finished). */
  caughtUp(stage: number): boolean;
  /** Micro-batches whose gradient `stage + 1` sends back to `stage` by its schedule. */
  gradsBack(stage: number): ReadonlySet<number>;
  /** The stages on this action's device. */
  deviceStages(): number[];
}

/**
 * Bytes a stage's engine holds and the terms they come from (cost/costs.ts stageTotals; for
 * local parallelism localTotals, for the relay one block per layer). Units: bytes.
 */
export interface StageBytes {
  params: number;
  /** The 2-byte copies of the parameters products read, besides them, where the precision policy keeps such copies (0 at fp32). */
  paramCopies?: number;
  maxParam: number;
  optTransient: number;
  inBytes: number;
  outBytes: number;
  fwdPeak: number;
  kept: number;
  bwdPeak: number;
  /**
   * What a split backward's input part (I) leaves for its weight part (W): the weight
   * products' saved inputs and their output gradients (pipeline/split-backward.ts frees the
   * rest). Default: the whole tape ({@link kept}).
   */
  weightHeld?: number;
  /** Peak above the kept tape during a split backward's input part. Default: {@link bwdPeak}. */
  bwdInputPeak?: number;
}

/** One relay layer's bytes (a block's, cost/costs.ts BlockCost). */
export interface LayerBytes {
  paramBytes: number;
  /** Bytes of the layer as uploaded (2-byte parameter copies: its matrices as those values); default paramBytes. */
  loadedBytes?: number;
  maxParamBytes: number;
  inBytes: number;
  outBytes: number;
  fwdPeakBytes: number;
  keptBytes: number;
  bwdPeakBytes: number;
}

/** Bytes of a relay layer on the device once uploaded. */
const loadedBytes = (l: LayerBytes): number => l.loadedBytes ?? l.paramBytes;

/** The running total of a memory walk over one device's action list (cost/memory.ts). */
export interface MemoryWalk {
  /** Bytes held now. */
  cur: number;
  /** Records a peak of `cur + extra` (a transient). */
  bump(extra: number): void;
  readonly first: boolean;
  readonly last: boolean;
  /** The stage's terms (backprop and local parallelism). */
  readonly t: StageBytes;
  readonly labelBytes: number;
  /** Micro-batches whose forward tape (activations and output) is kept. */
  readonly kept: Set<number>;
  /** Bytes of accumulated gradients now. */
  grads: number;
  /** Local parallelism: the overlap tail's terms, and whether the input gradient is sent back. */
  readonly tail: StageBytes | null;
  readonly sendsInputGrad: boolean;
  /** Relay: each layer's bytes, whether the stash is in host memory, what is loaded and which layers' gradients exist. */
  readonly layers: readonly LayerBytes[];
  /** Relay: the first and the last layer of the walk's stage (a pipelined relay's range; else the model's). */
  readonly firstLayer: number;
  readonly lastLayer: number;
  readonly hostStash: boolean;
  readonly loaded: Set<number>;
  readonly gradsStarted: Set<number>;
}

/** New gradients of `bytes` added to the accumulated ones: a sum per parameter, one at a time. */
function accumulate(w: MemoryWalk, bytes: number, maxParam: number): void {
  w.cur += bytes;
  if (w.grads > 0) {
    w.bump(maxParam);
    w.cur -= Math.min(bytes, w.grads);
  }
  w.grads = Math.max(w.grads, bytes);
}

/** Seconds of a stage's work per micro-batch (cost/costs.ts stageTotals), for an op's cost. */
export interface CostTerms {
  fwd: number;
  bwd: number;
  /**
   * The input-gradient part (I) of `bwd`; the weight part (W) is the rest. Default: half (a
   * dense layer's backward is two products of one forward's size, dx and dW; Qi et al. take
   * F = I = W).
   */
  bwdInput?: number;
  opt: number;
  /** Whether the backward of `mb` re-computes its forward (its forward kept nothing). */
  recomputes(mb: number): boolean;
  /** Local parallelism: the overlap tail's re-computation and backward. */
  tail: number;
  /** Relay: one layer's forward and backward seconds. */
  layer(l: number): { fwd: number; bwd: number };
}

/** The costs of simulate's default: forward 1, backward 2, everything else 0 (nothing re-computed). */
export const UNIT_COSTS: CostTerms = {
  fwd: 1,
  bwd: 2,
  opt: 0,
  recomputes: () => false,
  tail: 0,
  layer: () => ({ fwd: 1, bwd: 2 }),
};

/** Where the lowering pass stands when it meets a compute action. */
export interface LowerContext {
  /** The previous stage exists and runs on another device (messages cross a link). */
  readonly remotePrev: boolean;
  /** The next stage exists and runs on another device. */
  readonly remoteNext: boolean;
  /** Local parallelism's overlap: the input gradient goes back; `deterministic`: at fixed points, else polled. */
  readonly overlap?: { deterministic: boolean };
}

/** Communication the lowering pass puts around a compute action. */
export interface Lowered {
  before?: Action[];
  after?: Action[];
}

/** The declaration of one op. */
export interface OpSpec<K extends Op> {
  /** Its compact form after the stage index: `F` in `1F3`. */
  short: string;
  /** Run by the executor's core (communication), not by a stage kind's handler. */
  core: boolean;
  /** Its time is waiting for another stage or the parameter server (a bubble), not work. */
  waits: boolean;
  /** The communication the lowering pass adds around it (compute ops only). */
  lower?(a: ActionOf<K>, c: LowerContext): Lowered;
  /** Checks the action's dependencies and applies it; false: it cannot run yet (waits for a message). */
  simulate(a: ActionOf<K>, c: SimContext): boolean;
  /** Its memory effect on a stage's engine. */
  memory(a: ActionOf<K>, w: MemoryWalk): void;
  /** Its seconds on a stage with these terms. */
  cost(a: ActionOf<K>, t: CostTerms): number;
}

const free = () => 0;
const nothing = () => {};

/** The local hand-over: stage `to` on the same device gets micro-batch mb at once. */
function handOver(
  c: SimContext,
  to: number,
  what: 'input' | 'grad',
  mb: number,
) {
  if (to < 0 || to >= c.stages || !c.local(to)) return;
  const st = c.stateOf(to);
  (what === 'input' ? st.received : st.gradIn).add(mb);
}

function takeMessage(
  c: SimContext,
  q: SimMessage[],
  mb: number,
  what: string,
): SimMessage | null {
  if (q.length === 0) return null;
  const msg = q.shift()!;
  if (msg.mb !== mb)
    c.fail(
      `expected ${what} of micro-batch ${mb}, the channel delivers ${msg.mb}`,
    );
  c.ready = Math.max(c.ready, msg.t);
  return msg;
}

/** Takes an overlap gradient (poll_grads, drain_grads) into the stage; returns its arrival time. */
function takeGrad(c: SimContext, msg: SimMessage): number {
  if (!c.st.forwarded.has(msg.mb))
    c.fail(
      `gradient of micro-batch ${msg.mb}, which this stage did not update`,
    );
  c.st.gradIn.add(msg.mb);
  return msg.t;
}

function layerMap<V>(m: Map<number, V>, l: number, make: () => V): V {
  let v = m.get(l);
  if (!v) {
    v = make();
    m.set(l, v);
  }
  return v;
}

/** The layer before `l` in its stage's list (undefined: `l` is the stage's first). */
function layerBelow(st: SimStage, l: number): number | undefined {
  const i = st.layers.indexOf(l);
  return i > 0 ? st.layers[i - 1] : undefined;
}

/** The layer after `l` in its stage's list (undefined: `l` is the stage's last). */
function layerAbove(st: SimStage, l: number): number | undefined {
  const i = st.layers.indexOf(l);
  return i >= 0 && i + 1 < st.layers.length ? st.layers[i + 1] : undefined;
}

function mustBeLoaded(c: SimContext, l: number): void {
  if (!c.st.loaded.has(l))
    c.fail(
      `layer ${l} is not loaded (load_layer it first; released layers and prefetches do not count)`,
    );
}

/** Sum-of-squares and step: only after every forwarded micro-batch of the device's stages was backwarded (and its W done). */
function stepReady(c: SimContext): void {
  for (const s of c.deviceStages()) {
    const st = c.stateOf(s);
    if (st.backwarded.size !== st.forwarded.size)
      c.fail('step before every backward');
    if (st.weightPending.size > 0)
      c.fail(
        `step before the weight gradients (W) of micro-batches ${[...st.weightPending].join(', ')}`,
      );
  }
}

/**
 * A backward's bytes up to its parameter gradients (a full backward's, or a split one's input
 * part): the forward again on the tape if micro-batch `mb` kept nothing (re-materialization),
 * the transient `peak`, then of the tape only `held` bytes stay (a split's weight part reads
 * them), the stage's input and its output gradient (the last stage: the labels) go, and the
 * input gradient comes (not on the first stage).
 */
function backwardBytes(
  mb: number,
  w: MemoryWalk,
  peak: number,
  held: number,
): void {
  const t = w.t;
  if (!w.kept.has(mb)) {
    w.bump(t.fwdPeak);
    w.cur += t.kept;
  }
  w.kept.delete(mb);
  w.bump(peak);
  w.cur +=
    held -
    t.kept -
    t.inBytes -
    (w.last ? w.labelBytes : t.outBytes) +
    (w.first ? 0 : t.inBytes);
}

/** The input part's seconds (I) of a stage's backward, and the weight part's (W). */
function splitCost(t: CostTerms): { i: number; w: number } {
  const i = t.bwdInput ?? t.bwd / 2;
  return { i, w: t.bwd - i };
}

/**
 * The declaration of every op. Adding an op: its variant in {@link Action}, its entry here (the
 * type requires one), and its handler in the stage kind that runs it (or the executor's core).
 */
export const OPS: { readonly [K in Op]: OpSpec<K> } = {
  recv_act: {
    short: 'RA',
    core: true,
    waits: true,
    simulate(a, c) {
      if (a.stage === 0) c.fail('the first stage has no previous stage');
      if (!takeMessage(c, c.actChannel(a.stage - 1), a.mb, 'activation'))
        return false;
      c.st.received.add(a.mb);
      return true;
    },
    memory(_a, w) {
      w.cur += w.t.inBytes;
    },
    cost: free,
  },
  send_act: {
    short: 'SA',
    core: true,
    waits: false,
    simulate(a, c) {
      if (a.stage === c.stages - 1) c.fail('the last stage has no next stage');
      if (!c.st.forwarded.has(a.mb)) c.fail('send before forward');
      c.actChannel(a.stage).push({ mb: a.mb, t: c.ready });
      c.st.sentAct.add(a.mb);
      return true;
    },
    memory(a, w) {
      if (!w.kept.has(a.mb)) w.cur -= w.t.outBytes; // a kept output is part of the tape
    },
    cost: free,
  },
  recv_grad: {
    short: 'RG',
    core: true,
    waits: true,
    simulate(a, c) {
      if (a.stage === c.stages - 1) c.fail('the last stage has no next stage');
      if (!takeMessage(c, c.gradChannel(a.stage), a.mb, 'gradient'))
        return false;
      c.st.gradIn.add(a.mb);
      return true;
    },
    memory(_a, w) {
      w.cur += w.t.outBytes;
    },
    cost: free,
  },
  send_grad: {
    short: 'SG',
    core: true,
    waits: false,
    simulate(a, c) {
      if (a.stage === 0) c.fail('the first stage has no previous stage');
      if (!c.st.backwarded.has(a.mb)) c.fail('send_grad before backward');
      c.gradChannel(a.stage - 1).push({ mb: a.mb, t: c.ready });
      return true;
    },
    memory(_a, w) {
      w.cur -= w.t.inBytes;
    },
    cost: free,
  },
  reduce_grad_norm: {
    short: 'NORM',
    core: true,
    waits: true,
    simulate(_a, c) {
      stepReady(c);
      return true;
    },
    memory(_a, w) {
      w.bump(w.t.maxParam); // the sum of squares, one parameter at a time
    },
    cost: free,
  },
  all_reduce_grads: {
    short: 'ALLRED',
    core: true,
    waits: true,
    simulate(_a, c) {
      stepReady(c);
      return true;
    },
    memory(_a, w) {
      w.bump(w.t.maxParam); // a sum replaces its accumulator one parameter at a time
    },
    cost: free,
  },
  poll_grads: {
    short: 'POLL',
    core: true,
    waits: false,
    simulate(a, c) {
      if (a.stage === c.stages - 1) c.fail('the last stage has no next stage');
      // every gradient sent by this device's clock is in the channel once the next stage's clock is past it
      if (!c.force && !c.caughtUp(a.stage + 1)) return false;
      const q = c.gradChannel(a.stage);
      while (q.length > 0 && q[0].t <= c.ready) takeGrad(c, q.shift()!);
      return true;
    },
    memory: nothing,
    cost: free,
  },
  drain_grads: {
    short: 'DRAIN',
    core: true,
    waits: true,
    simulate(a, c) {
      if (a.stage === c.stages - 1) c.fail('the last stage has no next stage');
      const back = c.gradsBack(a.stage);
      const coming = new Set(
        [...c.st.sentAct].filter((mb) => back.has(mb) && !c.st.gradIn.has(mb)),
      );
      const q = c.gradChannel(a.stage);
      for (const msg of q) coming.delete(msg.mb);
      if (coming.size > 0) return false;
      for (let msg = q.shift(); msg; msg = q.shift())
        c.ready = Math.max(c.ready, takeGrad(c, msg));
      return true;
    },
    memory: nothing,
    cost: free,
  },
  forward: {
    short: 'F',
    core: false,
    waits: false,
    lower: (a, c) => ({
      before: c.remotePrev
        ? [{ op: 'recv_act', stage: a.stage, mb: a.mb }]
        : [],
      after: c.remoteNext ? [{ op: 'send_act', stage: a.stage, mb: a.mb }] : [],
    }),
    simulate(a, c) {
      if (a.stage > 0 && !c.st.received.has(a.mb))
        c.fail('forward before its input was received');
      if (c.st.forwarded.has(a.mb)) c.fail('micro-batch forwarded twice');
      c.st.forwarded.add(a.mb);
      handOver(c, a.stage + 1, 'input', a.mb);
      return true;
    },
    memory(a, w) {
      w.bump(w.t.fwdPeak);
      if (a.keep) {
        w.cur += w.t.kept; // the output is part of the tape; the copy sent on shares its data
        w.kept.add(a.mb);
      } else if (!w.last) {
        w.cur += w.t.outBytes; // output held until sent
      }
    },
    cost: (_a, t) => t.fwd,
  },
  backward: {
    short: 'B',
    core: false,
    waits: false,
    lower: (a, c) => ({
      before: c.remoteNext
        ? [{ op: 'recv_grad', stage: a.stage, mb: a.mb }]
        : [],
      after: c.remotePrev
        ? [{ op: 'send_grad', stage: a.stage, mb: a.mb }]
        : [],
    }),
    simulate(a, c) {
      if (!c.st.forwarded.has(a.mb)) c.fail('backward before forward');
      if (a.stage < c.stages - 1 && !c.st.gradIn.has(a.mb))
        c.fail('backward before its output gradient was received');
      if (c.st.backwarded.has(a.mb)) c.fail('micro-batch backwarded twice');
      c.st.backwarded.add(a.mb);
      handOver(c, a.stage - 1, 'grad', a.mb);
      return true;
    },
    memory(a, w) {
      backwardBytes(a.mb, w, w.t.bwdPeak, 0);
      accumulate(w, w.t.params, w.t.maxParam);
    },
    cost: (a, t) => t.bwd + (t.recomputes(a.mb) ? t.fwd : 0),
  },
  backward_input: {
    short: 'I',
    core: false,
    waits: false,
    lower: (a, c) => OPS.backward.lower!({ ...a, op: 'backward' }, c),
    simulate(a, c) {
      if (!OPS.backward.simulate({ ...a, op: 'backward' }, c)) return false;
      c.st.weightPending.add(a.mb);
      return true;
    },
    memory(a, w) {
      // as a full backward, less the parameter gradients; of the tape, what W reads stays (the
      // saved inputs of the weight products and their output gradients)
      const t = w.t;
      backwardBytes(
        a.mb,
        w,
        t.bwdInputPeak ?? t.bwdPeak,
        t.weightHeld ?? t.kept,
      );
    },
    cost: (a, t) => splitCost(t).i + (t.recomputes(a.mb) ? t.fwd : 0),
  },
  backward_weight: {
    short: 'W',
    core: false,
    waits: false,
    simulate(a, c) {
      if (!c.st.weightPending.has(a.mb))
        c.fail('weight gradient (W) before its input gradient (I)');
      c.st.weightPending.delete(a.mb);
      return true;
    },
    memory(_a, w) {
      const t = w.t;
      w.bump(t.params); // this micro-batch's parameter gradients, made from what I left
      w.cur -= t.weightHeld ?? t.kept;
      accumulate(w, t.params, t.maxParam);
    },
    cost: (_a, t) => splitCost(t).w,
  },
  optimizer_step: {
    short: 'STEP',
    core: false,
    waits: false,
    simulate(_a, c) {
      stepReady(c);
      const st = c.st;
      if (st.trains) {
        const missing = st.layers.filter(
          (l) =>
            !st.pushed.has(l) ||
            (st.unpushed.get(l) ?? 0) > 0 ||
            (st.layerBwd.get(l)?.size ?? 0) < c.m,
        );
        if (missing.length > 0)
          c.fail(
            `step before every layer's gradients of every micro-batch were pushed (layers ${missing.join(', ')} not pushed)`,
          );
      }
      return true;
    },
    memory(_a, w) {
      w.bump(w.t.optTransient);
      w.cur -= w.grads;
      w.grads = 0;
    },
    cost: (_a, t) => t.opt,
  },
  local_update: {
    short: 'L',
    core: false,
    waits: false,
    lower: (a, c) => {
      const after: Action[] = [];
      if (c.remoteNext)
        after.push({ op: 'send_act', stage: a.stage, mb: a.mb });
      if (c.overlap && c.remotePrev)
        after.push({ op: 'send_grad', stage: a.stage, mb: a.mb });
      if (c.overlap && !c.overlap.deterministic && c.remoteNext)
        after.push({ op: 'poll_grads', stage: a.stage });
      return {
        before: c.remotePrev
          ? [{ op: 'recv_act', stage: a.stage, mb: a.mb }]
          : [],
        after,
      };
    },
    simulate(a, c) {
      if (a.stage > 0 && !c.st.received.has(a.mb))
        c.fail('local update before its input was received');
      if (c.st.forwarded.has(a.mb)) c.fail('micro-batch updated twice');
      c.st.forwarded.add(a.mb);
      c.st.backwarded.add(a.mb);
      c.st.updates++;
      handOver(c, a.stage + 1, 'input', a.mb);
      return true;
    },
    memory(_a, w) {
      const t = w.t;
      const out = w.last ? 0 : t.outBytes; // the copy of the output to send on
      const stash = w.tail ? w.tail.inBytes : 0; // the tail's input, kept for the overlap
      w.bump(t.fwdPeak);
      w.cur += t.kept + out + stash;
      w.bump(t.bwdPeak);
      // the tape is freed; the input and labels are disposed; the input gradient stays when it is sent back
      w.cur +=
        -t.kept - t.inBytes - w.labelBytes + (w.sendsInputGrad ? t.inBytes : 0);
      accumulate(w, t.params, t.maxParam);
    },
    cost: (_a, t) => t.fwd + t.bwd,
  },
  overlap_backward: {
    short: 'O',
    core: false,
    waits: false,
    lower: (a, c) => ({
      before: c.remoteNext
        ? [{ op: 'recv_grad', stage: a.stage, mb: a.mb }]
        : [],
    }),
    simulate(a, c) {
      if (!c.st.gradIn.has(a.mb))
        c.fail('overlap backward before its gradient was received');
      if (!c.st.forwarded.has(a.mb))
        c.fail('overlap backward of a micro-batch this stage did not update');
      return true;
    },
    memory(_a, w) {
      const tail = w.tail;
      if (!tail) return;
      w.bump(tail.fwdPeak); // the tail again, on the tape, from its stashed input
      w.bump(tail.kept + tail.bwdPeak);
      accumulate(w, tail.params, tail.maxParam);
      w.cur -= tail.inBytes + w.t.outBytes; // the stash entry and the received gradient
    },
    cost: (_a, t) => t.tail,
  },
  local_step: {
    short: 'LSTEP',
    core: false,
    waits: false,
    simulate(_a, c) {
      if (c.st.updates === 0)
        c.fail(
          'local step with no local_update since the previous step (nothing to apply)',
        );
      c.st.updates = 0;
      return true;
    },
    memory(_a, w) {
      w.bump(w.t.maxParam); // the gradient norm, one parameter at a time
      w.bump(w.t.optTransient);
      w.cur -= w.grads;
      w.grads = 0;
    },
    cost: (_a, t) => t.opt,
  },
  load_layer: {
    short: 'LOAD',
    core: false,
    waits: false,
    simulate(a, c) {
      c.st.loaded.add(a.layer);
      return true;
    },
    memory(a, w) {
      if (!w.loaded.has(a.layer)) {
        w.loaded.add(a.layer);
        w.cur += loadedBytes(w.layers[a.layer]);
      }
    },
    cost: free,
  },
  prefetch_layer: {
    short: 'PREF',
    core: false,
    waits: false,
    // may upload nothing (the parameter server is not ready): only load_layer makes a layer usable
    simulate: () => true,
    memory(a, w) {
      OPS.load_layer.memory({ ...a, op: 'load_layer' }, w); // predicted as if the server were ready
    },
    cost: free,
  },
  release_layer: {
    short: 'FREE',
    core: false,
    waits: false,
    simulate(a, c) {
      c.st.loaded.delete(a.layer); // no-op when not loaded, as in the runtime
      return true;
    },
    memory(a, w) {
      if (w.loaded.delete(a.layer)) w.cur -= loadedBytes(w.layers[a.layer]);
    },
    cost: free,
  },
  layer_forward: {
    short: 'F',
    core: false,
    waits: false,
    simulate(a, c) {
      const l = a.layer;
      const st = c.st;
      mustBeLoaded(c, l);
      if (a.grad && l === st.lastLayer)
        c.fail(
          `forward with grad through the last layer ${l}: the relay fuses its forward into layer_backward`,
        );
      const fwdOf = (x: number) => layerMap(st.layerFwd, x, () => new Map());
      const below = layerBelow(st, l);
      if (below !== undefined && !fwdOf(below).has(a.mb))
        c.fail(
          `forward through layer ${l} before the forward of micro-batch ${a.mb} through layer ${below}`,
        );
      if (below === undefined && c.stage > 0 && !st.received.has(a.mb))
        c.fail(
          `forward through layer ${l}, the stage's first, before micro-batch ${a.mb}'s input was received`,
        );
      if (fwdOf(l).has(a.mb))
        c.fail(`micro-batch ${a.mb} forwarded twice through layer ${l}`);
      fwdOf(l).set(a.mb, a.grad);
      if (layerAbove(st, l) === undefined && l !== st.lastLayer) {
        // the stage's last layer: its output goes to the next stage
        st.forwarded.add(a.mb);
        handOver(c, c.stage + 1, 'input', a.mb);
      }
      return true;
    },
    memory(a, w) {
      const l = w.layers[a.layer];
      const first = a.layer === w.firstLayer; // its input: the step's, or received (recv_act)
      if (w.hostStash && !first) w.cur += l.inBytes; // uploaded from the host stash
      w.bump(l.fwdPeakBytes);
      if (a.layer === w.lastLayer && a.layer < w.layers.length - 1) {
        w.cur += l.outBytes; // the stage's output, held until send_act
        if (w.hostStash && a.layer > 0) w.cur -= l.inBytes; // the input, downloaded to the stash
      } else if (w.hostStash) {
        w.bump(l.outBytes); // the output, downloaded to the host stash and freed
        if (a.layer > 0) w.cur -= l.inBytes;
      } else {
        w.cur += l.outBytes; // the output stays on the device as the next layer's stashed input
      }
    },
    cost: (a, t) => t.layer(a.layer).fwd,
  },
  layer_backward: {
    short: 'B',
    core: false,
    waits: false,
    simulate(a, c) {
      const l = a.layer;
      const st = c.st;
      mustBeLoaded(c, l);
      const fwdOf = (x: number) => layerMap(st.layerFwd, x, () => new Map());
      const bwdOf = (x: number) =>
        layerMap(st.layerBwd, x, () => new Set<number>());
      const below = layerBelow(st, l);
      const above = layerAbove(st, l);
      if (below !== undefined && !fwdOf(below).has(a.mb))
        c.fail(
          `backward through layer ${l} before the forward of micro-batch ${a.mb} through layer ${below} (no stashed input)`,
        );
      if (below === undefined && c.stage > 0 && !st.received.has(a.mb))
        c.fail(
          `backward through layer ${l}, the stage's first, before micro-batch ${a.mb}'s input was received`,
        );
      if (fwdOf(l).get(a.mb) === false)
        c.fail(
          `backward through layer ${l} after a forward without grad, which kept no input`,
        );
      if (above !== undefined && !bwdOf(above).has(a.mb))
        c.fail(
          `backward through layer ${l} before the backward of micro-batch ${a.mb} through layer ${above} (no incoming gradient)`,
        );
      if (above === undefined && l !== st.lastLayer && !st.gradIn.has(a.mb))
        c.fail(
          `backward through layer ${l}, the stage's last, before micro-batch ${a.mb}'s output gradient was received`,
        );
      if (bwdOf(l).has(a.mb))
        c.fail(`micro-batch ${a.mb} backwarded twice through layer ${l}`);
      for (const [other, n] of st.unpushed) {
        if (other !== l && n > 0)
          c.fail(
            `backward through layer ${l} while layer ${other}'s gradients are not pushed (one layer's gradient is accumulated at a time)`,
          );
      }
      bwdOf(l).add(a.mb);
      st.unpushed.set(l, (st.unpushed.get(l) ?? 0) + 1);
      if (below === undefined) {
        // the stage's first layer: the micro-batch has been through the stage (on the model's
        // last stage maybe only here), and its input gradient goes to the previous stage
        st.forwarded.add(a.mb);
        st.backwarded.add(a.mb);
        handOver(c, c.stage - 1, 'grad', a.mb);
      }
      return true;
    },
    memory(a, w) {
      const l = w.layers[a.layer];
      const last = a.layer === w.layers.length - 1;
      if (w.hostStash && a.layer > 0) w.cur += l.inBytes;
      w.bump(l.fwdPeakBytes); // re-computation on the tape
      w.cur += l.keptBytes;
      w.bump(l.bwdPeakBytes);
      w.cur -= l.keptBytes;
      // adding into the accumulated gradient: this micro-batch's gradients are all alive while
      // each parameter's sum is made (the accumulator frees them one parameter at a time)
      if (w.gradsStarted.has(a.layer)) w.bump(l.paramBytes + l.maxParamBytes);
      else {
        w.gradsStarted.add(a.layer);
        w.cur += l.paramBytes;
      }
      if (a.layer > 0) w.cur += l.inBytes; // the input gradient, for the layer below
      if (!last) w.cur -= l.outBytes; // the incoming gradient is freed
      w.cur -= l.inBytes; // the stashed input (layer 0: the micro-batch's tokens)
      if (last) w.cur -= w.labelBytes;
    },
    cost: (a, t) => t.layer(a.layer).bwd,
  },
  push_grads: {
    short: 'PUSH',
    core: false,
    waits: false,
    simulate(a, c) {
      const l = a.layer;
      const st = c.st;
      if (!st.unpushed.get(l))
        c.fail(
          `push of layer ${l} with no backward through it since its last push (pushed twice)`,
        );
      st.unpushed.set(l, 0);
      st.pushed.add(l);
      return true;
    },
    memory(a, w) {
      const l = w.layers[a.layer];
      w.bump(l.maxParamBytes); // the sum of squares, one parameter at a time
      if (w.gradsStarted.delete(a.layer)) w.cur -= l.paramBytes;
    },
    cost: free,
  },
};

/**
 * The declaration of `op`. Throws an Error naming the op when nothing declares it (an action
 * from a file or another program that this version does not know): an undeclared op is never
 * free.
 */
export function declarationOf(op: string): OpSpec<Op> {
  const spec = Object.hasOwn(OPS, op)
    ? (OPS as Record<string, OpSpec<Op>>)[op]
    : undefined;
  if (!spec)
    throw new Error(
      `op '${op}' has no declaration (schedule/ops.ts OPS); declared: ${Object.keys(OPS).join(', ')}`,
    );
  return spec;
}

// every declaration agrees with the core ops' list (checked once, when this module loads)
for (const op of Object.keys(OPS) as Op[]) {
  if (OPS[op].core !== (CORE_OPS as readonly string[]).includes(op))
    throw new Error(
      `op '${op}' is declared ${OPS[op].core ? 'core' : 'compute'} but CORE_OPS says otherwise`,
    );
}
