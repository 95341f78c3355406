/** The planner on hand-made profiles, size parsing, and `layerwise plan`'s bad input. */

import assert from 'node:assert/strict';
import { spawnSync } from 'node:child_process';
import { test } from 'node:test';
import { fileURLToPath } from 'node:url';
import type { ModelProfile } from '../cost/costs.js';
import { divisors } from '../cost/strategy-plan.js';
import { type ScheduleKind, stagesPerDevice } from '../schedule/schedule.js';
import { specOf } from '../strategies/index.js';
import { parseSize } from '../util/size.js';
import { describe, label, type PlanRequest, plan } from './plan.js';

const MiB = 2 ** 20;

/**
 * n equal blocks: 1 MiB of parameters each, 1 MiB of activations per example kept, 1 ms per
 * example forward; and an auxiliary head after every block but the last (a sixteenth of a block).
 */
function profile(n: number, heads = true): ModelProfile {
  const at = (b: number, f = 1) => ({
    inBytes: 1024 * b,
    outBytes: 1024 * b,
    fwdPeakBytes: 2 * MiB * b * f,
    keptBytes: MiB * b * f,
    bwdPeakBytes: 2 * MiB * b * f,
    fwdSeconds: 1e-3 * b * f,
    bwdSeconds: 2e-3 * b * f,
  });
  const head: ModelProfile = {
    backend: 'cpu',
    blocks: [
      {
        name: 'aux',
        paramBytes: MiB / 16,
        maxParamBytes: MiB / 16,
        optTransientBytes: MiB / 16,
        optSeconds: 1e-5,
      },
    ],
    sizes: [1, 32].map((b) => ({
      batch: b,
      labelBytes: 4 * b,
      blocks: [at(b, 1 / 16)],
    })),
  };
  return {
    backend: 'cpu',
    blocks: Array.from({ length: n }, (_, i) => ({
      name: `b${i}`,
      paramBytes: MiB,
      maxParamBytes: MiB / 2,
      optTransientBytes: MiB,
      optSeconds: 1e-4,
    })),
    sizes: [1, 32].map((b) => ({
      batch: b,
      labelBytes: 4 * b,
      blocks: Array.from({ length: n }, () => at(b)),
    })),
    ...(heads
      ? {
          auxHeads: Object.fromEntries(
            Array.from({ length: n - 1 }, (_, i) => [i + 1, head]),
          ),
        }
      : {}),
  };
}
const REQ: PlanRequest = {
  deviceMemory: 512 * MiB,
  stages: 4,
  batchSize: 32,
  slots: 2,
};

test('sizes: SI and IEC units, plain and scientific bytes; bad sizes name the fix', () => {
  assert.equal(parseSize('512MB'), 512e6);
  assert.equal(parseSize('1.5GiB'), 1.5 * 2 ** 30);
  assert.equal(parseSize('2e9'), 2e9);
  assert.equal(parseSize('4096'), 4096);
  assert.equal(parseSize('64 kib'), 65536);
  for (const bad of ['lots', '-1MB', '0', '12XB', '']) {
    assert.throws(
      () => parseSize(bad),
      /--device-memory '.*' is not a positive size; write e.g. 512MB, 1.5GiB or 2e9/,
    );
  }
});

test('a model too large for one device: single does not fit, gpipe and 4 replicas of single (a quarter of the batch each) do; the fastest that fits is recommended', () => {
  const p = plan(profile(8), REQ);
  const single = p.strategies.find(
    (s) => s.strategy === 'single' && !s.replicas,
  )!;
  const replicated = p.strategies.find(
    (s) => s.strategy === 'single' && s.replicas === 4,
  )!;
  assert.equal(replicated.fits, true);
  assert.ok(replicated.peakBytes[0]! < single.peakBytes[0]!);
  const fastest = Math.min(
    ...p.strategies.filter((s) => s.fits && s.exact).map((s) => s.stepSeconds),
  );
  assert.equal(p.recommendedPlan!.stepSeconds, fastest);
  const gpipe = p.strategies.find((s) => s.strategy === 'gpipe')!;
  assert.equal(single.fits, false);
  assert.ok(single.peakBytes[0] > 512 * MiB);
  assert.equal(gpipe.fits, true);
  assert.ok(Math.max(...gpipe.peakBytes) <= 512 * MiB);
  assert.equal(
    gpipe.balance.reduce((a, b) => a + b, 0),
    8,
  );
  assert.ok(32 % gpipe.microBatches === 0);
  // without the replicas (a batch they cannot split), gpipe is recommended
  const odd = plan(profile(8), { ...REQ, batchSize: 30 });
  assert.equal(odd.recommended, 'gpipe');
  assert.match(
    odd.recommendation,
    /^gpipe \(--strategy gpipe --stages 4 --micro-batches \d+ --checkpoint \w+ --schedule [\w-]+ --balance [\d,]+\)/,
  );
  assert.match(
    plan(profile(8), REQ).recommendation,
    /--replicas 4|--strategy gpipe/,
  );
  // the equal blocks are balanced evenly over the stages (2 each, or 1 each where a schedule
  // runs 2 stages per device); the bubble is predicted from the simulated schedule, per device
  const per = stagesPerDevice(gpipe.schedule as ScheduleKind);
  assert.deepEqual(gpipe.balance, new Array(4 * per).fill(2 / per));
  assert.equal(gpipe.peakBytes.length, 4);
  assert.equal(gpipe.bubble.length, 4);
  assert.ok(gpipe.bubble.every((b) => b >= 0 && b < 1));
});

