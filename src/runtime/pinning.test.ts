import assert from 'node:assert/strict';
import { once } from 'node:events';
import { test } from 'node:test';
import { Worker } from 'node:worker_threads';
import { nativeAddon } from '../backend/native-addon.js';
import { threadsPerDevice } from '../strategies/spec.js';
import {
  allowedCpus,
  bySiblings,
  devicePlacement,
  ompPinning,
  placeDevices,
  processPinning,
  threadPinning,
} from './pinning.js';

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
  // a browser tab's threads are not ours to place
  assert.deepEqual(
    run({ devices: [{ kind: 'browser', threads: 2 }, ...processes([2])] }),
    none,
  );
  assert.deepEqual(run({ devices: processes([4, 6]) }), none); // 10 threads, 8 CPUs
  // one device on this host (the other one is elsewhere): nothing to keep apart
  assert.deepEqual(
    run({ devices: [...processes([4]), { kind: 'host', threads: 4 }] }),
    none,
  );
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

const threadDevices = (k: number, threads: number) =>
  Array.from({ length: k }, () => ({ kind: 'thread', threads }));
const cpusOf = (n: number) => Array.from({ length: n }, (_, i) => i);

test('threadPinning gives K thread devices cores/K CPUs each, disjoint, on 2 and 16 cores', () => {
  for (const cores of [2, 16])
    for (let k = 1; k <= 4; k++) {
      const each = threadsPerDevice({ threads: 0 }, k, cores);
      const places = threadPinning({
        devices: threadDevices(k, each),
        env: {},
        cpus: cpusOf(cores),
      });
      const label = `K=${k} on ${cores} cores`;
      assert.equal(places.length, k, label);
      if (k === 1) {
        // one device: nothing to keep it apart from; left to the OS
        assert.deepEqual(places, [undefined], label);
        continue;
      }
      if (k * each > cores) {
        // 3 or 4 devices on 2 cores: 1 thread each would share a core; better not to pin
        assert.deepEqual(
          places,
          threadDevices(k, each).map(() => undefined),
          label,
        );
        continue;
      }
      places.forEach((p, i) =>
        assert.deepEqual(
          p,
          cpusOf(each).map((c) => i * each + c),
          label,
        ),
      );
      const all = places.flatMap((p) => p!);
      assert.equal(new Set(all).size, all.length, `${label}: disjoint`);
    }
  // the exact splits the issue names
  assert.deepEqual(
    threadPinning({ devices: threadDevices(2, 1), env: {}, cpus: cpusOf(2) }),
    [[0], [1]],
  );
  assert.deepEqual(
    threadPinning({
      devices: threadDevices(4, 4),
      env: {},
      cpus: cpusOf(16),
    }).map((p) => [p![0], p!.at(-1)]),
    [
      [0, 3],
      [4, 7],
      [8, 11],
      [12, 15],
    ],
  );
});

test("thread and process devices on one host are placed together; the user's affinity or LAYERWISE_PIN=0 wins", () => {
  const devices = [
    { kind: 'thread', threads: 2 },
    { kind: 'process', threads: 2 },
    { kind: 'host', threads: 8 },
    { kind: 'thread', threads: 4 },
  ];
  const input = { devices, env: {}, cpus: cpus8 };
  assert.deepEqual(devicePlacement(input), [
    [0, 1],
    [2, 3],
    undefined,
    [4, 5, 6, 7],
  ]);
  assert.deepEqual(threadPinning(input), [
    [0, 1],
    undefined,
    undefined,
    [4, 5, 6, 7],
  ]);
  assert.deepEqual(processPinning(input), [
    {},
    { OMP_PLACES: '{2},{3}', OMP_PROC_BIND: 'close' },
    {},
    {},
  ]);
  const none = devices.map(() => undefined);
  assert.deepEqual(
    threadPinning({ ...input, env: { LAYERWISE_PIN: '0' } }),
    none,
  );
  assert.deepEqual(
    threadPinning({ ...input, env: { OMP_PLACES: 'cores' } }),
    none,
  );
  assert.deepEqual(threadPinning({ ...input, cpus: undefined }), none);
  assert.throws(
    () => threadPinning({ ...input, env: { LAYERWISE_PIN: 'on' } }),
    /LAYERWISE_PIN=on: use 1/,
  );
});

/** Runs `body` (a function of the addon, returning JSON) in a fresh worker thread: pinning there leaves this thread's CPUs alone. */
async function inWorker<T>(body: string): Promise<T> {
  const addon = new URL(
    '../../native/build/Release/layerwise_native.node',
    import.meta.url,
  ).pathname;
  const w = new Worker(
    `const { parentPort } = require('node:worker_threads');
     const { readFileSync, readdirSync } = require('node:fs');
     const lib = require(${JSON.stringify(addon)});
     try { parentPort.postMessage({ ok: (${body})(lib, readFileSync, readdirSync) }); }
     catch (e) { parentPort.postMessage({ error: e.message }); }`,
    { eval: true },
  );
  const [m] = (await once(w, 'message')) as [{ ok?: T; error?: string }];
  await w.terminate();
  if (m.error !== undefined) throw new Error(m.error);
  return m.ok as T;
}

test("pinTeam binds each member of the calling thread's team to one CPU, as the OS reads it back", {
  skip:
    process.platform !== 'linux' || !nativeAddon()
      ? 'needs Linux and the native addon'
      : false,
}, async () => {
  const allowed = allowedCpus()!;
  // two members on the last and the first allowed CPU (the same one on a 1-CPU machine), reversed
  const want = [allowed.at(-1)!, allowed[0]!];
  const r = await inWorker<{
    pinned: number[][];
    again: number[][];
    self: string;
    others: string[];
  }>(
    `(lib, readFileSync, readdirSync) => {
      lib.setThreads(2);
      const pinned = lib.pinTeam(${JSON.stringify(want)});
      const list = (f) => /^Cpus_allowed_list:\\s*(\\S+)/m.exec(readFileSync(f, 'utf8'))[1];
      return {
        pinned,
        again: lib.teamAffinity(),
        self: list('/proc/thread-self/status'),
        others: readdirSync('/proc/self/task').map((t) => list('/proc/self/task/' + t + '/status')),
      };
    }`,
  );
  assert.deepEqual(r.pinned, [[want[0]], [want[1]]]);
  assert.deepEqual(r.again, r.pinned); // still bound in the next region: the same pool thread
  assert.equal(r.self, String(want[0])); // member 0 is the calling thread
  assert.ok(
    r.others.includes(String(want[1])),
    `no thread of ${r.others.join(' | ')} is on CPU ${want[1]} alone`,
  );
  // this thread (not pinned) still has every allowed CPU
  assert.deepEqual(allowedCpus(), allowed);
});

test('pinTeam names a CPU the process may not run on, and bad lists', {
  skip:
    process.platform !== 'linux' || !nativeAddon()
      ? 'needs Linux and the native addon'
      : false,
}, async () => {
  const allowed = new Set(allowedCpus());
  const outside = Array.from({ length: 1024 }, (_, i) => i).find(
    (c) => !allowed.has(c),
  )!;
  await assert.rejects(
    inWorker(`(lib) => lib.pinTeam([${outside}])`),
    new RegExp(`CPU ${outside} is not one this process may run on`),
  );
  await assert.rejects(
    inWorker('(lib) => lib.pinTeam([])'),
    /at least one CPU/,
  );
  await assert.rejects(
    inWorker('(lib) => lib.pinTeam([0.5])'),
    /CPU 0.5 is not an integer/,
  );
});
