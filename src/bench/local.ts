/**
 * `npm run bench -- local`: validation loss against wall-clock time for single, gpipe (K = 2)
 * and local parallelism (K = 2, greedy and overlap 1) on the same model, data and time budget,
 * and the throughput of each against single and against gpipe. On a shared machine one run of
 * each is noise, so the runs go in `rounds` rounds, each round in a rotated order (a slow spell
 * falls on different strategies), and each strategy's figure is the median over rounds; the
 * ratios are given both as median/median and as the median of the per-round ratios (A/B taken
 * minutes apart at most). Process CPU seconds per 1000 tokens (all threads) are given beside:
 * they measure the work, which contention changes less than the wall clock. Writes local.json,
 * local.md and local.svg (a line plot of the first round, drawn with Vega-Lite).
 */

import { join } from 'node:path';
import * as vega from 'vega';
import { compile, type TopLevelSpec } from 'vega-lite';
import { resolveConfig, type TrainConfig } from '../config/config.js';
import { type Batch, makeBatcher, validationBatches } from '../data/batcher.js';
import { modelParamCount } from '../model/model.js';
import { learningRate } from '../optim/lr.js';
import { createStrategy } from '../strategies/index.js';
import type { Strategy } from '../strategies/strategy.js';
import { writeFileAtomic } from '../util/fsx.js';
import {
  type BenchModel,
  inRotatedRounds,
  loadBenchModel,
  markdownTable,
  writeBenchResults,
} from './report.js';

export interface LocalBenchOptions {
  preset: string;
  batchSize: number;
  /** Training seconds per strategy and round (evaluation time is not counted). */
  seconds: number;
  /** Rounds: every strategy runs once per round, in an order rotated by one each round. */
  rounds: number;
  /** Evaluate every this many training seconds. */
  evalSeconds: number;
  evalBatches: number;
  /** Micro-batches for gpipe. */
  gpipeMicroBatches: number;
  /** Micro-batches (local updates per mini-batch) for local. */
  localMicroBatches: number;
  lr: number;
  backend: string;
  out: string;
}

/** One strategy's run in one round. */
interface Run {
  round: number;
  steps: number;
  /** Steady-state training throughput (no warm-up step, no evaluation), tokens per second. */
  tokens_per_s: number;
  /** Process CPU seconds (user + system, every thread) per 1000 steady-state tokens. */
  cpu_s_per_ktoken: number;
  final_val_loss: number;
  /** (training seconds, validation loss) points. */
  points: Array<{ t: number; val_loss: number }>;
}

/** A strategy over all rounds: its runs and their medians. */
interface Curve {
  name: string;
  runs: Run[];
  /** Median over rounds of tokens/s. */
  tokens_per_s: number;
  /** Median tokens/s over single's median. */
  speedup: number;
  /** Median over rounds of (this round's tokens/s / single's in the same round). */
  speedup_paired: number;
  /** Median tokens/s over gpipe's median (null for single and gpipe). */
  vs_gpipe: number | null;
  /** Median over rounds of (tokens/s / gpipe's in the same round). */
  vs_gpipe_paired: number | null;
  cpu_s_per_ktoken: number;
  /** Median over rounds of the final validation loss (the same seed every round). */
  final_val_loss: number;
  best_val_loss: number;
  /** The first round's (training seconds, validation loss) points. */
  points: Array<{ t: number; val_loss: number }>;
}

/** Median of a non-empty list (mean of the middle two for an even length). */
export function median(xs: readonly number[]): number {
  if (!xs.length) throw new Error('median of an empty list');
  const s = [...xs].sort((a, b) => a - b);
  const h = s.length >> 1;
  return s.length % 2 ? s[h]! : (s[h - 1]! + s[h]!) / 2;
}

/** One strategy of the comparison: its name in the results and its flags over the base config. */
interface Contender {
  name: string;
  cfg: Partial<TrainConfig>;
}

/** What every run of the bench shares. */
interface LocalRun {
  o: LocalBenchOptions;
  base: TrainConfig;
  bench: BenchModel;
  /** The validation batches every evaluation uses. */
  val: Batch[];
  log: (s: string) => void;
}

