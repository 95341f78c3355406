/**
 * `npm run bench -- local`: validation loss against wall-clock time for single, gpipe (K = 2)
 * and local parallelism (K = 2, greedy and overlap 1) on the same model, data and time budget,
 * and the throughput of each against single. Writes local.json, local.md and local.svg (a
 * line plot drawn with Vega-Lite).
 */

import { join } from 'node:path';
import * as vega from 'vega';
import { compile, type TopLevelSpec } from 'vega-lite';
import {
  modelConfigFor,
  resolveConfig,
  type TrainConfig,
} from '../config/config.js';
import { makeBatcher, validationBatches } from '../data/batcher.js';
import { loadDataset } from '../data/index.js';
import { initParams } from '../model/init.js';
import { buildModel, modelParamCount } from '../model/model.js';
import { learningRate } from '../optim/lr.js';
import { createStrategy } from '../strategies/index.js';
import { writeFileAtomic } from '../util/fsx.js';
import { markdownTable, writeBenchResults } from './report.js';

export interface LocalBenchOptions {
  preset: string;
  batchSize: number;
  /** Training seconds per strategy (evaluation time is not counted). */
  seconds: number;
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

interface Curve {
  name: string;
  steps: number;
  tokens_per_s: number;
  speedup: number;
  final_val_loss: number;
  best_val_loss: number;
  /** (training seconds, validation loss) points. */
  points: Array<{ t: number; val_loss: number }>;
}

/** Runs the benchmark and writes its files. */
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
  const ds = await loadDataset(base.data);
  const model = buildModel(modelConfigFor(base, ds));
  const params = initParams(model.blocks, base.seed);
  const context =
    model.config.arch === 'charlm' ? model.config.context : undefined;
  const val = validationBatches(ds, {
    batchSize: o.batchSize,
    context,
    maxBatches: o.evalBatches,
  });
  const runs: Array<{ name: string; cfg: Partial<TrainConfig> }> = [
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
  const curves: Curve[] = [];
  for (const r of runs) {
    const cfg = resolveConfig({
      ...base,
      balance: undefined,
      ...r.cfg,
      steps: 1_000_000,
    });
    const s = await createStrategy(cfg, model, params);
    const points: Curve['points'] = [];
    let t = 0;
    let tokens = 0;
    let steadySeconds = 0;
    let steps = 0;
    try {
      const batcher = makeBatcher(ds, {
        batchSize: o.batchSize,
        context,
        seed: cfg.seed,
      });
      points.push({ t: 0, val_loss: (await s.evaluate(val)).loss });
      let nextEval = o.evalSeconds;
      // training time: the wall clock minus evaluations; steps are submitted as the strategy
      // accepts them (local parallelism lets the first stage run ahead), as the trainer does
      const inFlight: Array<Promise<unknown>> = [];
      let clock = performance.now();
      while (t < o.seconds) {
        const b = batcher.next();
        const lr = learningRate(steps, {
          lr: o.lr,
          warmup: 10,
          decay: 'constant',
          totalSteps: 1,
          minRatio: 1,
        });
        const sub = s.submit(b, lr);
        inFlight.push(sub.done);
        await sub.accepted;
        while (inFlight.length > s.devices) await inFlight.shift();
        const dt = (performance.now() - clock) / 1000;
        steps++;
        t += dt;
        clock = performance.now();
        if (steps > 1) {
          // throughput: steady state (no warm-up step, no waits for evaluation)
          tokens += b.tokens;
          steadySeconds += dt;
        }
        if (t >= nextEval || t >= o.seconds) {
          await Promise.all(inFlight.splice(0));
          t += (performance.now() - clock) / 1000;
          points.push({ t, val_loss: (await s.evaluate(val)).loss });
          clock = performance.now();
          nextEval += o.evalSeconds;
        }
      }
    } finally {
      await s.close();
    }
    const tps = tokens / steadySeconds;
    const curve: Curve = {
      name: r.name,
      steps,
      tokens_per_s: tps,
      speedup: curves.length ? tps / curves[0].tokens_per_s : 1,
      final_val_loss: points[points.length - 1].val_loss,
      best_val_loss: Math.min(...points.map((p) => p.val_loss)),
      points,
    };
    curves.push(curve);
    log(
      `${r.name}: ${steps} steps, ${tps.toFixed(0)} tokens/s (${curve.speedup.toFixed(2)}x single), val loss ${curve.final_val_loss.toFixed(4)} after ${t.toFixed(0)} s`,
    );
  }
  const spec: TopLevelSpec = {
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
  const view = new vega.View(vega.parse(compile(spec).spec), {
    renderer: 'none',
  });
  const svg = await view.toSVG();
  await writeFileAtomic(join(o.out, 'local.svg'), svg);
  const md = [
    `# local parallelism benchmark\n`,
    `Model ${o.preset} (${modelParamCount(model).toLocaleString('en-US')} parameters) on ${base.data}, mini-batch ${o.batchSize}, lr ${o.lr}, backend ${o.backend}, ${o.seconds} s of training each (evaluation excluded), on this machine (${(await import('node:os')).cpus().length} cores). Plot: local.svg.\n`,
    markdownTable({
      columns: [
        'strategy',
        'steps',
        'tokens/s (steady state)',
        'vs single',
        `val loss at ${o.seconds} s`,
        'best val loss',
      ],
      rows: curves.map((c) => [
        c.name,
        c.steps,
        c.tokens_per_s.toFixed(0),
        `${c.speedup.toFixed(2)}x`,
        c.final_val_loss.toFixed(4),
        c.best_val_loss.toFixed(4),
      ]),
    }),
  ].join('\n');
  const files = await writeBenchResults(
    o.out,
    'local',
    { bench: 'local', options: o, params: modelParamCount(model), curves },
    md,
  );
  log(`wrote ${[...files, join(o.out, 'local.svg')].join(', ')}`);
}
