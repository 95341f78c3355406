/**
 * bf16 mixed precision on the native backend trains like single-device bf16 under every
 * strategy that splits the model or the batch: gpipe K=2 (M=2) and l2l (M=2) equal single bf16
 * within 1e-3 after 3 steps (losses and parameters), and bf16 stays near fp32 without being fp32
 * (the products really ran in bf16); a bf16 run resumed from its checkpoint (float32 masters)
 * continues like the uninterrupted one. Skipped, saying why, where the addon is not built or the
 * CPU has no avx512_bf16 or AMX.
 */

import assert from 'node:assert/strict';
import { spawnSync } from 'node:child_process';
import { mkdtempSync, readFileSync, rmSync, statSync } from 'node:fs';
import { tmpdir } from 'node:os';
import { join } from 'node:path';
import { test } from 'node:test';
import { fileURLToPath } from 'node:url';
import { bf16Support } from '../backend/names.js';
import { nativeAddon, nativeUnavailable } from '../backend/native.js';
import type { TrainConfig } from '../config/config.js';
import { maxParamDiff } from '../testing/assert-close.js';
import { trainTinyLm } from '../testing/fixtures.js';
import { checkpointDir } from '../train/checkpoint-io.js';

const skip = !nativeAddon()
  ? `native backend unavailable: ${nativeUnavailable()}`
  : !bf16Support().nativeBf16
    ? `this CPU has no avx512_bf16 or AMX (${bf16Support().note})`
    : false;
const TOL = 1e-3;
const SHAPE = { layers: 2, dModel: 32, heads: 2, context: 16 };

const run = (o: Partial<TrainConfig>) =>
  trainTinyLm(
    { backend: 'native', ...o },
    { shape: SHAPE, batchSize: 8, lrs: [3e-3, 2e-3, 1e-3] },
  );

test('bf16: gpipe K=2, l2l, l2l K=2 and 2 replicas of gpipe K=2 train like single bf16; bf16 is near fp32 but not fp32', {
  skip,
}, async () => {
  const fp32 = await run({ strategy: 'single' });
  const ref = await run({ strategy: 'single', precision: 'bf16' });
  assert.ok(
    ref.losses.every(Number.isFinite) && ref.losses[2]! < ref.losses[0]!,
    `single bf16 learns: ${ref.losses}`,
  );
  const vsFp32 = maxParamDiff(ref.params, fp32.params);
  assert.ok(vsFp32 > 0, 'bf16 parameters equal fp32 ones: bf16 did not run');
  ref.losses.forEach((l, i) =>
    assert.ok(
      Math.abs(l - fp32.losses[i]!) < 2e-2,
      `step ${i}: bf16 loss ${l} vs fp32 ${fp32.losses[i]}`,
    ),
  );
  const runs: Array<[string, Partial<TrainConfig>]> = [
    [
      'gpipe K=2 M=2',
      { strategy: 'gpipe', stages: 2, microBatches: 2, remat: 'except_last' },
    ],
    ['l2l M=2', { strategy: 'l2l', microBatches: 2, stash: 'host' }],
    ['l2l K=2 M=2', { strategy: 'l2l', stages: 2, microBatches: 2 }],
    [
      'gpipe K=2 M=2, 2 replicas',
      { strategy: 'gpipe', stages: 2, microBatches: 2, replicas: 2 },
    ],
  ];
  for (const [name, o] of runs) {
    const r = await run({ ...o, precision: 'bf16' });
    r.losses.forEach((l, i) =>
      assert.ok(
        Math.abs(l - ref.losses[i]!) <= TOL,
        `${name} step ${i}: loss ${l} vs single bf16 ${ref.losses[i]}`,
      ),
    );
    const d = maxParamDiff(r.params, ref.params);
    assert.ok(d <= TOL, `${name}: parameters differ from single bf16 by ${d}`);
  }
});