test('a generous budget: the fastest exact plan wins; a tiny one: nothing fits, and the plan says what to change', () => {
  const big = plan(profile(8), { ...REQ, deviceMemory: 64 * 2 ** 30 });
  assert.ok(big.strategies.every((s) => s.fits));
  const fastest = Math.min(
    ...big.strategies.filter((s) => s.exact).map((s) => s.stepSeconds),
  );
  assert.equal(big.recommendedPlan!.stepSeconds, fastest);
  const tiny = plan(profile(8), { ...REQ, deviceMemory: MiB });
  assert.equal(tiny.recommended, null);
  assert.match(
    tiny.recommendation,
    /^nothing fits 1 MiB per device: the smallest predicted peak is .* use more --stages, a smaller --batch-size, or more --device-memory/,
  );
});

test("on K devices l2l also plans the pipelined relay (each device a stage of layers; its run line has --stages, --schedule, --balance), and single and l2l are planned as K replicas with one replica's peak", () => {
  const p = plan(profile(8), { ...REQ, stages: 2 });
  // equal blocks: two devices relaying half the layers each beat one relaying all of them
  const l2l = p.strategies.find((s) => s.strategy === 'l2l' && !s.replicas)!;
  const one = specOf('l2l').plan(profile(8), { ...REQ, stages: 1 });
  assert.equal(l2l.stages, 2);
  assert.equal(l2l.peakBytes.length, 2);
  assert.deepEqual(l2l.balance, [4, 4]);
  assert.ok(
    l2l.stepSeconds < one.stepSeconds,
    `pipelined ${l2l.stepSeconds} s vs one device ${one.stepSeconds} s`,
  );
  assert.ok(Math.max(...l2l.peakBytes) <= one.peakBytes[0]! * 1.05);
  assert.match(
    describe(l2l),
    /^--strategy l2l --micro-batches \d+ --stash \w+ --stages 2 --schedule (gpipe|1f1b) --balance 4,4$/,
  );
  for (const name of ['single', 'l2l']) {
    const r = p.strategies.find(
      (s) => s.strategy === name && s.replicas === 2,
    )!;
    assert.ok(r, `${name} with 2 replicas is planned`);
    const alone = specOf(name).plan(profile(8), {
      ...REQ,
      stages: 1,
      batchSize: REQ.batchSize / 2,
    });
    assert.deepEqual(
      r.peakBytes,
      alone.peakBytes,
      `${name}: one replica's peak`,
    );
    assert.ok(
      Math.abs(r.examplesPerSecond - REQ.batchSize / alone.stepSeconds) < 1e-9,
    );
    assert.match(describe(r), / --replicas 2$/);
    assert.equal(label(r), `${name} x2 replicas`);
  }
});

test('a fixed --micro-batches is used; impossible requests are rejected with the fix', () => {
  const p = plan(profile(8), { ...REQ, microBatches: 8 });
  assert.equal(
    p.strategies.find((s) => s.strategy === 'gpipe')!.microBatches,
    8,
  );
  assert.throws(
    () => plan(profile(3), REQ),
    /--stages 4 exceeds the model's 3 blocks; use at most 3 stages/,
  );
  assert.throws(
    () => plan(profile(8), { ...REQ, microBatches: 5 }),
    /--micro-batches 5 must divide --batch-size 32/,
  );
  assert.throws(
    () => plan(profile(8), { ...REQ, deviceMemory: 0 }),
    /--device-memory must be a positive size/,
  );
  const one = plan(profile(8), { ...REQ, stages: 1 });
  assert.match(
    one.strategies.find((s) => s.strategy === 'gpipe')!.unavailable ?? '',
    /needs --stages 2 or more/,
  );
  assert.deepEqual(divisors(12), [1, 2, 3, 4, 6, 12]);
});

test('layerwise plan: bad input exits with status 2 and names the problem', () => {
  const cli = fileURLToPath(new URL('../cli/main.js', import.meta.url));
  const run = (args: string[]) =>
    spawnSync(process.execPath, [cli, 'plan', ...args], {
      encoding: 'utf8',
      timeout: 60_000,
    });
  const base = [
    '--preset',
    'charlm-tiny',
    '--layers',
    '1',
    '--d-model',
    '16',
    '--context',
    '8',
    '--batch-size',
    '8',
  ];
  let r = run([...base, '--device-memory', 'much', '--stages', '2']);
  assert.equal(r.status, 2);
  assert.match(r.stderr, /--device-memory 'much' is not a positive size/);
  r = run([...base, '--device-memory', '1GB', '--stages', '9']);
  assert.equal(r.status, 2);
  assert.match(
    r.stderr,
    /--stages 9 exceeds the model's 3 blocks; use at most 3 stages/,
  );
  r = run([...base, '--device-memory', '1GB', '--stages', '2']);
  assert.equal(r.status, 0, r.stderr);
  assert.match(r.stdout, /recommendation: /);
  // --stages and --batch-size default to train's (1 device, mini-batch 32)
  r = run([...base.slice(0, -2), '--device-memory', '1GB']);
  assert.equal(r.status, 0, r.stderr);
  assert.match(r.stdout, /mini-batch 32\b/);
  assert.match(r.stdout, /per device, 1 device;/);
});

