/**
 * The executor on its own: a fake stage kind (a handler table that records what it is asked)
 * and fake links (in-memory queues), no worker threads. Checks that the core does the
 * communication and the tracing, dispatches compute through the table, and reports a failing
 * action with the schedule marked.
 */

import assert from 'node:assert/strict';
import { test } from 'node:test';
import { initBackend } from '../backend/index.js';
import { tf } from '../backend/tfjs.js';
import {
  type Action,
  type ComputeAction,
  type ComputeSchedule,
  gpipeSchedule,
  localSchedule,
  lower,
} from '../schedule/schedule.js';
import {
  execute,
  type Handlers,
  type LayerGrads,
  ScheduleError,
  type StageLinks,
  type StageProgram,
  waitingMs,
} from './executor.js';
import { checkHandlers } from './stage-kind.js';

/** Links whose receives are served from queues filled beforehand; sends are recorded (and freed). */
function fakeLinks(
  o: {
    acts?: number[];
    grads?: number[];
    polled?: number[];
    scale?: number;
  } = {},
) {
  const sent: string[] = [];
  const norms: number[] = [];
  const pushed: LayerGrads[] = [];
  const acts = [...(o.acts ?? [])];
  const grads = [...(o.grads ?? [])];
  const polled = [...(o.polled ?? [])];
  const t = (mb: number) => ({ mb, t: tf.fill([2], mb) });
  const links: StageLinks = {
    async recvActivation() {
      const mb = acts.shift();
      if (mb === undefined) throw new Error('no activation queued');
      return t(mb);
    },
    sendActivation(_stage, mb, x) {
      sent.push(`act${mb}=${x.dataSync()[0]}`);
      x.dispose();
    },
    async recvGradient() {
      const mb = grads.shift();
      if (mb === undefined) throw new Error('no gradient queued');
      return t(mb);
    },
    pollGradient() {
      const mb = polled.shift();
      return mb === undefined ? null : t(mb);
    },
    sendGradient(_stage, mb, x) {
      sent.push(`grad${mb}=${x.dataSync()[0]}`);
      x.dispose();
    },
    async reduceGradNorm(s) {
      norms.push(s);
      return o.scale ?? 1;
    },
    pushGrads(g) {
      pushed.push(g);
    },
  };
  return { links, sent, norms, pushed };
}

/** A stage kind that runs forward (x + 10), backward (dy * 2), optimizer_step, and records every call. */
function fakeStage(
  extra: Partial<Handlers> = {},
  pending = () => 0,
): StageProgram & { calls: string[] } {
  const calls: string[] = [];
  return {
    kind: 'fake stage',
    calls,
    losses: new Map(),
    handlers: {
      forward(a, io) {
        calls.push(`F${a.mb}`);
        const x = io.takeInput(a.mb);
        io.putOutput(a.mb, tf.add(x, 10));
        x.dispose();
      },
      backward(a, io) {
        calls.push(`B${a.mb}`);
        const dy = io.takeOutputGrad(a.mb);
        io.putInputGrad(a.mb, tf.mul(dy, 2));
        dy.dispose();
        io.phase('recompute', 0.5);
      },
      optimizer_step(_a, io) {
        calls.push(`STEP lr=${io.lr} scale=${io.scale}`);
      },
      ...extra,
    },
    gradSquaredNorm: () => {
      const t = performance.now();
      while (performance.now() - t < 2); // the stage's own share of the norm takes time: work, not waiting
      return 7;
    },
    pendingGradients: pending,
    reset() {},
    dispose() {},
  };
}

