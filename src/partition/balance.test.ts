import assert from 'node:assert/strict';
import { test } from 'node:test';
import { LayerwiseError } from '../util/errors.js';
import { Rng } from '../util/rng.js';
import {
  balanceByCost,
  parseBalance,
  stageRanges,
  validateBalance,
} from './balance.js';

/** Every way to cut n blocks into k contiguous non-empty parts, as block counts. */
function* compositions(n: number, k: number): Generator<number[]> {
  if (k === 1) {
    if (n >= 1) yield [n];
    return;
  }
  for (let first = 1; first <= n - (k - 1); first++) {
    for (const rest of compositions(n - first, k - 1)) yield [first, ...rest];
  }
}

/** Cost of the most expensive part, summing each part directly. */
function maxPart(costs: readonly number[], sizes: readonly number[]): number {
  let i = 0;
  let max = -Infinity;
  for (const s of sizes) {
    let sum = 0;
    for (let j = 0; j < s; j++) sum += costs[i++];
    max = Math.max(max, sum);
  }
  return max;
}

function bruteForce(costs: readonly number[], k: number): number {
  let best = Infinity;
  for (const p of compositions(costs.length, k))
    best = Math.min(best, maxPart(costs, p));
  return best;
}

/** The result is a valid balance whose most expensive stage costs the brute-force optimum. */
function checkOptimal(costs: readonly number[], k: number, tol = 0): void {
  const what = `costs [${costs.join(', ')}], k=${k}`;
  const b = balanceByCost(costs, k);
  assert.equal(b.length, k, what);
  assert.ok(
    b.every((x) => Number.isInteger(x) && x >= 1),
    `${what}: ${b}`,
  );
  assert.equal(
    b.reduce((s, x) => s + x, 0),
    costs.length,
    what,
  );
  validateBalance(b, costs.length, k);
  const got = maxPart(costs, b);
  const want = bruteForce(costs, k);
  assert.ok(
    Math.abs(got - want) <= tol,
    `${what}: balance ${b} costs ${got}, optimum ${want}`,
  );
}

test('compositions enumerates C(n-1, k-1) partitions (sanity of the brute force)', () => {
  const binom = (n: number, r: number): number =>
    r === 0 ? 1 : (binom(n - 1, r - 1) * n) / r;
  for (let n = 1; n <= 8; n++)
    for (let k = 1; k <= n; k++)
      assert.equal([...compositions(n, k)].length, binom(n - 1, k - 1));
});

test('balanceByCost is optimal against brute force on random integer costs', () => {
  const rng = new Rng(12345);
  for (let it = 0; it < 400; it++) {
    const n = 1 + rng.int(9);
    const k = 1 + rng.int(n);
    const costs = Array.from({ length: n }, () => rng.int(10));
    checkOptimal(costs, k);
  }
});

test('balanceByCost is optimal against brute force on random real costs', () => {
  const rng = new Rng(99);
  for (let it = 0; it < 200; it++) {
    const n = 1 + rng.int(10);
    const k = 1 + rng.int(n);
    const costs = Array.from({ length: n }, () => rng.next() * 1e6);
    checkOptimal(costs, k, 1e-6);
  }
});

test('balanceByCost on hand-made cases', () => {
  // Equal costs: equal parts.
  assert.deepEqual(balanceByCost([1, 1, 1, 1, 1, 1], 3), [2, 2, 2]);
  assert.deepEqual(balanceByCost([4, 4, 4, 4], 4), [1, 1, 1, 1]);
  assert.deepEqual(balanceByCost([7, 7], 1), [2]);
  // One huge block must stand alone.
  assert.deepEqual(balanceByCost([1, 1, 100, 1, 1], 3), [2, 1, 2]);
  assert.deepEqual(balanceByCost([100, 1, 1, 1], 2), [1, 3]);
  assert.deepEqual(balanceByCost([1, 1, 1, 100], 2), [3, 1]);
  // 1..9 into 3: {1..5}=15, {6,7}=13, {8,9}=17 is optimal (a part holding 8 and 9 costs >= 17,
  // and splitting them leaves 1..7 = 28 for two parts, or 1..8 = 36 for two parts: >= 18).
  assert.equal(
    maxPart(
      [1, 2, 3, 4, 5, 6, 7, 8, 9],
      balanceByCost([1, 2, 3, 4, 5, 6, 7, 8, 9], 3),
    ),
    17,
  );
  // Zero-cost blocks (e.g. an embedding with no flops) still get a stage each when k = n.
  assert.deepEqual(balanceByCost([0, 0, 0], 3), [1, 1, 1]);
  const z = balanceByCost([0, 5, 0, 5], 2);
  assert.equal(maxPart([0, 5, 0, 5], z), 5);
  // A transformer-like profile: cheap embedding, equal decoders, a big head.
  checkOptimal([0, 10, 10, 10, 10, 25], 3);
  checkOptimal([3, 1, 4, 1, 5, 9, 2, 6, 5, 3, 5], 4);
});

