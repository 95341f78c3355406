/**
 * `npm run bench -- balance`: on a model with deliberately uneven blocks (a character
 * Transformer with a wide vocabulary: the embedding holds many parameters but costs almost no
 * time, the head costs most of the time), gpipe throughput with `--balance time` against the
 * default balance by parameter count, for a few M; each stage's measured bubble beside
 * (K-1)/(M+K-1) and beside the cost model's prediction.
 */

import { resolveConfig } from '../config/config.js';
import { blockBalanceCosts, costsAt } from '../cost/costs.js';
import { profileModel } from '../cost/profile.js';
import { predictStepTime } from '../cost/time.js';
import type { Batch } from '../data/batcher.js';
import { initParams } from '../model/init.js';
import {
  buildModel,
  type CharLmConfig,
  modelParamCount,
} from '../model/model.js';
import { defaultOptimizerConfig } from '../optim/optimizer.js';
import {
  balanceByCost,
  type StageRange,
  stageRanges,
} from '../partition/balance.js';
import { idealBubble } from '../schedule/schedule.js';
import { createStrategy, planStages } from '../strategies/index.js';
import { Rng } from '../util/rng.js';
import { markdownTable, writeBenchResults } from './report.js';

export interface BalanceBenchOptions {
  layers: number;
  dModel: number;
  context: number;
  /** Vocabulary size: the width of the head (the uneven block). */
  vocab: number;
  batchSize: number;
  stages: number;
  microBatches: number[];
  /** Measured steps per configuration (after one warm-up step). */
  steps: number;
  backend: string;
  out: string;
}

interface Row {
  balance_by: 'params' | 'time';
  balance: number[];
  micro_batches: number;
  tokens_per_s: number;
  speedup_vs_params: number;
  step_s: number;
  predicted_step_s: number;
  bubble_measured: number[];
  bubble_predicted: number[];
  bubble_ideal: number;
  stage_busy_s: number[];
}

/** Runs the benchmark and writes balance.json and balance.md into o.out. */
export async function benchBalance(
  o: BalanceBenchOptions,
  log: (s: string) => void,
): Promise<void> {
  const config: CharLmConfig = {
    arch: 'charlm',
    layers: o.layers,
    dModel: o.dModel,
    heads: 2,
    context: o.context,
    vocab: o.vocab,
  };
  const model = buildModel(config);
  const params = initParams(model.blocks, 1);
  const opt = defaultOptimizerConfig('adamw');
  const rng = new Rng(7);
  const batch = (): Batch => {
    const n = o.batchSize * o.context;
    return {
      x: new Int32Array(n).map(() => rng.int(o.vocab)),
      xShape: [o.batchSize, o.context],
      y: new Int32Array(n).map(() => rng.int(o.vocab)),
      yShape: [o.batchSize, o.context],
      examples: o.batchSize,
      tokens: n,
    };
  };
  const t0 = performance.now();
  const profile = await profileModel(model, {
    backend: o.backend,
    microBatchSizes: o.microBatches.map((m) => o.batchSize / m),
    optimizer: opt,
  });
  log(
    `profiled ${model.blocks.length} blocks in ${((performance.now() - t0) / 1000).toFixed(1)} s`,
  );

  const rows: Row[] = [];
  for (const m of o.microBatches) {
    const cfg = resolveConfig({
      preset: 'charlm-tiny',
      strategy: 'gpipe',
      stages: o.stages,
      microBatches: m,
      batchSize: o.batchSize,
      remat: 'except_last',
      backend: o.backend,
      steps: o.steps + 1,
    });
    const costs = costsAt(profile, o.batchSize / m);
    const shape = { m, remat: cfg.remat, schedule: cfg.schedule };
    const byTime = stageRanges(
      balanceByCost(
        blockBalanceCosts(costs, 'time', { ...shape, slots: 2 }, o.stages),
        o.stages,
      ),
    );
    const byParams = planStages(cfg, model);
    let paramsRate = NaN;
    for (const [by, ranges] of [
      ['params', byParams],
      ['time', byTime],
    ] as Array<[Row['balance_by'], StageRange[]]>) {
      const s = await createStrategy(cfg, model, params, ranges);
      try {
        await s.trainStep(batch(), 1e-4); // warm-up
        let secs = 0;
        let tokens = 0;
        const bubble = new Array<number>(s.devices).fill(0);
        const busy = new Array<number>(s.devices).fill(0);
        for (let i = 0; i < o.steps; i++) {
          const b = batch();
          const ts = performance.now();
          const r = await s.trainStep(b, 1e-4);
          secs += (performance.now() - ts) / 1000;
          tokens += b.tokens;
          r.bubble.forEach((x, j) => (bubble[j] += x / o.steps));
          r.stageSeconds.forEach(
            (x, j) => (busy[j] += (x * (1 - r.bubble[j])) / o.steps),
          );
        }
        const pred = predictStepTime(costs, ranges, shape);
        const rate = tokens / secs;
        if (by === 'params') paramsRate = rate;
        const row: Row = {
          balance_by: by,
          balance: ranges.map((r) => r.to - r.from),
          micro_batches: m,
          tokens_per_s: rate,
          speedup_vs_params: rate / paramsRate,
          step_s: secs / o.steps,
          predicted_step_s: pred.seconds,
          bubble_measured: bubble,
          bubble_predicted: pred.bubble,
          bubble_ideal: idealBubble(m, o.stages),
          stage_busy_s: busy,
        };
        rows.push(row);
        log(
          `M=${m} balance by ${by} ${row.balance.join(',')}: ${rate.toFixed(0)} tokens/s (${row.speedup_vs_params.toFixed(2)}x), bubble ${bubble.map((b) => b.toFixed(3)).join('/')} vs ideal ${row.bubble_ideal.toFixed(3)}`,
        );
      } finally {
        await s.close();
      }
    }
  }
  const f3 = (x: number) => x.toFixed(3);
  const md = [
    `# balance benchmark\n`,
    `Uneven model: charlm, ${o.layers} decoder layers of d_model ${o.dModel}, context ${o.context}, vocabulary ${o.vocab} ` +
      `(${modelParamCount(model).toLocaleString('en-US')} parameters; the embedding and the head each hold about as many parameters as all decoders, ` +
      `but the embedding costs almost no time and the head most of it). gpipe, K = ${o.stages}, mini-batch ${o.batchSize}, checkpoint except_last, ` +
      `backend ${o.backend}, ${o.steps} measured steps after one warm-up step, on this machine (${(await import('node:os')).cpus().length} cores).\n`,
    markdownTable({
      columns: [
        'M',
        'balance by',
        'blocks per stage',
        'tokens/s',
        'vs params',
        'step s (measured / predicted)',
        'bubble per stage (measured)',
        'bubble per stage (predicted)',
        '(K-1)/(M+K-1)',
        'busy s per stage',
      ],
      rows: rows.map((r) => [
        r.micro_batches,
        r.balance_by,
        r.balance.join(','),
        r.tokens_per_s.toFixed(0),
        `${r.speedup_vs_params.toFixed(2)}x`,
        `${f3(r.step_s)} / ${f3(r.predicted_step_s)}`,
        r.bubble_measured.map(f3).join(' / '),
        r.bubble_predicted.map(f3).join(' / '),
        f3(r.bubble_ideal),
        r.stage_busy_s.map(f3).join(' / '),
      ]),
    }),
  ].join('\n');
  const files = await writeBenchResults(
    o.out,
    'balance',
    {
      bench: 'balance',
      options: o,
      params: modelParamCount(model),
      profile,
      rows,
    },
    md,
  );
  log(`wrote ${files.join(', ')}`);
}
