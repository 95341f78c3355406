import assert from 'node:assert/strict';
import { test } from 'node:test';
import { LayerwiseError } from '../util/errors.js';
import {
  type Action,
  type ComputeAction,
  type ComputeSchedule,
  chainPlacement,
  clockCycles,
  computeSchedule,
  evalSchedule,
  formatAction,
  formatSchedule,
  gpipeCompute,
  gpipeSchedule,
  idealBubble,
  keepsActivations,
  linkSide,
  localCompute,
  localSchedule,
  lower,
  makeSchedule,
  needsWrapLink,
  oneFOneBCompute,
  oneFOneBSchedule,
  placementOf,
  REMAT_MODES,
  type RematMode,
  relayCompute,
  relayPipelineSchedule,
  relayPipelineTraining,
  relaySchedule,
  type Schedule,
  zbH1Compute,
} from './schedule.js';
import { type CostFn, simulate } from './simulate.js';

const MS = [1, 2, 4, 8];
const KS = [1, 2, 3, 4];
const KINDS = [
  ['gpipe', gpipeSchedule],
  ['1f1b', oneFOneBSchedule],
] as const;

/** Micro-batch indices of the actions of one op, in list order. */
function mbsOf(acts: readonly Action[], op: Action['op']): number[] {
  return acts.filter((a) => a.op === op).map((a) => (a as { mb: number }).mb);
}

/** Largest number of micro-batches forwarded but not yet backwarded along the list. */
function maxInFlight(acts: readonly Action[]): number {
  let live = 0;
  let max = 0;
  for (const a of acts) {
    if (a.op === 'forward') live++;
    if (a.op === 'backward') live--;
    assert.ok(live >= 0, 'a backward before any forward');
    max = Math.max(max, live);
  }
  return max;
}

const range = (n: number) => Array.from({ length: n }, (_, i) => i);
const unit: CostFn = (_, a) =>
  a.op === 'forward' ? 1 : a.op === 'backward' ? 2 : 0;

test('simulate accepts gpipe and 1f1b for every M, K and mode', () => {
  for (const [name, make] of KINDS) {
    for (const m of MS) {
      for (const k of KS) {
        for (const mode of REMAT_MODES) {
          const s = make(m, k, mode);
          assert.equal(
            s.length,
            k,
            `${name} M=${m} K=${k}: one list per stage`,
          );
          const r = simulate(s);
          const total = s.reduce((n, acts) => n + acts.length, 0);
          assert.equal(
            r.events.length,
            total,
            `${name} M=${m} K=${k}: every action ran`,
          );
        }
      }
    }
  }
});

test('every stage forwards and backwards each micro-batch exactly once, forward first', () => {
  for (const [name, make] of KINDS) {
    for (const m of MS) {
      for (const k of KS) {
        const s = make(m, k, 'except_last');
        s.forEach((acts, st) => {
          const what = `${name} M=${m} K=${k} stage ${st}`;
          const f = mbsOf(acts, 'forward');
          const b = mbsOf(acts, 'backward');
          assert.deepEqual(
            [...f].sort((x, y) => x - y),
            range(m),
            `${what}: forwards`,
          );
          assert.deepEqual(
            [...b].sort((x, y) => x - y),
            range(m),
            `${what}: backwards`,
          );
          for (let i = 0; i < m; i++) {
            const fi = acts.findIndex((a) => a.op === 'forward' && a.mb === i);
            const bi = acts.findIndex((a) => a.op === 'backward' && a.mb === i);
            assert.ok(fi < bi, `${what}: forward of ${i} before its backward`);
          }
          // Forwards always run in micro-batch order (the input channel is FIFO).
          assert.deepEqual(f, range(m), `${what}: forward order`);
          // Exactly one norm all-reduce and one optimizer step, at the very end, in that order.
          assert.deepEqual(
            acts.slice(-2).map((a) => a.op),
            ['reduce_grad_norm', 'optimizer_step'],
            what,
          );
          assert.equal(
            acts.filter(
              (a) => a.op === 'optimizer_step' || a.op === 'reduce_grad_norm',
            ).length,
            2,
            what,
          );
          // Communication only where there is a neighbour.
          const ops = new Set(acts.map((a) => a.op));
          assert.equal(
            ops.has('recv_act'),
            st > 0,
            `${what}: recv_act iff not first`,
          );
          assert.equal(
            ops.has('send_grad'),
            st > 0,
            `${what}: send_grad iff not first`,
          );
          assert.equal(
            ops.has('send_act'),
            st < k - 1,
            `${what}: send_act iff not last`,
          );
          assert.equal(
            ops.has('recv_grad'),
            st < k - 1,
            `${what}: recv_grad iff not last`,
          );
          // A receive directly precedes the forward that consumes it, a send directly follows.
          acts.forEach((a, i) => {
            if (a.op === 'recv_act')
              assert.deepEqual(
                acts[i + 1],
                { ...acts[i + 1], op: 'forward', mb: a.mb },
                what,
              );
            if (a.op === 'send_act')
              assert.deepEqual(
                acts[i - 1],
                { ...acts[i - 1], op: 'forward', mb: a.mb },
                what,
              );
            if (a.op === 'recv_grad')
              assert.deepEqual(
                acts[i + 1],
                { op: 'backward', stage: a.stage, mb: a.mb },
                what,
              );
            if (a.op === 'send_grad')
              assert.deepEqual(
                acts[i - 1],
                { op: 'backward', stage: a.stage, mb: a.mb },
                what,
              );
          });
        });
      }
    }
  }
});

