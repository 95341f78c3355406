/** The cost model on hand-made block costs: exact byte accounting, interpolation, times and bubbles. */
import { test } from 'node:test';
import assert from 'node:assert/strict';
import { stageRanges } from './balance.js';
import {
  blockBalanceCosts, costsAt, optimizerSlots, predictPeakBytes, predictStepTime,
  type BlockCost, type MicroBatchCosts, type ModelProfile,
} from './memory-model.js';
import { idealBubble } from '../schedule/schedule.js';

/** A block whose every quantity is given; activations 100 bytes per micro-batch unit. */
function block(o: Partial<BlockCost> = {}): BlockCost {
  return {
    name: 'b', paramBytes: 1000, maxParamBytes: 800, optTransientBytes: 5000, optSeconds: 0,
    inBytes: 10, outBytes: 10, fwdPeakBytes: 200, keptBytes: 100, bwdPeakBytes: 1300, fwdSeconds: 1, bwdSeconds: 2, ...o,
  };
}
const costs = (n: number, o: Partial<BlockCost> = {}, labelBytes = 4): MicroBatchCosts => ({ batch: 1, blocks: Array.from({ length: n }, () => block(o)), labelBytes });

test('optimizer slots: AdamW 2, SGD with momentum 1, plain SGD 0', () => {
  assert.equal(optimizerSlots({ kind: 'adamw', momentum: 0.9 }), 2);
  assert.equal(optimizerSlots({ kind: 'sgd', momentum: 0.9 }), 1);
  assert.equal(optimizerSlots({ kind: 'sgd', momentum: 0 }), 0);
});

test('single device: params + slots + inputs + labels, peaked by the optimizer step', () => {
  // P = 2000, slots 2P = 4000, input 10, labels 4; backward peak = 2000+4000+14 + kept 200 + bwd 2600 = 8814;
  // optimizer: 6000 + grads 2000 + transient 5000 = 13000
  const [p] = predictPeakBytes(costs(2), [{ from: 0, to: 2 }], { m: 1, checkpoint: 'never', schedule: 'gpipe', slots: 2 });
  assert.equal(p, 13000);
  const [q] = predictPeakBytes(costs(2, { optTransientBytes: 0 }), [{ from: 0, to: 2 }], { m: 1, checkpoint: 'never', schedule: 'gpipe', slots: 2 });
  assert.equal(q, 2000 + 4000 + 10 + 4 + 200 + 2600);
});

test('activations: never keeps M tapes, except_last one, always recomputes; 1F1B keeps at most K - s', () => {
  const c = costs(4, { optTransientBytes: 0, paramBytes: 0, maxParamBytes: 0, bwdPeakBytes: 0, fwdPeakBytes: 0 });
  const ranges = stageRanges([2, 2]);
  const peak = (checkpoint: 'never' | 'except_last' | 'always', schedule: 'gpipe' | '1f1b', m = 8) =>
    predictPeakBytes(c, ranges, { m, checkpoint, schedule, slots: 0 });
  // stage 0 holds all 8 inputs (80 bytes) and, at its first backward, the received output gradient (10);
  // kept tape 200 per micro-batch; the last stage holds received inputs and labels (4 each)
  assert.deepEqual(peak('never', 'gpipe'), [80 + 8 * 200 + 10, 8 * 10 + 8 * 200 + 8 * 4]);
  assert.equal(peak('except_last', 'gpipe')[0], 80 + 200 + 10);
  assert.equal(peak('always', 'gpipe')[0], 80 + 200 + 10); // the recomputed tape of one micro-batch
  // 1F1B: stage 0 has at most 2 micro-batches in flight, the last stage 1
  assert.equal(peak('never', '1f1b')[0], 80 + 2 * 200 + 10);
  assert.ok(peak('never', '1f1b')[1] < peak('never', 'gpipe')[1]);
  // more micro-batches, more kept tapes under 'never'
  assert.ok(peak('never', 'gpipe', 16)[0] > peak('never', 'gpipe', 8)[0]);
});

test('costsAt interpolates linearly between measured sizes and extrapolates beyond', () => {
  const at = (n: number) => ({ inBytes: 10 * n, outBytes: 10 * n, fwdPeakBytes: 30 * n, keptBytes: 20 * n, bwdPeakBytes: 40 * n, fwdSeconds: 1 + n, bwdSeconds: 2 + 2 * n });
  const profile: ModelProfile = {
    backend: 'cpu',
    blocks: [{ name: 'a', paramBytes: 8, maxParamBytes: 8, optTransientBytes: 16, optSeconds: 0.5 }],
    sizes: [2, 8].map((n) => ({ batch: n, labelBytes: 4 * n, blocks: [at(n)] })),
  };
  for (const n of [1, 2, 4, 8, 16]) {
    const c = costsAt(profile, n);
    assert.deepEqual({ ...c.blocks[0] }, { name: 'a', paramBytes: 8, maxParamBytes: 8, optTransientBytes: 16, optSeconds: 0.5, ...at(n) });
    assert.equal(c.labelBytes, 4 * n);
  }
  assert.throws(() => costsAt(profile, 0), /micro-batch size must be positive/);
  assert.throws(() => costsAt({ ...profile, sizes: [] }, 1), /no measured micro-batch size/);
});

test('step time: equal stages give the ideal bubble (K-1)/(M+K-1); re-materialization adds a forward per backward', () => {
  const c = costs(4);
  for (const [k, m] of [[2, 4], [4, 8], [2, 1]]) {
    const ranges = stageRanges(Array.from({ length: k }, () => 4 / k));
    const t = predictStepTime(c, ranges, { m, checkpoint: 'never', schedule: 'gpipe' });
    const per = (4 / k) * 3;
    assert.ok(Math.abs(t.seconds - (m + k - 1) * per) < 1e-9, `makespan K=${k} M=${m}`);
    t.bubble.forEach((b) => assert.ok(Math.abs(b - idealBubble(m, k)) < 1e-9));
  }
  const never = predictStepTime(c, stageRanges([4]), { m: 2, checkpoint: 'never', schedule: 'gpipe' }).seconds;
  const always = predictStepTime(c, stageRanges([4]), { m: 2, checkpoint: 'always', schedule: 'gpipe' }).seconds;
  assert.equal(always - never, 2 * 4 * 1);
});

test('balance costs: time counts the recomputed forwards, memory the kept tapes', () => {
  const c = costs(2);
  const shape = { m: 4, checkpoint: 'except_last' as const, schedule: 'gpipe' as const, slots: 2 };
  assert.deepEqual(blockBalanceCosts(c, 'time', shape, 2), [1 * (1 + 3 / 4) + 2, 1 * (1 + 3 / 4) + 2]);
  const never = blockBalanceCosts(c, 'memory', { ...shape, checkpoint: 'never' }, 2)[0];
  const last = blockBalanceCosts(c, 'memory', shape, 2)[0];
  assert.equal(never - last, 3 * 100);
});

test('an empty stage is rejected with the rule', () => {
  assert.throws(() => predictPeakBytes(costs(2), [{ from: 0, to: 0 }, { from: 0, to: 2 }], { m: 1, checkpoint: 'never', schedule: 'gpipe', slots: 0 }), /needs at least 1 block/);
});