test('balanceByCost rejects k > n and k < 1, naming the limit', () => {
  assert.throws(
    () => balanceByCost([1, 2, 3], 4),
    (e: unknown) =>
      e instanceof LayerwiseError &&
      /3 blocks into 4 stages/.test(e.message) &&
      /at most 3 stages/.test(e.message),
  );
  assert.throws(
    () => balanceByCost([], 1),
    (e: unknown) =>
      e instanceof LayerwiseError && /at most 0 stages/.test(e.message),
  );
  for (const k of [0, -1, 1.5, NaN]) {
    assert.throws(
      () => balanceByCost([1, 2, 3], k),
      (e: unknown) =>
        e instanceof LayerwiseError &&
        /positive integer/.test(e.message) &&
        e.message.includes(String(k)),
      `k=${k}`,
    );
  }
});

test('validateBalance accepts good balances and explains bad ones', () => {
  validateBalance([2, 3, 3], 8, 3);
  validateBalance([1], 1, 1);
  const err = (re: RegExp) => (e: unknown) =>
    e instanceof LayerwiseError && re.test(e.message);
  // Wrong number of entries.
  assert.throws(
    () => validateBalance([4, 4], 8, 3),
    err(/2 entries but --stages is 3/),
  );
  assert.throws(
    () => validateBalance([2, 2, 2, 2], 8, 3),
    err(/4 entries but --stages is 3/),
  );
  // Empty stage or non-integer entry.
  assert.throws(
    () => validateBalance([0, 4, 4], 8, 3),
    err(/at least 1 block/),
  );
  assert.throws(
    () => validateBalance([-1, 5, 4], 8, 3),
    err(/at least 1 block/),
  );
  assert.throws(
    () => validateBalance([2.5, 2.5, 3], 8, 3),
    err(/whole numbers/),
  );
  // Wrong sum: the message names the sum and the number of blocks.
  assert.throws(
    () => validateBalance([2, 3, 4], 8, 3),
    err(/sums to 9, but the model has 8 blocks/),
  );
  assert.throws(
    () => validateBalance([1, 1, 1], 8, 3),
    (e: unknown) =>
      e instanceof LayerwiseError &&
      e.message.includes('sums to 3') &&
      e.message.includes('8 blocks'),
  );
});

test('parseBalance parses comma-separated counts and rejects anything else', () => {
  assert.deepEqual(parseBalance('2,3,3'), [2, 3, 3]);
  assert.deepEqual(parseBalance(' 2 , 3,3 '), [2, 3, 3]);
  assert.deepEqual(parseBalance('12'), [12]);
  for (const bad of [
    '',
    '2,,3',
    '2,a',
    'a',
    '2.5,1',
    '-1,2',
    '2;3',
    '1e2',
    '0x3',
    '2,3,',
  ]) {
    assert.throws(
      () => parseBalance(bad),
      (e: unknown) =>
        e instanceof LayerwiseError &&
        e.message.includes(`'${bad}'`) &&
        /comma-separated/.test(e.message),
      `'${bad}'`,
    );
  }
});

test('stageRanges is contiguous and covers every block', () => {
  const rng = new Rng(3);
  for (let it = 0; it < 50; it++) {
    const k = 1 + rng.int(6);
    const balance = Array.from({ length: k }, () => 1 + rng.int(5));
    const r = stageRanges(balance);
    assert.equal(r.length, k);
    assert.equal(r[0].from, 0);
    for (let i = 0; i < k; i++) {
      assert.equal(r[i].to - r[i].from, balance[i]);
      if (i > 0) assert.equal(r[i].from, r[i - 1].to);
    }
    assert.equal(
      r[k - 1].to,
      balance.reduce((a, b) => a + b, 0),
    );
  }
  assert.deepEqual(stageRanges([2, 3, 3]), [
    { from: 0, to: 2 },
    { from: 2, to: 5 },
    { from: 5, to: 8 },
  ]);
});