test('receives match sends in order between neighbouring stages', () => {
  for (const [name, make] of KINDS) {
    for (const m of MS) {
      for (const k of KS) {
        const s = make(m, k, 'always');
        for (let st = 0; st + 1 < k; st++) {
          assert.deepEqual(
            mbsOf(s[st + 1], 'recv_act'),
            mbsOf(s[st], 'send_act'),
            `${name} M=${m} K=${k} act ${st}->${st + 1}`,
          );
          assert.deepEqual(
            mbsOf(s[st], 'recv_grad'),
            mbsOf(s[st + 1], 'send_grad'),
            `${name} M=${m} K=${k} grad ${st + 1}->${st}`,
          );
        }
      }
    }
  }
});

test('gpipe: all forwards, then backwards in reverse order; exact lists for stage 0 and the last stage', () => {
  for (const m of MS) {
    for (const k of KS) {
      const s = gpipeSchedule(m, k, 'never');
      for (const acts of s) {
        assert.deepEqual(
          mbsOf(acts, 'backward'),
          range(m).reverse(),
          `M=${m} K=${k}`,
        );
        const lastF = acts.map((a) => a.op).lastIndexOf('forward');
        const firstB = acts.findIndex((a) => a.op === 'backward');
        assert.ok(lastF < firstB, `M=${m} K=${k}: fill then drain`);
      }
      // Stage 0 starts computing at once: its first action is the forward of micro-batch 0.
      assert.deepEqual(s[0][0], {
        op: 'forward',
        stage: 0,
        mb: 0,
        keep: true,
        grad: true,
      });
      // The last stage: receive, forward for each micro-batch, then (no gradient to receive)
      // backward and send the input gradient, last micro-batch first.
      const last = k - 1;
      const expected: Action[] = [];
      for (let i = 0; i < m; i++) {
        if (last > 0) expected.push({ op: 'recv_act', stage: last, mb: i });
        expected.push({
          op: 'forward',
          stage: last,
          mb: i,
          keep: true,
          grad: true,
        });
      }
      for (let i = m - 1; i >= 0; i--) {
        expected.push({ op: 'backward', stage: last, mb: i });
        if (last > 0) expected.push({ op: 'send_grad', stage: last, mb: i });
      }
      expected.push(
        { op: 'reduce_grad_norm', stage: last },
        { op: 'optimizer_step', stage: last },
      );
      assert.deepEqual(s[last], expected, `M=${m} K=${k}: last stage`);
    }
  }
});

test('1f1b: backwards in micro-batch order, warm-up of K-s-1 forwards', () => {
  for (const m of MS) {
    for (const k of KS) {
      const s = oneFOneBSchedule(m, k, 'never');
      assert.deepEqual(s[0][0], {
        op: 'forward',
        stage: 0,
        mb: 0,
        keep: true,
        grad: true,
      });
      s.forEach((acts, st) => {
        assert.deepEqual(
          mbsOf(acts, 'backward'),
          range(m),
          `M=${m} K=${k} stage ${st}`,
        );
        const firstB = acts.findIndex((a) => a.op === 'backward');
        const before = acts
          .slice(0, firstB)
          .filter((a) => a.op === 'forward').length;
        assert.equal(
          before,
          Math.min(k - st, m),
          `M=${m} K=${k} stage ${st}: forwards before the first backward`,
        );
      });
      // The last stage alternates strictly: F0 B0 F1 B1 ...
      const fb = s[k - 1]
        .filter((a) => a.op === 'forward' || a.op === 'backward')
        .map((a) => `${a.op[0]}${(a as { mb: number }).mb}`);
      assert.deepEqual(
        fb,
        range(m).flatMap((i) => [`f${i}`, `b${i}`]),
        `M=${m} K=${k} last stage`,
      );
    }
  }
});

test('in-flight micro-batches: 1f1b keeps at most K - s on stage s, gpipe keeps M', () => {
  for (const m of MS) {
    for (const k of KS) {
      const g = gpipeSchedule(m, k, 'never');
      const o = oneFOneBSchedule(m, k, 'never');
      for (let st = 0; st < k; st++) {
        assert.equal(maxInFlight(g[st]), m, `gpipe M=${m} K=${k} stage ${st}`);
        const inflight = maxInFlight(o[st]);
        assert.ok(
          inflight <= k - st,
          `1f1b M=${m} K=${k} stage ${st}: ${inflight} > ${k - st}`,
        );
        assert.equal(
          inflight,
          Math.min(k - st, m),
          `1f1b M=${m} K=${k} stage ${st}`,
        );
      }
    }
  }
});

