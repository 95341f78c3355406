import assert from 'node:assert/strict';
import { test } from 'node:test';
import { threadsPerDevice } from '../strategies/spec.js';
import { coresGrid, parseCoresOptions, threadsForDevices } from './cores.js';

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
});
