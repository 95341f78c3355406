/**
 * Discrete-event simulation of a {@link Schedule}: runs every stage's action list against
 * unbounded FIFO channels, checks that each action's data dependencies are met (no deadlock,
 * forward before backward, activations and gradients exchanged in a consistent order, every
 * message received) and
 * returns the resulting timeline. Pure: used by tests and to predict bubbles.
 */
import type { Action, Schedule } from './schedule.js';

/** Cost in seconds of one action kind on one stage. */
export type CostFn = (stage: number, a: Action) => number;

/** One executed action on the simulated timeline (seconds). */
export interface SimEvent {
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
  /** Per stage, idle fraction of the makespan. */
  bubble: number[];
}

/**
 * Simulates a schedule. Throws an Error naming the stage and action when the schedule is
 * invalid: a receive that can never be matched (deadlock), a backward of a micro-batch that
 * had no forward, a micro-batch run twice, or a step before all backwards.
 */
export function simulate(schedule: Schedule, cost: CostFn = (_, a) => (a.op === 'forward' ? 1 : a.op === 'backward' ? 2 : 0)): SimResult {
  const k = schedule.length;
  const pc = new Array<number>(k).fill(0);
  const clock = new Array<number>(k).fill(0);
  const busy = new Array<number>(k).fill(0);
  // channels: act[s] carries activations s -> s+1, grad[s] carries gradients s+1 -> s
  const act: Array<Array<{ mb: number; t: number }>> = Array.from({ length: k }, () => []);
  const grad: Array<Array<{ mb: number; t: number }>> = Array.from({ length: k }, () => []);
  const state = Array.from({ length: k }, () => ({
    received: new Set<number>(), forwarded: new Set<number>(), gradIn: new Set<number>(), backwarded: new Set<number>(),
  }));
  const events: SimEvent[] = [];
  const fail = (s: number, a: Action, why: string): never => {
    throw new Error(`invalid schedule: stage ${s} ${JSON.stringify(a)}: ${why}`);
  };
  let progressed = true;
  while (progressed) {
    progressed = false;
    for (let s = 0; s < k; s++) {
      while (pc[s] < schedule[s].length) {
        const a = schedule[s][pc[s]];
        const st = state[s];
        let ready = clock[s];
        if (a.op === 'recv_act') {
          if (s === 0) fail(s, a, 'the first stage has no previous stage');
          const q = act[s - 1];
          if (q.length === 0) break;
          const msg = q.shift()!;
          if (msg.mb !== a.mb) fail(s, a, `expected activation of micro-batch ${a.mb}, the channel delivers ${msg.mb}`);
          st.received.add(a.mb);
          ready = Math.max(ready, msg.t);
        } else if (a.op === 'recv_grad') {
          if (s === k - 1) fail(s, a, 'the last stage has no next stage');
          const q = grad[s];
          if (q.length === 0) break;
          const msg = q.shift()!;
          if (msg.mb !== a.mb) fail(s, a, `expected gradient of micro-batch ${a.mb}, the channel delivers ${msg.mb}`);
          st.gradIn.add(a.mb);
          ready = Math.max(ready, msg.t);
        } else if (a.op === 'forward') {
          if (s > 0 && !st.received.has(a.mb)) fail(s, a, 'forward before its input was received');
          if (st.forwarded.has(a.mb)) fail(s, a, 'micro-batch forwarded twice');
          st.forwarded.add(a.mb);
        } else if (a.op === 'send_act') {
          if (s === k - 1) fail(s, a, 'the last stage has no next stage');
          if (!st.forwarded.has(a.mb)) fail(s, a, 'send before forward');
          act[s].push({ mb: a.mb, t: clock[s] });
        } else if (a.op === 'backward') {
          if (!st.forwarded.has(a.mb)) fail(s, a, 'backward before forward');
          if (s < k - 1 && !st.gradIn.has(a.mb)) fail(s, a, 'backward before its output gradient was received');
          if (st.backwarded.has(a.mb)) fail(s, a, 'micro-batch backwarded twice');
          st.backwarded.add(a.mb);
        } else if (a.op === 'send_grad') {
          if (s === 0) fail(s, a, 'the first stage has no previous stage');
          if (!st.backwarded.has(a.mb)) fail(s, a, 'send_grad before backward');
          grad[s - 1].push({ mb: a.mb, t: clock[s] });
        } else if (a.op === 'local_update') {
          if (s > 0 && !st.received.has(a.mb)) fail(s, a, 'local update before its input was received');
          if (st.forwarded.has(a.mb)) fail(s, a, 'micro-batch updated twice');
          st.forwarded.add(a.mb);
          st.backwarded.add(a.mb);
        } else if (a.op === 'overlap_backward') {
          if (!st.gradIn.has(a.mb)) fail(s, a, 'overlap backward before its gradient was received');
          if (!st.forwarded.has(a.mb)) fail(s, a, 'overlap backward of a micro-batch this stage did not update');
        } else if (a.op === 'drain_grads') {
          if (s === k - 1) fail(s, a, 'the last stage has no next stage');
          for (let msg = grad[s].shift(); msg; msg = grad[s].shift()) {
            st.gradIn.add(msg.mb);
            ready = Math.max(ready, msg.t);
          }
        } else if (a.op === 'optimizer_step' || a.op === 'reduce_grad_norm') {
          if (st.backwarded.size !== st.forwarded.size) fail(s, a, 'step before every backward');
        }
        const c = cost(s, a);
        events.push({ stage: s, action: a, start: ready, end: ready + c });
        clock[s] = ready + c;
        busy[s] += c;
        pc[s]++;
        progressed = true;
      }
    }
  }
  for (let s = 0; s < k; s++) {
    if (pc[s] < schedule[s].length) fail(s, schedule[s][pc[s]], 'deadlock: waits for a message that is never sent');
  }
  for (let s = 0; s < k - 1; s++) {
    if (act[s].length) throw new Error(`invalid schedule: stage ${s + 1} never receives the activation of micro-batch ${act[s][0].mb} that stage ${s} sends`);
    if (grad[s].length) throw new Error(`invalid schedule: stage ${s} never receives the gradient of micro-batch ${grad[s][0].mb} that stage ${s + 1} sends`);
  }
  const makespan = Math.max(0, ...clock);
  return { events, makespan, bubble: busy.map((b) => (makespan > 0 ? 1 - b / makespan : 0)) };
}