test('zb-h1: 1F1B with split backwards: F, then I before W on stages s > 0 (W deferred by s), B on stage 0; 1F1B in flight; valid', () => {
  for (const m of MS)
    for (const k of KS)
      for (const mode of REMAT_MODES) {
        const c = zbH1Compute(m, k, mode);
        const one = oneFOneBCompute(m, k, mode);
        const lowered = lower(c, chainPlacement(k), { step: 'all-reduce' });
        assert.equal(
          simulate(lowered).events.length,
          lowered.flat().length,
          `zb-h1 M=${m} K=${k} ${mode}: every action ran`,
        );
        c.forEach((acts, s) => {
          const what = `zb-h1 M=${m} K=${k} stage ${s}`;
          assert.deepEqual(
            mbsOf(acts, 'forward'),
            range(m),
            `${what}: forwards`,
          );
          // the forwards and the input gradients come in 1F1B's order
          assert.deepEqual(
            acts
              .filter((a) => a.op !== 'backward_weight')
              .map(
                (a) =>
                  `${a.op === 'backward_input' ? 'backward' : a.op}${'mb' in a ? a.mb : ''}`,
              ),
            one[s]!.map((a) => `${a.op}${'mb' in a ? a.mb : ''}`),
            `${what}: 1F1B's order of F and B (I)`,
          );
          if (s === 0) {
            assert.deepEqual(mbsOf(acts, 'backward'), range(m), `${what}: B`);
            assert.equal(mbsOf(acts, 'backward_input').length, 0);
            return;
          }
          assert.deepEqual(
            mbsOf(acts, 'backward_input'),
            range(m),
            `${what}: I`,
          );
          assert.deepEqual(
            mbsOf(acts, 'backward_weight'),
            range(m),
            `${what}: W`,
          );
          for (let j = 0; j < m; j++) {
            const at = (op: string, mb: number) =>
              acts.findIndex((a) => a.op === op && 'mb' in a && a.mb === mb);
            assert.ok(at('backward_input', j) < at('backward_weight', j));
            // W(j) waits until I(j + s) ran (or every I did)
            const after = Math.min(j + s, m - 1);
            assert.ok(
              at('backward_weight', j) > at('backward_input', after),
              `${what}: W${j} after I${after}`,
            );
          }
        });
      }
});

test("zb-h1 with F = I = W = 1 (B = 2): makespan 3M + K - 1 for M >= K, against 1F1B's 3(M + K - 1)", () => {
  const cost: CostFn = (_, a) =>
    a.op === 'forward' ||
    a.op === 'backward_input' ||
    a.op === 'backward_weight'
      ? 1
      : a.op === 'backward'
        ? 2
        : 0;
  for (const m of MS)
    for (const k of KS) {
      if (m < k) continue;
      const zb = simulate(
        lower(zbH1Compute(m, k, 'never'), chainPlacement(k), {
          step: 'all-reduce',
        }),
        cost,
      );
      const one = simulate(oneFOneBSchedule(m, k, 'never'), cost);
      assert.equal(one.makespan, 3 * (m + k - 1), `1f1b M=${m} K=${k}`);
      assert.equal(zb.makespan, 3 * m + k - 1, `zb-h1 M=${m} K=${k}`);
      if (k > 1)
        assert.ok(
          Math.max(...zb.bubble) < Math.max(...one.bubble),
          `zb-h1 M=${m} K=${k}: bubble ${zb.bubble} vs 1f1b ${one.bubble}`,
        );
    }
});

test('interleaved-1f1b, zbv and dualpipev: several stages per device, each stage F once and B (or I and W) once per micro-batch, valid; their placements', () => {
  assert.deepEqual(placementOf('interleaved-1f1b', 3, 2), [0, 1, 2, 0, 1, 2]);
  assert.deepEqual(placementOf('interleaved-1f1b', 2, 3), [0, 1, 0, 1, 0, 1]);
  assert.deepEqual(placementOf('zbv', 3), [0, 1, 2, 2, 1, 0]);
  assert.deepEqual(placementOf('dualpipev', 2), [0, 1, 1, 0]);
  assert.deepEqual(placementOf('1f1b', 3), [0, 1, 2]);
  for (const [kind, v] of [
    ['interleaved-1f1b', 2],
    ['interleaved-1f1b', 3],
    ['zbv', 2],
    ['dualpipev', 2],
  ] as const)
    for (const m of [...MS, 12])
      for (const k of KS) {
        const what = `${kind} V=${v} M=${m} K=${k}`;
        if (kind === 'dualpipev' && m < 2 * k) {
          assert.throws(
            () => computeSchedule(kind, m, k, 'never'),
            /dualpipev needs at least as many micro-batches as stages/,
          );
          continue;
        }
        if (kind === 'interleaved-1f1b' && m % Math.max(1, Math.floor(m / k)))
          continue;
        const c = computeSchedule(kind, m, k, 'except_last', v);
        const placement = placementOf(kind, k, v);
        assert.equal(c.length, k, what);
        const lowered = lower(c, placement, { step: 'all-reduce' });
        assert.equal(
          simulate(lowered).events.length,
          lowered.flat().length,
          `${what}: every action ran`,
        );
        for (let s = 0; s < placement.length; s++) {
          const acts = c[placement[s]!]!.filter((a) => a.stage === s);
          assert.deepEqual(
            mbsOf(acts, 'forward'),
            range(m),
            `${what} stage ${s}: forwards in order`,
          );
          const n = (op: Action['op'], mb: number) =>
            mbsOf(acts, op).filter((x) => x === mb).length;
          for (let mb = 0; mb < m; mb++) {
            assert.equal(
              n('backward', mb) + n('backward_input', mb),
              1,
              `${what} stage ${s} micro-batch ${mb}: one B or I`,
            );
            assert.equal(
              n('backward_weight', mb),
              n('backward_input', mb),
              `${what} stage ${s} micro-batch ${mb}: a W for its I`,
            );
          }
          if (kind === 'zbv')
            assert.equal(
              mbsOf(acts, 'backward').length,
              0,
              `${what}: zbv splits every backward`,
            );
        }
      }
  assert.throws(
    () => computeSchedule('interleaved-1f1b', 4, 2, 'never', 1),
    /--virtual-stages of at least 2/,
  );
  assert.throws(
    () => computeSchedule('interleaved-1f1b', 7, 3, 'never', 2),
    /--micro-batches 7 is not a multiple of 2; use 8/,
  );
});

