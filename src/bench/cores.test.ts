import assert from 'node:assert/strict';
import { test } from 'node:test';
import { threadsPerDevice } from '../strategies/spec.js';
import {
  type CoreConfig,
  type CoresBenchOptions,
  coresGrid,
  measureRounds,
  overOneThread,
  parseCoresOptions,
  type Row,
  type Skipped,
  threadsForDevices,
} from './cores.js';

test("threadsForDevices keeps what fits K x threads <= cores and adds K's default", () => {
  // the default: 16 cores less 2 for the host's threads, over K
  assert.deepEqual(
    threadsForDevices([1, 2, 4, 8, 16], 1, 16),
    [1, 2, 4, 8, 14, 16],
  );
  assert.deepEqual(threadsForDevices([1, 2, 4, 8, 16], 3, 16), [1, 2, 4]);
  assert.deepEqual(threadsForDevices([1, 2, 4, 8, 16], 4, 16), [1, 2, 3, 4]);
  assert.deepEqual(threadsForDevices([4], 2, 2), [1]);
});

const all = {
  threads: [1, 2, 4, 8, 16],
  stages: [2, 3, 4],
  kinds: [
    'single',
    'single-bf16',
    '1f1b',
    'zb-h1',
    'zbv',
    'dualpipev',
    'local',
  ] as const,
  microBatches: [4, 8],
};

test('coresGrid on 16 cores and 6 blocks: what runs first, what does not fit', () => {
  const { configs, skipped } = coresGrid(
    { ...all, kinds: [...all.kinds] },
    16,
    6,
  );
  const key = (c: {
    kind: string;
    devices: number;
    threads: number | '-';
    microBatches?: number;
  }) =>
    `${c.kind}/${c.devices}x${c.threads}${c.microBatches ? `/M${c.microBatches}` : ''}`;
  // the bars' rows come first: single at its default and PyTorch at 16 threads, zbv K=3 on
  // 3 x 4 at each M
  assert.deepEqual(configs.slice(0, 6).map(key), [
    'single/1x14',
    'pytorch/1x16',
    'single-bf16/1x14',
    'pytorch-bf16/1x16',
    'zbv/3x4/M4',
    'zbv/3x4/M8',
  ]);
  // a pipeline schedule runs at every M, single and local once without one
  for (const kind of ['1f1b', 'zb-h1', 'zbv', 'dualpipev'])
    assert.deepEqual(
      [
        ...new Set(
          configs.filter((c) => c.kind === kind).map((c) => c.microBatches),
        ),
      ].sort(),
      [4, 8],
      kind,
    );
  assert.ok(
    configs
      .filter((c) => c.kind === 'local' || c.kind.startsWith('single'))
      .every((c) => c.microBatches === undefined),
  );
  // V-shaped schedules need 2K stages: no K=4 on 6 blocks
  assert.ok(!configs.some((c) => c.kind === 'zbv' && c.devices === 4));
  assert.ok(
    skipped.some(
      (s) =>
        key(s) === 'dualpipev/4x-' && /needs 8 stages.*6 blocks/.test(s.reason),
    ),
  );
  // nothing over the cores runs, and each such setting is listed
  assert.ok(configs.every((c) => c.devices * c.threads <= 16));
  assert.ok(skipped.some((s) => key(s) === '1f1b/4x8'));
  // every configuration once
  assert.equal(new Set(configs.map(key)).size, configs.length);
  // after the defaults, more threads in all first
  const rest = configs.filter(
    (c) => c.threads !== threadsPerDevice({ threads: 0 }, c.devices, 16),
  );
  const totals = rest.map((c) => c.devices * c.threads);
  assert.deepEqual(
    totals,
    [...totals].sort((a, b) => b - a),
  );
});

test('coresGrid lists PyTorch rows as skipped, with the reason, where it is not importable', () => {
  const { configs, skipped } = coresGrid(
    {
      threads: [1, 2],
      stages: [2],
      kinds: ['single', 'zbv'],
      microBatches: [4],
    },
    2,
    6,
    'PyTorch not importable',
  );
  assert.ok(!configs.some((c) => c.kind.startsWith('pytorch')));
  assert.deepEqual(
    skipped.map((s) => `${s.kind} ${s.threads} ${s.reason}`),
    [
      'pytorch 1 PyTorch not importable',
      'pytorch 2 PyTorch not importable',
      'zbv 2 2 x 2 threads > 2 cores',
    ],
  );
  assert.deepEqual(
    configs.map((c) => `${c.kind} ${c.devices}x${c.threads}`),
    ['single 1x2', 'zbv 2x1', 'single 1x1'],
  );
});

