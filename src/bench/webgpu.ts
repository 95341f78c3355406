/**
 * `npm run bench -- webgpu`: matrix-product GFLOP/s on the webgpu backend (Dawn in Node: a real
 * GPU where there is one, else Mesa's software rasteriser), beside the cpu-side backends'
 * matmul in the same process for scale. Each size runs a warm-up product (shader compilation),
 * then `reps` products, timed to the asynchronous read of the last. Writes webgpu.json and
 * webgpu.md. (charlm-small tokens/s on webgpu waits for a training path without synchronous
 * reads; see --backend webgpu.)
 */
import { initBackend } from '../backend/index.js';
import { installDawn } from '../backend/webgpu.js';
import { tf } from '../backend/tfjs.js';
import { markdownTable, writeBenchResults } from './report.js';

export interface WebGPUBenchOptions {
  sizes: number[];
  reps: number;
  out: string;
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

export async function benchWebGPU(o: WebGPUBenchOptions, log: (s: string) => void): Promise<void> {
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
  const md = `# WebGPU matmul\n\nAdapter: ${adapter.description} (${adapter.featureLevel} feature level). ${o.reps} products per size, timed to the read of the last.\n\n` +
    markdownTable({ columns: ['backend', 'n (n x n times n x n)', 'GFLOP/s'], rows: rows.map((r) => [r.backend, r.n, r.gflops.toFixed(1)]) });
  const files = await writeBenchResults(o.out, 'webgpu', { adapter, options: o, rows }, md);
  log(`wrote ${files.join(', ')}`);
}