test('interleaved-1f1b divides the bubble by V, zbv nearly removes it: makespans with F = I = W (B = 2F) per whole stage', () => {
  // each of a device's V stages does 1/V of its work: F = 1/V, B = 2/V, I = W = 1/V
  for (const v of [2, 3])
    for (const k of [2, 3, 4])
      for (const m of [4, 8, 12]) {
        if (m < k || m % Math.max(1, Math.floor(m / k)) !== 0) continue;
        const cost: CostFn = (_, a) =>
          (a.op === 'forward' ? 1 : a.op === 'backward' ? 2 : 0) / v;
        const r = simulate(
          makeSchedule('interleaved-1f1b', m, k, 'never', v),
          cost,
        );
        // 1F1B: 3(m + k - 1); interleaved: the fill and drain shrink V times
        assert.ok(
          Math.abs(r.makespan - (3 * m + (3 * (k - 1)) / v)) < 1e-9,
          `interleaved V=${v} K=${k} M=${m}: makespan ${r.makespan}`,
        );
      }
  const half: CostFn = (_, a) =>
    a.op === 'forward' ||
    a.op === 'backward_input' ||
    a.op === 'backward_weight'
      ? 0.5
      : 0;
  for (const k of [2, 3, 4])
    for (const m of [8, 12, 16]) {
      const r = simulate(makeSchedule('zbv', m, k, 'never'), half);
      assert.ok(
        Math.abs(r.makespan - (3 * m + (k - 1) / 2)) < 1e-9,
        `zbv K=${k} M=${m}: makespan ${r.makespan}`,
      );
      // DualPipeV: its full backwards cost I + W
      const full: CostFn = (_, a) => (a.op === 'backward' ? 1 : half(0, a));
      const d = simulate(makeSchedule('dualpipev', m, k, 'never'), full);
      const one = 3 * (m + k - 1);
      assert.ok(
        d.makespan < 3 * m + (k - 1) * 1.5 && d.makespan < one,
        `dualpipev K=${k} M=${m}: makespan ${d.makespan} (1f1b ${one})`,
      );
    }
});

test('links: neighbours both ways, and the ring from the last device to the first past 2 devices', () => {
  assert.equal(linkSide(0, 1, 2), 'next');
  assert.equal(linkSide(1, 0, 2), 'prev');
  assert.equal(linkSide(2, 0, 3), 'next');
  assert.equal(linkSide(0, 2, 3), 'prev');
  assert.throws(() => linkSide(0, 2, 4), /linked to their neighbours/);
  assert.equal(needsWrapLink(placementOf('interleaved-1f1b', 3, 2)), true);
  assert.equal(needsWrapLink(placementOf('interleaved-1f1b', 2, 2)), false);
  assert.equal(needsWrapLink(placementOf('zbv', 4)), false);
});

test('keep flags follow the checkpoint mode', () => {
  const expectKept = (mode: RematMode, m: number): number[] =>
    mode === 'never' ? range(m) : mode === 'except_last' ? [m - 1] : [];
  for (const [name, make] of KINDS) {
    for (const m of MS) {
      for (const k of KS) {
        for (const mode of REMAT_MODES) {
          for (const acts of make(m, k, mode)) {
            const fw = acts.filter(
              (a): a is Extract<Action, { op: 'forward' }> =>
                a.op === 'forward',
            );
            assert.ok(
              fw.every((a) => a.grad),
              `${name}: training forwards record gradients`,
            );
            const kept = fw
              .filter((a) => a.keep)
              .map((a) => a.mb)
              .sort((x, y) => x - y);
            assert.deepEqual(
              kept,
              expectKept(mode, m),
              `${name} M=${m} K=${k} ${mode}`,
            );
          }
        }
      }
    }
  }
  assert.equal(keepsActivations('always', 0, 1), false);
  assert.equal(keepsActivations('except_last', 0, 1), true);
  assert.equal(keepsActivations('except_last', 0, 2), false);
  assert.equal(keepsActivations('never', 0, 2), true);
});

test('evalSchedule: forwards only, nothing kept, no step', () => {
  for (const m of MS) {
    for (const k of KS) {
      const s = evalSchedule(m, k);
      simulate(s);
      for (const acts of s) {
        assert.ok(
          acts.every(
            (a) =>
              a.op === 'forward' || a.op === 'recv_act' || a.op === 'send_act',
          ),
        );
        assert.deepEqual(mbsOf(acts, 'forward'), range(m));
        assert.ok(
          acts.every((a) => a.op !== 'forward' || (!a.keep && !a.grad)),
        );
      }
    }
  }
});

