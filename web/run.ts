/**
 * A training run in the page: the library's configuration, data, model, partition, strategies
 * and training loop (src/train/loop.ts), exactly as `layerwise train` uses them
 * (src/train/trainer.ts), with the run's records kept in memory instead of a run folder:
 * metrics lines, the summary (summary.json's fields), the trace recorder's timeline, and the
 * trained parameters. No checkpoints and no resume here (the page has no files).
 */

import {
  resolveConfig,
  runModelConfig,
  type TrainConfig,
} from '../src/config/config.js';
import {
  type Batch,
  makeBatcher,
  validationBatches,
} from '../src/data/batcher.js';
import { type Dataset, loadDataset } from '../src/data/index.js';
import { textDatasetFromString } from '../src/data/text.js';
import { type HostParams, initParams } from '../src/model/init.js';
import {
  checkLayerDrop,
  type LayerDropSchedule,
} from '../src/model/layer-drop.js';
import { loadModel, type Model, modelParamCount } from '../src/model/model.js';
import {
  checkWebGpuLimits,
  type WebGpuBufferLimits,
} from '../src/plan/webgpu-limits.js';
import {
  createStrategy,
  resolveStages,
  specOf,
  validateStrategy,
} from '../src/strategies/index.js';
import type { StepReport, Strategy } from '../src/strategies/strategy.js';
import { TrainingLoop } from '../src/train/loop.js';
import type { StepMetrics, Summary } from '../src/train/metrics.js';
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
  /** LayerDrop (`layerwise train`'s --layer-drop, --layer-drop-schedule): single, gpipe, l2l. */
  layerDrop?: number;
  layerDropSchedule?: LayerDropSchedule;
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
  /** A warning, at most once per run (a loss far above its running median: training may be diverging). */
  warn?(msg: string): void;
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

/** The run's configuration: `layerwise train`'s, from the page's options. */
function pageConfig(opts: PageRunOptions): TrainConfig {
  return resolveConfig({
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
    layerDrop: opts.layerDrop,
    layerDropSchedule: opts.layerDropSchedule,
    layers: opts.layers,
    dModel: opts.dModel,
    heads: opts.heads,
    context: opts.context,
    data: opts.text?.name,
    out: 'page',
  });
}

/** The validation batches; throws {@link LayerwiseError} when the text holds less than one. */
function pageValidation(
  ds: Dataset,
  cfg: TrainConfig,
  context: number | undefined,
): Batch[] {
  const valBatches = validationBatches(ds, {
    batchSize: cfg.batchSize,
    context,
    maxBatches: cfg.evalBatches,
  });
  if (valBatches.length === 0)
    throw new LayerwiseError(
      `the validation part of ${ds.name} (a tenth of it) holds less than one batch of ${cfg.batchSize} windows of ${context ?? 1} characters; give a longer text`,
    );
  return valBatches;
}

/** Loads the data and the model and checks them against the run (LayerDrop, WebGPU limits). */
async function pageModel(
  cfg: TrainConfig,
  opts: PageRunOptions,
): Promise<{ ds: Dataset; model: Model }> {
  const ds = opts.text
    ? textDatasetFromString(opts.text.name, opts.text.text)
    : await loadDataset(cfg.data);
  const model = await loadModel(await runModelConfig(cfg, ds));
  if (cfg.layerDrop > 0) checkLayerDrop(model);
  if (cfg.backend === 'webgpu' && opts.webgpuLimits)
    checkWebGpuLimits(
      model,
      specOf(cfg.strategy).memory.microBatch(cfg), // the examples a device's step holds
      opts.webgpuLimits,
    );
  return { ds, model };
}

/**
 * Trains as `opts` asks, in this page (devices are Web Workers), with the trainer's own loop
 * (src/train/loop.ts: the same steps, LayerDrop, checks, metrics lines and summary fields as
 * `layerwise train`), its records kept in memory. Throws {@link LayerwiseError} for bad input
 * (an unknown preset, a text with nothing to train on, a strategy's flag checks, a model over
 * the WebGPU adapter's buffer limits) before any worker starts, a NumericFaultError (a
 * LayerwiseError) at a step whose loss is not finite, and a StageError when a device fails.
 */
export async function runInPage(
  opts: PageRunOptions,
  hooks: PageRunHooks = {},
): Promise<PageRunResult> {
  const t0 = performance.now();
  const cfg = pageConfig(opts);
  validateStrategy(cfg);
  const { ds, model } = await pageModel(cfg, opts);
  const ranges = await resolveStages(cfg, model);
  const context =
    model.config.arch === 'charlm' ? model.config.context : undefined;
  const valBatches = pageValidation(ds, cfg, context);
  const batcher = makeBatcher(ds, {
    batchSize: cfg.batchSize,
    context: cfg.context ?? context,
    seed: cfg.seed,
  });
  const strategy: Strategy = await createStrategy(
    cfg,
    model,
    initParams(model.blocks, cfg.seed),
    ranges,
  );
  hooks.onStart?.({
    params: modelParamCount(model),
    ranges,
    dataset: ds.name,
  });
  const metrics: StepMetrics[] = [];
  const recorder = new TraceRecorder(true);
  const loop = new TrainingLoop(
    {
      cfg,
      model,
      strategy,
      batcher,
      valBatches,
      ranges,
      text: ds.kind === 'text',
      recorder,
      t0,
    },
    {
      record(m, r) {
        metrics.push(m);
        hooks.onStep?.(m, r, recorder);
      },
      stopRequested: () => hooks.stopRequested?.() ?? false,
      warn: (msg) => hooks.warn?.(msg),
    },
  );
  let stopped: boolean;
  let params: HostParams;
  try {
    ({ stopped } = await loop.run());
    params = await strategy.getParams();
  } finally {
    await strategy.close();
  }
  const summary = loop.summary();
  return { summary, metrics, model, params, dataset: ds, stopped };
}
