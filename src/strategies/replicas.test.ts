/**
 * Issue 24's data-parallel replicas (`--replicas R`): R copies of a run's devices, each on its
 * 1/R of every mini-batch, gradients summed across replicas before the one step (a ring
 * all-reduce for single and gpipe; the parameter server's sum for l2l). Training equals
 * single-device training on the whole mini-batch: charlm-small's shape (wasm, batch 8), single
 * and gpipe K=2 (1F1B) with 2 replicas, single with 4, l2l and l2l K=2 with 2, within 1e-5
 * after 3 steps. The ring itself sums exactly and identically on every replica; replicas run
 * over device processes too (replica links between processes, and bridged to a thread); a
 * run resumed from a checkpoint continues exactly; bad uses are refused.
 */
import assert from 'node:assert/strict';
import { mkdtempSync, readFileSync, rmSync } from 'node:fs';
import { tmpdir } from 'node:os';
import { join } from 'node:path';
import { test } from 'node:test';
import { MessageChannel } from 'node:worker_threads';
import { resolveConfig, type TrainConfig } from '../config/config.js';
import { Channel } from '../runtime/channel.js';
import { parseDevices } from '../runtime/devices.js';
import { ringAllReduce } from '../runtime/stage-host.js';
import { maxParamDiff } from '../testing/assert-close.js';
import { trainTinyLm } from '../testing/fixtures.js';
import { readStepMetrics } from '../train/metrics.js';
import { LayerwiseError } from '../util/errors.js';
import { Rng } from '../util/rng.js';

const RUN = {
  shape: { layers: 4, dModel: 256, heads: 4, context: 128 },
  batchSize: 8,
  lrs: [3e-3, 2e-3, 1e-3],
};
const base: Partial<TrainConfig> = { backend: 'wasm' };

test('charlm-small shape: single and gpipe K=2 (1f1b) with --replicas 2, single with 4, l2l and l2l K=2 with 2 reach single-device losses within 1e-5 after 3 steps', async () => {
  const single = await trainTinyLm({ ...base, strategy: 'single' }, RUN);
  assert.ok(single.losses[2]! < single.losses[0]!, `${single.losses}`);
  const cases: Array<[string, Partial<TrainConfig>, number]> = [
    ['single R=2', { strategy: 'single', replicas: 2 }, 2],
    ['single R=4', { strategy: 'single', replicas: 4 }, 4],
    [
      'gpipe K=2 R=2',
      {
        strategy: 'gpipe',
        stages: 2,
        microBatches: 2,
        schedule: '1f1b',
        replicas: 2,
      },
      4,
    ],
    ['l2l R=2', { strategy: 'l2l', microBatches: 2, replicas: 2 }, 2],
    [
      'l2l K=2 R=2',
      { strategy: 'l2l', stages: 2, microBatches: 2, replicas: 2 },
      4,
    ],
  ];
  for (const [what, o, devices] of cases) {
    const r = await trainTinyLm({ ...base, ...o }, RUN);
    r.losses.forEach((l, i) =>
      assert.ok(
        Math.abs(l - single.losses[i]!) <= 1e-5,
        `${what} step ${i}: loss ${l} vs single ${single.losses[i]}`,
      ),
    );
    const d = maxParamDiff(r.params, single.params);
    assert.ok(d <= 1e-4, `${what}: parameters differ from single by ${d}`);
    const rep = r.reports[0]!;
    assert.equal(rep.peakBytes.length, devices, `${what}: a report per device`);
    assert.equal(rep.traces.length, devices, `${what}: a trace per device`);
  }
});

test('ring all-reduce: every replica ends with the element-wise sums, identical bit for bit, for 2, 3 and 5 replicas and arrays that do not split evenly', async () => {
  for (const n of [2, 3, 5]) {
    const rng = new Rng(n);
    const lengths = [7, 1, 12, 0, 5];
    const inputs = Array.from({ length: n }, () =>
      lengths.map((len) =>
        Float32Array.from({ length: len }, () => rng.normal()),
      ),
    );
    // ring links: replica r's next is r + 1's prev (two replicas: one link both ways)
    const links = Array.from({ length: n }, () => new MessageChannel());
    const chans = Array.from({ length: n }, (_, r) => {
      const next = new Channel(links[r]!.port1);
      const prev = new Channel(links[(r - 1 + n) % n]!.port2);
      return n === 2
        ? r === 0
          ? { to: next, from: next }
          : { to: prev, from: prev }
        : { to: next, from: prev };
    });
    const values = inputs.map((arrs) => arrs.map((a) => a.slice()));
    await Promise.all(
      values.map((v, r) =>
        ringAllReduce(v, r, n, chans[r]!.to, chans[r]!.from),
      ),
    );
    lengths.forEach((len, j) => {
      for (let i = 0; i < len; i++) {
        const want = inputs.reduce((a, arrs) => a + arrs[j]![i]!, 0);
        for (let r = 0; r < n; r++) {
          assert.ok(
            Math.abs(values[r]![j]![i]! - want) <= 1e-5,
            `n=${n} array ${j}[${i}] on replica ${r}: ${values[r]![j]![i]} vs ${want}`,
          );
          assert.equal(values[r]![j]![i], values[0]![j]![i], 'identical');
        }
      }
    });
    for (const l of links) {
      l.port1.close();
      l.port2.close();
    }
  }
});