test('gpipe timeline follows the clock-cycle table; makespan and bubble are the theoretical ones', () => {
  for (const m of MS) {
    for (const k of KS) {
      const r = simulate(gpipeSchedule(m, k, 'except_last'), unit);
      const startOf = (op: 'forward' | 'backward', mb: number, st: number) =>
        r.events.find(
          (e) =>
            e.stage === st &&
            e.action.op === op &&
            (e.action as { mb: number }).mb === mb,
        )!.start;
      // Forward of micro-batch i on stage j runs in clock tick i + j (cost 1 per tick).
      let tick = 0;
      for (const pairs of clockCycles(m, k)) {
        for (const [i, j] of pairs)
          assert.equal(
            startOf('forward', i, j),
            tick,
            `M=${m} K=${k} F${i} on ${j}`,
          );
        tick++;
      }
      // Backward: the mirrored table after the last forward ends at tick M+K-1, 2 per tick.
      for (let i = 0; i < m; i++) {
        for (let j = 0; j < k; j++) {
          assert.equal(
            startOf('backward', i, j),
            m + k - 1 + 2 * (m - 1 - i + (k - 1 - j)),
            `M=${m} K=${k} B${i} on ${j}`,
          );
        }
      }
      // Each stage is busy 3M; the step takes (M + K - 1) ticks of forward + backward.
      assert.equal(r.makespan, 3 * (m + k - 1), `M=${m} K=${k} makespan`);
      for (const b of r.bubble)
        assert.ok(
          Math.abs(b - (k - 1) / (m + k - 1)) < 1e-12,
          `M=${m} K=${k} bubble ${b}`,
        );
      assert.ok(Math.abs(idealBubble(m, k) - (k - 1) / (m + k - 1)) < 1e-15);
    }
  }
});

test('gpipe and 1f1b have the same makespan (f + b)(M + K - 1) for any uniform costs', () => {
  for (const [f, b] of [
    [1, 1],
    [1, 2],
    [2, 3],
    [3, 1],
  ]) {
    const cost: CostFn = (_, a) =>
      a.op === 'forward' ? f : a.op === 'backward' ? b : 0;
    for (const m of MS) {
      for (const k of KS) {
        for (const [name, make] of KINDS) {
          const r = simulate(make(m, k, 'always'), cost);
          assert.equal(
            r.makespan,
            (f + b) * (m + k - 1),
            `${name} f=${f} b=${b} M=${m} K=${k}`,
          );
          assert.equal(r.bubble.length, k);
          for (const x of r.bubble)
            assert.ok(
              Math.abs(x - idealBubble(m, k)) < 1e-12,
              `${name} f=${f} b=${b} M=${m} K=${k}: bubble ${x}`,
            );
        }
      }
    }
  }
  // An unbalanced pipeline: the slow stage dictates the pace and idles least.
  const slow: CostFn = (s, a) =>
    a.op === 'forward'
      ? s === 1
        ? 2
        : 1
      : a.op === 'backward'
        ? s === 1
          ? 4
          : 2
        : 0;
  const r = simulate(gpipeSchedule(4, 3, 'never'), slow);
  assert.ok(
    r.bubble[1] < r.bubble[0] && r.bubble[1] < r.bubble[2],
    `bubbles ${r.bubble}`,
  );
  assert.ok(r.makespan > 3 * (4 + 3 - 1));
});

test('clockCycles yields exactly the pairs with i + j = t', () => {
  for (let m = 1; m <= 6; m++) {
    for (let n = 1; n <= 5; n++) {
      const ticks = [...clockCycles(m, n)];
      assert.equal(ticks.length, m + n - 1, `m=${m} n=${n}`);
      ticks.forEach((pairs, t) => {
        const want: string[] = [];
        for (let i = 0; i < m; i++)
          for (let j = 0; j < n; j++) if (i + j === t) want.push(`${i},${j}`);
        assert.deepEqual(
          pairs.map(([i, j]) => `${i},${j}`).sort(),
          want.sort(),
          `m=${m} n=${n} t=${t}`,
        );
      });
    }
  }
  // The documented 4 x 3 table.
  assert.deepEqual(
    [...clockCycles(4, 3)],
    [
      [[0, 0]],
      [
        [1, 0],
        [0, 1],
      ],
      [
        [2, 0],
        [1, 1],
        [0, 2],
      ],
      [
        [3, 0],
        [2, 1],
        [1, 2],
      ],
      [
        [3, 1],
        [2, 2],
      ],
      [[3, 2]],
    ],
  );
});

test('formatAction and formatSchedule print compact labels', () => {
  assert.equal(
    formatAction({ stage: 1, op: 'forward', mb: 3, keep: false, grad: true }),
    '1F3',
  );
  assert.equal(
    formatAction({ stage: 1, op: 'forward', mb: 3, keep: true, grad: true }),
    '1Fk3',
  );
  assert.equal(
    formatAction({ stage: 0, op: 'forward', mb: 2, keep: true, grad: false }),
    '0F2',
  );
  assert.equal(formatAction({ stage: 0, op: 'backward', mb: 0 }), '0B0');
  assert.equal(formatAction({ stage: 2, op: 'recv_act', mb: 1 }), '2RA1');
  assert.equal(formatAction({ stage: 2, op: 'send_act', mb: 1 }), '2SA1');
  assert.equal(formatAction({ stage: 2, op: 'recv_grad', mb: 1 }), '2RG1');
  assert.equal(formatAction({ stage: 2, op: 'send_grad', mb: 1 }), '2SG1');
  assert.equal(formatAction({ stage: 2, op: 'optimizer_step' }), '2STEP');
  assert.equal(formatAction({ stage: 2, op: 'reduce_grad_norm' }), '2NORM');
  assert.equal(
    formatSchedule(gpipeSchedule(2, 2, 'except_last')),
    '0F0 0SA0 0Fk1 0SA1 0RG1 0B1 0RG0 0B0 0NORM 0STEP\n' +
      '1RA0 1F0 1RA1 1Fk1 1B1 1SG1 1B0 1SG0 1NORM 1STEP',
  );
  assert.equal(
    formatSchedule(oneFOneBSchedule(2, 2, 'always')),
    '0F0 0SA0 0F1 0SA1 0RG0 0B0 0RG1 0B1 0NORM 0STEP\n' +
      '1RA0 1F0 1B0 1SG0 1RA1 1F1 1B1 1SG1 1NORM 1STEP',
  );
});

