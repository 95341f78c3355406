import assert from 'node:assert/strict';
import { test } from 'node:test';
import {
  type Action,
  evalSchedule,
  flushSchedule,
  gpipeSchedule,
  localSchedule,
  oneFOneBSchedule,
  REMAT_MODES,
  relayEvalSchedule,
  relaySchedule,
  type Schedule,
} from './schedule.js';
import { type CostFn, defaultCost, simulate } from './simulate.js';

/** A deep copy of a schedule to break on purpose. */
const copy = (s: Schedule): Schedule =>
  s.map((acts) => acts.map((a) => ({ ...a })));
const total = (s: Schedule) => s.reduce((n, acts) => n + acts.length, 0);
/** Index of the first action of stage list `acts` matching `pred`; fails the test when there is none. */
function indexOf(
  acts: readonly Action[],
  pred: (a: Action) => boolean,
): number {
  const i = acts.findIndex(pred);
  assert.ok(i >= 0, 'the action to break is in the schedule');
  return i;
}
const isOp =
  <O extends Action['op']>(
    op: O,
    fields: Partial<Extract<Action, { op: O }>> = {},
  ) =>
  (a: Action) =>
    a.op === op &&
    Object.entries(fields).every(
      ([key, v]) => (a as unknown as Record<string, unknown>)[key] === v,
    );
/** Concatenates schedules stage by stage (a step followed by a flush). */
const then = (a: Schedule, b: Schedule): Schedule =>
  a.map((acts, s) => [...acts, ...b[s]]);

const load = (layer: number): Action => ({ op: 'load_layer', stage: 0, layer });
const F = (layer: number, mb: number, grad = true): Action => ({
  op: 'layer_forward',
  stage: 0,
  layer,
  mb,
  grad,
});
const B = (layer: number, mb: number): Action => ({
  op: 'layer_backward',
  stage: 0,
  layer,
  mb,
});

test('gpipe, 1f1b and evaluation schedules simulate for several M, K and remat modes; default costs unchanged', () => {
  for (const make of [gpipeSchedule, oneFOneBSchedule]) {
    for (const m of [1, 2, 3, 4, 8]) {
      for (const k of [1, 2, 3, 4]) {
        for (const mode of REMAT_MODES) {
          const s = make(m, k, mode);
          const r = simulate(s);
          assert.equal(
            r.events.length,
            total(s),
            `${make.name} M=${m} K=${k} ${mode}: every action ran`,
          );
          assert.equal(
            r.makespan,
            3 * (m + k - 1),
            `${make.name} M=${m} K=${k}: forward 1, backward 2 by default`,
          );
          assert.deepEqual(r.carried, []);
        }
      }
      const e = evalSchedule(m, 3);
      assert.equal(simulate(e).makespan, m + 2);
    }
  }
});

test('defaultCost: relay compute 1 and 2, local update 3, the rest free', () => {
  assert.equal(defaultCost(0, F(0, 0)), 1);
  assert.equal(defaultCost(0, B(0, 0)), 2);
  assert.equal(defaultCost(0, { op: 'local_update', stage: 0, mb: 0 }), 3);
  assert.equal(
    defaultCost(0, { op: 'forward', stage: 0, mb: 0, keep: true, grad: true }),
    1,
  );
  assert.equal(defaultCost(0, { op: 'backward', stage: 0, mb: 0 }), 2);
  for (const a of [
    load(0),
    { op: 'prefetch_layer', stage: 0, layer: 0 },
    { op: 'push_grads', stage: 0, layer: 0 },
    { op: 'release_layer', stage: 0, layer: 0 },
    { op: 'local_step', stage: 0 },
    { op: 'optimizer_step', stage: 0 },
  ] as Action[]) {
    assert.equal(defaultCost(0, a), 0, a.op);
  }
});