/** Where a run's training stood when its time was up. */
interface Trained {
  points: Run['points'];
  /** Training seconds (evaluations excluded). */
  t: number;
  steps: number;
  /** Tokens, seconds and process CPU milliseconds of the steady-state steps (all but the first). */
  tokens: number;
  steadySeconds: number;
  steadyCpuMs: number;
}

/**
 * Runs the benchmark and writes its files. Throws if `o.rounds` is not a positive integer
 * (after loading the data and building the model).
 */
export async function benchLocal(
  o: LocalBenchOptions,
  log: (s: string) => void,
): Promise<void> {
  const base = resolveConfig({
    preset: o.preset,
    batchSize: o.batchSize,
    backend: o.backend,
    lr: o.lr,
  });
  const bench = await loadBenchModel(base);
  const val = validationBatches(bench.ds, {
    batchSize: o.batchSize,
    context: bench.context,
    maxBatches: o.evalBatches,
  });
  const runs = contenders(o);
  if (!Number.isInteger(o.rounds) || o.rounds < 1)
    throw new Error(`--rounds must be a positive integer, got ${o.rounds}`);
  const run: LocalRun = { o, base, bench, val, log };
  const byRun = await inRotatedRounds(runs.length, o.rounds, (i, round) =>
    runOnce(run, runs[i]!, round),
  );
  const curves = localCurves(runs, byRun, o.rounds);
  for (const c of curves) log(curveLine(c));
  await writeFileAtomic(
    join(o.out, 'local.svg'),
    await plotSvg(lossPlotSpec(o, base, curves)),
  );
  const md = await localMarkdown(o, run, curves);
  const files = await writeBenchResults(
    o.out,
    'local',
    {
      bench: 'local',
      options: o,
      params: modelParamCount(bench.model),
      curves,
    },
    md,
  );
  log(`wrote ${[...files, join(o.out, 'local.svg')].join(', ')}`);
}

/** single, gpipe K=2 (`o.gpipeMicroBatches`, checkpoint except_last), local K=2 greedy and with overlap 1. */
function contenders(o: LocalBenchOptions): Contender[] {
  return [
    { name: 'single', cfg: { strategy: 'single' } },
    {
      name: `gpipe K=2 M=${o.gpipeMicroBatches}`,
      cfg: {
        strategy: 'gpipe',
        stages: 2,
        microBatches: o.gpipeMicroBatches,
        remat: 'except_last',
      },
    },
    {
      name: `local K=2 greedy M=${o.localMicroBatches}`,
      cfg: { strategy: 'local', stages: 2, microBatches: o.localMicroBatches },
    },
    {
      name: `local K=2 overlap 1 M=${o.localMicroBatches}`,
      cfg: {
        strategy: 'local',
        stages: 2,
        microBatches: o.localMicroBatches,
        overlap: 1,
      },
    },
  ];
}

/** One training run of `r` for `o.seconds` from the same initial parameters and data order; logs its figures. */
async function runOnce(
  run: LocalRun,
  r: Contender,
  round: number,
): Promise<Run> {
  const { o } = run;
  const cfg = resolveConfig({
    ...run.base,
    balance: undefined,
    ...r.cfg,
    steps: 1_000_000,
  });
  const s = await createStrategy(cfg, run.bench.model, run.bench.params);
  let tr: Trained;
  try {
    tr = await trainFor(run, s, cfg.seed);
  } finally {
    await s.close();
  }
  const { points, steps } = tr;
  const result: Run = {
    round,
    steps,
    tokens_per_s: tr.tokens / tr.steadySeconds,
    cpu_s_per_ktoken: tr.steadyCpuMs / tr.tokens,
    final_val_loss: points[points.length - 1]!.val_loss,
    points,
  };
  run.log(
    `round ${round + 1}/${o.rounds} ${r.name}: ${steps} steps, ${result.tokens_per_s.toFixed(0)} tokens/s, ${result.cpu_s_per_ktoken.toFixed(3)} CPU s/1k tokens, val loss ${result.final_val_loss.toFixed(4)} after ${tr.t.toFixed(0)} s`,
  );
  return result;
}

