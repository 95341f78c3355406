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
};

test('coresGrid on 16 cores and 6 blocks: what runs first, what does not fit', () => {
  const { configs, skipped } = coresGrid(
    { ...all, kinds: [...all.kinds] },
    16,
    6,
  );
  const key = (c: { kind: string; devices: number; threads: number | '-' }) =>
    `${c.kind}/${c.devices}x${c.threads}`;
  // the bars' rows come first: single and PyTorch at 16 threads, zbv K=3 on 3 x 5
  assert.deepEqual(configs.slice(0, 5).map(key), [
    'single/1x14',
    'pytorch/1x16',
    'single-bf16/1x14',
    'pytorch-bf16/1x16',
    'zbv/3x4',
  ]);
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
    { threads: [1, 2], stages: [2], kinds: ['single', 'zbv'] },
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
    devices: 'thread',
    steps: 3,
    budgetS: 240,
    batchSize: 32,
  };
  assert.deepEqual(parseCoresOptions(raw).threads, [1, 2]);
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