test('local schedules simulate for every overlap and mode; free-running gradients are carried, a flush takes them all', () => {
  for (const m of [1, 2, 3, 5]) {
    for (const k of [1, 2, 3, 4]) {
      for (const overlap of [0, 1]) {
        for (const deterministic of [true, false]) {
          const what = `M=${m} K=${k} overlap=${overlap} deterministic=${deterministic}`;
          const s = localSchedule(m, k, overlap, deterministic);
          const r = simulate(s);
          assert.equal(r.events.length, total(s), `${what}: every action ran`);
          // the stages run free: the last stage starts micro-batch i after the first stage's update of it
          assert.equal(r.makespan, 3 * (m + k - 1), what);
          if (overlap === 0 || deterministic || k === 1) {
            assert.deepEqual(r.carried, [], what);
          } else {
            // each receiving stage polls before the next stage's last update is done
            for (let st = 0; st < k - 1; st++)
              assert.ok(
                r.carried.some((c) => c.stage === st && c.mb === m - 1),
                `${what}: stage ${st} carries ${m - 1}`,
              );
            assert.ok(r.carried.every((c) => c.stage < k - 1));
            const f = then(s, flushSchedule(k));
            const rf = simulate(f);
            assert.equal(rf.events.length, total(f), what);
            assert.deepEqual(
              rf.carried,
              [],
              `${what}: the flush takes every outstanding gradient`,
            );
          }
        }
      }
      const fl = simulate(flushSchedule(k));
      assert.equal(fl.events.length, k - 1);
      assert.equal(fl.makespan, 0);
    }
  }
});

test('poll_grads takes the gradients sent by its stage clock, without waiting; drain_grads waits for the rest', () => {
  const s = localSchedule(2, 2, 1, false);
  // stage 1 updates instantly: each gradient is there when stage 0 polls
  const fast: CostFn = (st, a) =>
    a.op === 'local_update' ? (st === 0 ? 3 : 0) : 0;
  assert.deepEqual(simulate(s, fast).carried, []);
  // default costs: the gradient of micro-batch 0 (sent at 6) is taken by the poll at 6, the last one is carried
  assert.deepEqual(simulate(s).carried, [{ stage: 0, mb: 1 }]);
  // stage 1 is slow: both polls find nothing, and they do not wait for it
  const slow: CostFn = (st, a) =>
    a.op === 'local_update' ? (st === 0 ? 3 : 10) : 0;
  const r = simulate(s, slow);
  assert.deepEqual(r.carried, [
    { stage: 0, mb: 0 },
    { stage: 0, mb: 1 },
  ]);
  const polls = r.events.filter(
    (e) => e.stage === 0 && e.action.op === 'poll_grads',
  );
  assert.deepEqual(
    polls.map((e) => e.start),
    [3, 6],
  );
  // the flush waits for the last gradient, sent when stage 1's second update ends (13 + 10)
  const rf = simulate(then(s, flushSchedule(2)), slow);
  const drain = rf.events.find((e) => e.action.op === 'drain_grads')!;
  assert.equal(drain.start, 23);
  assert.deepEqual(rf.carried, []);
});

test('relay schedules simulate for 1..5 layers and 1..4 micro-batches, with the expected makespan', () => {
  for (let layers = 1; layers <= 5; layers++) {
    for (let m = 1; m <= 4; m++) {
      const s = relaySchedule(layers, m);
      const r = simulate(s);
      assert.equal(
        r.events.length,
        total(s),
        `layers=${layers} M=${m}: every action ran`,
      );
      // every layer but the last forward once per micro-batch (1), every layer backward once (2)
      assert.equal(
        r.makespan,
        (layers - 1) * m + 2 * layers * m,
        `layers=${layers} M=${m}`,
      );
      const e = relayEvalSchedule(layers, m);
      const re = simulate(e);
      assert.equal(re.events.length, total(e));
      assert.equal(re.makespan, layers * m, `eval layers=${layers} M=${m}`);
    }
  }
});

