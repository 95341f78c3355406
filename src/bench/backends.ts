/**
 * `npm run bench -- backends`: tokens/s of single-device training of one model on each backend
 * in the same run (wasm, cpu, native), and on native the pipelines with one thread per stage
 * (gpipe K=2 M=8, local K=2) against native single with all threads. Writes backends.json and
 * backends.md. Each configuration runs one warm-up step, then the median of `steps` steps.
 */
import { availableParallelism } from 'node:os';
import { nativeAddon, nativeUnavailable } from '../backend/native.js';
import {
  modelConfigFor,
  resolveConfig,
  type TrainConfig,
} from '../config/config.js';
import { makeBatcher } from '../data/batcher.js';
import { loadDataset } from '../data/index.js';
import { initParams } from '../model/init.js';
import { buildModel, modelParamCount } from '../model/model.js';
import { createStrategy } from '../strategies/index.js';
import { median } from '../util/stats.js';
import { markdownTable, writeBenchResults } from './report.js';

export interface BackendsBenchOptions {
  preset: string;
  batchSize: number;
  /** Measured steps per configuration (after one warm-up step); the cpu backend takes `cpuSteps`. */
  steps: number;
  cpuSteps: number;
  out: string;
}

interface Row {
  backend: string;
  strategy: string;
  threads_per_device: number;
  tokens_per_s: number;
  step_s: number;
  loss_after: number;
}

export async function benchBackends(
  o: BackendsBenchOptions,
  log: (s: string) => void,
): Promise<void> {
  const base = resolveConfig({ preset: o.preset, batchSize: o.batchSize });
  const ds = await loadDataset(base.data);
  const model = buildModel(modelConfigFor(base, ds));
  const params = initParams(model.blocks, base.seed);
  const context =
    model.config.arch === 'charlm' ? model.config.context : undefined;
  const cores = availableParallelism();

  async function measure(
    over: Partial<TrainConfig>,
    steps: number,
  ): Promise<Row> {
    const cfg = resolveConfig({
      ...base,
      balance: undefined,
      ...over,
    } as Parameters<typeof resolveConfig>[0]);
    const s = await createStrategy(cfg, model, params);
    try {
      const batcher = makeBatcher(ds, {
        batchSize: o.batchSize,
        context,
        seed: 1,
      });
      await s.trainStep(batcher.next(), 1e-4);
      const times: number[] = [];
      let tokens = 0;
      let loss = NaN;
      for (let i = 0; i < steps; i++) {
        const b = batcher.next();
        const t0 = performance.now();
        loss = (await s.trainStep(b, 1e-4)).loss;
        times.push((performance.now() - t0) / 1000);
        tokens = b.tokens;
      }
      const secs = median(times);
      // only the native backend runs its kernels on a team of threads; wasm and cpu use one per device
      const threads =
        cfg.backend !== 'native'
          ? 1
          : cfg.threads > 0
            ? cfg.threads
            : Math.max(1, Math.floor(cores / s.devices));
      const row = {
        backend: cfg.backend,
        strategy: `${cfg.strategy}${s.devices > 1 ? ` K=${s.devices}` : ''}${cfg.strategy === 'gpipe' ? ` M=${cfg.microBatches}` : ''}`,
        threads_per_device: threads,
        tokens_per_s: tokens / secs,
        step_s: secs,
        loss_after: loss,
      };
      log(
        `${row.backend} ${row.strategy} (${threads} thread(s) per device): ${row.tokens_per_s.toFixed(0)} tokens/s, ${secs.toFixed(2)} s/step`,
      );
      return row;
    } finally {
      await s.close();
    }
  }

  const rows: Row[] = [];
  rows.push(await measure({ backend: 'wasm', strategy: 'single' }, o.steps));
  rows.push(await measure({ backend: 'cpu', strategy: 'single' }, o.cpuSteps));
  if (nativeAddon()) {
    rows.push(
      await measure({ backend: 'native', strategy: 'single' }, o.steps),
    );
    rows.push(
      await measure(
        {
          backend: 'native',
          strategy: 'gpipe',
          stages: 2,
          microBatches: 8,
          remat: 'never',
        },
        o.steps,
      ),
    );
    rows.push(
      await measure(
        { backend: 'native', strategy: 'local', stages: 2, microBatches: 2 },
        o.steps,
      ),
    );
  } else {
    log(`native: skipped (${nativeUnavailable()})`);
  }
  const md = [
    `# backends benchmark\n`,
    `Model ${o.preset} (${modelParamCount(model).toLocaleString('en-US')} parameters), mini-batch ${o.batchSize}, median of ${o.steps} measured steps (cpu: ${o.cpuSteps}) after one warm-up step, on this machine (${cores} cores, Node ${process.versions.node}).\n`,
    markdownTable({
      columns: [
        'backend',
        'strategy',
        'threads per device',
        'tokens/s',
        's/step',
      ],
      rows: rows.map((r) => [
        r.backend,
        r.strategy,
        r.threads_per_device,
        r.tokens_per_s.toFixed(0),
        r.step_s.toFixed(2),
      ]),
    }),
  ].join('\n');
  const files = await writeBenchResults(
    o.out,
    'backends',
    {
      bench: 'backends',
      options: o,
      cores,
      params: modelParamCount(model),
      rows,
    },
    md,
  );
  log(`wrote ${files.join(', ')}`);
}