test("layerwise plan takes train's defaults: --stages 1, --batch-size 32, and this machine's memory (saying so)", () => {
  const cli = fileURLToPath(new URL('../cli/main.js', import.meta.url));
  const r = spawnSync(
    process.execPath,
    [
      cli,
      'plan',
      '--preset',
      'charlm-tiny',
      '--layers',
      '1',
      '--d-model',
      '16',
      '--context',
      '8',
      '--backend',
      'wasm',
    ],
    { encoding: 'utf8', timeout: 60_000 },
  );
  assert.equal(r.status, 0, r.stderr);
  assert.match(r.stdout, /mini-batch 32/);
  assert.match(
    r.stdout,
    /per device \(assumed: this machine's .* of memory shared by 1 device; give --device-memory/,
  );
  assert.match(r.stdout, /, 1 device;/);
  assert.match(r.stdout, /recommendation: /);
});

test('local parallelism is planned with its auxiliary heads, free-running stages, and never silently recommended over backprop', () => {
  const p = plan(profile(8), { ...REQ, deviceMemory: 64 * 2 ** 30 });
  const local = p.strategies.find((s) => s.strategy === 'local')!;
  const gpipe = p.strategies.find((s) => s.strategy === 'gpipe')!;
  assert.equal(local.exact, false);
  assert.equal(gpipe.exact, true);
  assert.equal(local.fits, true);
  assert.equal(local.stages, 4);
  assert.equal(
    local.balance.reduce((a, b) => a + b, 0),
    8,
  );
  // stages run free: no fill or drain, and the fastest balance is the even one; the last stage has
  // no head, so it idles a little; no backward crosses stages, so it is about as fast as gpipe's
  // best here (a zero-bubble schedule, which leaves little bubble either), its heads' work aside
  assert.deepEqual(local.balance, [2, 2, 2, 2]);
  assert.equal(Math.max(...local.bubble.slice(0, 3)), 0);
  assert.ok(local.bubble[3] > 0 && local.bubble[3] < 0.2, `${local.bubble}`);
  assert.match(gpipe.schedule, /^(zb-h1|zbv|dualpipev)$/, 'a zero-bubble one');
  assert.ok(
    local.stepSeconds < 1.05 * gpipe.stepSeconds,
    `local ${local.stepSeconds} s vs gpipe ${gpipe.stepSeconds} s`,
  );
  // each stage but the last holds its head too
  assert.ok(local.peakBytes[0] > local.peakBytes[3]);
  assert.notEqual(p.recommended, 'local');
  assert.match(
    p.recommendation,
    /local fits too (and|but) is predicted [\d.]+x (faster|slower) \(--strategy local --stages 4 --micro-batches \d+ --balance 2,2,2,2; it trains with local losses/,
  );
  // without the heads' costs local cannot be planned, and says so
  const bare = plan(profile(8, false), REQ).strategies.find(
    (s) => s.strategy === 'local',
  )!;
  assert.match(bare.unavailable ?? '', /needs the auxiliary heads profiled/);
});

test('a deep model on one small device: only l2l fits, with the host stash, and is recommended', () => {
  // 64 blocks of 1 MiB: single needs the whole model plus AdamW state (3 x 64 MiB) and every tape;
  // l2l holds about two layers' parameters, one gradient and one layer's activations
  const p = plan(profile(64), {
    ...REQ,
    stages: 1,
    deviceMemory: 96 * MiB,
    microBatches: 4,
  });
  const l2l = p.strategies.find((s) => s.strategy === 'l2l')!;
  assert.equal(p.strategies.find((s) => s.strategy === 'single')!.fits, false);
  assert.equal(l2l.fits, true);
  assert.ok(l2l.peakBytes[0] < 96 * MiB, `l2l peak ${l2l.peakBytes[0]}`);
  assert.equal(l2l.stash, 'host');
  assert.equal(p.recommended, 'l2l');
  assert.match(
    p.recommendation,
    /--strategy l2l --micro-batches 4 --stash host/,
  );
  // and l2l's peak does not grow with depth, where single's does
  const shallow = plan(profile(8), {
    ...REQ,
    stages: 1,
    deviceMemory: 96 * MiB,
    microBatches: 4,
  });
  assert.equal(
    shallow.strategies.find((s) => s.strategy === 'l2l')!.peakBytes[0],
    l2l.peakBytes[0],
  );
});
