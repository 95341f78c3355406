/**
 * `npm run bench -- l2l`: L2L against single-device training.
 *
 * - Depth sweep: peak device bytes and throughput (tokens/s) of single and of l2l (stash in
 *   host memory) for character Transformers of the same width and 6, 12, 24, 48 blocks.
 * - Budget: under one fixed device budget, the deepest of those models each strategy trains
 *   (single's measured peak grows with depth; a single run over the budget stops at once with
 *   the runtime guard, "device out of memory").
 * - Throughput on charlm-small (the gpipe bench's model) where it fits on one device: l2l with
 *   the stash in host memory and on the device, against single measured first and last.
 * - The parameter server's host AdamW in parameters per second beside TF.js's own Adam on the
 *   same backend (src/bench/param-server.ts).
 */

import {
  modelConfigFor,
  resolveConfig,
  type TrainConfig,
} from '../config/config.js';
import { makeBatcher } from '../data/batcher.js';
import { type Dataset, loadDataset } from '../data/index.js';
import { initParams } from '../model/init.js';
import { buildModel, type Model, modelParamCount } from '../model/model.js';
import { createStrategy } from '../strategies/index.js';
import { formatSize } from '../util/size.js';
import { median } from '../util/stats.js';
import { benchServerUpdateRate, type ServerBenchRow } from './param-server.js';
import { markdownTable, reportBenchResults } from './report.js';

export interface L2LBenchOptions {
  /** Blocks per model of the depth sweep (a charlm has layers + 2 blocks). */
  blocks: number[];
  dModel: number;
  context: number;
  batchSize: number;
  /** l2l micro-batches in the depth sweep. */
  microBatches: number;
  /** Device budget of the "largest model" comparison, bytes. */
  budget: number;
  /** Measured steps per run (after one warm-up step). */
  steps: number;
  backend: string;
  out: string;
  /** Skip the charlm-small throughput rows (slow). */
  quick?: boolean;
}

interface Row {
  model: string;
  blocks: number;
  params: number;
  strategy: string;
  micro_batches: number;
  stash: string;
  tokens_per_s: number | null;
  peak_device_bytes: number | null;
  /** Fraction of the step the device waited for the parameter server (l2l). */
  wait_fraction: number | null;
  error?: string;
}

/** The sweep's guard for single: below the wasm heap's 4 GiB, so a model too deep for it stops cleanly. */
const SINGLE_GUARD = 3.5 * 2 ** 30;

/** What every run of the bench shares. */
interface L2LRun {
  o: L2LBenchOptions;
  ds: Dataset;
  log: (s: string) => void;
}

/** The deepest sweep model each strategy trains within the budget (nulls: none). */
interface LargestRow {
  strategy: string;
  blocks: number | null;
  params: number | null;
  peak_device_bytes: number | null;
}

/** Runs the benchmark and writes l2l.json and l2l.md. */
export async function benchL2L(
  o: L2LBenchOptions,
  log: (s: string) => void,
): Promise<void> {
  const run: L2LRun = { o, ds: await loadDataset('moby-dick'), log };
  const sweep = await depthSweep(run);
  const headline = o.quick ? [] : await headlineRuns(run);
  const server = await serverRate(log);
  const largestRows = largestUnderBudget(sweep, o.budget);
  await reportBenchResults(
    o.out,
    'l2l',
    { bench: 'l2l', options: o, sweep, largest: largestRows, headline, server },
    await l2lMarkdown(o, { sweep, largestRows, headline, server }),
    log,
  );
}

/**
 * Trains `cfg` on `model`: one warm-up step, then `o.steps` timed steps; the row holds tokens/s
 * of the median step, the peak device bytes and (l2l) the mean fraction of the step the device
 * waited for the parameter server, or the error a step threw (its "stage N: " prefix cut).
 * Logs the row. Closes the strategy; rejects only if it cannot be created or closed.
 */
async function measure(
  run: L2LRun,
  label: string,
  model: Model,
  cfg: TrainConfig,
): Promise<Row> {
  const { o, ds, log } = run;
  const params = initParams(model.blocks, cfg.seed);
  const context = model.config.arch === 'charlm' ? model.config.context : 1;
  const row = emptyRow(label, model, cfg);
  const s = await createStrategy(cfg, model, params);
  try {
    const batcher = makeBatcher(ds, {
      batchSize: cfg.batchSize,
      context,
      seed: 1,
    });
    await s.trainStep(batcher.next(), 1e-4); // warm-up
    const times: number[] = [];
    let peak = 0;
    let wait = 0;
    for (let i = 0; i < o.steps; i++) {
      const t0 = performance.now();
      const r = await s.trainStep(batcher.next(), 1e-4);
      times.push((performance.now() - t0) / 1000);
      peak = Math.max(peak, r.peakBytes[0]);
      wait += r.bubble[0] / o.steps;
    }
    row.tokens_per_s = (cfg.batchSize * context) / median(times);
    row.peak_device_bytes = peak;
    row.wait_fraction = cfg.strategy === 'l2l' ? wait : null;
  } catch (e) {
    row.error = (e as Error).message.replace(/^stage \d+: /, '');
  } finally {
    await s.close();
  }
  log(
    `${label} ${row.strategy}${row.strategy === 'l2l' ? ` M=${row.micro_batches} stash ${row.stash}` : ''}: ` +
      (row.error
        ? row.error
        : `${row.tokens_per_s!.toFixed(0)} tokens/s, peak ${formatSize(row.peak_device_bytes!)}`),
  );
  return row;
}