test('a bf16 run saves float32 masters and its precision, and resumes like the uninterrupted run', {
  skip,
}, async () => {
  const { train } = await import('../train/trainer.js');
  const dir = mkdtempSync(join(tmpdir(), 'layerwise-bf16-'));
  try {
    const common = {
      preset: 'charlm-tiny',
      ...SHAPE,
      batchSize: 8,
      evalBatches: 1,
      evalEvery: 0,
      lr: 0.01,
      warmup: 1,
      backend: 'native',
      precision: 'bf16' as const,
      strategy: 'gpipe',
      stages: 2,
      microBatches: 2,
    };
    const full = await train({ ...common, steps: 4, out: join(dir, 'full') });
    await train({ ...common, steps: 2, out: join(dir, 'part') });
    const resumed = await train({ steps: 4 }, join(dir, 'part'));
    assert.equal(full.summary.precision, 'bf16');
    assert.equal(resumed.summary.precision, 'bf16', 'precision kept on resume');
    const losses = (run: string) =>
      readFileSync(join(dir, run, 'metrics.jsonl'), 'utf8')
        .trim()
        .split('\n')
        .map((l) => JSON.parse(l).loss as number);
    const [a, b] = [losses('full'), losses('part')];
    assert.equal(b.length, 4);
    a.forEach((l, i) =>
      assert.ok(Math.abs(l - b[i]!) <= 1e-4, `step ${i + 1}: ${l} vs ${b[i]}`),
    );
    // the checkpoint's parameters are float32 masters: 4 bytes each
    const meta = JSON.parse(
      readFileSync(join(checkpointDir(join(dir, 'full')), 'meta.json'), 'utf8'),
    );
    assert.equal(meta.config.precision, 'bf16');
    assert.equal(
      statSync(join(checkpointDir(join(dir, 'full')), 'params.bin')).size,
      4 * full.summary.params,
    );
  } finally {
    rmSync(dir, { recursive: true, force: true });
  }
});

test('l2l bf16 ships layers and stashes in bf16: host-to-device bytes per step at most 0.55x fp32 and peak device bytes at most 0.65x, in metrics.jsonl and summary.json (charlm-small, M=4)', {
  skip,
}, async () => {
  const { train } = await import('../train/trainer.js');
  const dir = mkdtempSync(join(tmpdir(), 'layerwise-bf16-l2l-'));
  try {
    const moved: Record<string, { h2d: number; d2h: number; peak: number }> =
      {};
    for (const precision of ['fp32', 'bf16'] as const) {
      const out = join(dir, precision);
      const r = await train({
        preset: 'charlm-small',
        batchSize: 32,
        steps: 2,
        evalBatches: 1,
        evalEvery: 0,
        lr: 1e-3,
        warmup: 1,
        backend: 'native',
        precision,
        strategy: 'l2l',
        microBatches: 4,
        stash: 'host',
        out,
      });
      const lines = readFileSync(join(out, 'metrics.jsonl'), 'utf8')
        .trim()
        .split('\n')
        .map((l) => JSON.parse(l));
      const m = lines[lines.length - 1];
      assert.ok(
        Array.isArray(m.host_to_device_bytes) &&
          Array.isArray(m.device_to_host_bytes),
        'metrics.jsonl reports the step transfers',
      );
      assert.deepEqual(
        r.summary.host_to_device_bytes,
        m.host_to_device_bytes,
        'summary.json: the per-step mean (every step moves the same)',
      );
      moved[precision] = {
        h2d: m.host_to_device_bytes[0],
        d2h: m.device_to_host_bytes[0],
        peak: m.peak_device_bytes[0],
      };
    }
    const { fp32, bf16 } = moved as Record<string, (typeof moved)['fp32']>;
    assert.ok(fp32!.h2d > 0 && fp32!.d2h > 0, 'fp32 counts its transfers');
    const ratio = bf16!.h2d / fp32!.h2d;
    assert.ok(
      ratio <= 0.55,
      `host-to-device bytes per step: bf16 ${bf16!.h2d} vs fp32 ${fp32!.h2d} (${ratio.toFixed(3)}x)`,
    );
    // the stash's downloads halve too (the gradients stay float32, for float32 accumulation)
    assert.ok(
      bf16!.d2h < fp32!.d2h,
      `device-to-host: ${bf16!.d2h} vs ${fp32!.d2h}`,
    );
    // activations, their gradients and the saved tape held as bf16 (issue 23's bar: 0.65x)
    const peakRatio = bf16!.peak / fp32!.peak;
    assert.ok(
      peakRatio <= 0.65,
      `peak device bytes: bf16 ${bf16!.peak} vs fp32 ${fp32!.peak} (${peakRatio.toFixed(3)}x)`,
    );
  } finally {
    rmSync(dir, { recursive: true, force: true });
  }
});

