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
import type { Dataset } from '../data/index.js';
import { loadDataset } from '../data/index.js';
import { initParams } from '../model/init.js';
import { buildModel, type Model, modelParamCount } from '../model/model.js';
import { createStrategy } from '../strategies/index.js';
import { formatSize } from '../util/size.js';
import { median } from '../util/stats.js';
import { benchServerUpdateRate } from './param-server.js';
import { markdownTable, writeBenchResults } from './report.js';

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

/** Runs the benchmark and writes l2l.json and l2l.md. */
export async function benchL2L(
  o: L2LBenchOptions,
  log: (s: string) => void,
): Promise<void> {
  const ds = await loadDataset('moby-dick');

  async function measure(
    label: string,
    model: Model,
    cfg: TrainConfig,
  ): Promise<Row> {
    const params = initParams(model.blocks, cfg.seed);
    const context = model.config.arch === 'charlm' ? model.config.context : 1;
    const row: Row = {
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
    const model = buildModel(modelConfigFor(base, ds as Dataset));
    const label = `charlm d${o.dModel} x${blocks - 2}`;
    // single stops at once (the runtime guard) when it needs more than 3.5 GiB, rather than
    // aborting in the wasm heap's 4 GiB limit
    sweep.push(
      await measure(
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

  const headline: Row[] = [];
  if (!o.quick) {
    const base = resolveConfig({
      preset: 'charlm-small',
      batchSize: 32,
      backend: o.backend,
    });
    const model = buildModel(modelConfigFor(base, ds as Dataset));
    headline.push(
      await measure(
        'charlm-small',
        model,
        resolveConfig({ ...base, balance: undefined, strategy: 'single' }),
      ),
    );
    for (const stash of ['host', 'device'] as const) {
      headline.push(
        await measure(
          'charlm-small',
          model,
          resolveConfig({
            ...base,
            balance: undefined,
            strategy: 'l2l',
            microBatches: 1,
            stash,
          }),
        ),
      );
    }
    headline.push(
      await measure(
        'charlm-small',
        model,
        resolveConfig({
          ...base,
          balance: undefined,
          strategy: 'l2l',
          microBatches: 4,
          stash: 'host',
        }),
      ),
    );
    headline.push(
      await measure(
        'charlm-small',
        model,
        resolveConfig({ ...base, balance: undefined, strategy: 'single' }),
      ),
    );
  }

  log('parameter server update rate ...');
  const server = await benchServerUpdateRate();
  for (const e of server)
    log(
      `${e.optimizer}${e.threads ? ` (${e.threads} thread${e.threads > 1 ? 's' : ''})` : ''}: ${(e.paramsPerSecond / 1e6).toFixed(0)} M params/s`,
    );

  const fits = (r: Row) =>
    !r.error && r.peak_device_bytes !== null && r.peak_device_bytes <= o.budget;
  const largest = (strategy: string) => {
    const ok = sweep.filter((r) => r.strategy === strategy && fits(r));
    return ok.length
      ? ok.reduce((a, b) => (b.params > a.params ? b : a))
      : null;
  };
  const largestRows = ['single', 'l2l'].map((st) => {
    const r = largest(st);
    return {
      strategy: st,
      blocks: r?.blocks ?? null,
      params: r?.params ?? null,
      peak_device_bytes: r?.peak_device_bytes ?? null,
    };
  });
  const singleRef = headline
    .filter((r) => r.strategy === 'single' && r.tokens_per_s !== null)
    .map((r) => r.tokens_per_s!);
  const ref = singleRef.length
    ? singleRef.reduce((a, b) => a + b, 0) / singleRef.length
    : NaN;
  const mib = (b: number | null) =>
    b === null ? '-' : (b / 2 ** 20).toFixed(1);
  const tps = (r: Row) =>
    r.tokens_per_s === null ? '-' : r.tokens_per_s.toFixed(0);
  const vsSingle = (r: Row, single?: Row) =>
    r.tokens_per_s !== null && single?.tokens_per_s
      ? `${(r.tokens_per_s / single.tokens_per_s).toFixed(2)}x`
      : '-';
  const md = [
    `# l2l benchmark\n`,
    `Backend ${o.backend}, median of ${o.steps} measured steps after one warm-up step, on this machine (${(await import('node:os')).cpus().length} cores).\n`,
    `## Peak device memory and throughput against depth\n`,
    `Character Transformers of width ${o.dModel}, context ${o.context}, mini-batch ${o.batchSize}; l2l with ${o.microBatches} micro-batches and the stash in host memory. Single runs with a guard at ${formatSize(SINGLE_GUARD)} (below the wasm heap's 4 GiB) and stops at once when it needs more.\n`,
    markdownTable({
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
              sweep.find(
                (s) => s.strategy === 'single' && s.blocks === r.blocks,
              ),
            )
          : '',
        mib(r.peak_device_bytes),
        r.wait_fraction === null
          ? ''
          : `${(100 * r.wait_fraction).toFixed(1)}%`,
      ]),
    }),
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
    ...(headline.length
      ? [
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
              r.wait_fraction === null
                ? ''
                : `${(100 * r.wait_fraction).toFixed(1)}%`,
            ]),
          }),
        ]
      : []),
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
  const files = await writeBenchResults(
    o.out,
    'l2l',
    { bench: 'l2l', options: o, sweep, largest: largestRows, headline, server },
    md,
  );
  log(`wrote ${files.join(', ')}`);
}
