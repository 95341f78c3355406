import assert from 'node:assert/strict';
import { test } from 'node:test';
import { LayerwiseError } from '../util/errors.js';
import {
  allowedCpus,
  bySiblings,
  ompPinning,
  parseCpuList,
  placeDevices,
  processPinning,
} from './pinning.js';

test('parseCpuList reads ranges and single CPUs in order, and names a bad part', () => {
  assert.deepEqual(parseCpuList('0-3,8,10-11\n'), [0, 1, 2, 3, 8, 10, 11]);
  assert.deepEqual(parseCpuList('5'), [5]);
  assert.deepEqual(parseCpuList('2,0-1'), [0, 1, 2]);
  assert.throws(() => parseCpuList('3-1'), /'3-1' is not N or N-M/);
  assert.throws(() => parseCpuList('0-3,x'), LayerwiseError);
});

test('allowedCpus is the CPUs of /proc/self/status on Linux, as many as Node sees', async () => {
  const cpus = allowedCpus();
  if (process.platform !== 'linux') return assert.equal(cpus, undefined);
  const { availableParallelism } = await import('node:os');
  assert.ok(cpus !== undefined && cpus.length > 0);
  assert.equal(cpus.length, availableParallelism());
});

test('bySiblings puts the hardware threads of one core side by side', () => {
  // 4 cores x 2 threads numbered as Linux often does: siblings c and c + 4
  const siblings = (c: number) => [c % 4, (c % 4) + 4];
  const cpus = [0, 1, 2, 3, 4, 5, 6, 7];
  assert.deepEqual(bySiblings(cpus, siblings), [0, 4, 1, 5, 2, 6, 3, 7]);
  // two devices of 4 threads each get two whole cores each
  assert.deepEqual(placeDevices([4, 4], bySiblings(cpus, siblings)), [
    [0, 4, 1, 5],
    [2, 6, 3, 7],
  ]);
  // a sibling outside the allowed CPUs (taskset -c 0-2) is left out; no SMT: unchanged
  assert.deepEqual(bySiblings([0, 1, 2], siblings), [0, 1, 2]);
  assert.deepEqual(
    bySiblings([3, 1, 2], (c) => [c]),
    [1, 2, 3],
  );
});

test('placeDevices gives each device its own consecutive CPUs, or nothing when they would share', () => {
  const cpus = Array.from({ length: 16 }, (_, i) => i);
  // K=4 pipelines on 16 cores, 4 threads each: disjoint quarters
  assert.deepEqual(placeDevices([4, 4, 4, 4], cpus), [
    [0, 1, 2, 3],
    [4, 5, 6, 7],
    [8, 9, 10, 11],
    [12, 13, 14, 15],
  ]);
  // K=3 on 16 cores (5 each): one CPU left over
  assert.deepEqual(
    placeDevices([5, 5, 5], cpus)?.map((c) => [c[0], c.at(-1)]),
    [
      [0, 4],
      [5, 9],
      [10, 14],
    ],
  );
  // an allowed list with holes (taskset -c 2,3,6,7) is followed, not 0..n-1
  assert.deepEqual(placeDevices([2, 2], [2, 3, 6, 7]), [
    [2, 3],
    [6, 7],
  ]);
  assert.equal(placeDevices([8, 8, 8], cpus), undefined);
  assert.throws(() => placeDevices([0], cpus), /positive integers, got 0/);
});

test('ompPinning binds one thread per place, in order', () => {
  assert.deepEqual(ompPinning([4, 5, 6]), {
    OMP_PLACES: '{4},{5},{6}',
    OMP_PROC_BIND: 'close',
  });
  assert.throws(() => ompPinning([]), /at least one CPU/);
});

const processes = (threads: number[], env: Record<string, string> = {}) =>
  threads.map((t) => ({ kind: 'process', env, threads: t }));
const cpus8 = [0, 1, 2, 3, 4, 5, 6, 7];

test('processPinning pins local device processes, skipping hosts', () => {
  const devices = [
    ...processes([2]),
    { kind: 'host', threads: 8 }, // another machine: its cores are not ours
    ...processes([4]),
  ];
  assert.deepEqual(processPinning({ devices, env: {}, cpus: cpus8 }), [
    { OMP_PLACES: '{0},{1}', OMP_PROC_BIND: 'close' },
    {},
    { OMP_PLACES: '{2},{3},{4},{5}', OMP_PROC_BIND: 'close' },
  ]);
});

test('processPinning pins nothing where it would hurt or the user chose', () => {
  const none = [{}, {}];
  const run = (over: Partial<Parameters<typeof processPinning>[0]>) =>
    processPinning({
      devices: processes([2, 2]),
      env: {},
      cpus: cpus8,
      ...over,
    });
  assert.notDeepEqual(run({}), none);
  // thread devices share the coordinator's environment: its places would stack every team on CPU 0
  assert.deepEqual(
    run({ devices: [{ kind: 'thread', threads: 2 }, ...processes([2])] }),
    none,
  );
  assert.deepEqual(run({ devices: processes([4, 6]) }), none); // 10 threads, 8 CPUs
  assert.deepEqual(run({ cpus: undefined }), none); // the OS does not say
  assert.deepEqual(run({ env: { LAYERWISE_PIN: '0' } }), none);
  assert.deepEqual(run({ env: { OMP_PROC_BIND: 'spread' } }), none);
  assert.deepEqual(
    run({ devices: processes([2, 2], { GOMP_CPU_AFFINITY: '0-3' }) }),
    none,
  );
  assert.throws(
    () => run({ env: { LAYERWISE_PIN: 'yes' } }),
    /LAYERWISE_PIN=yes: use 1/,
  );
});
