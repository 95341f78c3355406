/**
 * What a training step asks of the GPU (issue 36 item 2): on webgpu every device reports its
 * step's compute dispatches, queue submits and readbacks (and its thread's CPU time: the host's
 * side of the step), the strategy sums them, and
 * summary.json gives their means per step; on a host backend nothing is reported. A single
 * step reads back only its loss and its gradient norm. Skipped, saying why, where no WebGPU
 * adapter can be made.
 */

import assert from 'node:assert/strict';
import { mkdtempSync, readFileSync, rmSync } from 'node:fs';
import { tmpdir } from 'node:os';
import { join } from 'node:path';
import { test } from 'node:test';
import { installDawn } from '../backend/webgpu.js';
import type { StepReport } from '../strategies/strategy.js';
import { runCli } from '../testing/cli.js';
import { trainTinyLm } from '../testing/fixtures.js';
import type { Summary } from './metrics.js';
import { StepTally } from './step-tally.js';

let why: string | false = false;
try {
  await installDawn();
} catch (e) {
  why = `no WebGPU adapter here: ${(e as Error).message}`;
}

const run = (backend: string, o: Record<string, unknown> = {}) =>
  trainTinyLm(
    { backend, strategy: 'single', clipNorm: 1, ...o },
    {
      shape: { layers: 2, dModel: 16, heads: 2, context: 8 },
      batchSize: 4,
      lrs: [3e-3, 2e-3],
    },
  );

test('the tally gives summary.json the mean GPU counts per counted step, and none without them', () => {
  const report = (
    gpu?: StepReport['gpu'],
    gpuBusy?: StepReport['gpuBusy'],
  ): StepReport => ({
    loss: 1,
    stageLosses: [1],
    peakBytes: [0],
    stageSeconds: [0.1],
    bubble: [0],
    traces: [[]],
    startedAt: [0],
    ...(gpu ? { gpu } : {}),
    ...(gpuBusy ? { gpuBusy } : {}),
  });
  const facts = (step: number, counted: boolean) => ({
    step,
    lr: 0.1,
    tokens: 10,
    seconds: 0.1,
    counted,
  });
  const t = new StepTally(1, true);
  t.step(
    report({ dispatches: 999, submits: 99, readbacks: 9, copies: 999 }),
    facts(1, false),
  );
  t.step(
    report(
      {
        dispatches: 100,
        submits: 10,
        readbacks: 2,
        copies: 30,
        hostMs: 4,
        pollMs: 1,
      },
      { busySeconds: 0.05, stepSeconds: 0.1 },
    ),
    facts(2, true),
  );
  const line = t.step(
    report(
      {
        dispatches: 200,
        submits: 20,
        readbacks: 2,
        copies: 50,
        hostMs: 8,
        pollMs: 3,
      },
      { busySeconds: 0.25, stepSeconds: 0.3 },
    ),
    facts(3, true),
  );
  assert.equal(line.host_ms, 8, "metrics.jsonl's line: the step's host ms");
  const s = t.summaryFields();
  assert.equal(s.dispatches_per_step, 150);
  assert.equal(s.submits_per_step, 15);
  assert.equal(s.readbacks_per_step, 2);
  assert.equal(s.copies_per_step, 40);
  assert.equal(s.host_ms_per_step, 6); // (4 + 8) / 2
  assert.equal(s.host_us_per_dispatch, 40); // 12 ms over 300 dispatches
  assert.equal(s.poll_ms_per_step, 2); // (1 + 3) / 2
  // a report carries the previous step's busy time: step 2's is step 1's, which is not counted
  assert.ok(
    Math.abs(s.gpu_busy! - 0.25 / 0.3) < 1e-12,
    `gpu_busy ${s.gpu_busy}`,
  );
  const untimed = new StepTally(1, true);
  untimed.step(
    report({ dispatches: 100, submits: 10, readbacks: 2, copies: 30 }),
    facts(1, true),
  );
  assert.equal(untimed.summaryFields().gpu_busy, undefined);
  // counted from the start (a resumed run's steps): step 2's busy time is step 1's, counted
  const counted = new StepTally(1, true);
  const busy = { busySeconds: 0.05, stepSeconds: 0.1 };
  counted.step(
    report({ dispatches: 1, submits: 1, readbacks: 2, copies: 2 }),
    facts(1, true),
  );
  counted.step(
    report({ dispatches: 1, submits: 1, readbacks: 2, copies: 2 }, busy),
    facts(2, true),
  );
  assert.equal(counted.summaryFields().gpu_busy, 0.5);
  // a step without the thread's CPU time (not Linux): no host time, rather than a low one
  assert.equal(untimed.summaryFields().host_ms_per_step, undefined);
  const host = new StepTally(1, true);
  assert.equal(host.step(report(), facts(1, true)).host_ms, undefined);
  assert.equal(host.summaryFields().dispatches_per_step, undefined);
});