test("the core receives, sends and all-reduces; compute goes through the stage kind's handlers in schedule order", async () => {
  await initBackend('cpu');
  const before = tf.memory().numTensors;
  // the middle stage of three: it receives activations and gradients and sends both
  const actions = gpipeSchedule(2, 3, 'always')[1];
  const stage = fakeStage();
  const { links, sent, norms } = fakeLinks({
    acts: [0, 1],
    grads: [1, 0],
    scale: 0.25,
  });
  const trace = await execute(stage, actions, links, { m: 2, lr: 0.1 }, 1);
  assert.deepEqual(stage.calls, [
    'F0',
    'F1',
    'B1',
    'B0',
    'STEP lr=0.1 scale=0.25',
  ]);
  assert.deepEqual(sent, ['act0=10', 'act1=11', 'grad1=2', 'grad0=0']);
  assert.deepEqual(
    norms,
    [7],
    "the all-reduce gets the stage kind's share of the norm",
  );
  // one span per action, except backwards, split into recompute + backward by io.phase, and the
  // all-reduce, split into the stage's own norm (busy) and the wait for the others
  assert.equal(trace.length, actions.length + 3);
  assert.deepEqual(
    trace.filter((s) => s.op === 'backward').map((s) => s.label),
    ['recompute', 'backward', 'recompute', 'backward'],
  );
  const norm = trace.filter((s) => s.op === 'reduce_grad_norm');
  assert.deepEqual(
    norm.map((s) => s.label),
    ['grad_norm', 'reduce_grad_norm'],
  );
  assert.ok(
    norm[0]!.end - norm[0]!.start >= 2,
    `the local norm's span covers its 2 ms: ${JSON.stringify(norm[0])}`,
  );
  assert.equal(
    waitingMs(norm),
    norm[1]!.end - norm[1]!.start,
    'only the wait for the other stages counts as waiting',
  );
  for (let i = 1; i < trace.length; i++)
    assert.ok(trace[i].start >= trace[i - 1].start, 'spans are in order');
  assert.ok(
    waitingMs(trace) >= 0 && waitingMs(trace) <= trace[trace.length - 1].end,
  );
  assert.equal(
    tf.memory().numTensors,
    before,
    'every tensor that passed through the step was freed',
  );
});

test('a first stage takes its inputs from the step, a last stage its labels; the link order is checked', async () => {
  await initBackend('cpu');
  const seen: number[] = [];
  const stage = fakeStage({
    forward(a, io) {
      const x = io.takeInput(a.mb);
      const y = io.takeLabelsIfAny(a.mb);
      seen.push(x.dataSync()[0], y ? y.dataSync()[0] : -1);
      x.dispose();
      y?.dispose();
    },
  });
  const inputs = [tf.scalar(5), tf.scalar(6)];
  const labels = [tf.scalar(50), tf.scalar(60)];
  await execute(
    stage,
    [
      { op: 'forward', stage: 0, mb: 1, keep: false, grad: false },
      { op: 'forward', stage: 0, mb: 0, keep: false, grad: false },
    ],
    fakeLinks().links,
    { inputs, labels, m: 2, lr: 0 },
  );
  assert.deepEqual(seen, [6, 60, 5, 50]);
  // a receive that delivers another micro-batch than the schedule expects is a schedule bug
  const wrong = fakeLinks({ acts: [1] });
  await assert.rejects(
    execute(fakeStage(), [{ op: 'recv_act', stage: 0, mb: 0 }], wrong.links, {
      m: 2,
      lr: 0,
    }),
    /received the activation of micro-batch 1 while its schedule expects 0/,
  );
});

test('an action the stage kind does not have fails with the schedule shown and the failing action marked', async () => {
  await initBackend('cpu');
  const before = tf.memory().numTensors;
  const actions: Action[] = [
    { op: 'forward', stage: 3, mb: 0, keep: false, grad: true },
    { op: 'send_act', stage: 3, mb: 0 },
    { op: 'local_update', stage: 3, mb: 1 },
    { op: 'optimizer_step', stage: 3 },
  ];
  const inputs = [tf.scalar(1), tf.scalar(2)];
  const err = await execute(
    fakeStage(),
    actions,
    fakeLinks().links,
    { inputs, m: 2, lr: 0 },
    3,
  ).then(
    () => null,
    (e: unknown) => e,
  );
  assert.ok(err instanceof ScheduleError, String(err));
  assert.match(err.message, /a fake stage has no 'local_update' action/);
  assert.equal(err.stage, 3);
  assert.equal(err.index, 2);
  assert.equal(
    err.schedule,
    'schedule of device 3, action 3 of 4:\n  3F0\n  3SA0\n  3L1  <-- ERROR HERE\n  3STEP',
  );
  assert.equal(
    tf.memory().numTensors,
    before,
    'the input the stage never reached was freed with the failure',
  );
});

