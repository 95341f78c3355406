/**
 * The op declarations (ops.ts): every op is declared once, core ops agree with the executor's
 * list, and an op nobody declared is an error everywhere a schedule is read (simulation,
 * lowering, memory and time predictions), never free.
 */
import assert from 'node:assert/strict';
import { test } from 'node:test';
import { CORE_OPS, declarationOf, OPS, UNIT_COSTS } from './ops.js';
import {
  type Action,
  type ComputeSchedule,
  gpipeSchedule,
  localSchedule,
  lower,
  relaySchedule,
} from './schedule.js';
import { defaultCost, simulate } from './simulate.js';

test('every op of every schedule kind has a declaration; core ops are exactly CORE_OPS', () => {
  const ops = new Set<string>();
  for (const s of [
    gpipeSchedule(3, 2, 'except_last'),
    localSchedule(3, 2, 1, false),
    localSchedule(3, 2, 1, true),
    relaySchedule(3, 2),
  ])
    for (const acts of s) for (const a of acts) ops.add(a.op);
  for (const op of ops) assert.ok(declarationOf(op), op);
  assert.deepEqual(
    Object.keys(OPS).filter((op) => declarationOf(op).core),
    [...CORE_OPS],
  );
});

test('an undeclared op is an error: declarationOf, simulate and lower throw, naming it', () => {
  assert.throws(
    () => declarationOf('teleport'),
    /op 'teleport' has no declaration/,
  );
  assert.throws(
    () => declarationOf('toString'),
    /op 'toString' has no declaration/,
  );
  const bogus = { op: 'teleport', stage: 0, mb: 0 } as unknown as Action;
  assert.throws(
    () => simulate([[bogus]]),
    /stage 0 .*op 'teleport' has no declaration/,
  );
  assert.throws(
    () => defaultCost(0, bogus),
    /op 'teleport' has no declaration/,
  );
  assert.throws(
    () => lower([[bogus]] as unknown as ComputeSchedule, [0]),
    /op 'teleport' has no declaration/,
  );
});

test("the declared costs are simulate's defaults: forward 1, backward 2, local update 3, communication free", () => {
  const f: Action = { op: 'forward', stage: 0, mb: 0, keep: true, grad: true };
  assert.equal(OPS.forward.cost(f, UNIT_COSTS), 1);
  assert.equal(defaultCost(0, { op: 'backward', stage: 0, mb: 0 }), 2);
  assert.equal(defaultCost(0, { op: 'local_update', stage: 0, mb: 0 }), 3);
  for (const op of CORE_OPS)
    assert.equal(
      defaultCost(0, { op, stage: 0, mb: 0 } as unknown as Action),
      0,
      op,
    );
  // a re-materialized backward costs its forward again
  const recompute = { ...UNIT_COSTS, recomputes: () => true };
  assert.equal(
    OPS.backward.cost({ op: 'backward', stage: 0, mb: 0 }, recompute),
    3,
  );
});