/**
 * Trains `s` on batches from `seed` until `o.seconds` of training time have passed, evaluating
 * at the start, every `o.evalSeconds` and at the end. Training time is the wall clock minus
 * evaluations; steps are submitted as the strategy accepts them (local parallelism lets the
 * first stage run ahead), as the trainer does, with at most one in flight per device.
 */
async function trainFor(
  run: LocalRun,
  s: Strategy,
  seed: number,
): Promise<Trained> {
  const { o } = run;
  const tr: Trained = {
    points: [],
    t: 0,
    steps: 0,
    tokens: 0,
    steadySeconds: 0,
    steadyCpuMs: 0,
  };
  const batcher = makeBatcher(run.bench.ds, {
    batchSize: o.batchSize,
    context: run.bench.context,
    seed,
  });
  tr.points.push({ t: 0, val_loss: (await s.evaluate(run.val)).loss });
  let nextEval = o.evalSeconds;
  const inFlight: Array<Promise<unknown>> = [];
  let clock = performance.now();
  let cpu = process.cpuUsage();
  while (tr.t < o.seconds) {
    const b = batcher.next();
    const sub = s.submit(b, warmupLr(o.lr, tr.steps));
    inFlight.push(sub.done);
    await sub.accepted;
    while (inFlight.length > s.devices) await inFlight.shift();
    const dt = (performance.now() - clock) / 1000;
    const c = process.cpuUsage(cpu);
    tr.steps++;
    tr.t += dt;
    clock = performance.now();
    cpu = process.cpuUsage();
    if (tr.steps > 1) {
      // throughput: steady state (no warm-up step, no waits for evaluation)
      tr.tokens += b.tokens;
      tr.steadySeconds += dt;
      tr.steadyCpuMs += (c.user + c.system) / 1000;
    }
    if (tr.t >= nextEval || tr.t >= o.seconds) {
      await Promise.all(inFlight.splice(0));
      tr.t += (performance.now() - clock) / 1000;
      tr.points.push({ t: tr.t, val_loss: (await s.evaluate(run.val)).loss });
      clock = performance.now();
      cpu = process.cpuUsage();
      nextEval += o.evalSeconds;
    }
  }
  return tr;
}

/** The learning rate of step `step` (0-based): a linear warm-up over 10 steps to `lr`, then constant. */
function warmupLr(lr: number, step: number): number {
  return learningRate(step, {
    lr,
    warmup: 10,
    decay: 'constant',
    totalSteps: 1,
    minRatio: 1,
  });
}

/**
 * Each contender's curve from its runs (`byRun[i]`, one per round): medians over the rounds, the
 * ratios against single (index 0) and, for local (index 2 on), against gpipe (index 1), both
 * median/median and the median of each round's ratio.
 */
function localCurves(
  runs: Contender[],
  byRun: Run[][],
  roundCount: number,
): Curve[] {
  const tps = (i: number, round: number) =>
    byRun[i]!.find((x) => x.round === round)!.tokens_per_s;
  const rounds = Array.from({ length: roundCount }, (_, r) => r);
  const medTps = byRun.map((rs) => median(rs.map((x) => x.tokens_per_s)));
  return runs.map((r, i) => {
    const rs = [...byRun[i]!].sort((a, b) => a.round - b.round);
    const againstGpipe = i >= 2;
    return {
      name: r.name,
      runs: rs,
      tokens_per_s: medTps[i]!,
      speedup: medTps[i]! / medTps[0]!,
      speedup_paired: median(rounds.map((k) => tps(i, k) / tps(0, k))),
      vs_gpipe: againstGpipe ? medTps[i]! / medTps[1]! : null,
      vs_gpipe_paired: againstGpipe
        ? median(rounds.map((k) => tps(i, k) / tps(1, k)))
        : null,
      cpu_s_per_ktoken: median(rs.map((x) => x.cpu_s_per_ktoken)),
      final_val_loss: median(rs.map((x) => x.final_val_loss)),
      best_val_loss: Math.min(
        ...rs.flatMap((x) => x.points.map((p) => p.val_loss)),
      ),
      points: rs[0]!.points,
    };
  });
}