test('relay: a layer is used only while loaded by load_layer; release of an unloaded layer and a second load are no-ops', () => {
  // forward through a layer that was released
  const a = copy(relaySchedule(3, 2));
  a[0].splice(indexOf(a[0], isOp('layer_forward', { layer: 1 })), 0, {
    op: 'release_layer',
    stage: 0,
    layer: 1,
  });
  assert.throws(
    () => simulate(a),
    /stage 0 .*"layer_forward".*layer 1 is not loaded/,
  );
  // backward after the layer was released
  const b = copy(relaySchedule(3, 2));
  b[0].splice(indexOf(b[0], isOp('layer_backward', { layer: 0 })), 0, {
    op: 'release_layer',
    stage: 0,
    layer: 0,
  });
  assert.throws(
    () => simulate(b),
    /stage 0 .*"layer_backward".*layer 0 is not loaded/,
  );
  // only prefetched: the runtime's prefetch uploads nothing when the parameter server is not ready
  const c = copy(relaySchedule(3, 2));
  c[0].splice(indexOf(c[0], isOp('load_layer', { layer: 1 })), 1);
  assert.throws(() => simulate(c), /layer 1 is not loaded/);
  assert.throws(
    () =>
      simulate([
        [
          { op: 'prefetch_layer', stage: 0, layer: 0 },
          F(0, 0),
          load(1),
          B(1, 0),
        ],
      ]),
    /layer 0 is not loaded/,
  );
  // releasing what is not loaded, and loading twice, are allowed
  const d = copy(relaySchedule(3, 2));
  d[0].unshift({ op: 'release_layer', stage: 0, layer: 2 }, load(0), load(0));
  d[0].splice(
    indexOf(d[0], isOp('push_grads', { layer: 0 })),
    0,
    { op: 'release_layer', stage: 0, layer: 1 },
    { op: 'release_layer', stage: 0, layer: 1 },
  );
  assert.equal(simulate(d).events.length, total(d));
});

test('relay: forwards run layer by layer, at most once, never with grad on the last layer', () => {
  // forward of layer 1 before layer 0's forward of that micro-batch
  assert.throws(
    () => simulate([[load(0), load(1), F(1, 0, false), F(0, 0, false)]]),
    /stage 0 .*forward through layer 1 before the forward of micro-batch 0 through layer 0/,
  );
  // twice through a layer
  const a = copy(relaySchedule(3, 2));
  a[0].splice(
    indexOf(a[0], isOp('layer_forward', { layer: 0, mb: 1 })) + 1,
    0,
    F(0, 1),
  );
  assert.throws(
    () => simulate(a),
    /micro-batch 1 forwarded twice through layer 0/,
  );
  // the last layer's forward with grad: fused into its backward
  const b = copy(relaySchedule(3, 1));
  b[0].splice(
    indexOf(b[0], isOp('layer_forward', { layer: 1, mb: 0 })) + 1,
    0,
    load(2),
    F(2, 0),
  );
  assert.throws(
    () => simulate(b),
    /forward with grad through the last layer 2/,
  );
  // ... but evaluation does forward it, without grad
  assert.equal(
    simulate([[load(0), F(0, 0, false), load(1), F(1, 0, false)]]).events
      .length,
    4,
  );
});

test("relay: backwards need the stashed input, the incoming gradient, and one layer's gradient at a time", () => {
  // backward of layer 0 before layer 1's backward of that micro-batch (no incoming gradient)
  assert.throws(
    () => simulate([[load(0), load(1), F(0, 0), B(0, 0), B(1, 0)]]),
    /stage 0 .*backward through layer 0 before the backward of micro-batch 0 through layer 1/,
  );
  const a = copy(relaySchedule(3, 2));
  // swap the order of layers 2 and 1 in the backward: layer 1's backward of mb 1 now comes before layer 2's
  const i = indexOf(a[0], isOp('layer_backward', { layer: 2, mb: 1 }));
  a[0].splice(i, 0, load(1), B(1, 1));
  assert.throws(
    () => simulate(a),
    /backward through layer 1 before the backward of micro-batch 1 through layer 2/,
  );
  // backward of the last layer before the forward below it (no stashed input)
  assert.throws(
    () => simulate([[load(0), load(1), B(1, 0)]]),
    /backward through layer 1 before the forward of micro-batch 0 through layer 0 \(no stashed input\)/,
  );
  // a forward without grad keeps no input for the backward
  assert.throws(
    () => simulate([[load(0), load(1), F(0, 0, false), B(1, 0), B(0, 0)]]),
    /backward through layer 0 after a forward without grad/,
  );
  // twice through a layer
  const b = copy(relaySchedule(2, 2));
  b[0].splice(
    indexOf(b[0], isOp('layer_backward', { layer: 1, mb: 0 })) + 1,
    0,
    B(1, 0),
  );
  assert.throws(
    () => simulate(b),
    /micro-batch 0 backwarded twice through layer 1/,
  );
  // interleaved layers: layer 1's gradient would be cleared by the push of layer 0
  assert.throws(
    () => simulate([[load(0), load(1), F(0, 0), F(0, 1), B(1, 1), B(0, 1)]]),
    /backward through layer 0 while layer 1's gradients are not pushed/,
  );
});