/** A deep copy of a schedule to break on purpose. */
const copy = (s: Schedule): Schedule =>
  s.map((acts) => acts.map((a) => ({ ...a })));

test('simulate rejects invalid schedules, naming the stage', () => {
  // Backward before forward on stage 1.
  const a = copy(gpipeSchedule(2, 2, 'never'));
  const f = a[1].findIndex((x) => x.op === 'forward');
  a[1].splice(f, 0, { op: 'backward', stage: 1, mb: 0 });
  assert.throws(() => simulate(a), /stage 1 .*backward before forward/);

  // Single stage: backward with no forward at all.
  assert.throws(
    () => simulate([[{ op: 'backward', stage: 0, mb: 0 }]]),
    /stage 0 .*backward before forward/,
  );

  // A receive nobody sends: stage 1 waits for an activation that never comes.
  const b = copy(gpipeSchedule(2, 2, 'never'));
  b[1].push({ op: 'recv_act', stage: 1, mb: 2 });
  assert.throws(() => simulate(b), /stage 1 .*recv_act.*deadlock/);
  const b2 = copy(gpipeSchedule(2, 3, 'never'));
  b2[0].push({ op: 'recv_grad', stage: 0, mb: 0 });
  assert.throws(() => simulate(b2), /stage 0 .*recv_grad.*deadlock/);

  // Swapped receive order: stage 2 expects micro-batch 1 first, the channel delivers 0.
  const c = copy(gpipeSchedule(2, 3, 'never'));
  const ra = c[2]
    .map((x, i) => (x.op === 'recv_act' ? i : -1))
    .filter((i) => i >= 0);
  [c[2][ra[0]], c[2][ra[1]]] = [c[2][ra[1]], c[2][ra[0]]];
  assert.throws(
    () => simulate(c),
    /stage 2 .*expected activation of micro-batch 1, the channel delivers 0/,
  );

  // Swapped gradient order on stage 0.
  const d = copy(gpipeSchedule(3, 2, 'never'));
  const rg = d[0]
    .map((x, i) => (x.op === 'recv_grad' ? i : -1))
    .filter((i) => i >= 0);
  [d[0][rg[0]], d[0][rg[2]]] = [d[0][rg[2]], d[0][rg[0]]];
  assert.throws(
    () => simulate(d),
    /stage 0 .*expected gradient of micro-batch 0, the channel delivers 2/,
  );

  // A micro-batch forwarded twice; a step before every backward; receive on the first stage.
  const e = copy(gpipeSchedule(2, 1, 'never'));
  e[0].splice(1, 0, { op: 'forward', stage: 0, mb: 0, keep: true, grad: true });
  assert.throws(() => simulate(e), /stage 0 .*forwarded twice/);
  const g = copy(gpipeSchedule(2, 2, 'never'));
  g[1] = g[1].filter(
    (x) =>
      !(x.op === 'backward' && x.mb === 0) &&
      !(x.op === 'send_grad' && x.mb === 0),
  );
  assert.throws(() => simulate(g), /stage 1 .*step before every backward/);
  assert.throws(
    () =>
      simulate([
        [
          { op: 'forward', stage: 0, mb: 0, keep: true, grad: true },
          { op: 'optimizer_step', stage: 0 },
        ],
      ]),
    /stage 0 .*step before every backward/,
  );
  assert.throws(
    () => simulate([[{ op: 'recv_act', stage: 0, mb: 0 }]]),
    /stage 0 .*no previous stage/,
  );
  assert.throws(
    () => simulate([[{ op: 'recv_grad', stage: 0, mb: 0 }]]),
    /stage 0 .*no next stage/,
  );
});

test('simulate names the stage for sends past the pipeline ends', () => {
  const fb: Action[] = [
    { op: 'forward', stage: 0, mb: 0, keep: true, grad: true },
    { op: 'backward', stage: 0, mb: 0 },
  ];
  assert.throws(
    () => simulate([[...fb, { op: 'send_grad', stage: 0, mb: 0 }]]),
    /stage 0 /,
  );
  assert.throws(
    () => simulate([[fb[0], { op: 'send_act', stage: 0, mb: 0 }, fb[1]]]),
    /stage 0 /,
  );
});