test('gpipe K=2 and local K=2 in bf16: activations and gradients cross stages as bf16, half the bytes of fp32 (metrics.jsonl)', {
  skip,
}, async () => {
  const { train } = await import('../train/trainer.js');
  const dir = mkdtempSync(join(tmpdir(), 'layerwise-bf16-wire-'));
  try {
    const moved = async (
      strategy: string,
      precision: 'fp32' | 'bf16',
    ): Promise<{ h2d: number[]; d2h: number[] }> => {
      const out = join(dir, `${strategy}-${precision}`);
      await train({
        preset: 'charlm-tiny',
        ...SHAPE,
        batchSize: 8,
        steps: 1,
        evalBatches: 1,
        evalEvery: 0,
        lr: 1e-3,
        backend: 'native',
        precision,
        strategy,
        stages: 2,
        microBatches: 2,
        out,
      });
      const m = JSON.parse(
        readFileSync(join(out, 'metrics.jsonl'), 'utf8').trim().split('\n')[0]!,
      );
      return { h2d: m.host_to_device_bytes, d2h: m.device_to_host_bytes };
    };
    for (const strategy of ['gpipe', 'local']) {
      const [a, b] = [
        await moved(strategy, 'fp32'),
        await moved(strategy, 'bf16'),
      ];
      // stage 0 sends activations (gpipe: receives gradients), stage 1 the reverse
      for (const dir of ['h2d', 'd2h'] as const) {
        const total = (x: number[]) => x.reduce((s, v) => s + v, 0);
        assert.ok(total(a[dir]) > 0, `${strategy} fp32 counts ${dir}`);
        assert.equal(
          total(b[dir]),
          total(a[dir]) / 2,
          `${strategy} ${dir}: bf16 ${b[dir]} vs fp32 ${a[dir]}`,
        );
      }
    }
  } finally {
    rmSync(dir, { recursive: true, force: true });
  }
});

test('a numeric fault in a bf16 gpipe step is named by step, stage, block and micro-batch (issue 23 item 8)', {
  skip,
}, () => {
  const cli = fileURLToPath(new URL('../cli/main.js', import.meta.url));
  const dir = mkdtempSync(join(tmpdir(), 'layerwise-bf16-fault-'));
  const train = (args: string[]) =>
    spawnSync(process.execPath, [cli, 'train', ...args], {
      encoding: 'utf8',
      timeout: 300_000,
    });
  try {
    const out = join(dir, 'run');
    const common = [
      '--preset',
      'charlm-tiny',
      '--layers',
      '2',
      '--d-model',
      '32',
      '--heads',
      '2',
      '--context',
      '16',
      '--batch-size',
      '8',
      '--eval-batches',
      '1',
      '--eval-every',
      '0',
      '--strategy',
      'gpipe',
      '--stages',
      '2',
      '--micro-batches',
      '2',
      '--backend',
      'native',
      '--precision',
      'bf16',
    ];
    const a = train([...common, '--steps', '2', '--lr', '0.01', '--out', out]);
    assert.equal(a.status, 0, a.stderr);
    // an absurd learning rate: the first update is finite but huge, a later forward overflows
    // (at 1e6 the gradients' float32 sum of squares overflowed first, every gradient finite)
    const b = train(['--resume', out, '--steps', '10', '--lr', '1e12']);
    assert.equal(b.status, 2, b.stderr);
    assert.match(
      b.stderr,
      /non-finite value at step \d+: the (output|loss|gradient|input).* (of )?block \d+ \(\w+\) on stage \d, micro-batch \d/,
    );
  } finally {
    rmSync(dir, { recursive: true, force: true });
  }
});

test('bf16: the device memory predicted before training (profiled at bf16) is within 15% of the measured peak: single, gpipe K=2, l2l, l2l K=2', {
  skip: skip ? skip : false,
  timeout: 300_000,
}, async () => {
  const { train } = await import('../train/trainer.js');
  const dir = mkdtempSync(join(tmpdir(), 'layerwise-bf16-memory-'));
  try {
    const cases: Array<[string, Record<string, unknown>]> = [
      ['single', { strategy: 'single' }],
      ['gpipe', { strategy: 'gpipe', stages: 2, microBatches: 4 }],
      ['l2l', { strategy: 'l2l', microBatches: 4 }],
      ['l2l-k2', { strategy: 'l2l', stages: 2, microBatches: 4 }],
    ];
    for (const [name, flags] of cases) {
      const out = join(dir, name);
      await train({
        // activations well above one layer's parameters: a prefetch the parameter server is
        // not ready for (skipped on a busy machine) changes l2l's peak by little
        preset: 'charlm-tiny',
        layers: 2,
        dModel: 32,
        heads: 2,
        context: 64,
        batchSize: 32,
        steps: 2,
        evalEvery: 0,
        evalBatches: 1,
        backend: 'native',
        precision: 'bf16',
        deviceMemory: '4GiB',
        out,
        ...flags,
      });
      const s = JSON.parse(readFileSync(join(out, 'summary.json'), 'utf8'));
      const predicted = s.predicted_peak_device_bytes as number[];
      const measured = s.peak_device_bytes as number[];
      assert.equal(predicted.length, measured.length, name);
      measured.forEach((m, i) =>
        assert.ok(
          Math.abs(predicted[i]! - m) <= 0.15 * m,
          `${name} device ${i}: predicted ${predicted[i]}, measured ${m}`,
        ),
      );
    }
  } finally {
    rmSync(dir, { recursive: true, force: true });
  }
});
