/**
 * `npm run bench -- webgpu`: matrix-product GFLOP/s on the webgpu backend (Dawn in Node: a real
 * GPU where there is one, else Mesa's software rasteriser), beside the cpu-side backends'
 * matmul in the same process for scale. Each size runs a warm-up product (shader compilation),
 * then `reps` products, timed to the asynchronous read of the last. Writes webgpu.json and
 * webgpu.md; then single-device training tokens/s of a preset (default charlm-small; slow on
 * a software GPU, so pass --preset charlm-tiny there) on webgpu, native and wasm.
 */
import { initBackend } from '../backend/index.js';
import { tf } from '../backend/tfjs.js';
import { installDawn } from '../backend/webgpu.js';
import { markdownTable, writeBenchResults } from './report.js';

export interface WebGPUBenchOptions {
  sizes: number[];
  reps: number;
  /** Preset whose single-device training throughput is measured (0 steps: skip). */
  preset: string;
  steps: number;
  out: string;
}

/** Tokens/s of single-device training of `preset` on `backend`: one warm-up step, then the median of `steps`. */
async function trainRate(
  preset: string,
  backend: string,
  steps: number,
): Promise<number> {
  const { resolveConfig, modelConfigFor } = await import('../config/config.js');
  const { loadDataset } = await import('../data/index.js');
  const { makeBatcher } = await import('../data/batcher.js');
  const { buildModel } = await import('../model/model.js');
  const { initParams } = await import('../model/init.js');
  const { createStrategy } = await import('../strategies/index.js');
  const cfg = resolveConfig({ preset, backend, batchSize: 32 });
  const ds = await loadDataset(cfg.data);
  const model = buildModel(modelConfigFor(cfg, ds));
  const s = await createStrategy(cfg, model, initParams(model.blocks, 1));
  try {
    const batcher = makeBatcher(ds, {
      batchSize: 32,
      context:
        model.config.arch === 'charlm' ? model.config.context : undefined,
      seed: 1,
    });
    await s.trainStep(batcher.next(), 1e-4);
    const times: number[] = [];
    let tokens = 0;
    for (let i = 0; i < steps; i++) {
      const b = batcher.next();
      const t = performance.now();
      await s.trainStep(b, 1e-4);
      times.push((performance.now() - t) / 1000);
      tokens = b.tokens;
    }
    times.sort((a, b) => a - b);
    return tokens / times[Math.floor(times.length / 2)]!;
  } finally {
    await s.close();
  }
}

async function gflops(n: number, reps: number): Promise<number> {
  const a = tf.randomNormal([n, n], 0, 1, 'float32', 1);
  const b = tf.randomNormal([n, n], 0, 1, 'float32', 2);
  await tf.matMul(a, b).data(); // compile, upload
  const t0 = performance.now();
  let c: tf.Tensor | null = null;
  for (let i = 0; i < reps; i++) {
    c?.dispose();
    c = tf.matMul(a, b);
  }
  await c!.data();
  const secs = (performance.now() - t0) / 1000;
  tf.dispose([a, b, c!]);
  return (2 * n ** 3 * reps) / secs / 1e9;
}

export async function benchWebGPU(
  o: WebGPUBenchOptions,
  log: (s: string) => void,
): Promise<void> {
  const adapter = await installDawn();
  log(`adapter: ${adapter.description} (${adapter.featureLevel})`);
  const rows: Array<{ backend: string; n: number; gflops: number }> = [];
  for (const backend of ['webgpu', 'native', 'wasm']) {
    try {
      await initBackend(backend);
    } catch (e) {
      log(`${backend}: skipped (${(e as Error).message.split('\n')[0]})`);
      continue;
    }
    for (const n of o.sizes) {
      const g = await gflops(n, o.reps);
      rows.push({ backend, n, gflops: g });
      log(`${backend} matmul ${n}^3: ${g.toFixed(1)} GFLOP/s`);
    }
  }
  const rates: Array<{
    backend: string;
    preset: string;
    tokens_per_s: number;
  }> = [];
  if (o.steps > 0) {
    for (const backend of ['webgpu', 'native', 'wasm']) {
      try {
        const r = await trainRate(o.preset, backend, o.steps);
        rates.push({ backend, preset: o.preset, tokens_per_s: r });
        log(`${o.preset} single on ${backend}: ${r.toFixed(0)} tokens/s`);
      } catch (e) {
        log(
          `${o.preset} on ${backend}: skipped (${(e as Error).message.split('\n')[0]})`,
        );
      }
    }
  }
  const md =
    `# WebGPU matmul\n\nAdapter: ${adapter.description} (${adapter.featureLevel} feature level). ${o.reps} products per size, timed to the read of the last.\n\n` +
    markdownTable({
      columns: ['backend', 'n (n x n times n x n)', 'GFLOP/s'],
      rows: rows.map((r) => [r.backend, r.n, r.gflops.toFixed(1)]),
    }) +
    (rates.length
      ? `\n## Single-device training, ${o.preset}, batch 32\n\n${markdownTable({ columns: ['backend', 'tokens/s'], rows: rates.map((r) => [r.backend, r.tokens_per_s.toFixed(0)]) })}`
      : '');
  const files = await writeBenchResults(
    o.out,
    'webgpu',
    { adapter, options: o, rows, training: rates },
    md,
  );
  log(`wrote ${files.join(', ')}`);
}