test("a handler's own error keeps its name and message; a long schedule is shown around the failing action", async () => {
  await initBackend('cpu');
  const actions = gpipeSchedule(40, 1, 'always')[0];
  let n = 0;
  const stage = fakeStage({
    forward(a, io) {
      io.takeInput(a.mb).dispose();
      if (++n === 20) {
        const e = new Error('device out of memory: needs 2 KiB');
        e.name = 'DeviceOutOfMemoryError';
        throw e;
      }
    },
  });
  const inputs = Array.from({ length: 40 }, (_, i) => tf.scalar(i));
  const err = await execute(stage, actions, fakeLinks().links, {
    inputs,
    m: 40,
    lr: 0,
  }).then(
    () => null,
    (e: unknown) => e,
  );
  assert.ok(err instanceof ScheduleError);
  assert.equal(err.name, 'DeviceOutOfMemoryError');
  assert.equal(err.message, 'device out of memory: needs 2 KiB');
  const lines = err.schedule.split('\n');
  assert.equal(
    lines[0],
    `schedule of device 0, action 20 of ${actions.length}:`,
  );
  assert.equal(lines[1], '  ... 13 earlier');
  assert.equal(
    lines.filter((l) => l.endsWith('<-- ERROR HERE')).join(),
    '  0F19  <-- ERROR HERE',
  );
  assert.match(lines[lines.length - 1], /^ {2}\.\.\. \d+ later$/);
  assert.equal(lines.length, 1 + 1 + 13 + 1);
});

test('local parallelism: poll_grads applies every gradient that has arrived; drain_grads waits for the outstanding ones', async () => {
  await initBackend('cpu');
  const applied: number[] = [];
  let outstanding = 3;
  const handlers: Partial<Handlers> = {
    local_update(a, io) {
      io.takeInput(a.mb).dispose();
      io.takeLabels(a.mb).dispose();
      io.putOutput(a.mb, tf.scalar(a.mb));
    },
    overlap_backward(a, io) {
      applied.push(a.mb);
      io.takeOutputGrad(a.mb).dispose();
      outstanding--;
    },
    local_step() {},
  };
  const stage = fakeStage(handlers, () => outstanding);
  // stage 0 of 2 with free-running overlap: poll_grads after each update
  const actions = localSchedule(2, 2, 1, false)[0];
  assert.ok(actions.some((a) => a.op === 'poll_grads'));
  const { links } = fakeLinks({ polled: [0], grads: [1, 2] });
  const inputs = [tf.scalar(0), tf.scalar(1)];
  const labels = [tf.scalar(0), tf.scalar(1)];
  await execute(stage, actions, links, { inputs, labels, m: 2, lr: 0 });
  assert.deepEqual(
    applied,
    [0],
    'the one gradient that had arrived, applied without waiting',
  );
  await execute(stage, [{ op: 'drain_grads', stage: 0 }], links, {
    m: 2,
    lr: 0,
  });
  assert.deepEqual(
    applied,
    [0, 1, 2],
    'draining received until nothing was outstanding',
  );
});