test('parseCoresOptions names a bad list entry, kind or device kind', () => {
  const raw = {
    threads: '1,2',
    stages: '2',
    kinds: 'single',
    microBatches: '4,8',
    devices: 'thread',
    steps: 3,
    budgetS: 240,
    batchSize: 32,
  };
  assert.deepEqual(parseCoresOptions(raw).threads, [1, 2]);
  assert.deepEqual(parseCoresOptions(raw).microBatches, [4, 8]);
  assert.throws(
    () => parseCoresOptions({ ...raw, microBatches: '4,x' }),
    /--micro-batches: 'x' is not a positive integer/,
  );
  assert.throws(
    () => parseCoresOptions({ ...raw, threads: '1,0' }),
    /--threads: '0' is not a positive integer/,
  );
  assert.throws(
    () => parseCoresOptions({ ...raw, kinds: 'single,gpipe' }),
    /--kinds: unknown 'gpipe'/,
  );
  assert.throws(
    () => parseCoresOptions({ ...raw, devices: 'host' }),
    /neither thread nor process/,
  );
  assert.equal(parseCoresOptions(raw).rounds, undefined);
  assert.equal(parseCoresOptions({ ...raw, rounds: '5' }).rounds, 5);
  for (const bad of ['0', 'x', '2.5'])
    assert.throws(
      () => parseCoresOptions({ ...raw, rounds: bad }),
      new RegExp(
        `--rounds: '${bad.replace('.', '\\.')}' is not a positive integer`,
      ),
    );
});

/** A measured row of `c` at `tokens` tokens/s. */
function rowOf(c: CoreConfig, tokens: number): Row {
  return {
    kind: c.kind,
    engine: 'layerwise',
    precision: 'fp32',
    devices: c.devices,
    stages: c.devices,
    threads_per_device: c.threads,
    threads_total: c.devices * c.threads,
    micro_batches: null,
    tokens_per_s: tokens,
    step_s: 1 / tokens,
  };
}

test('measureRounds runs each configuration once a round in a rotated order, keeps the median round, runs a failed one no more, and saves after each measurement', async () => {
  const configs: CoreConfig[] = [1, 2, 4].map((threads) => ({
    kind: 'single',
    devices: 1,
    threads,
  }));
  // each configuration's tokens/s by round: the median of 3 is the middle value
  const speeds: Record<number, number[]> = {
    1: [100, 300, 200],
    2: [500, 400, 600],
    4: [0, 0, 0], // fails
  };
  const calls: number[] = [];
  const saves: Array<{ rows: number; skipped: number }> = [];
  const gridSkipped: Skipped[] = [
    { kind: 'pytorch', devices: 1, threads: 1, reason: 'PyTorch not run' },
  ];
  const { rows, skipped } = await measureRounds(
    { o: { rounds: 3, budgetS: 600 } as CoresBenchOptions },
    configs,
    gridSkipped,
    async (r, s) => {
      saves.push({ rows: r.length, skipped: s.length });
    },
    async (c) => {
      const round = calls.filter((t) => t === c.threads).length;
      calls.push(c.threads);
      return c.threads === 4
        ? { ...c, reason: 'failed: out of memory' }
        : rowOf(c, speeds[c.threads]![round]!);
    },
  );
  // round 0 in the grid's order, round 1 from the second, round 2 from the third; 4 runs once
  assert.deepEqual(calls, [1, 2, 4, 2, 1, 1, 2]);
  assert.deepEqual(
    rows.map((r) => [
      r.threads_per_device,
      r.tokens_per_s,
      r.rounds_tokens_per_s,
    ]),
    [
      [1, 200, [100, 300, 200]],
      [2, 500, [500, 400, 600]],
    ],
  );
  assert.deepEqual(
    skipped.map((s) => s.reason),
    ['PyTorch not run', 'failed: out of memory'],
  );
  assert.equal(saves.length, calls.length, 'a save after each measurement');
  // after the first measurement: one row, the two not yet run listed as skipped beside the grid's
  assert.deepEqual(saves[0], { rows: 1, skipped: 3 });
});

test('measureRounds starts nothing once the budget is spent and lists what did not run; one round keeps the plain row', async () => {
  const configs: CoreConfig[] = [1, 2].map((threads) => ({
    kind: 'single',
    devices: 1,
    threads,
  }));
  const { rows, skipped } = await measureRounds(
    { o: { budgetS: 0.05 } as CoresBenchOptions },
    configs,
    [],
    async () => {},
    async (c) => {
      await new Promise((r) => setTimeout(r, 120));
      return rowOf(c, 1000);
    },
  );
  assert.equal(rows.length, 1);
  assert.equal(rows[0]!.rounds_tokens_per_s, undefined);
  assert.deepEqual(
    skipped.map((s) => [s.threads, s.reason]),
    [[2, 'time budget of 0.05 s spent']],
  );
});

test('overOneThread pairs the rounds: the median of round-by-round ratios, which a drift between rounds does not move; the first rounds where one row was cut short; the plain ratio without rounds', () => {
  // the machine ran 20% faster in round 2 and 17% slower in round 3; the rounds' ratios are
  // 1.8x, 1.8x and 1.9x; each row's tokens/s is its own median round's
  const one = { tokens_per_s: 6000, rounds_tokens_per_s: [6000, 7200, 5000] };
  const two = {
    tokens_per_s: 10800,
    rounds_tokens_per_s: [10800, 12960, 9500],
  };
  assert.equal(overOneThread(two, one).toFixed(3), '1.800');
  // a row cut short by the budget after 2 rounds pairs those two: (2.0 + 1.8) / 2, where its
  // median round over the other row's would read 12,000 / 6,000 = 2.0x
  const short = { tokens_per_s: 12000, rounds_tokens_per_s: [12000, 12960] };
  assert.equal(overOneThread(short, one).toFixed(3), '1.900');
  assert.equal(
    overOneThread({ tokens_per_s: 9000 }, { tokens_per_s: 5000 }),
    1.8,
  );
});
