/**
 * Discrete-event simulation of a {@link Schedule}: runs every stage's action list against
 * unbounded FIFO channels (activations s -> s+1, gradients s+1 -> s), checks that each action's
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
 * - L2L relay (relaySchedule, relayEvalSchedule; per stage, normally one): L layers and M
 *   micro-batches are inferred as the largest layer index + 1 (of the stage) and the largest
 *   micro-batch index + 1 (of the whole schedule). layer_forward and layer_backward use a layer
 *   that load_layer put on the device and no release_layer removed since (a prefetch_layer alone
 *   does not count: the runtime skips it when the parameter server is not ready); releasing a
 *   layer that is not loaded is a no-op, like loading one that is. layer_forward of layer l and
 *   micro-batch i comes after layer l-1's forward of i, at most once, and never with grad on the
 *   last layer (its forward is fused into its backward). layer_backward of layer l, i comes after
 *   layer l-1's forward of i (its stashed input), not after a grad: false forward of l, i (which
 *   keeps no input), below the last layer after layer l+1's backward of i (its incoming
 *   gradient), at most once, and not while another layer has gradients that were not pushed (the
 *   stage accumulates one layer's gradient at a time). push_grads of a layer only after all M
 *   micro-batches were backwarded through it, at most once. optimizer_step of a training stage
 *   (one with a layer_backward) only after all L layers were pushed.
 *
 * Errors read `invalid schedule: stage S {action as JSON}: why`.
 */
import type { Action, Schedule } from './schedule.js';

/** Cost in seconds of one action kind on one stage. */
export type CostFn = (stage: number, a: Action) => number;

/**
 * Default costs: forward and layer_forward 1, backward and layer_backward 2, local_update (a
 * forward and a backward) 3, everything else 0.
 */
export const defaultCost: CostFn = (_, a) => {
  switch (a.op) {
    case 'forward':
    case 'layer_forward':
      return 1;
    case 'backward':
    case 'layer_backward':
      return 2;
    case 'local_update':
      return 3;
    default:
      return 0;
  }
};

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
  /**
   * Gradients still in flight at the end towards a stage that takes them with poll_grads
   * (free-running local parallelism): `stage` will take the gradient of `mb` in the next
   * mini-batch or in the flush. Empty for every other schedule.
   */
  carried: Array<{ stage: number; mb: number }>;
}

interface Msg {
  mb: number;
  t: number;
}

/**
 * Simulates a schedule. Throws an Error naming the stage and action when the schedule is
 * invalid (see the module documentation for every check): a receive that can never be matched
 * (deadlock), a backward of a micro-batch that had no forward, a micro-batch run twice, a step
 * before all backwards, a relay layer used while not loaded or out of order, a local step with
 * nothing to apply.
 */