test('push_grads reaches the parameter server link through io.pushGrads; without such a link it fails', async () => {
  await initBackend('cpu');
  const stage = fakeStage({
    push_grads: (a, io) =>
      io.pushGrads({
        layer: a.layer,
        grads: { [`${a.layer}.w`]: new Float32Array([1]) },
        sumSquares: 1,
      }),
  });
  const { links, pushed } = fakeLinks();
  await execute(stage, [{ op: 'push_grads', stage: 0, layer: 2 }], links, {
    m: 1,
    lr: 0,
  });
  assert.deepEqual(
    pushed.map((g) => g.layer),
    [2],
  );
  const { pushGrads: _, ...noServer } = links;
  await assert.rejects(
    execute(stage, [{ op: 'push_grads', stage: 0, layer: 2 }], noServer, {
      m: 1,
      lr: 0,
    }),
    /push_grads needs a link to the parameter server/,
  );
});

test("one device runs several stages: each action on its stage's program, neighbours on the device hand over directly, one all-reduce for the device", async () => {
  await initBackend('cpu');
  // stages 0 and 1 on device 0, stage 2 on another device (lowered fill-drain, M = 2)
  const s0 = fakeStage();
  const s1 = fakeStage();
  const compute: ComputeSchedule = [
    [
      ...[0, 1].flatMap((mb) =>
        [0, 1].map(
          (stage): ComputeAction => ({
            op: 'forward',
            stage,
            mb,
            keep: false,
            grad: true,
          }),
        ),
      ),
      ...[1, 0].flatMap((mb) =>
        [1, 0].map((stage): ComputeAction => ({ op: 'backward', stage, mb })),
      ),
    ],
    [],
  ];
  const actions = lower(compute, [0, 0, 1], { step: 'all-reduce' })[0];
  const { links, sent, norms } = fakeLinks({ grads: [1, 0], scale: 0.5 });
  const inputs = [tf.scalar(1), tf.scalar(2)];
  const trace = await execute(
    new Map([
      [0, s0],
      [1, s1],
    ]),
    actions,
    links,
    { inputs, m: 2, lr: 0.1 },
  );
  assert.deepEqual(s0.calls, ['F0', 'F1', 'B1', 'B0', 'STEP lr=0.1 scale=0.5']);
  assert.deepEqual(s1.calls, ['F0', 'F1', 'B1', 'B0', 'STEP lr=0.1 scale=0.5']);
  // stage 1's outputs went on (x + 10 + 10); nothing crossed between stages 0 and 1 by link
  assert.deepEqual(sent, ['act0=21', 'act1=22']);
  assert.deepEqual(
    norms,
    [14],
    "the device's share: both stages' sums of squares",
  );
  assert.deepEqual(
    [...new Set(trace.map((t) => t.stage))].sort(),
    [0, 1],
    'spans name their stage',
  );
  // an action of a stage this device does not run fails with the schedule marked
  await assert.rejects(
    execute(
      new Map([[0, fakeStage()]]),
      [{ op: 'optimizer_step', stage: 4 }],
      links,
      { m: 1, lr: 0 },
    ),
    (e: unknown) =>
      e instanceof ScheduleError &&
      /stage 4 does not run on this device/.test(e.message) &&
      /4STEP {2}<-- ERROR HERE/.test(e.schedule),
  );
});

test('an op without a declaration fails at run time and in a handler table at load time', async () => {
  await initBackend('cpu');
  const bogus = { op: 'teleport', stage: 0, mb: 0 } as unknown as Action;
  await assert.rejects(
    execute(fakeStage(), [bogus], fakeLinks().links, { m: 1, lr: 0 }),
    (e: unknown) =>
      e instanceof ScheduleError &&
      /op 'teleport' has no declaration/.test(e.message) &&
      /0teleport0 {2}<-- ERROR HERE/.test(e.schedule),
  );
  const withBogus = fakeStage({
    teleport: () => {},
  } as unknown as Partial<Handlers>);
  assert.throws(
    () => checkHandlers(withBogus),
    /op 'teleport' has no declaration/,
  );
  const withCore = fakeStage({
    recv_act: () => {},
  } as unknown as Partial<Handlers>);
  assert.throws(
    () => checkHandlers(withCore),
    /a fake stage handles 'recv_act', which the executor's core runs/,
  );
  assert.equal(checkHandlers(fakeStage()).kind, 'fake stage');
});
