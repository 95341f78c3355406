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

test('splitThreads: by load, at least 1 each, the rest to the largest remainders; all 1 below one a device', async () => {
  const { splitThreads } = await import('./spec.js');
  assert.deepEqual(splitThreads(14, [0.1, 2, 2]), [1, 7, 6]);
  assert.deepEqual(splitThreads(14, [1, 1]), [7, 7]);
  assert.deepEqual(splitThreads(12, [1, 2, 3]), [2, 4, 6]);
  assert.deepEqual(splitThreads(3, [0, 0, 5]), [1, 1, 1]);
  assert.deepEqual(splitThreads(2, [1, 1, 1]), [1, 1, 1]);
  // devices raised to 1 take from the largest
  assert.deepEqual(splitThreads(5, [0, 0, 0, 10]), [1, 1, 1, 2]);
  assert.deepEqual(splitThreads(6, [0, 0]), [3, 3], 'no load: equal');
  for (const [total, loads] of [
    [16, [3, 1, 1, 9]],
    [7, [0.5, 0.25, 0.25]],
    [31, [1, 2, 3, 4, 5]],
  ] as Array<[number, number[]]>) {
    const got = splitThreads(total, loads);
    assert.equal(
      got.reduce((a, b) => a + b, 0),
      total,
      `${loads}: every thread given`,
    );
    assert.ok(got.every((t) => t >= 1));
  }
  assert.throws(() => splitThreads(4, []), /one per device/);
  assert.throws(() => splitThreads(4, [1, -1]), /non-negative/);
});

test("a V-shape's first device holds the embedding and the head: by default its threads go to the others, in the run and its summary line", async () => {
  const { resolveConfig } = await import('../config/config.js');
  const { buildModel } = await import('../model/model.js');
  const { specOf, planStages } = await import('./index.js');
  const { runThreads } = await import('./spec.js');
  const cfg = resolveConfig({
    preset: 'charlm-small',
    strategy: 'gpipe',
    schedule: 'zbv',
    stages: 3,
    microBatches: 8,
    backend: 'native',
  } as Parameters<typeof resolveConfig>[0]);
  // charlm-small's shape: 4 decoder blocks of d 256, context 128
  const model = buildModel({
    arch: 'charlm',
    vocab: 89,
    context: 128,
    dModel: 256,
    heads: 4,
    layers: 4,
  });
  const ranges = planStages(cfg, model);
  assert.equal(ranges.length, 6, 'zbv K=3: 6 stages of one block each');
  const loads = specOf('gpipe').deviceLoads!(cfg, model, ranges);
  assert.equal(loads.length, 3);
  assert.ok(
    loads[0]! < 0.1 * loads[1]! &&
      Math.abs(loads[1]! - loads[2]!) < 1e-6 * loads[1]!,
    `loads ${loads}`,
  );
  assert.deepEqual(runThreads(cfg, false, loads, 16), [1, 7, 6]);
  assert.deepEqual(deviceThreads(cfg, false, 16, loads), [1, 7, 6]);
  assert.match(
    threadsLine(cfg, false, 16, loads) ?? '',
    /^kernel threads per device: 1, 7, 6 \(the 16 cores less 2 for the host's threads divided among 3 devices by each device's share of the model's FLOPs; --threads sets them\)$/,
  );
  // --threads, or devices of equal loads (1F1B's balanced stages): the even split
  assert.deepEqual(
    runThreads({ ...cfg, threads: 4 }, false, loads, 16),
    [4, 4, 4],
  );
  assert.deepEqual(runThreads(cfg, false, [5, 5, 5], 16), [4, 4, 4]);
  // replicas: each replica's devices split its share of the cores
  assert.deepEqual(
    runThreads({ ...cfg, replicas: 2 }, false, loads, 16),
    [1, 3, 3, 1, 3, 3],
  );
});
