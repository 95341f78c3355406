/**
 * Discrete-event simulation of a {@link Schedule}: runs every device's action list, each action
 * by its op's declared rule (schedule/ops.ts), against unbounded FIFO channels (activations s -> s+1, gradients s+1 -> s), checks that each action's
 * data dependencies are met and returns the resulting timeline. Pure (no tensors): used by tests,
 * to validate schedules and to predict bubbles. What it checks, per kind of schedule:
 *
 * - Backprop pipeline (gpipe, 1F1B, evaluation): no deadlock (every receive is matched by a
 *   send); activations and gradients are received in the order they were sent; forward before
 *   send_act, a stage's input received before its forward; backward only after the forward and,
 *   but on the last stage, after the output gradient arrived; no micro-batch forwarded or
 *   backwarded twice; send_grad after backward; reduce_grad_norm and optimizer_step only after
 *   every forwarded micro-batch was backwarded; no receive or send past the pipeline's ends;
 *   every message sent is received.
 * - Local parallelism (localSchedule, flushSchedule): a local_update after its input arrived, at
 *   most once per micro-batch; local_step only after at least one local_update since the
 *   previous local_step; overlap_backward only for an updated micro-batch whose gradient arrived;
 *   poll_grads and drain_grads only on a stage that has a next stage, and every gradient they
 *   take belongs to a micro-batch the stage updated. poll_grads never waits: it takes the
 *   gradients sent by the stage's clock (the simulation makes sure the next stage has run up to
 *   that time first; a gradient sent at the very same instant may count as not yet arrived).
 *   drain_grads waits for the gradient of every micro-batch the stage sent on and the next stage
 *   sends back (by its schedule). Gradients still in flight at the end are an error, except
 *   where the receiving stage's last gradient-taking action is a poll_grads: those are carried to
 *   the next mini-batch (its polls or the flush take them) and listed in {@link SimResult.carried}.
 * - L2L relay (relaySchedule, relayEvalSchedule: one stage of every layer; relayPipelineSchedule:
 *   a stage per device, each with its range of layers): a stage's layers are those its actions
 *   name, the model's last layer the largest any stage names, and M the largest micro-batch
 *   index + 1 (of the whole schedule). layer_forward and layer_backward use a layer that
 *   load_layer put on the device and no release_layer removed since (a prefetch_layer alone
 *   does not count: the runtime skips it when the parameter server is not ready); releasing a
 *   layer that is not loaded is a no-op, like loading one that is. layer_forward of layer l and
 *   micro-batch i comes after the forward of i through the stage's layer below l (the stage's
 *   first layer: after i's input was received, except on stage 0), at most once, and never with
 *   grad on the model's last layer (its forward is fused into its backward); through the stage's
 *   last layer it makes i's output, for send_act. layer_backward of l, i comes after the forward
 *   below (its stashed input), not after a grad: false forward of l, i (which keeps no input),
 *   after the backward of i through the layer above (its incoming gradient; the stage's last
 *   layer: the gradient received, except on the model's last layer), at most once, and not
 *   while another layer has gradients that were not pushed (the stage accumulates one layer's
 *   gradient at a time); through the stage's first layer it makes i's input gradient, for
 *   send_grad. push_grads of a layer takes the backwards since its last push (at least one).
 *   optimizer_step of a training stage (one with a layer_backward) only after every layer was
 *   backwarded for all M micro-batches and pushed.
 *
 * Errors read `invalid schedule: stage S {action as JSON}: why`.
 */
import {
  type CostTerms,
  declarationOf,
  type OpSpec,
  type SimContext,
  type SimMessage,
  type SimStage,
  UNIT_COSTS,
} from './ops.js';
import type { Action, Schedule } from './schedule.js';

/** Cost in seconds of one action on one device. */
export type CostFn = (device: number, a: Action) => number;

/** Cost of `a` from its op's declaration (schedule/ops.ts `cost`) with the terms `t`. */
export function opCost(a: Action, t: CostTerms): number {
  return (declarationOf(a.op) as OpSpec<typeof a.op>).cost(a, t);
}

/**
 * Default costs ({@link UNIT_COSTS} through each op's declaration): forward and layer_forward
 * 1, backward and layer_backward 2, local_update (a forward and a backward) 3, everything else 0.
 */
export const defaultCost: CostFn = (_, a) => opCost(a, UNIT_COSTS);

/** One executed action on the simulated timeline (seconds). */
export interface SimEvent {
  /** The device that ran it (its index in the schedule). */
  device: number;
  /** The action's stage. */
  stage: number;
  action: Action;
  start: number;
  end: number;
}

/** Result of {@link simulate}. */
export interface SimResult {
  events: SimEvent[];
  /** Wall time of the step, seconds. */
  makespan: number;
  /** Per device, idle fraction of the makespan. */
  bubble: number[];
  /**
   * Gradients still in flight at the end towards a stage that takes them with poll_grads
   * (free-running local parallelism): `stage` will take the gradient of `mb` in the next
   * mini-batch or in the flush. Empty for every other schedule.
   */
  carried: Array<{ stage: number; mb: number }>;
}