/** A row naming the model and configuration, its figures not measured yet. */
function emptyRow(label: string, model: Model, cfg: TrainConfig): Row {
  return {
    model: label,
    blocks: model.blocks.length,
    params: modelParamCount(model),
    strategy: cfg.strategy,
    micro_batches: cfg.microBatches,
    stash: cfg.strategy === 'l2l' ? cfg.stash : '-',
    tokens_per_s: null,
    peak_device_bytes: null,
    wait_fraction: null,
  };
}

/**
 * For each depth of `o.blocks`: single (with the runtime guard at {@link SINGLE_GUARD}), then
 * l2l with the host stash, on a charlm of `o.dModel` and `o.context`; two rows per depth.
 */
async function depthSweep(run: L2LRun): Promise<Row[]> {
  const { o } = run;
  const sweep: Row[] = [];
  for (const blocks of o.blocks) {
    const base = resolveConfig({
      preset: 'charlm-small',
      layers: blocks - 2,
      dModel: o.dModel,
      context: o.context,
      batchSize: o.batchSize,
      backend: o.backend,
      heads: 4,
      clipNorm: 1,
    });
    const model = buildModel(modelConfigFor(base, run.ds));
    const label = `charlm d${o.dModel} x${blocks - 2}`;
    // single stops at once (the runtime guard) when it needs more than 3.5 GiB, rather than
    // aborting in the wasm heap's 4 GiB limit
    sweep.push(
      await measure(
        run,
        label,
        model,
        resolveConfig({
          ...base,
          balance: undefined,
          strategy: 'single',
          deviceMemory: SINGLE_GUARD,
        }),
      ),
    );
    sweep.push(
      await measure(
        run,
        label,
        model,
        resolveConfig({
          ...base,
          balance: undefined,
          strategy: 'l2l',
          microBatches: o.microBatches,
          stash: 'host',
        }),
      ),
    );
  }
  return sweep;
}

/**
 * charlm-small at mini-batch 32: single, l2l M=1 with the stash in host and in device memory,
 * l2l M=4 (host stash), and single again; one row each, in that order.
 */
async function headlineRuns(run: L2LRun): Promise<Row[]> {
  const base = resolveConfig({
    preset: 'charlm-small',
    batchSize: 32,
    backend: run.o.backend,
  });
  const model = buildModel(modelConfigFor(base, run.ds));
  const one = (over: Partial<TrainConfig>) =>
    measure(
      run,
      'charlm-small',
      model,
      resolveConfig({ ...base, balance: undefined, ...over }),
    );
  const headline: Row[] = [];
  headline.push(await one({ strategy: 'single' }));
  for (const stash of ['host', 'device'] as const)
    headline.push(await one({ strategy: 'l2l', microBatches: 1, stash }));
  headline.push(await one({ strategy: 'l2l', microBatches: 4, stash: 'host' }));
  headline.push(await one({ strategy: 'single' }));
  return headline;
}

/** The parameter server's update rate beside TF.js's ({@link benchServerUpdateRate}); logs each row. */
async function serverRate(log: (s: string) => void): Promise<ServerBenchRow[]> {
  log('parameter server update rate ...');
  const server = await benchServerUpdateRate();
  for (const e of server)
    log(
      `${e.optimizer}${e.threads ? ` (${e.threads} thread${e.threads > 1 ? 's' : ''})` : ''}: ${(e.paramsPerSecond / 1e6).toFixed(0)} M params/s`,
    );
  return server;
}

/** For single and l2l: the sweep row with the most parameters that ran and peaked within `budget` bytes. */
function largestUnderBudget(sweep: Row[], budget: number): LargestRow[] {
  const fits = (r: Row) =>
    !r.error && r.peak_device_bytes !== null && r.peak_device_bytes <= budget;
  const largest = (strategy: string) => {
    const ok = sweep.filter((r) => r.strategy === strategy && fits(r));
    return ok.length
      ? ok.reduce((a, b) => (b.params > a.params ? b : a))
      : null;
  };
  return ['single', 'l2l'].map((st) => {
    const r = largest(st);
    return {
      strategy: st,
      blocks: r?.blocks ?? null,
      params: r?.params ?? null,
      peak_device_bytes: r?.peak_device_bytes ?? null,
    };
  });
}

