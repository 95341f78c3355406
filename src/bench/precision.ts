/**
 * `npm run bench -- precision`: fp32 against bf16 mixed precision on the native backend, in one
 * run: training tokens/s of single (one device) and gpipe (K stages, M micro-batches) at each
 * precision, on the same model, parameters and batches. The four strategies run side by side
 * and take turns step by step (median step time of each), so a contended machine slows them
 * alike. The bars (issue 23): bf16 at least 1.5x fp32 on single and 1.4x on gpipe K=2. With
 * `--convergence <steps>` it also trains charlm-tiny on Moby-Dick for that many steps at each
 * precision from the same seed and compares the validation losses (bar: bf16 within 2% of
 * fp32). Writes bench/results/precision.{json,md}, naming the CPU's ISA.
 */
import { mkdtempSync, rmSync } from 'node:fs';
import { tmpdir } from 'node:os';
import { join } from 'node:path';
import { bf16Support, type Precision } from '../backend/names.js';
import { resolveConfig, type TrainConfig } from '../config/config.js';
import { makeBatcher } from '../data/batcher.js';
import { type Model, modelParamCount } from '../model/model.js';
import { createStrategy } from '../strategies/index.js';
import type { Strategy } from '../strategies/strategy.js';
import { check } from '../util/errors.js';
import { median } from '../util/stats.js';
import {
  type BenchModel,
  loadBenchModel,
  markdownTable,
  reportBenchResults,
} from './report.js';

export interface PrecisionBenchOptions {
  preset: string;
  batchSize: number;
  /** Measured steps per configuration (after one warm-up step each). */
  steps: number;
  stages: number;
  microBatches: number;
  /** charlm-tiny training steps per precision for the convergence comparison (0: skip). */
  convergence: number;
  out: string;
}

interface Row {
  strategy: string;
  precision: Precision;
  tokens_per_s: number;
  step_s: number;
  peak_device_bytes: number[];
}

/** One strategy at one precision, created up front; they take turns step by step. */
interface PrecisionRun {
  name: string;
  precision: Precision;
  s: Strategy;
}

/** bf16's speed-up over fp32 for one strategy, beside its bar. */
interface Bar {
  strategy: string;
  bar: number;
  speedup: number;
}

/** The convergence comparison's final validation losses and bf16's relative difference. */
type Convergence = Awaited<ReturnType<typeof convergenceRun>>;

/**
 * Runs the benchmark and writes precision.json and precision.md. Throws (check) without the
 * native backend. Closes every strategy it created, also when one fails.
 */
export async function benchPrecision(
  o: PrecisionBenchOptions,
  log: (s: string) => void,
): Promise<void> {
  const support = bf16Support();
  check(
    support.available,
    `bench precision needs the native backend: ${support.note}`,
  );
  log(support.note);
  const base = resolveConfig({
    preset: o.preset,
    batchSize: o.batchSize,
    backend: 'native',
    steps: o.steps + 1,
  });
  const bench = await loadBenchModel(base);
  const gpipeName = `gpipe K=${o.stages} M=${o.microBatches}`;
  const runs: PrecisionRun[] = [];
  try {
    await createRuns(runs, o, base, bench, gpipeName);
    const { rows, tokens } = await timeInTurns(o, bench, runs);
    const bars = precisionBars(rows, gpipeName);
    for (const r of rows)
      log(
        `${r.strategy.padEnd(16)} ${r.precision}: ${r.tokens_per_s.toFixed(0)} tokens/s (median step ${(r.step_s * 1000).toFixed(0)} ms)`,
      );
    for (const b of bars)
      log(
        `${b.strategy}: bf16 ${b.speedup.toFixed(2)}x fp32 (bar ${b.bar}x: ${b.speedup >= b.bar ? 'met' : 'NOT met'})`,
      );
    const convergence =
      o.convergence > 0 ? await convergenceRun(o.convergence, log) : undefined;
    const md = precisionMarkdown(o, bench.model, support, {
      rows,
      bars,
      convergence,
    });
    await reportBenchResults(
      o.out,
      'precision',
      {
        bench: 'precision',
        options: o,
        isa: support.isa,
        native_bf16: support.nativeBf16,
        conversion: support.conversion,
        tokens_per_step: tokens,
        rows,
        bars,
        ...(convergence ? { convergence } : {}),
      },
      md,
      log,
    );
  } finally {
    for (const r of runs) await r.s.close();
  }
}

/**
 * Creates, for fp32 and then bf16, single and gpipe (`o.stages` stages, `o.microBatches`
 * micro-batches) on the same model and parameters, pushing each onto `runs` as it is created
 * (so the caller closes those made before a failure).
 */
async function createRuns(
  runs: PrecisionRun[],
  o: PrecisionBenchOptions,
  base: TrainConfig,
  bench: BenchModel,
  gpipeName: string,
): Promise<void> {
  for (const precision of ['fp32', 'bf16'] as const) {
    runs.push({
      name: 'single',
      precision,
      s: await createStrategy(
        resolveConfig({ ...base, balance: undefined, precision }),
        bench.model,
        bench.params,
      ),
    });
    runs.push({
      name: gpipeName,
      precision,
      s: await createStrategy(
        resolveConfig({
          ...base,
          balance: undefined,
          precision,
          strategy: 'gpipe',
          stages: o.stages,
          microBatches: o.microBatches,
        }),
        bench.model,
        bench.params,
      ),
    });
  }
}

