/**
 * `npm run bench -- gpu`'s bookkeeping (no GPU, no timing): which configurations run, how
 * `--configs` selects them, how tokens/s is taken from metrics lines, what the page names; and,
 * where Dawn gives an adapter (lavapipe in CI), that its plain TF.js row leaves out layerwise's
 * WGSL kernels.
 */
import assert from 'node:assert/strict';
import { mkdtempSync, readFileSync, rmSync } from 'node:fs';
import { tmpdir } from 'node:os';
import { join } from 'node:path';
import { test } from 'node:test';
import type { StepMetrics } from '../train/metrics.js';
import {
  benchGpu,
  GPU_MODELS,
  type GpuRow,
  gpuConfigs,
  gpuMarkdown,
  measuredRate,
  probeTorch,
  selectConfigs,
} from './gpu.js';

test("the full bench is issue 36's table: both models on layerwise (captured and not), plain TF.js and three PyTorch runs; l2l and gpipe K=2 of the large model only", () => {
  const all = gpuConfigs(GPU_MODELS.full);
  const names = all.map((c) => c.name);
  for (const m of ['small', 'large'])
    for (const r of [
      'layerwise',
      'uncaptured',
      'tfjs',
      'pytorch-fp32',
      'pytorch-sdpa',
      'pytorch-sdpa-bf16',
    ])
      assert.ok(names.includes(`${m}/${r}`), `${m}/${r} missing`);
  assert.ok(names.includes('large/l2l') && names.includes('large/gpipe-k2'));
  assert.ok(!names.includes('small/l2l'));
  // plain TF.js differs from layerwise only by the switches that leave out the WGSL kernels and
  // the captured step; the uncaptured row by the latter alone
  const lw = all.find((c) => c.name === 'large/layerwise')!;
  const plain = all.find((c) => c.name === 'large/tfjs')!;
  const uncaptured = all.find((c) => c.name === 'large/uncaptured')!;
  assert.deepEqual(plain.args, lw.args);
  assert.deepEqual(uncaptured.args, lw.args);
  assert.deepEqual(plain.env, {
    LAYERWISE_WEBGPU_KERNELS: 'tfjs',
    LAYERWISE_WEBGPU_CAPTURE: '0',
  });
  assert.deepEqual(uncaptured.env, { LAYERWISE_WEBGPU_CAPTURE: '0' });
  assert.equal(lw.env, undefined);
  assert.deepEqual(lw.model.cli.slice(2), [
    '--layers',
    '8',
    '--d-model',
    '1024',
    '--heads',
    '16',
    '--context',
    '256',
  ]);
  assert.deepEqual(lw.model.torch, lw.model.cli.slice(2));
});

test('--configs takes whole names and model prefixes, and names the valid ones for a wrong entry', () => {
  const all = gpuConfigs(GPU_MODELS.full);
  const picked = selectConfigs(all, ['small', 'large/l2l']).map((c) => c.name);
  assert.equal(picked.length, 7);
  assert.ok(picked.every((n) => n.startsWith('small/') || n === 'large/l2l'));
  assert.equal(selectConfigs(all, undefined).length, all.length);
  assert.throws(
    () => selectConfigs(all, ['large/l2'] /* a prefix not ending at '/' */),
    /--configs: no configuration 'large\/l2' \(valid: small\/layerwise, .*large\/gpipe-k2, or a model: small, large\)/,
  );
});

test('tokens/s leaves out the warm-up steps and divides tokens by seconds', () => {
  const line = (step: number, s: number, tokens: number) =>
    ({ step, step_s: s, tokens_per_s: tokens / s }) as StepMetrics;
  const lines = [
    line(1, 30, 4096),
    line(2, 9, 4096),
    line(3, 1, 4096),
    line(4, 3, 4096),
  ];
  const r = measuredRate(lines, 2)!;
  assert.equal(r.n, 2);
  assert.ok(Math.abs(r.tokensPerS - 8192 / 4) < 1e-9, String(r.tokensPerS));
  assert.equal(r.stepS, 3);
  assert.equal(measuredRate(lines, 4), undefined);
});

test('a Python without torch gives rows saying why, not a failure', () => {
  const r = probeTorch('/nonexistent/python3');
  assert.equal(r.ok, false);
  assert.match(r.why ?? '', /not importable/);
});