/** Bytes as MiB with one decimal; '-' for null. */
function mib(b: number | null): string {
  return b === null ? '-' : (b / 2 ** 20).toFixed(1);
}

/** A row's tokens/s as an integer; '-' when not measured. */
function tps(r: Row): string {
  return r.tokens_per_s === null ? '-' : r.tokens_per_s.toFixed(0);
}

/** A row's wait for the parameter server as a percentage; '' where there is none (single). */
function waitCell(r: Row): string {
  return r.wait_fraction === null
    ? ''
    : `${(100 * r.wait_fraction).toFixed(1)}%`;
}

/** l2l.md: the setting, then the depth sweep, the largest models, the headline and the server tables. */
async function l2lMarkdown(
  o: L2LBenchOptions,
  results: {
    sweep: Row[];
    largestRows: LargestRow[];
    headline: Row[];
    server: ServerBenchRow[];
  },
): Promise<string> {
  const { sweep, largestRows, headline, server } = results;
  return [
    `# l2l benchmark\n`,
    `Backend ${o.backend}, median of ${o.steps} measured steps after one warm-up step, on this machine (${(await import('node:os')).cpus().length} cores).\n`,
    `## Peak device memory and throughput against depth\n`,
    `Character Transformers of width ${o.dModel}, context ${o.context}, mini-batch ${o.batchSize}; l2l with ${o.microBatches} micro-batches and the stash in host memory. Single runs with a guard at ${formatSize(SINGLE_GUARD)} (below the wasm heap's 4 GiB) and stops at once when it needs more.\n`,
    sweepTable(sweep),
    `## Largest model under a ${formatSize(o.budget)} device budget (of the sweep, by measured peak)\n`,
    markdownTable({
      columns: ['strategy', 'blocks', 'parameters', 'peak device MiB'],
      rows: largestRows.map((r) => [
        r.strategy,
        r.blocks ?? 'none',
        r.params?.toLocaleString('en-US') ?? '-',
        mib(r.peak_device_bytes),
      ]),
    }),
    ...headlineSection(headline),
    `## Parameter server AdamW update rate\n`,
    markdownTable({
      columns: ['optimizer', 'threads', 'M parameters/s'],
      rows: server.map((e) => [
        e.optimizer,
        e.threads ?? '-',
        (e.paramsPerSecond / 1e6).toFixed(0),
      ]),
    }),
  ].join('\n');
}

/** The depth sweep's table: one row per (depth, strategy); l2l's throughput against single's at that depth. */
function sweepTable(sweep: Row[]): string {
  const vsSingle = (r: Row, single?: Row) =>
    r.tokens_per_s !== null && single?.tokens_per_s
      ? `${(r.tokens_per_s / single.tokens_per_s).toFixed(2)}x`
      : '-';
  return markdownTable({
    columns: [
      'model',
      'blocks',
      'parameters',
      'strategy',
      'tokens/s',
      'l2l vs single',
      'peak device MiB',
      'device waiting for the PS',
    ],
    rows: sweep.map((r) => [
      r.model,
      r.blocks,
      r.params.toLocaleString('en-US'),
      r.strategy,
      r.error ? `stopped: ${r.error}` : tps(r),
      r.strategy === 'l2l'
        ? vsSingle(
            r,
            sweep.find((s) => s.strategy === 'single' && s.blocks === r.blocks),
          )
        : '',
      mib(r.peak_device_bytes),
      waitCell(r),
    ]),
  });
}

/**
 * The charlm-small section (none when `headline` is empty): its heading, the mean of single's
 * runs (tokens/s; NaN when none measured), and one table row per run against that mean.
 */
function headlineSection(headline: Row[]): string[] {
  if (!headline.length) return [];
  const singleRef = headline
    .filter((r) => r.strategy === 'single' && r.tokens_per_s !== null)
    .map((r) => r.tokens_per_s!);
  const ref = singleRef.length
    ? singleRef.reduce((a, b) => a + b, 0) / singleRef.length
    : NaN;
  return [
    `## Throughput where the model fits: charlm-small, mini-batch 32\n`,
    `Single runs first and last; l2l's ratio is against their mean (${ref.toFixed(0)} tokens/s).\n`,
    markdownTable({
      columns: [
        'strategy',
        'M',
        'stash',
        'tokens/s',
        'vs single',
        'peak device MiB',
        'device waiting for the PS',
      ],
      rows: headline.map((r) => [
        r.strategy,
        r.micro_batches,
        r.stash,
        tps(r),
        r.tokens_per_s ? `${(r.tokens_per_s / ref).toFixed(2)}x` : '-',
        mib(r.peak_device_bytes),
        waitCell(r),
      ]),
    }),
  ];
}