test('bad M or K throw LayerwiseError', () => {
  for (const [m, k] of [
    [0, 1],
    [1, 0],
    [-1, 2],
    [2, -3],
    [1.5, 2],
    [2, 2.5],
    [NaN, 1],
    [1, NaN],
  ]) {
    for (const make of [gpipeSchedule, oneFOneBSchedule]) {
      assert.throws(
        () => make(m, k, 'never'),
        (e: unknown) =>
          e instanceof LayerwiseError &&
          /positive integer/.test(e.message) &&
          e.message.includes(String(m < 1 || !Number.isInteger(m) ? m : k)),
        `M=${m} K=${k}`,
      );
    }
    assert.throws(() => evalSchedule(m, k), LayerwiseError);
  }
  assert.throws(
    () => makeSchedule('zigzag' as never, 2, 2, 'never'),
    (e: unknown) =>
      e instanceof LayerwiseError &&
      /unknown schedule 'zigzag'.*gpipe, 1f1b/.test(e.message),
  );
  assert.deepEqual(
    makeSchedule('gpipe', 4, 3, 'always'),
    gpipeSchedule(4, 3, 'always'),
  );
  assert.deepEqual(
    makeSchedule('1f1b', 4, 3, 'always'),
    oneFOneBSchedule(4, 3, 'always'),
  );
});

test('simulate rejects a message that is sent but never received', () => {
  // forward-only: stage 0 sends two activations, stage 1 receives one
  const s = evalSchedule(2, 2);
  s[1] = s[1].filter((a) => !('mb' in a && a.mb === 1));
  assert.throws(
    () => simulate(s),
    /stage 1 never receives the activation of micro-batch 1/,
  );
});

test('compute-only generators have no communication; lowering adds exactly the old sends and receives', () => {
  for (const m of MS)
    for (const k of KS)
      for (const mode of REMAT_MODES)
        for (const [gen, lowered] of [
          [gpipeCompute, gpipeSchedule],
          [oneFOneBCompute, oneFOneBSchedule],
        ] as const) {
          const c = gen(m, k, mode);
          for (const acts of c)
            for (const a of acts)
              assert.ok(['forward', 'backward'].includes(a.op), a.op);
          const s = lower(c, chainPlacement(k), { step: 'all-reduce' });
          assert.deepEqual(s, lowered(m, k, mode));
          // removing the communication and the step gives the compute list back
          assert.deepEqual(
            s.map((acts) =>
              acts.filter((a) => a.op === 'forward' || a.op === 'backward'),
            ),
            c,
          );
          // every action names its stage: stage s on device s
          s.forEach((acts, d) => {
            for (const a of acts) assert.equal(a.stage, d);
          });
        }
});