test('the page names the adapter, gives each run against layerwise webgpu and links the earlier runs', () => {
  const row = (run: string, config: string, tps?: number): GpuRow => ({
    config,
    model: 'charlm-tiny',
    run,
    tokens_per_s: tps,
    steps_measured: tps ? 3 : 0,
    command: 'x',
    note: tps ? undefined : 'PyTorch not importable',
  });
  const md = gpuMarkdown(
    {
      vendor: 'nvidia',
      architecture: 'hopper',
      description: 'NVIDIA H100',
      flags: [],
      featureLevel: 'core',
    },
    [
      row('layerwise webgpu', 'tiny/layerwise', 1000),
      row('plain TF.js webgpu', 'tiny/tfjs', 250),
      row('PyTorch CUDA fp32', 'tiny/pytorch-fp32'),
    ],
    { date: '2026-11-26', commit: 'abc', wallS: 10, command: 'c' },
    ['gpu-h100-2026-11-26.md'],
  );
  assert.match(md, /Adapter: nvidia \/ hopper \(NVIDIA H100;/);
  assert.match(md, /\| plain TF\.js webgpu \| 250 \| 0\.25x \|/);
  assert.match(md, /\| PyTorch CUDA fp32 \| - \| - \|.*PyTorch not importable/);
  assert.match(
    md,
    /## Earlier runs\n\n- \[gpu-h100-2026-11-26\.md\]\(gpu-h100-2026-11-26\.md\)/,
  );
});

/** Whether Dawn gives this process a webgpu adapter (a GPU or lavapipe). */
async function hasWebGPU(): Promise<boolean> {
  try {
    await (await import('../backend/webgpu.js')).installDawn();
    return true;
  } catch {
    return false;
  }
}

test("the bench's plain TF.js run leaves out layerwise's WGSL kernels: more dispatches per step, the same losses", async (t) => {
  if (!(await hasWebGPU())) {
    t.skip('Dawn gives no webgpu adapter here');
    return;
  }
  const out = mkdtempSync(join(tmpdir(), 'lw-gpu-bench-test-'));
  try {
    await benchGpu(
      {
        quick: true,
        steps: 1,
        warmup: 1,
        configs: ['tiny/layerwise', 'tiny/tfjs', 'tiny/pytorch-fp32'],
        configSeconds: 240,
        budgetSeconds: 600,
        python: '/nonexistent/python3',
        out,
        name: 'gpu',
      },
      () => undefined,
    );
    const r = JSON.parse(readFileSync(join(out, 'gpu.json'), 'utf8')) as {
      adapter: { description?: string };
      rows: GpuRow[];
    };
    const [lw, plain, torch] = r.rows;
    assert.ok(r.adapter.description, 'the adapter is named');
    assert.ok(lw!.tokens_per_s! > 0 && plain!.tokens_per_s! > 0);
    assert.equal(lw!.steps_measured, 1);
    if (lw!.gpu_busy !== undefined)
      assert.ok(
        lw!.gpu_busy > 0 && lw!.gpu_busy <= 1.05,
        `GPU busy ${lw!.gpu_busy} of the step`,
      );
    if (process.platform === 'linux')
      assert.ok(
        lw!.host_ms_per_step! > 0,
        `host ms per step ${lw!.host_ms_per_step}`,
      );
    assert.ok(
      plain!.dispatches_per_step! > 1.5 * lw!.dispatches_per_step!,
      `plain TF.js ${plain!.dispatches_per_step} vs layerwise ${lw!.dispatches_per_step} dispatches per step`,
    );
    assert.ok(
      Math.abs(plain!.final_loss! - lw!.final_loss!) < 1e-3,
      `losses ${plain!.final_loss} vs ${lw!.final_loss}`,
    );
    assert.equal(torch!.tokens_per_s, undefined);
    assert.match(torch!.note ?? '', /PyTorch not importable/);
    assert.match(
      readFileSync(join(out, 'gpu.md'), 'utf8'),
      /\| plain TF\.js webgpu \| [\d,]+ \| [\d.]+x \|/,
    );
  } finally {
    rmSync(out, { recursive: true, force: true });
  }
});