export function simulate(
  schedule: Schedule,
  cost: CostFn = defaultCost,
): SimResult {
  const k = schedule.length;
  const pc = new Array<number>(k).fill(0);
  const clock = new Array<number>(k).fill(0);
  const busy = new Array<number>(k).fill(0);
  // channels: act[s] carries activations s -> s+1, grad[s] carries gradients s+1 -> s
  const act: Msg[][] = Array.from({ length: k }, () => []);
  const grad: Msg[][] = Array.from({ length: k }, () => []);
  // micro-batches: the largest index + 1 in the whole schedule
  const m = schedule.reduce(
    (n, acts) =>
      acts.reduce((x, a) => ('mb' in a ? Math.max(x, a.mb + 1) : x), n),
    0,
  );
  const state = schedule.map((acts) => ({
    received: new Set<number>(),
    forwarded: new Set<number>(),
    gradIn: new Set<number>(),
    backwarded: new Set<number>(),
    /** micro-batches whose activation this stage sent on */
    sentAct: new Set<number>(),
    /** local_update actions since the last local_step */
    updates: 0,
    // relay: layers inferred per stage
    layers: acts.reduce(
      (n, a) => ('layer' in a ? Math.max(n, a.layer + 1) : n),
      0,
    ),
    trains: acts.some((a) => a.op === 'layer_backward'),
    loaded: new Set<number>(),
    /** per layer, micro-batch -> the forward's grad flag */
    layerFwd: new Map<number, Map<number, boolean>>(),
    layerBwd: new Map<number, Set<number>>(),
    pushed: new Set<number>(),
  }));
  // per stage, the micro-batches whose gradient the next stage sends back (what drain_grads waits for)
  const gradsBack = schedule.map(
    (_, s) =>
      new Set(
        s + 1 < k
          ? schedule[s + 1].flatMap((a) => (a.op === 'send_grad' ? [a.mb] : []))
          : [],
      ),
  );
  const events: SimEvent[] = [];
  const fail = (s: number, a: Action, why: string): never => {
    throw new Error(
      `invalid schedule: stage ${s} ${JSON.stringify(a)}: ${why}`,
    );
  };
  const fwdOf = (s: number, l: number) => {
    const f = state[s].layerFwd;
    if (!f.has(l)) f.set(l, new Map());
    return f.get(l)!;
  };
  const bwdOf = (s: number, l: number) => {
    const b = state[s].layerBwd;
    if (!b.has(l)) b.set(l, new Set());
    return b.get(l)!;
  };
  /** Takes an overlap gradient from the channel (poll_grads, drain_grads); returns its arrival time. */
  const takeGrad = (s: number, a: Action, msg: Msg): number => {
    if (!state[s].forwarded.has(msg.mb))
      fail(
        s,
        a,
        `gradient of micro-batch ${msg.mb}, which this stage did not update`,
      );
    state[s].gradIn.add(msg.mb);
    return msg.t;
  };
  const finished = (s: number) => pc[s] >= schedule[s].length;

  /** Runs stage s's next action if its inputs are there (`force`: a poll_grads goes ahead now); returns whether it ran. */
  const tryRun = (s: number, force: boolean): boolean => {
    const a = schedule[s][pc[s]];
    const st = state[s];
    let ready = clock[s];
    if (a.op === 'recv_act') {
      if (s === 0) fail(s, a, 'the first stage has no previous stage');
      const q = act[s - 1];
      if (q.length === 0) return false;
      const msg = q.shift()!;
      if (msg.mb !== a.mb)
        fail(
          s,
          a,
          `expected activation of micro-batch ${a.mb}, the channel delivers ${msg.mb}`,
        );
      st.received.add(a.mb);
      ready = Math.max(ready, msg.t);
    } else if (a.op === 'recv_grad') {
      if (s === k - 1) fail(s, a, 'the last stage has no next stage');
      const q = grad[s];
      if (q.length === 0) return false;
      const msg = q.shift()!;
      if (msg.mb !== a.mb)
        fail(
          s,
          a,
          `expected gradient of micro-batch ${a.mb}, the channel delivers ${msg.mb}`,
        );
      st.gradIn.add(a.mb);
      ready = Math.max(ready, msg.t);
    } else if (a.op === 'forward') {
      if (s > 0 && !st.received.has(a.mb))
        fail(s, a, 'forward before its input was received');
      if (st.forwarded.has(a.mb)) fail(s, a, 'micro-batch forwarded twice');
      st.forwarded.add(a.mb);
    } else if (a.op === 'send_act') {
      if (s === k - 1) fail(s, a, 'the last stage has no next stage');
      if (!st.forwarded.has(a.mb)) fail(s, a, 'send before forward');
      act[s].push({ mb: a.mb, t: clock[s] });
      st.sentAct.add(a.mb);
    } else if (a.op === 'backward') {
      if (!st.forwarded.has(a.mb)) fail(s, a, 'backward before forward');
      if (s < k - 1 && !st.gradIn.has(a.mb))
        fail(s, a, 'backward before its output gradient was received');
      if (st.backwarded.has(a.mb)) fail(s, a, 'micro-batch backwarded twice');
      st.backwarded.add(a.mb);
    } else if (a.op === 'send_grad') {
      if (s === 0) fail(s, a, 'the first stage has no previous stage');
      if (!st.backwarded.has(a.mb)) fail(s, a, 'send_grad before backward');
      grad[s - 1].push({ mb: a.mb, t: clock[s] });
    } else if (a.op === 'local_update') {
      if (s > 0 && !st.received.has(a.mb))
        fail(s, a, 'local update before its input was received');
      if (st.forwarded.has(a.mb)) fail(s, a, 'micro-batch updated twice');
      st.forwarded.add(a.mb);
      st.backwarded.add(a.mb);
      st.updates++;
    } else if (a.op === 'overlap_backward') {
      if (!st.gradIn.has(a.mb))
        fail(s, a, 'overlap backward before its gradient was received');
      if (!st.forwarded.has(a.mb))
        fail(
          s,
          a,
          'overlap backward of a micro-batch this stage did not update',
        );
    } else if (a.op === 'local_step') {
      if (st.updates === 0)
        fail(
          s,
          a,
          'local step with no local_update since the previous step (nothing to apply)',
        );
      st.updates = 0;
    } else if (a.op === 'poll_grads') {
      if (s === k - 1) fail(s, a, 'the last stage has no next stage');
      // every gradient sent by this stage's clock is in the channel once the next stage's clock is past it
      if (!force && !finished(s + 1) && clock[s + 1] <= clock[s]) return false;
      const q = grad[s];
      while (q.length > 0 && q[0].t <= clock[s]) takeGrad(s, a, q.shift()!);
    } else if (a.op === 'drain_grads') {
      if (s === k - 1) fail(s, a, 'the last stage has no next stage');
      const coming = new Set(
        [...st.sentAct].filter(
          (mb) => gradsBack[s].has(mb) && !st.gradIn.has(mb),
        ),
      );
      for (const msg of grad[s]) coming.delete(msg.mb);
      if (coming.size > 0) return false;
      for (let msg = grad[s].shift(); msg; msg = grad[s].shift())
        ready = Math.max(ready, takeGrad(s, a, msg));
    } else if (a.op === 'optimizer_step' || a.op === 'reduce_grad_norm') {
      if (st.backwarded.size !== st.forwarded.size)
        fail(s, a, 'step before every backward');
      if (
        a.op === 'optimizer_step' &&
        st.trains &&
        st.pushed.size < st.layers
      ) {
        const missing = Array.from({ length: st.layers }, (_, l) => l).filter(
          (l) => !st.pushed.has(l),
        );
        fail(
          s,
          a,
          `step before every layer's gradients were pushed (layers ${missing.join(', ')} not pushed)`,
        );
      }
    } else if (a.op === 'load_layer') {
      st.loaded.add(a.layer);
    } else if (a.op === 'prefetch_layer') {
      // may upload nothing (the parameter server is not ready): only load_layer makes a layer usable
    } else if (a.op === 'release_layer') {
      st.loaded.delete(a.layer); // no-op when not loaded, as in the runtime
    } else if (a.op === 'layer_forward') {
      const l = a.layer;
      if (!st.loaded.has(l))
        fail(
          s,
          a,
          `layer ${l} is not loaded (load_layer it first; released layers and prefetches do not count)`,
        );
      if (a.grad && l === st.layers - 1)
        fail(
          s,
          a,
          `forward with grad through the last layer ${l}: the relay fuses its forward into layer_backward`,
        );
      if (l > 0 && !fwdOf(s, l - 1).has(a.mb))
        fail(
          s,
          a,
          `forward through layer ${l} before the forward of micro-batch ${a.mb} through layer ${l - 1}`,
        );
      if (fwdOf(s, l).has(a.mb))
        fail(s, a, `micro-batch ${a.mb} forwarded twice through layer ${l}`);
      fwdOf(s, l).set(a.mb, a.grad);
    } else if (a.op === 'layer_backward') {
      const l = a.layer;
      if (!st.loaded.has(l))
        fail(
          s,
          a,
          `layer ${l} is not loaded (load_layer it first; released layers and prefetches do not count)`,
        );
      if (l > 0 && !fwdOf(s, l - 1).has(a.mb))
        fail(
          s,
          a,
          `backward through layer ${l} before the forward of micro-batch ${a.mb} through layer ${l - 1} (no stashed input)`,
        );
      if (fwdOf(s, l).get(a.mb) === false)
        fail(
          s,
          a,
          `backward through layer ${l} after a forward without grad, which kept no input`,
        );
      if (l < st.layers - 1 && !bwdOf(s, l + 1).has(a.mb))
        fail(
          s,
          a,
          `backward through layer ${l} before the backward of micro-batch ${a.mb} through layer ${l + 1} (no incoming gradient)`,
        );
      if (bwdOf(s, l).has(a.mb))
        fail(s, a, `micro-batch ${a.mb} backwarded twice through layer ${l}`);
      for (const [other, mbs] of st.layerBwd) {
        if (other !== l && mbs.size > 0 && !st.pushed.has(other))
          fail(
            s,
            a,
            `backward through layer ${l} while layer ${other}'s gradients are not pushed (one layer's gradient is accumulated at a time)`,
          );
      }
      bwdOf(s, l).add(a.mb);
    } else if (a.op === 'push_grads') {
      const l = a.layer;
      if (st.pushed.has(l)) fail(s, a, `gradients of layer ${l} pushed twice`);
      const done = bwdOf(s, l).size;
      if (done < m)
        fail(
          s,
          a,
          `push before every backward through layer ${l} (${done} of ${m} micro-batches)`,
        );
      st.pushed.add(l);
    }
    const c = cost(s, a);
    events.push({ stage: s, action: a, start: ready, end: ready + c });
    clock[s] = ready + c;
    busy[s] += c;
    pc[s]++;
    return true;
  };

  for (;;) {
    let progressed = false;
    for (let s = 0; s < k; s++) {
      while (!finished(s) && tryRun(s, false)) progressed = true;
    }
    if (progressed) continue;
    // Stuck: the earliest poll_grads goes ahead with what has arrived (it never waits).
    let p = -1;
    for (let s = 0; s < k; s++) {
      if (
        !finished(s) &&
        schedule[s][pc[s]].op === 'poll_grads' &&
        (p < 0 || clock[s] < clock[p])
      )
        p = s;
    }
    if (p < 0) break;
    tryRun(p, true);
  }
  for (let s = 0; s < k; s++) {
    if (!finished(s))
      fail(
        s,
        schedule[s][pc[s]],
        'deadlock: waits for a message that is never sent',
      );
  }
  const carried: SimResult['carried'] = [];
  for (let s = 0; s < k - 1; s++) {
    if (act[s].length)
      throw new Error(
        `invalid schedule: stage ${s + 1} never receives the activation of micro-batch ${act[s][0].mb} that stage ${s} sends`,
      );
    if (grad[s].length) {
      const takers = schedule[s].filter(
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
  const makespan = Math.max(0, ...clock);
  return {
    events,
    makespan,
    bubble: busy.map((b) => (makespan > 0 ? 1 - b / makespan : 0)),
    carried,
  };
}
