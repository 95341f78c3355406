/**
 * A training run in the page: the library's configuration, data, model, partition and
 * strategies, exactly as `layerwise train` uses them (src/train/trainer.ts), with the run's
 * records kept in memory instead of a run folder: metrics lines, the summary (summary.json's
 * fields), the trace recorder's timeline, and the trained parameters. No checkpoints and no
 * resume here (the page has no files).
 */

import { resolveConfig, runModelConfig } from '../src/config/config.js';
import { makeBatcher, validationBatches } from '../src/data/batcher.js';
import { type Dataset, loadDataset } from '../src/data/index.js';
import { textDatasetFromString } from '../src/data/text.js';
import { type HostParams, initParams } from '../src/model/init.js';
import { loadModel, type Model, modelParamCount } from '../src/model/model.js';
import { learningRate } from '../src/optim/lr.js';
import {
  checkWebGpuLimits,
  type WebGpuBufferLimits,
} from '../src/plan/webgpu-limits.js';
import {
  createStrategy,
  resolveStages,
  validateStrategy,
} from '../src/strategies/index.js';
import type { StepReport, Strategy } from '../src/strategies/strategy.js';
import type { StepMetrics, Summary } from '../src/train/metrics.js';
import { StepTally } from '../src/train/step-tally.js';
import { TraceRecorder } from '../src/train/trace.js';
import { LayerwiseError } from '../src/util/errors.js';

/** What a person picks on the page (or gives as URL parameters). */
export interface PageRunOptions {
  preset: string;
  strategy: string;
  stages: number;
  microBatches: number;
  steps: number;
  backend: 'wasm' | 'webgpu' | 'cpu';
  batchSize?: number;
  evalEvery?: number;
  evalBatches?: number;
  seed?: number;
  lr?: number;
  /** The preset's shape, changed (`layerwise train`'s --layers, --d-model, --heads, --context). */
  layers?: number;
  dModel?: number;
  heads?: number;
  context?: number;
  /** A person's own text (a dropped or picked .txt file) instead of the preset's data. */
  text?: { name: string; text: string };
  /** The WebGPU adapter's buffer limits: a webgpu run checks the model against them first. */
  webgpuLimits?: WebGpuBufferLimits;
}

/** Live progress of a run. */
export interface PageRunHooks {
  /** Once, when the devices are up and before the first step. */
  onStart?(info: {
    params: number;
    ranges: Array<{ from: number; to: number }>;
    dataset: string;
  }): void;
  /** After each recorded step: its metrics line, its report, and the run's timeline so far. */
  onStep?(m: StepMetrics, report: StepReport, trace: TraceRecorder): void;
  /** Asked before each step: true ends the run after the steps already submitted. */
  stopRequested?(): boolean;
}

/** The finished run: summary.json's fields, every metrics line, the model and its parameters. */
export interface PageRunResult {
  summary: Summary;
  metrics: StepMetrics[];
  model: Model;
  params: HostParams;
  dataset: Dataset;
  /** Whether the run was stopped before its last step (the summary covers the steps done). */
  stopped: boolean;
}

/** Throws when a step's loss is not finite (NaN or infinite), with advice. */
function checkFinite(loss: number, step: number, lr: number): void {
  if (!Number.isFinite(loss))
    throw new LayerwiseError(
      `loss became ${loss} at step ${step}; lower the learning rate (now ${lr})`,
    );
}

/**
 * Trains as `opts` asks, in this page (devices are Web Workers). Throws
 * {@link LayerwiseError} for bad input (an unknown preset, a text with nothing to train on, a
 * strategy's flag checks, a model over the WebGPU adapter's buffer limits) before any worker starts, and a StageError when a device fails.
 */