test('lower: stages on one device hand over directly (no send or receive between them); each device steps each of its stages', () => {
  // 3 stages on 2 devices: stages 0 and 1 on device 0, stage 2 on device 1; fill-drain
  const m = 2;
  const compute: ComputeSchedule = [
    [
      ...Array.from({ length: m }, (_, mb) => mb).flatMap((mb) =>
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
    [
      ...Array.from({ length: m }, (_, mb) => mb).map(
        (mb): ComputeAction => ({
          op: 'forward',
          stage: 2,
          mb,
          keep: false,
          grad: true,
        }),
      ),
      ...[1, 0].map((mb): ComputeAction => ({ op: 'backward', stage: 2, mb })),
    ],
  ];
  const s = lower(compute, [0, 0, 1], { step: 'all-reduce' });
  assert.equal(
    formatSchedule(s),
    [
      '0F0 1F0 1SA0 0F1 1F1 1SA1 1RG1 1B1 0B1 1RG0 1B0 0B0 0NORM 0STEP 1STEP',
      '2RA0 2F0 2RA1 2F1 2B1 2SG1 2B0 2SG0 2NORM 2STEP',
    ].join('\n'),
  );
  const sim = simulate(s);
  assert.equal(sim.events.length, s[0].length + s[1].length);
  assert.ok(sim.events.every((e) => e.device === (e.stage === 2 ? 1 : 0)));
  // a stage in the wrong device's list, a stage out of range, links that do not exist
  assert.throws(
    () => lower(compute, [0, 1, 1]),
    /stage 1 is placed on device 1/,
  );
  assert.throws(() => lower(compute, [0, 0]), /stage 2 is not one of the 2/);
  assert.throws(
    () => lower([[], [], [], []], [0, 2, 1, 3]),
    /stage 0 on device 0 and stage 1 on device 2: devices are linked to their neighbours/,
  );
  // communication in a compute-only list is refused
  assert.throws(
    () =>
      lower(
        [[{ op: 'send_act', stage: 0, mb: 0 }]] as unknown as ComputeSchedule,
        [0],
      ),
    /a compute-only schedule has no communication/,
  );
  // simulate refuses a stage whose actions are on two devices
  const split = s.map((acts) => [...acts]);
  split[1].unshift({ op: 'optimizer_step', stage: 0 });
  assert.throws(
    () => simulate(split),
    /stage 0 has actions on devices 0 and 1/,
  );
});

test('local and relay schedules are compute-only lists plus lowering', () => {
  for (const det of [true, false]) {
    const c = localCompute(3, 3, 1, det);
    for (const acts of c)
      for (const a of acts)
        assert.ok(
          ['local_update', 'overlap_backward', 'local_step'].includes(a.op),
        );
    assert.deepEqual(
      lower(c, chainPlacement(3), { overlap: { deterministic: det } }),
      localSchedule(3, 3, 1, det),
    );
  }
  assert.deepEqual(lower(relayCompute(3, 2), [0]), relaySchedule(3, 2));
  assert.equal(
    formatSchedule(localSchedule(2, 2, 1, true)),
    [
      '0L0 0SA0 0LSTEP 0L1 0SA1 0RG0 0O0 0LSTEP 0RG1 0O1',
      '1RA0 1L0 1SG0 1LSTEP 1RA1 1L1 1SG1 1LSTEP',
    ].join('\n'),
  );
});

/** Ranges of n layers cut into k contiguous stages, the first ones one layer longer. */
function cut(n: number, k: number): Array<{ from: number; to: number }> {
  const out: Array<{ from: number; to: number }> = [];
  let from = 0;
  for (let d = 0; d < k; d++) {
    const len = Math.floor(n / k) + (d < n % k ? 1 : 0);
    out.push({ from, to: from + len });
    from += len;
  }
  return out;
}

test("pipelined relay: gpipe and 1f1b stage schedules expanded over each stage's layers simulate for K = 2, 3 and M = 1..4, and beat the one-device relay", () => {
  for (const kind of ['gpipe', '1f1b'] as const)
    for (const k of [2, 3])
      for (const m of [1, 2, 4])
        for (const n of [k, k + 2, 7]) {
          const ranges = cut(n, k);
          const s = relayPipelineTraining(kind, m, ranges);
          const r = simulate(s); // throws on any broken dependency
          assert.equal(s.length, k);
          s.forEach((acts, d) => {
            const { from, to } = ranges[d]!;
            // every layer of the stage: one backward and one push per micro-batch, nothing else's
            for (let l = from; l < to; l++) {
              const bwd = acts.filter(
                (a) => a.op === 'layer_backward' && a.layer === l,
              );
              assert.deepEqual(
                bwd.map((a) => (a as { mb: number }).mb).sort(),
                Array.from({ length: m }, (_, i) => i),
              );
              assert.equal(
                acts.filter((a) => a.op === 'push_grads' && a.layer === l)
                  .length,
                m,
              );
            }
            assert.ok(
              acts.every(
                (a) => !('layer' in a) || (a.layer >= from && a.layer < to),
              ),
            );
            assert.deepEqual(acts.at(-1), { op: 'optimizer_step', stage: d });
            // at most two layers on the device at once (the current and the prefetched one)
            const on = new Set<number>();
            for (const a of acts) {
              if (a.op === 'load_layer' || a.op === 'prefetch_layer')
                on.add(a.layer);
              if (a.op === 'release_layer') on.delete(a.layer);
              assert.ok(
                on.size <= 2,
                `${kind} K=${k} M=${m}: layers ${[...on]} at once`,
              );
            }
          });
          if (n >= 2 * k && m >= 2) {
            const one = simulate(relaySchedule(n, m));
            assert.ok(
              r.makespan < one.makespan,
              `${kind} K=${k} M=${m} n=${n}: ${r.makespan} vs one device ${one.makespan}`,
            );
          }
        }
});

test('pipelined relay: the exact 1F1B list of 2 stages of one layer each, M = 2 (the layer stays loaded between micro-batches)', () => {
  assert.equal(
    formatSchedule(
      relayPipelineTraining('1f1b', 2, [
        { from: 0, to: 1 },
        { from: 1, to: 2 },
      ]),
    ),
    [
      '0L0LOAD 0L0F0 0SA0 0L0F1 0SA1 0RG0 0L0B0 0L0PUSH 0RG1 0L0B1 0L0PUSH 0L0FREE 0STEP',
      '1RA0 1L1LOAD 1L1B0 1L1PUSH 1SG0 1RA1 1L1B1 1L1PUSH 1L1FREE 1SG1 1STEP',
    ].join('\n'),
  );
  // evaluation: every layer forward without grad, the last one included
  const e = relayPipelineSchedule(evalSchedule(1, 2), [
    { from: 0, to: 2 },
    { from: 2, to: 3 },
  ]);
  assert.equal(
    formatSchedule(e),
    [
      '0L0LOAD 0L0F0 0L1PREF 0L0FREE 0L1LOAD 0L1F0 0L1FREE 0SA0',
      '1RA0 1L2LOAD 1L2F0 1L2FREE',
    ].join('\n'),
  );
  simulate(e);
});

test('pipelined relay: LayerDrop leaves dropped layers out (a stage with none left passes micro-batches on); a split backward is refused', () => {
  const s = relayPipelineTraining('1f1b', 2, cut(6, 2), new Set([1, 4]));
  simulate(s);
  assert.ok(
    s.flat().every((a) => !('layer' in a) || (a.layer !== 1 && a.layer !== 4)),
  );
  // a stage with no layer left passes each micro-batch on through its first layer, unloaded
  const skip = relayPipelineTraining('gpipe', 2, cut(6, 3), new Set([2, 3]));
  assert.equal(
    formatSchedule([skip[1]!]),
    '1RA0 1L2F0 1SA0 1RA1 1L2F1 1SA1 1RG1 1L2B1 1SG1 1RG0 1L2B0 1SG0 1STEP',
  );
  assert.throws(
    () =>
      relayPipelineSchedule(
        lower(computeSchedule('zb-h1', 2, 2, 'never'), chainPlacement(2)),
        cut(4, 2),
      ),
    /a pipelined relay runs forwards and backwards, not 1I0; use --schedule gpipe or 1f1b/,
  );
});
