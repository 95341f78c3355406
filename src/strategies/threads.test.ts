import assert from 'node:assert/strict';
import { test } from 'node:test';
import {
  devicesOfRun,
  deviceThreads,
  threadsLine,
  threadsPerDevice,
} from './spec.js';

const run = {
  threads: 0,
  backend: 'native',
  stages: 4,
  replicas: 1,
  devices: undefined as string | undefined,
};

test("threadsPerDevice: --threads, else the cores less the host's divided among the devices, at least 1", () => {
  // 16 cores: 2 left to the host's threads, 14 divided
  assert.equal(threadsPerDevice({ threads: 0 }, 4, 16), 3);
  assert.equal(threadsPerDevice({ threads: 0 }, 3, 16), 4);
  assert.equal(threadsPerDevice({ threads: 0 }, 2, 16), 7);
  assert.equal(threadsPerDevice({ threads: 0 }, 1, 16), 14);
  assert.equal(threadsPerDevice({ threads: 0 }, 1, 8), 7);
  // under 8 cores every core runs kernels
  assert.equal(threadsPerDevice({ threads: 0 }, 1, 4), 4);
  assert.equal(threadsPerDevice({ threads: 0 }, 1, 2), 2);
  assert.equal(threadsPerDevice({ threads: 0 }, 2, 2), 1);
  assert.equal(threadsPerDevice({ threads: 0 }, 4, 2), 1);
  assert.equal(threadsPerDevice({ threads: 3 }, 4, 16), 3);
});

test('devicesOfRun counts every replica; single has one device per replica', () => {
  assert.equal(devicesOfRun({ stages: 4, replicas: 1 }, false), 4);
  assert.equal(devicesOfRun({ stages: 2, replicas: 3 }, false), 6);
  assert.equal(devicesOfRun({ stages: 4, replicas: 2 }, true), 2);
  assert.equal(devicesOfRun({ stages: 0, replicas: 1 }, false), 1);
});

test('deviceThreads: the default for threads and processes alike, a device its own threads=, 1 off native', () => {
  assert.deepEqual(deviceThreads(run, false, 16), [3, 3, 3, 3]);
  assert.deepEqual(deviceThreads(run, true, 16), [14]);
  assert.deepEqual(
    deviceThreads({ ...run, stages: 2, replicas: 2 }, false, 16),
    [3, 3, 3, 3],
  );
  assert.deepEqual(
    deviceThreads({ ...run, devices: 'process' }, false, 16),
    [3, 3, 3, 3],
  );
  assert.deepEqual(
    deviceThreads(
      {
        ...run,
        stages: 3,
        devices: 'thread,process:threads=8,process:backend=wasm',
      },
      false,
      16,
    ),
    [4, 8, 1],
  );
  assert.deepEqual(
    deviceThreads({ ...run, backend: 'wasm' }, false, 16),
    [1, 1, 1, 1],
  );
});

test('threadsLine says the count and where it comes from, only for native runs', () => {
  assert.equal(
    threadsLine({ ...run, stages: 2 }, false, 16),
    "kernel threads per device: 7 (the 16 cores less 2 for the host's threads divided among 2 devices; --threads sets them)",
  );
  assert.equal(
    threadsLine({ ...run, threads: 2 }, false, 16),
    'kernel threads per device: 2 (--threads)',
  );
  assert.equal(threadsLine({ ...run, backend: 'wasm' }, false, 16), undefined);
  // a wasm run with one native device process: that device's threads
  assert.equal(
    threadsLine(
      {
        ...run,
        backend: 'wasm',
        stages: 2,
        devices: 'thread,process:backend=native',
      },
      false,
      16,
    ),
    "kernel threads per device: 7 (the 16 cores less 2 for the host's threads divided among 2 devices; --threads sets them)",
  );
});