function newStage(acts: readonly Action[]): SimStage {
  return {
    received: new Set(),
    forwarded: new Set(),
    gradIn: new Set(),
    backwarded: new Set(),
    weightPending: new Set(),
    sentAct: new Set(),
    updates: 0,
    layers: [
      ...new Set(acts.flatMap((a) => ('layer' in a ? [a.layer] : []))),
    ].sort((x, y) => x - y),
    lastLayer: -1, // set once every stage is known
    trains: acts.some((a) => a.op === 'layer_backward'),
    loaded: new Set(),
    layerFwd: new Map(),
    layerBwd: new Map(),
    pushed: new Set(),
    unpushed: new Map(),
  };
}

/** The simulation's state: the schedule, per device and per stage where it stands. */
interface Sim {
  schedule: Schedule;
  cost: CostFn;
  /** Per device: the index of its next action, its clock and its busy time (seconds). */
  pc: number[];
  clock: number[];
  busy: number[];
  /** The device of each stage, and each stage's actions. */
  placement: Map<number, number>;
  byStage: Map<number, Action[]>;
  /** Stages S. */
  stages: number;
  /** Channels: act[s] carries activations s -> s+1, grad[s] carries gradients s+1 -> s. */
  act: SimMessage[][];
  grad: SimMessage[][];
  /** Micro-batches M: the largest index + 1 in the whole schedule. */
  m: number;
  /** Each stage's simulation state. */
  state: SimStage[];
  /** Per stage, the micro-batches whose gradient the next stage sends back (what drain_grads waits for). */
  gradsBack: Set<number>[];
  events: SimEvent[];
}

/** Throws the simulation's error for action `a` of stage `s`, with the action attached (a schedule file marks it). */
function fail(s: number, a: Action, why: string): never {
  throw Object.assign(
    new Error(`invalid schedule: stage ${s} ${JSON.stringify(a)}: ${why}`),
    { action: a },
  );
}

/**
 * Each stage's device and actions, from the device lists. Throws an Error when a stage has
 * actions on two devices.
 */
function placeStages(schedule: Schedule): {
  placement: Map<number, number>;
  byStage: Map<number, Action[]>;
} {
  const placement = new Map<number, number>();
  const byStage = new Map<number, Action[]>();
  schedule.forEach((acts, d) => {
    for (const a of acts) {
      const at = placement.get(a.stage);
      if (at !== undefined && at !== d)
        throw new Error(
          `invalid schedule: stage ${a.stage} has actions on devices ${at} and ${d} (a stage runs on one device)`,
        );
      placement.set(a.stage, d);
      if (!byStage.has(a.stage)) byStage.set(a.stage, []);
      byStage.get(a.stage)!.push(a);
    }
  });
  return { placement, byStage };
}

/** The simulation at time 0: every device at its first action, channels empty, stages fresh. Throws as {@link placeStages}. */
function newSim(schedule: Schedule, cost: CostFn): Sim {
  const devices = schedule.length;
  const pc = new Array<number>(devices).fill(0);
  const clock = new Array<number>(devices).fill(0);
  const busy = new Array<number>(devices).fill(0);
  const { placement, byStage } = placeStages(schedule);
  // at least one stage per device: a device whose list is empty still runs its stage (a flush)
  const stages = Math.max(devices, ...[...placement.keys()].map((s) => s + 1));
  const act: SimMessage[][] = Array.from({ length: stages }, () => []);
  const grad: SimMessage[][] = Array.from({ length: stages }, () => []);
  const m = schedule.reduce(
    (n, acts) =>
      acts.reduce((x, a) => ('mb' in a ? Math.max(x, a.mb + 1) : x), n),
    0,
  );
  const state = Array.from({ length: stages }, (_, s) =>
    newStage(byStage.get(s) ?? []),
  );
  const lastLayer = Math.max(-1, ...state.flatMap((st) => st.layers));
  for (const st of state) st.lastLayer = lastLayer;
  const gradsBack = state.map(
    (_, s) =>
      new Set(
        (byStage.get(s + 1) ?? []).flatMap((a) =>
          a.op === 'send_grad' ? [a.mb] : [],
        ),
      ),
  );
  return {
    schedule,
    cost,
    pc,
    clock,
    busy,
    placement,
    byStage,
    stages,
    act,
    grad,
    m,
    state,
    gradsBack,
    events: [],
  };
}

/** Whether device d has run its whole list. */
function finished(sim: Sim, d: number): boolean {
  return sim.pc[d] >= sim.schedule[d].length;
}

/** What an op's simulation rule sees of action `a`, device d's next (`force`: a poll_grads goes ahead now). */
function contextOf(sim: Sim, d: number, a: Action, force: boolean): SimContext {
  const { state, placement, clock } = sim;
  return {
    stage: a.stage,
    st: state[a.stage],
    stages: sim.stages,
    m: sim.m,
    ready: clock[d],
    force,
    fail: (why) => fail(a.stage, a, why),
    stateOf: (s) => state[s],
    local: (s) => placement.get(s) === d,
    actChannel: (s) => sim.act[s],
    gradChannel: (s) => sim.grad[s],
    caughtUp: (s) => {
      const e = placement.get(s);
      return e === undefined || finished(sim, e) || clock[e] > clock[d];
    },
    gradsBack: (s) => sim.gradsBack[s] ?? new Set(),
    deviceStages: () =>
      [...placement].filter(([, x]) => x === d).map(([s]) => s),
  };
}