test('replicas over device processes (process,process and process,thread) equal replicas over threads', async () => {
  const shape = { layers: 2, dModel: 32, heads: 2, context: 16 };
  const go = (devices: string) =>
    trainTinyLm(
      { ...base, strategy: 'single', replicas: 2, devices },
      { shape, batchSize: 8, lrs: [3e-3, 2e-3] },
    );
  const threads = await go('thread');
  for (const devices of ['process', 'process,thread']) {
    const r = await go(devices);
    assert.deepEqual(r.losses, threads.losses, devices);
    assert.equal(maxParamDiff(r.params, threads.params), 0, devices);
  }
});

test('gpipe --replicas 2 (traced: a track per device) stopped at step 2 and resumed reaches the uninterrupted single run losses', async () => {
  const { train } = await import('../train/trainer.js');
  const dir = mkdtempSync(join(tmpdir(), 'layerwise-replicas-'));
  try {
    const common = {
      preset: 'charlm-tiny',
      layers: 2,
      dModel: 16,
      heads: 2,
      context: 8,
      batchSize: 8,
      evalBatches: 1,
      evalEvery: 0,
      lr: 0.01,
      warmup: 1,
      backend: 'cpu',
      steps: 4,
    };
    const losses = (run: string) =>
      readStepMetrics(join(dir, run)).map((m) => m.loss);
    await train({ ...common, strategy: 'single', out: join(dir, 'single') });
    const rep = {
      strategy: 'gpipe',
      stages: 2,
      microBatches: 2,
      replicas: 2,
    };
    const trace = join(dir, 'trace.json');
    await train({ ...common, ...rep, steps: 2, out: join(dir, 'part'), trace });
    // --trace: one track per device, named by replica and stage
    const events = JSON.parse(readFileSync(trace, 'utf8'));
    const names = new Set(
      (Array.isArray(events) ? events : events.traceEvents)
        .filter((e: { name: string }) => e.name === 'thread_name')
        .map((e: { args: { name: string } }) => e.args.name),
    );
    assert.deepEqual([...names].sort(), [
      'replica 0 stage 0',
      'replica 0 stage 1',
      'replica 1 stage 0',
      'replica 1 stage 1',
    ]);
    await train({ steps: 4 }, join(dir, 'part'));
    const want = losses('single');
    losses('part').forEach((l, i) =>
      assert.ok(
        Math.abs(l - want[i]!) <= 1e-5,
        `step ${i + 1}: ${l} vs ${want[i]}`,
      ),
    );
    const summary = JSON.parse(
      readFileSync(join(dir, 'part', 'summary.json'), 'utf8'),
    );
    assert.equal(summary.replicas, 2);
    assert.equal(summary.devices, 4);
    assert.equal(summary.peak_device_bytes.length, 4);
  } finally {
    rmSync(dir, { recursive: true, force: true });
  }
});

test('--replicas refused where it cannot run: local parallelism, a mini-batch that does not split, a --devices list of the wrong length', () => {
  const cfg = (o: Record<string, unknown>) =>
    resolveConfig({
      preset: 'charlm-tiny',
      batchSize: 8,
      ...o,
    } as Parameters<typeof resolveConfig>[0]);
  assert.throws(
    () => cfg({ strategy: 'local', stages: 2, replicas: 2 }),
    (e: Error) =>
      e instanceof LayerwiseError &&
      /--replicas 2: data-parallel replicas run single, gpipe and l2l/.test(
        e.message,
      ),
  );
  assert.throws(
    () => cfg({ strategy: 'gpipe', stages: 2, microBatches: 8, replicas: 2 }),
    /--batch-size 8 must be a multiple of --replicas 2 x --micro-batches 8 = 16/,
  );
  assert.throws(
    () => cfg({ replicas: 0 }),
    /--replicas must be an integer >= 1, got 0/,
  );
  assert.throws(
    () => parseDevices('thread,process,thread', 2, 2),
    /--devices lists 3 devices but the run has 2 replicas of 2 stage\(s\), 4 devices; give one per device, replica after replica/,
  );
});