/**
 * One warm-up step of every run on one batch (primitives, buffers, bf16 weights), then
 * `o.steps` batches, each trained by every run in turn. Returns a row per run (median step
 * seconds, tokens/s, peak device bytes per stage) and the tokens of one step.
 */
async function timeInTurns(
  o: PrecisionBenchOptions,
  bench: BenchModel,
  runs: PrecisionRun[],
): Promise<{ rows: Row[]; tokens: number }> {
  const batcher = makeBatcher(bench.ds, {
    batchSize: o.batchSize,
    context: bench.context,
    seed: 1,
  });
  const warm = batcher.next();
  for (const r of runs) await r.s.trainStep(warm, 1e-4);
  const times = runs.map(() => [] as number[]);
  const peaks = runs.map((r) => new Array<number>(r.s.devices).fill(0));
  let tokens = 0;
  for (let i = 0; i < o.steps; i++) {
    const b = batcher.next();
    tokens = b.tokens;
    for (const [j, r] of runs.entries()) {
      const t0 = performance.now();
      const res = await r.s.trainStep(b, 1e-4);
      times[j]!.push((performance.now() - t0) / 1000);
      res.peakBytes.forEach(
        (x, k) => (peaks[j]![k] = Math.max(peaks[j]![k]!, x)),
      );
    }
  }
  const rows: Row[] = runs.map((r, j) => ({
    strategy: r.name,
    precision: r.precision,
    step_s: median(times[j]!),
    tokens_per_s: tokens / median(times[j]!),
    peak_device_bytes: peaks[j]!,
  }));
  return { rows, tokens };
}

/** bf16's tokens/s over fp32's for single (bar 1.5x) and gpipe (bar 1.4x). */
function precisionBars(rows: Row[], gpipeName: string): Bar[] {
  const speedup = (name: string) => {
    const f = rows.find((r) => r.strategy === name && r.precision === 'fp32')!;
    const b = rows.find((r) => r.strategy === name && r.precision === 'bf16')!;
    return b.tokens_per_s / f.tokens_per_s;
  };
  return [
    { strategy: 'single', bar: 1.5, speedup: speedup('single') },
    { strategy: gpipeName, bar: 1.4, speedup: speedup(gpipeName) },
  ];
}

/** precision.md: the setting, the rows, the bars and (where run) the convergence comparison. */
function precisionMarkdown(
  o: PrecisionBenchOptions,
  model: Model,
  support: ReturnType<typeof bf16Support>,
  results: { rows: Row[]; bars: Bar[]; convergence: Convergence | undefined },
): string {
  const { rows, bars, convergence } = results;
  return [
    '# precision benchmark\n',
    `fp32 against bf16 mixed precision on the native backend, ${o.preset} (${modelParamCount(model).toLocaleString('en-US')} parameters), mini-batch ${o.batchSize}; median of ${o.steps} steps per configuration after one warm-up step, the configurations taking turns step by step in one run. ${support.note}.\n`,
    markdownTable({
      columns: [
        'strategy',
        'precision',
        'tokens/s',
        'step ms',
        'peak device MiB per stage',
      ],
      rows: rows.map((r) => [
        r.strategy,
        r.precision,
        r.tokens_per_s.toFixed(0),
        (r.step_s * 1000).toFixed(0),
        r.peak_device_bytes.map((x) => (x / 2 ** 20).toFixed(1)).join(' / '),
      ]),
    }),
    '',
    markdownTable({
      columns: ['strategy', 'bf16 / fp32 tokens/s', 'bar', 'met'],
      rows: bars.map((b) => [
        b.strategy,
        `${b.speedup.toFixed(2)}x`,
        `${b.bar}x`,
        b.speedup >= b.bar ? 'yes' : 'no',
      ]),
    }),
    ...(convergence
      ? [
          `\nConvergence: charlm-tiny on Moby-Dick, ${o.convergence} steps, seed 1: validation loss fp32 ${convergence.fp32.toFixed(4)}, bf16 ${convergence.bf16.toFixed(4)} (${(100 * convergence.relative).toFixed(2)}% apart; bar 2%: ${Math.abs(convergence.relative) <= 0.02 ? 'met' : 'NOT met'}).\n`,
        ]
      : []),
  ].join('\n');
}

/** charlm-tiny on Moby-Dick for `steps` steps at each precision; the final validation losses. */
async function convergenceRun(
  steps: number,
  log: (s: string) => void,
): Promise<{ fp32: number; bf16: number; relative: number }> {
  const { train } = await import('../train/trainer.js');
  const dir = mkdtempSync(join(tmpdir(), 'layerwise-precision-'));
  try {
    const val: Record<string, number> = {};
    for (const precision of ['fp32', 'bf16'] as const) {
      const r = await train({
        preset: 'charlm-tiny',
        backend: 'native',
        precision,
        steps,
        evalEvery: 0,
        out: join(dir, precision),
      });
      val[precision] = r.summary.val_loss;
      log(
        `convergence ${precision}: validation loss ${r.summary.val_loss.toFixed(4)} after ${steps} steps`,
      );
    }
    return {
      fp32: val.fp32!,
      bf16: val.bf16!,
      relative: (val.bf16! - val.fp32!) / val.fp32!,
    };
  } finally {
    rmSync(dir, { recursive: true, force: true });
  }
}