/**
 * Runs device d's next action if its inputs are there (`force`: a poll_grads goes ahead now):
 * its event recorded, the device's clock and busy time advanced by its cost. Returns whether it
 * ran. Throws (see {@link fail}) when its op has no declaration or its rule finds it invalid.
 */
function tryRun(sim: Sim, d: number, force: boolean): boolean {
  const a = sim.schedule[d][sim.pc[d]];
  const spec = (() => {
    try {
      return declarationOf(a.op) as OpSpec<typeof a.op>;
    } catch (e) {
      return fail(a.stage, a, (e as Error).message);
    }
  })();
  const c = contextOf(sim, d, a, force);
  if (!spec.simulate(a, c)) return false;
  const cost_ = sim.cost(d, a);
  sim.events.push({
    device: d,
    stage: a.stage,
    action: a,
    start: c.ready,
    end: c.ready + cost_,
  });
  sim.clock[d] = c.ready + cost_;
  sim.busy[d] += cost_;
  sim.pc[d]++;
  return true;
}

/**
 * Runs every device as far as it can, again and again; when all are stuck, the earliest
 * poll_grads goes ahead with what has arrived (it never waits). Returns when no device can
 * go on (finished or waiting for ever).
 */
function runAll(sim: Sim): void {
  const devices = sim.schedule.length;
  for (;;) {
    let progressed = false;
    for (let d = 0; d < devices; d++) {
      while (!finished(sim, d) && tryRun(sim, d, false)) progressed = true;
    }
    if (progressed) continue;
    // Stuck: the earliest poll_grads goes ahead with what has arrived (it never waits).
    let p = -1;
    for (let d = 0; d < devices; d++) {
      if (
        !finished(sim, d) &&
        sim.schedule[d][sim.pc[d]].op === 'poll_grads' &&
        (p < 0 || sim.clock[d] < sim.clock[p])
      )
        p = d;
    }
    if (p < 0) break;
    tryRun(sim, p, true);
  }
}

/** Throws a deadlock error at the first device that did not run its whole list. */
function checkAllRan(sim: Sim): void {
  for (let d = 0; d < sim.schedule.length; d++) {
    if (!finished(sim, d)) {
      const a = sim.schedule[d][sim.pc[d]];
      fail(a.stage, a, 'deadlock: waits for a message that is never sent');
    }
  }
}

/**
 * The gradients still in flight at the end, towards stages whose last gradient-taking action
 * is a poll_grads (carried to the next mini-batch). Throws an Error for an activation never
 * received, or a gradient never received by any other stage.
 */
function carriedGradients(sim: Sim): SimResult['carried'] {
  const { act, grad } = sim;
  const carried: SimResult['carried'] = [];
  for (let s = 0; s < sim.stages - 1; s++) {
    if (act[s].length)
      throw new Error(
        `invalid schedule: stage ${s + 1} never receives the activation of micro-batch ${act[s][0].mb} that stage ${s} sends`,
      );
    if (grad[s].length) {
      const takers = (sim.byStage.get(s) ?? []).filter(
        (a) =>
          a.op === 'poll_grads' ||
          a.op === 'drain_grads' ||
          a.op === 'recv_grad',
      );
      if (takers.at(-1)?.op !== 'poll_grads')
        throw new Error(
          `invalid schedule: stage ${s} never receives the gradient of micro-batch ${grad[s][0].mb} that stage ${s + 1} sends`,
        );
      for (const msg of grad[s]) carried.push({ stage: s, mb: msg.mb });
    }
  }
  return carried;
}

/**
 * Simulates a lowered schedule (per device, its actions; each action names its stage): every
 * action runs by its op's simulation rule (schedule/ops.ts), which checks its data dependencies
 * and says whether it can run yet. The stages are 0 .. S-1 with S the largest stage index + 1;
 * a stage runs on the device whose list has its actions, and stages on one device hand
 * activations and gradients to each other directly. S is at least the number of devices. Throws an Error naming the stage and action
 * when the schedule is invalid (see the module documentation for every check): a receive that
 * can never be matched (deadlock), a backward of a micro-batch that had no forward, a
 * micro-batch run twice, a step before all backwards, a relay layer used while not loaded or
 * out of order, a local step with nothing to apply, an op nothing declares.
 */
export function simulate(
  schedule: Schedule,
  cost: CostFn = defaultCost,
): SimResult {
  const sim = newSim(schedule, cost);
  runAll(sim);
  checkAllRan(sim);
  const carried = carriedGradients(sim);
  const makespan = Math.max(0, ...sim.clock);
  return {
    events: sim.events,
    makespan,
    bubble: sim.busy.map((b) => (makespan > 0 ? 1 - b / makespan : 0)),
    carried,
  };
}