test('on webgpu a single step reports its dispatches and submits, and reads back the loss and the gradient norm in one read; cpu reports none', {
  skip: why,
}, async () => {
  const gpu = await run('webgpu');
  for (const r of gpu.reports) {
    assert.ok(r.gpu, 'a webgpu step reports its GPU counts');
    assert.ok(r.gpu.dispatches > 0, `dispatches ${r.gpu.dispatches}`);
    assert.ok(r.gpu.submits > 0, `submits ${r.gpu.submits}`);
    assert.equal(
      r.gpu.readbacks,
      1,
      'the loss and the gradient norm, in one read',
    );
    // at least the readbacks' copies to their staging buffers
    assert.ok(r.gpu.copies >= 2, `copies ${r.gpu.copies}`);
    if (process.platform === 'linux')
      assert.ok(
        r.gpu.hostMs !== undefined &&
          r.gpu.hostMs > 0 &&
          r.gpu.pollMs !== undefined &&
          r.gpu.pollMs >= 0,
        `the device thread's CPU ms ${r.gpu.hostMs}, polling ${r.gpu.pollMs}`,
      );
  }
  // timestamp queries (lavapipe has them): each step after the first carries its predecessor's busy time
  const timed = gpu.reports.slice(1).filter((r) => r.gpuBusy);
  for (const r of timed) {
    const { busySeconds, stepSeconds } = r.gpuBusy!;
    assert.ok(
      busySeconds > 0 && busySeconds <= stepSeconds * 1.05,
      `busy ${busySeconds} s of a ${stepSeconds} s step`,
    );
  }
  const cpu = await run('cpu');
  assert.ok(cpu.reports.every((r) => r.gpu === undefined));
});

test("on webgpu an l2l step reads each layer's gradients and sum of squares in one read, and its losses in one", {
  skip: why,
}, async () => {
  const layers = 2;
  const gpu = await trainTinyLm(
    {
      backend: 'webgpu',
      strategy: 'l2l',
      microBatches: 2,
      stash: 'device',
      clipNorm: 1,
    },
    {
      shape: { layers, dModel: 16, heads: 2, context: 8 },
      batchSize: 4,
      lrs: [3e-3, 2e-3],
    },
  );
  // the relay's layers: the embedding, the blocks and the head; one read a layer and the losses'
  const reads = layers + 2 + 1;
  for (const r of gpu.reports)
    assert.equal(
      r.gpu?.readbacks,
      reads,
      'one readback a layer (its gradients and their sums of squares) and one for the losses',
    );
});

test("on webgpu the replicas' all-reduce reads each replica's gradients in one read: two a replica a step, with the loss and norm's", {
  skip: why,
}, async () => {
  const replicas = 2;
  const single = await run('webgpu');
  const r = await run('webgpu', { replicas });
  r.losses.forEach((l, i) =>
    assert.ok(
      Math.abs(l - single.losses[i]!) <= 1e-5,
      `step ${i}: ${l} with ${replicas} replicas, ${single.losses[i]} single`,
    ),
  );
  for (const x of r.reports)
    assert.equal(
      x.gpu?.readbacks,
      2 * replicas,
      "each replica's losses and norm in one read, its gradients in another",
    );
});

/** Trains single on webgpu with `args` (after `train --strategy single --backend webgpu`) in a temporary folder and returns its summary.json. */
function trainSummary(
  args: string[],
  env: Record<string, string> = {},
): Summary {
  const dir = mkdtempSync(join(tmpdir(), 'layerwise-gpu-summary-'));
  try {
    const out = join(dir, 'run');
    const r = runCli(
      [
        ...['train', '--strategy', 'single', '--backend', 'webgpu'],
        ...['--eval-every', '0', '--eval-batches', '1', '--out', out],
        ...args,
      ],
      env,
      200_000,
    );
    assert.equal(r.code, 0, r.err);
    return JSON.parse(
      readFileSync(join(out, 'summary.json'), 'utf8'),
    ) as Summary;
  } finally {
    rmSync(dir, { recursive: true, force: true });
  }
}

test("a charlm-small single step on webgpu (its blocks and ops, at d 32) takes at most 200 dispatches and 2 readbacks, in summary.json (issue 36's count; TF.js's own kernels took about 1,470)", {
  skip: why,
  timeout: 240_000,
}, () => {
  const s = trainSummary([
    ...['--preset', 'charlm-small', '--d-model', '32', '--heads', '4'],
    ...['--context', '16', '--batch-size', '4', '--steps', '3'],
  ]);
  const d = s.dispatches_per_step;
  // a step's work: the blocks' products, attention, norms, the loss and the update
  assert.ok(d !== undefined && d >= 60 && d <= 200, `dispatches per step ${d}`);
  assert.ok(
    s.readbacks_per_step !== undefined && s.readbacks_per_step <= 2,
    `readbacks per step ${s.readbacks_per_step}`,
  );
});

test('LAYERWISE_WEBGPU_KERNEL_TIMES=1: summary.json gives the GPU ms per step of every dispatch by kernel, slowest first, and the kernels account for every dispatch of the step', {
  skip: why,
  timeout: 240_000,
}, () => {
  const s = trainSummary(
    [
      ...['--preset', 'charlm-tiny', '--context', '16', '--batch-size', '4'],
      ...['--steps', '4'],
    ],
    { LAYERWISE_WEBGPU_KERNEL_TIMES: '1' },
  );
  const k = s.gpu_kernels;
  assert.ok(k && k.length > 5, `gpu_kernels ${JSON.stringify(k)}`);
  const sum = (f: (x: NonNullable<typeof k>[number]) => number) =>
    k.reduce((a, x) => a + f(x), 0);
  // each dispatch in a timed pass of its own, labelled: as many as the step counted
  assert.equal(
    sum((x) => x.dispatches_per_step),
    s.dispatches_per_step,
  );
  for (const name of ['lw_matmul', 'lw_flash_attention', 'lw_adamw_multi'])
    assert.ok(
      k.some((x) => x.kernel.startsWith(name) && x.ms_per_step > 0),
      `${name} timed: ${k.map((x) => x.kernel).join(', ')}`,
    );
  assert.ok(
    k.every((x, i) => i === 0 || x.ms_per_step <= k[i - 1]!.ms_per_step),
    'slowest first',
  );
  assert.ok(
    !k.some((x) => x.kernel === '(other passes)'),
    'every pass labelled',
  );
});