export async function runInPage(
  opts: PageRunOptions,
  hooks: PageRunHooks = {},
): Promise<PageRunResult> {
  const t0 = performance.now();
  const cfg = resolveConfig({
    preset: opts.preset,
    strategy: opts.strategy,
    stages: opts.stages,
    microBatches: opts.microBatches,
    steps: opts.steps,
    backend: opts.backend,
    batchSize: opts.batchSize,
    evalEvery: opts.evalEvery,
    evalBatches: opts.evalBatches,
    seed: opts.seed,
    lr: opts.lr,
    layers: opts.layers,
    dModel: opts.dModel,
    heads: opts.heads,
    context: opts.context,
    data: opts.text?.name,
    out: 'page',
  });
  validateStrategy(cfg);
  const ds = opts.text
    ? textDatasetFromString(opts.text.name, opts.text.text)
    : await loadDataset(cfg.data);
  const model = await loadModel(await runModelConfig(cfg, ds));
  if (cfg.backend === 'webgpu' && opts.webgpuLimits)
    checkWebGpuLimits(
      model,
      cfg.strategy === 'single'
        ? cfg.batchSize
        : Math.ceil(cfg.batchSize / cfg.microBatches),
      opts.webgpuLimits,
    );
  const ranges = await resolveStages(cfg, model);
  const context =
    model.config.arch === 'charlm' ? model.config.context : undefined;
  const valBatches = validationBatches(ds, {
    batchSize: cfg.batchSize,
    context,
    maxBatches: cfg.evalBatches,
  });
  if (valBatches.length === 0)
    throw new LayerwiseError(
      `the validation part of ${ds.name} (a tenth of it) holds less than one batch of ${cfg.batchSize} windows of ${context ?? 1} characters; give a longer text`,
    );
  const batcher = makeBatcher(ds, {
    batchSize: cfg.batchSize,
    context: cfg.context ?? context,
    seed: cfg.seed,
  });
  const nParams = modelParamCount(model);
  const strategy: Strategy = await createStrategy(
    cfg,
    model,
    initParams(model.blocks, cfg.seed),
    ranges,
  );
  hooks.onStart?.({ params: nParams, ranges, dataset: ds.name });
  const metrics: StepMetrics[] = [];
  const recorder = new TraceRecorder(true);
  const tally = new StepTally(
    strategy.devices,
    ds.kind === 'text',
    cfg.strategy === 'local',
  );
  let initialLoss: number | undefined;
  let stopped = false;
  let done = 0;
  let params: HostParams;
  const due = (step: number) =>
    (cfg.evalEvery > 0 && step % cfg.evalEvery === 0) || step === cfg.steps;
  try {
    let mark = performance.now();
    for (let step = 0; step < cfg.steps; step++) {
      if (hooks.stopRequested?.()) {
        stopped = true;
        break;
      }
      const batch = batcher.next();
      const lr = learningRate(step, {
        lr: cfg.lr,
        warmup: cfg.warmup,
        decay: cfg.decay,
        totalSteps: cfg.steps,
        minRatio: 0.1,
      });
      const sub = strategy.submit(batch, lr);
      const r = await sub.done; // one step at a time: the page draws each
      const now = performance.now();
      const secs = (now - mark) / 1000;
      done = step + 1;
      checkFinite(r.loss, done, cfg.lr);
      initialLoss ??= r.loss;
      recorder.add(done, r);
      const m = tally.step(r, {
        step: done,
        lr,
        tokens: batch.tokens,
        seconds: secs,
        counted: step > 0 || cfg.steps === 1, // the first step warms kernels up
      });
      if (due(done)) tally.evaluation(m, await strategy.evaluate(valBatches));
      metrics.push(m);
      hooks.onStep?.(m, r, recorder);
      mark = performance.now();
    }
    if (strategy.drainServerSpans)
      recorder.addServerSpans(done, await strategy.drainServerSpans());
    params = await strategy.getParams();
  } finally {
    await strategy.close();
  }
  const last = metrics[metrics.length - 1];
  const summary: Summary = {
    strategy: cfg.strategy,
    backend: cfg.backend,
    precision: cfg.precision,
    preset: cfg.preset,
    params: nParams,
    stages: ranges.length,
    micro_batches: cfg.strategy === 'single' ? 1 : cfg.microBatches,
    rematerialization: cfg.remat,
    schedule: cfg.schedule,
    balance: ranges.map((r) => r.to - r.from),
    batch_size: cfg.batchSize,
    steps: done,
    initial_loss: initialLoss ?? Number.NaN,
    final_loss: last?.loss ?? Number.NaN,
    ...tally.summaryFields(),
    wall_s: (performance.now() - t0) / 1000,
  };
  return { summary, metrics, model, params, dataset: ds, stopped };
}
