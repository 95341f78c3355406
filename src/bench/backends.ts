/**
 * `npm run bench -- backends`: tokens/s of single-device training of one model on each backend
 * in the same run (wasm, cpu, native), and on native the pipelines with one thread per stage
 * (gpipe K=2 M=8, local K=2) against native single with all threads. Writes backends.json and
 * backends.md. Each configuration runs one warm-up step, then the median of `steps` steps.
 */
import { availableParallelism } from 'node:os';
import { nativeAddon, nativeUnavailable } from '../backend/native.js';
import { resolveConfig, type TrainConfig } from '../config/config.js';
import { makeBatcher } from '../data/batcher.js';
import { modelParamCount } from '../model/model.js';
import { createStrategy } from '../strategies/index.js';
import { threadsPerDevice } from '../strategies/spec.js';
import { median } from '../util/stats.js';
import {
  type BenchRun,
  loadBenchModel,
  markdownTable,
  reportBenchResults,
  timeTrainSteps,
} from './report.js';

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

/** The bench's shared run: its options, configuration, model, cores and log. */
type BackendsRun = BenchRun<BackendsBenchOptions>;

/** Runs every configuration (native ones where the addon loads) and writes backends.json and backends.md. */
export async function benchBackends(
  o: BackendsBenchOptions,
  log: (s: string) => void,
): Promise<void> {
  const base = resolveConfig({ preset: o.preset, batchSize: o.batchSize });
  const bench = await loadBenchModel(base);
  const run: BackendsRun = {
    o,
    base,
    bench,
    cores: availableParallelism(),
    log,
  };
  const rows = await measureAll(run);
  await reportBenchResults(
    o.out,
    'backends',
    {
      bench: 'backends',
      options: o,
      cores: run.cores,
      params: modelParamCount(bench.model),
      rows,
    },
    backendsMarkdown(run, rows),
    log,
  );
}

/**
 * wasm and cpu single, then (where the native addon loads) native single, gpipe K=2 M=8 and
 * local K=2 M=2; one row each, in that order. Logs why native is skipped.
 */
async function measureAll(run: BackendsRun): Promise<Row[]> {
  const { o } = run;
  const rows: Row[] = [];
  rows.push(
    await measure(run, { backend: 'wasm', strategy: 'single' }, o.steps),
  );
  rows.push(
    await measure(run, { backend: 'cpu', strategy: 'single' }, o.cpuSteps),
  );
  if (nativeAddon()) {
    rows.push(
      await measure(run, { backend: 'native', strategy: 'single' }, o.steps),
    );
    rows.push(
      await measure(
        run,
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
        run,
        { backend: 'native', strategy: 'local', stages: 2, microBatches: 2 },
        o.steps,
      ),
    );
  } else {
    run.log(`native: skipped (${nativeUnavailable()})`);
  }
  return rows;
}

/**
 * Trains the base config with `over` on top: one warm-up step, then `steps` timed steps; the
 * row holds the median step (seconds) and tokens/s of it. Logs the row. Closes the strategy.
 */
async function measure(
  run: BackendsRun,
  over: Partial<TrainConfig>,
  steps: number,
): Promise<Row> {
  const { o, base, bench } = run;
  const cfg = resolveConfig({
    ...base,
    balance: undefined,
    ...over,
  } as Parameters<typeof resolveConfig>[0]);
  const s = await createStrategy(cfg, bench.model, bench.params);
  try {
    const batcher = makeBatcher(bench.ds, {
      batchSize: o.batchSize,
      context: bench.context,
      seed: 1,
    });
    let tokens = 0;
    let loss = NaN;
    const times = await timeTrainSteps(
      s,
      () => batcher.next(),
      steps,
      (r, b) => {
        loss = r.loss;
        tokens = b.tokens;
      },
    );
    const secs = median(times);
    const threads = threadsOf(cfg, s.devices, run.cores);
    const row = {
      backend: cfg.backend,
      strategy: strategyLabel(cfg, s.devices),
      threads_per_device: threads,
      tokens_per_s: tokens / secs,
      step_s: secs,
      loss_after: loss,
    };
    run.log(
      `${row.backend} ${row.strategy} (${threads} thread(s) per device): ${row.tokens_per_s.toFixed(0)} tokens/s, ${secs.toFixed(2)} s/step`,
    );
    return row;
  } finally {
    await s.close();
  }
}

/**
 * Kernel threads per device: only the native backend runs its kernels on a team of threads
 * (`cfg.threads`, else strategies/spec.ts threadsPerDevice); wasm and cpu use one.
 */
function threadsOf(cfg: TrainConfig, devices: number, cores: number): number {
  return cfg.backend !== 'native' ? 1 : threadsPerDevice(cfg, devices, cores);
}

/** A row's strategy column: e.g. `single`, `local K=2`, `gpipe K=2 M=8`. */
function strategyLabel(cfg: TrainConfig, devices: number): string {
  return `${cfg.strategy}${devices > 1 ? ` K=${devices}` : ''}${cfg.strategy === 'gpipe' ? ` M=${cfg.microBatches}` : ''}`;
}

/** backends.md: the setting, then one table row per configuration. */
function backendsMarkdown(run: BackendsRun, rows: Row[]): string {
  const { o, bench, cores } = run;
  return [
    `# backends benchmark\n`,
    `Model ${o.preset} (${modelParamCount(bench.model).toLocaleString('en-US')} parameters), mini-batch ${o.batchSize}, median of ${o.steps} measured steps (cpu: ${o.cpuSteps}) after one warm-up step, on this machine (${cores} cores, Node ${process.versions.node}).\n`,
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
}