/** A curve's log line: its median tokens/s and ratios against single (and gpipe). */
function curveLine(c: Curve): string {
  return (
    `${c.name}: median ${c.tokens_per_s.toFixed(0)} tokens/s, ${c.speedup.toFixed(2)}x single (paired ${c.speedup_paired.toFixed(2)}x)` +
    (c.vs_gpipe === null
      ? ''
      : `, ${c.vs_gpipe.toFixed(2)}x gpipe (paired ${c.vs_gpipe_paired!.toFixed(2)}x)`)
  );
}

/** The Vega-Lite line plot of the first round: validation loss against training seconds, a line per strategy. */
function lossPlotSpec(
  o: LocalBenchOptions,
  base: TrainConfig,
  curves: Curve[],
): TopLevelSpec {
  return {
    $schema: 'https://vega.github.io/schema/vega-lite/v5.json',
    title: `${o.preset} on ${base.data}: validation loss vs training time (${o.backend}, ${o.seconds} s each)`,
    width: 640,
    height: 360,
    data: {
      values: curves.flatMap((c) =>
        c.points.map((p) => ({
          strategy: c.name,
          seconds: p.t,
          val_loss: p.val_loss,
        })),
      ),
    },
    mark: { type: 'line', point: true },
    encoding: {
      x: {
        field: 'seconds',
        type: 'quantitative',
        title: 'training wall-clock (s)',
      },
      y: {
        field: 'val_loss',
        type: 'quantitative',
        title: 'validation loss (nats/char)',
        scale: { zero: false },
      },
      color: {
        field: 'strategy',
        type: 'nominal',
        legend: { labelLimit: 400 },
      },
    },
  };
}

/** Renders a Vega-Lite spec to SVG text (no browser: Vega's headless view). */
function plotSvg(spec: TopLevelSpec): Promise<string> {
  const view = new vega.View(vega.parse(compile(spec).spec), {
    renderer: 'none',
  });
  return view.toSVG();
}

/** local.md: the setting, a row per strategy (medians and ratios), and each round's figures. */
async function localMarkdown(
  o: LocalBenchOptions,
  run: LocalRun,
  curves: Curve[],
): Promise<string> {
  const x = (v: number | null) => (v === null ? '-' : `${v.toFixed(2)}x`);
  return [
    `# local parallelism benchmark\n`,
    `Model ${o.preset} (${modelParamCount(run.bench.model).toLocaleString('en-US')} parameters) on ${run.base.data}, mini-batch ${o.batchSize}, lr ${o.lr}, backend ${o.backend}, ${o.seconds} s of training each (evaluation excluded), ${o.rounds} round(s) in rotated order, on this machine (${(await import('node:os')).cpus().length} cores; shared machines make single runs noisy). Figures are medians over rounds; "paired" ratios are the median of each round's ratio. Plot (first round): local.svg.\n`,
    markdownTable({
      columns: [
        'strategy',
        'tokens/s (median)',
        'vs single',
        'vs single (paired)',
        'vs gpipe',
        'vs gpipe (paired)',
        'CPU s / 1k tokens',
        `val loss at ${o.seconds} s (median)`,
        'best val loss',
      ],
      rows: curves.map((c) => [
        c.name,
        c.tokens_per_s.toFixed(0),
        x(c.speedup),
        x(c.speedup_paired),
        x(c.vs_gpipe),
        x(c.vs_gpipe_paired),
        c.cpu_s_per_ktoken.toFixed(3),
        c.final_val_loss.toFixed(4),
        c.best_val_loss.toFixed(4),
      ]),
    }),
    `\nEach round (tokens/s, steps, final val loss):\n`,
    markdownTable({
      columns: ['round', ...curves.map((c) => c.name)],
      rows: Array.from({ length: o.rounds }, (_, r) => [
        r + 1,
        ...curves.map((c) => {
          const u = c.runs.find((x) => x.round === r)!;
          return `${u.tokens_per_s.toFixed(0)} (${u.steps}, ${u.final_val_loss.toFixed(4)})`;
        }),
      ]),
    }),
  ].join('\n');
}