test("relay: a layer's gradient is pushed before another layer's backward, never twice without a backward between; the step after every micro-batch's push", () => {
  const a = copy(relaySchedule(2, 3));
  const push = indexOf(a[0], isOp('push_grads', { layer: 1 }));
  const [p] = a[0].splice(push, 1);
  a[0].splice(indexOf(a[0], isOp('layer_backward', { layer: 1, mb: 0 })), 0, p);
  assert.throws(
    () => simulate(a),
    /stage 0 .*"layer_backward".*backward through layer 0 while layer 1's gradients are not pushed/,
  );
  const b = copy(relaySchedule(2, 3));
  b[0].splice(indexOf(b[0], isOp('push_grads', { layer: 1 })), 0, {
    op: 'push_grads',
    stage: 0,
    layer: 1,
  });
  assert.throws(
    () => simulate(b),
    /push of layer 1 with no backward through it since its last push \(pushed twice\)/,
  );
  // the step before layer 0 was pushed
  const c = copy(relaySchedule(3, 2));
  c[0].splice(indexOf(c[0], isOp('push_grads', { layer: 0 })), 1);
  assert.throws(
    () => simulate(c),
    /stage 0 .*"optimizer_step".*step before every layer's gradients of every micro-batch were pushed \(layers 0 not pushed\)/,
  );
  // the step moved before the backward
  const d = copy(relaySchedule(3, 2));
  const [step] = d[0].splice(d[0].length - 1, 1);
  d[0].splice(indexOf(d[0], isOp('layer_backward')), 0, step);
  assert.throws(
    () => simulate(d),
    /step before every layer's gradients of every micro-batch were pushed \(layers 0, 1, 2 not pushed\)/,
  );
});

test('local: a local_step needs a local_update since the previous one; poll and drain need a next stage', () => {
  const a = copy(localSchedule(2, 2, 0, true));
  a[1].splice(indexOf(a[1], isOp('local_step')) + 1, 0, {
    op: 'local_step',
    stage: 1,
  });
  assert.throws(
    () => simulate(a),
    /stage 1 .*"local_step".*local step with no local_update since the previous step/,
  );
  assert.throws(
    () => simulate([[{ op: 'local_step', stage: 0 }]]),
    /stage 0 .*local step with no local_update/,
  );
  const b = copy(localSchedule(2, 2, 1, false));
  b[1].push({ op: 'poll_grads', stage: 1 });
  assert.throws(
    () => simulate(b),
    /stage 1 .*"poll_grads".*the last stage has no next stage/,
  );
  assert.throws(
    () => simulate([[{ op: 'drain_grads', stage: 0 }]]),
    /stage 0 .*"drain_grads".*the last stage has no next stage/,
  );
});

test('local: gradients left over are an error unless the receiving stage polls last; a drain waits for a gradient that never comes', () => {
  // deterministic overlap without its final receive: the last gradient is never taken
  const a = copy(localSchedule(2, 2, 1, true));
  a[0] = a[0].slice(0, -2);
  assert.throws(
    () => simulate(a),
    /stage 0 never receives the gradient of micro-batch 1 that stage 1 sends/,
  );
  // a drain followed by a stage that sends later: a drain does not carry
  const b = copy(localSchedule(2, 2, 1, false));
  b[0].splice(indexOf(b[0], isOp('poll_grads')), 1, {
    op: 'drain_grads',
    stage: 0,
  });
  b[0].splice(indexOf(b[0], isOp('poll_grads')), 1);
  // stage 0 now drains after micro-batch 0 (waiting for it) and never takes micro-batch 1's gradient
  assert.throws(
    () => simulate(b),
    /stage 0 never receives the gradient of micro-batch 1/,
  );
  // the next stage stalls before its send_grad: the drain waits forever
  const c: Schedule = [
    [
      { op: 'local_update', stage: 0, mb: 0 },
      { op: 'send_act', stage: 0, mb: 0 },
      { op: 'drain_grads', stage: 0 },
    ],
    [
      { op: 'recv_act', stage: 1, mb: 0 },
      { op: 'local_update', stage: 1, mb: 0 },
      { op: 'recv_act', stage: 1, mb: 1 },
      { op: 'send_grad', stage: 1, mb: 0 },
    ],
  ];
  assert.throws(() => simulate(c), /stage 0 .*"drain_grads".*deadlock/);
});
