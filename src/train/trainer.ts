/**
 * The one training loop for every strategy: data -> model -> strategy -> steps, with the
 * learning-rate schedule, periodic validation, metrics, atomic checkpoints and exact resume.
 *
 * Everything that can be wrong with the input (config, data, checkpoint, balance) is checked
 * before anything is written, so a bad run leaves no files behind.
 */

import { existsSync } from 'node:fs';
import { readdir, readFile, rm } from 'node:fs/promises';
import { join, resolve } from 'node:path';
import { precisionNote } from '../backend/names.js';
import {
  resolveConfig,
  runModelConfig,
  scheduleName,
  type TrainConfig,
} from '../config/config.js';
import {
  type BatcherState,
  makeBatcher,
  validationBatches,
} from '../data/batcher.js';
import { type Dataset, loadDataset, Vocab } from '../data/index.js';
import { type HostParams, initParams } from '../model/init.js';
import { checkLayerDrop, droppedBlocks } from '../model/layer-drop.js';
import { loadModel, type Model, modelParamCount } from '../model/model.js';
import type { LossScaleState } from '../optim/loss-scale.js';
import { learningRate } from '../optim/lr.js';
import type { OptimizerState } from '../optim/optimizer.js';
import type { StageRange } from '../partition/balance.js';
import type { BudgetCheck } from '../plan/budget.js';
import { parseDevices } from '../runtime/devices.js';
import {
  createStrategy,
  resolveStages,
  specOf,
  validateStrategy,
} from '../strategies/index.js';
import type { Strategy } from '../strategies/strategy.js';
import {
  LayerwiseError,
  NumericFaultError,
  tagRunDir,
} from '../util/errors.js';
import { writeFileAtomic } from '../util/fsx.js';
import {
  CHECKPOINTS,
  type Checkpoint,
  cleanCheckpoints,
  findCheckpoint,
  holdsRun,
  OLD_CHECKPOINT,
  saveRunCheckpoint,
} from './checkpoint-io.js';
import { MetricsLog, type StepMetrics, type Summary } from './metrics.js';
import { checkRunPaths, lockRunFolder } from './run-folder.js';
import { StepTally } from './step-tally.js';
import { type StageSummary, TraceRecorder } from './trace.js';

/** Flags that define the model and data stream; a resumed run must not change them. */
const FIXED_ON_RESUME = [
  'preset',
  'model',
  'loss',
  'data',
  'layers',
  'dModel',
  'heads',
  'context',
  'batchSize',
  'seed',
] as const;

/** Progress callbacks (the CLI draws a progress bar with them). */
export interface TrainHooks {
  /** Once, before the first step. */
  onStart?(info: {
    config: TrainConfig;
    model: Model;
    params: number;
    bytes: number;
    ranges: Array<{ from: number; to: number }>;
    startStep: number;
    /** With --device-memory: the budget and the predicted peak device bytes per stage (see plan/budget.ts). */
    budget?: BudgetCheck;
  }): void;
  onStep?(m: StepMetrics, total: number): void;
  log?(msg: string): void;
  /** A warning, at most once per kind per run (e.g. the divergence guard: a loss far above its running median). */
  warn?(msg: string): void;
}

export interface TrainResult {
  summary: Summary;
  outDir: string;
  /** Busy/idle percentages and peak bytes per stage over the run's steps. */
  stages: StageSummary[];
  /** The trace files written (Chrome JSON, SVG), when --trace was given. */
  traceFiles?: string[];
}

/** A step handed to the strategy whose report has not been recorded yet. */
interface InFlight {
  step: number;
  lr: number;
  tokens: number;
  /** Blocks the step skipped (--layer-drop). */
  dropped: number[];
  /** The step's share of the training wall time, seconds (see the loop). */
  seconds: number;
  done: Promise<import('../strategies/strategy.js').StepReport>;
}

/** How {@link train} treats the --out folder. */
export interface TrainOptions {
  /** A fresh run into a folder that holds a run replaces it (else that is refused). */
  overwrite?: boolean;
  /** The command line that started the run (written to run.json: the command that starts it again). */
  argv?: string[];
}

interface Prepared {
  cfg: TrainConfig;
  /** The checkpoint folder resumed from, when it lies in --out (its leftovers are cleaned there). */
  resumedDir?: string;
  ds: Dataset;
  model: Model;
  params: HostParams;
  optimizer?: OptimizerState;
  data?: BatcherState;
  startStep: number;
  /** The resumed checkpoint already reaches --steps (nothing to train; train() says so after tidying the folder). */
  finished: boolean;
  stats: { initialLoss?: number; wallS: number; lossScale?: LossScaleState };
  /** The stages' block ranges (profiled first for --balance time|memory). */
  ranges: StageRange[];
  /** With --device-memory: the predicted peak device bytes per stage, within the budget. */
  budget?: BudgetCheck;
}

/**
 * Validates the configuration, loads data, builds the model and the initial (or resumed)
 * state, and with --device-memory checks the predicted peak device bytes against the budget
 * (plan/budget.ts; throws DeviceOutOfMemoryError, a {@link LayerwiseError}). Writes nothing.
 */
export async function prepare(
  raw: Parameters<typeof resolveConfig>[0],
  resume?: string,
  opts: TrainOptions = {},
): Promise<Prepared> {
  let ck: Checkpoint | undefined;
  let cfg: TrainConfig;
  let found: Awaited<ReturnType<typeof findCheckpoint>> | undefined;
  if (resume) {
    found = await findCheckpoint(resume);
    ck = found.ck;
    const saved = ck.config as unknown as TrainConfig;
    for (const k of FIXED_ON_RESUME) {
      const given = (raw as Record<string, unknown>)[k];
      if (
        given !== undefined &&
        JSON.stringify(given) !== JSON.stringify(saved[k])
      ) {
        throw new LayerwiseError(
          `checkpoint ${resume} was trained with ${k} = ${JSON.stringify(saved[k])}, not ${JSON.stringify(given)}; drop that flag to resume, or start a new run`,
        );
      }
    }
    const merged: Record<string, unknown> = { ...saved };
    for (const [k, v] of Object.entries(raw))
      if (v !== undefined) merged[k] = v;
    if (raw.out === undefined) merged.out = saved.out ?? resume;
    cfg = resolveConfig(merged as Parameters<typeof resolveConfig>[0]);
  } else {
    cfg = resolveConfig(raw);
  }
  validateStrategy(cfg);
  checkRunPaths(cfg); // --out and --trace, before any work (the data and model paths are checked as they load)
  const resumedDir =
    found && within(found.dir, cfg.out) ? found.dir : undefined;
  if (!resumedDir && !opts.overwrite && holdsRun(cfg.out)) {
    throw new LayerwiseError(
      `--out ${cfg.out} already holds a run; continue it with 'layerwise train --resume ${cfg.out}', start it over with --overwrite (deletes that run), or give another --out`,
    );
  }
  const vocab = ck?.vocab ? Vocab.fromJSON(ck.vocab) : undefined;
  const ds = await loadDataset(cfg.data, { vocab });
  const modelConfig = await runModelConfig(cfg, ds);
  if (ck && JSON.stringify(ck.model) !== JSON.stringify(modelConfig)) {
    throw new LayerwiseError(
      `checkpoint model ${JSON.stringify(ck.model)} does not match this configuration's ${JSON.stringify(modelConfig)}; resume with the same preset and data`,
    );
  }
  const model = await loadModel(modelConfig);
  if (cfg.layerDrop > 0) checkLayerDrop(model);
  const ranges = await resolveStages(cfg, model); // validates the balance now, before any file or worker exists
  parseDevices(cfg.devices, cfg.stages); // and the devices
  const finished = ck !== undefined && ck.step >= cfg.steps;
  if (finished && !resumedDir) throw alreadyReaches(ck!.step, cfg);
  let budget: BudgetCheck | undefined;
  if (cfg.deviceMemory !== undefined) {
    // before any file or worker exists: a run that cannot fit fails here (loads TF.js, so only when asked)
    const { checkDeviceBudget } = await import('../plan/budget.js');
    budget = await checkDeviceBudget(cfg, model, ranges);
  }
  return {
    cfg,
    resumedDir,
    ds,
    model,
    params: ck ? ck.params : initParams(model.blocks, cfg.seed),
    optimizer: ck?.optimizer,
    data: ck?.data as BatcherState | undefined,
    startStep: ck?.step ?? 0,
    finished,
    stats: ck?.stats ?? { wallS: 0 },
    ranges,
    budget,
  };
}

/** The error of a resume whose checkpoint (of step `step`) already reaches --steps. */
function alreadyReaches(step: number, cfg: TrainConfig): LayerwiseError {
  const summary = join(cfg.out, 'summary.json');
  return new LayerwiseError(
    `checkpoint is at step ${step}, which already reaches --steps ${cfg.steps}${existsSync(summary) ? ` (the run is complete: ${summary})` : ''}; pass a larger --steps to continue`,
  );
}

/** Whether `child` lies inside folder `parent`. */
function within(child: string, parent: string): boolean {
  return resolve(child).startsWith(`${resolve(parent)}/`);
}

/** Everything a run writes into its folder (removed by --overwrite before the new run starts). */
const RUN_OUTPUTS = [
  'metrics.jsonl',
  'summary.json',
  'run.json',
  'error.txt',
  CHECKPOINTS,
  OLD_CHECKPOINT,
];

/** Keeps only the metrics lines of steps <= `step` (a resumed run rewrites what came after). */
async function truncateMetrics(out: string, step: number): Promise<void> {
  const path = join(out, 'metrics.jsonl');
  if (!existsSync(path)) return;
  const lines = (await readFile(path, 'utf8'))
    .split('\n')
    .filter((l) => l.trim() !== '');
  const keep = lines.filter((l) => {
    try {
      return (JSON.parse(l) as StepMetrics).step <= step;
    } catch {
      return false;
    }
  });
  await writeFileAtomic(path, keep.map((l) => `${l}\n`).join(''));
}

/**
 * Trains as configured. `raw` holds the CLI flags (undefined = default); `resume` a run or
 * checkpoint folder to continue exactly from. Returns the summary written to summary.json.
 * Throws {@link LayerwiseError} for bad input (before writing anything) and StageError when a
 * stage fails (after stopping every worker).
 */
export async function train(
  raw: Parameters<typeof resolveConfig>[0],
  resume?: string,
  hooks: TrainHooks = {},
  opts: TrainOptions = {},
): Promise<TrainResult> {
  const t0 = performance.now();
  const p = await prepare(raw, resume, opts);
  const { cfg, ds, model } = p;
  const context =
    model.config.arch === 'charlm' ? model.config.context : undefined;
  const valBatches = validationBatches(ds, {
    batchSize: cfg.batchSize,
    context,
    maxBatches: cfg.evalBatches,
  });
  if (valBatches.length === 0) {
    if (ds.kind === 'text' && context !== undefined) {
      // a batch is batchSize windows of context + 1 characters, each starting `context` after the last
      const need = cfg.batchSize * context + 1;
      const chars = ds.train.length + ds.val.length;
      throw new LayerwiseError(
        `the text ${cfg.data} (${chars} characters) is too short: its validation split (the last ${ds.val.length} characters) holds less than one batch of ${cfg.batchSize} windows of --context ${context} (${need} characters); give a smaller --context${cfg.batchSize > 1 ? ' or --batch-size' : ''}, or a longer text (about ${Math.ceil(need / 0.1)} characters)`,
      );
    }
    throw new LayerwiseError(
      `the validation split of ${cfg.data} holds less than one batch of ${cfg.batchSize}; use a smaller --batch-size`,
    );
  }
  // one writer per run folder: a second run on it fails here, before it writes anything
  const existed = existsSync(cfg.out);
  const lock = await lockRunFolder(cfg.out);
  let failedEmpty = false;
  try {
    if (p.resumedDir) {
      // what a crash left behind: interrupted saves, checkpoints older (or broken newer) than this one
      await cleanCheckpoints(cfg.out, p.resumedDir);
    } else if (existed) {
      // a fresh run (--overwrite, or a restart before the first checkpoint): the old run goes
      const names = await readdir(cfg.out);
      for (const n of names)
        if (RUN_OUTPUTS.includes(n) || n.startsWith(`${OLD_CHECKPOINT}.`))
          await rm(join(cfg.out, n), { recursive: true, force: true });
    }
    // a finished run (perhaps killed after its last checkpoint: summary.json is written before that save), tidied above
    if (p.finished) throw alreadyReaches(p.startStep, cfg);
    if (!p.resumedDir && opts.argv)
      await writeFileAtomic(
        join(cfg.out, 'run.json'),
        `${JSON.stringify({ argv: opts.argv })}\n`,
      );
    const r = await run(p, t0, hooks, lock, valBatches);
    await rm(join(cfg.out, 'error.txt'), { force: true }); // a report of an earlier failure is stale now
    return r;
  } catch (e) {
    // a run that failed before writing anything (devices that refused it, say) leaves no folder
    failedEmpty =
      !existed &&
      (e instanceof LayerwiseError ||
        (e as { causeName?: string }).causeName === 'LayerwiseError');
    throw failedEmpty ? e : tagRunDir(e, cfg.out); // the CLI writes an internal error's full report there
  } finally {
    await lock.release();
    if (
      failedEmpty &&
      !existed &&
      (await readdir(cfg.out).catch(() => ['?'])).every((n) => n === 'run.json')
    )
      await rm(cfg.out, { recursive: true, force: true });
  }
}

/** How far above its running median a loss must be for the divergence warning. */
const DIVERGENCE_FACTOR = 10;
/** Steps of loss history before the divergence guard speaks, and the window of its median. */
const DIVERGENCE_WARMUP = 2;
const DIVERGENCE_WINDOW = 50;

async function run(
  p: Prepared,
  t0: number,
  hooks: TrainHooks,
  lock: { assertHeld(): void },
  valBatches: ReturnType<typeof validationBatches>,
): Promise<TrainResult> {
  const { cfg, ds, model, ranges } = p;
  const batcher = makeBatcher(
    ds,
    {
      batchSize: cfg.batchSize,
      context:
        cfg.context ??
        (model.config.arch === 'charlm' ? model.config.context : undefined),
      seed: cfg.seed,
    },
    p.data,
  );
  const nParams = modelParamCount(model);
  hooks.onStart?.({
    config: cfg,
    model,
    params: nParams,
    bytes: nParams * 4,
    ranges,
    startStep: p.startStep,
    budget: p.budget,
  });

  const spec = specOf(cfg.strategy);
  const strategy: Strategy = await createStrategy(cfg, model, p.params, ranges);
  const log = new MetricsLog(cfg.out);
  const stats = { ...p.stats };
  let last: StepMetrics | undefined;
  const tally = new StepTally(
    strategy.devices,
    ds.kind === 'text',
    spec.stageLosses,
    cfg.layerDrop > 0,
  );
  // data-parallel replicas: device d is replica floor(d / K)'s device d mod K
  const perReplica = strategy.devices / cfg.replicas;
  const recorder = new TraceRecorder(
    cfg.trace !== undefined,
    cfg.replicas > 1
      ? (d) => `replica ${Math.floor(d / perReplica)} stage ${d % perReplica}`
      : undefined,
  );
  /** summary.json's fields from the steps recorded so far. */
  const summarize = (): Summary => ({
    strategy: cfg.strategy,
    backend: cfg.backend,
    precision: cfg.precision,
    ...(cfg.precision !== 'fp32'
      ? { precision_note: precisionNote(cfg.precision) }
      : {}),
    preset: cfg.preset,
    params: nParams,
    stages: ranges.length,
    ...(ranges.length > cfg.stages && cfg.stages > 0
      ? { devices: cfg.stages, virtual_stages: ranges.length / cfg.stages }
      : {}),
    ...(cfg.replicas > 1
      ? { replicas: cfg.replicas, devices: cfg.replicas * cfg.stages }
      : {}),
    micro_batches: cfg.batchSize / spec.memory.microBatch(cfg) / cfg.replicas,
    rematerialization: cfg.remat,
    schedule: scheduleName(cfg),
    balance: ranges.map((r) => r.to - r.from),
    batch_size: cfg.batchSize,
    steps: cfg.steps,
    initial_loss: stats.initialLoss ?? NaN,
    final_loss: last?.loss ?? NaN,
    ...tally.summaryFields(),
    // with --device-memory: the budget and the peak predicted before training, beside the measured one
    ...(p.budget
      ? {
          device_memory_budget: p.budget.budget,
          predicted_peak_device_bytes:
            p.budget.predicted?.map(Math.round) ?? null,
        }
      : {}),
    wall_s: stats.wallS + (performance.now() - t0) / 1000,
  });
  /** The summary, written at the last step before its checkpoint: a kill during that save leaves a complete run. */
  let result: Summary | undefined;
  try {
    if (p.optimizer) await strategy.setOptimizerState(p.optimizer);
    if (stats.lossScale) strategy.setLossScaleState?.(stats.lossScale);
    await truncateMetrics(cfg.out, p.startStep); // a fresh run into an old folder starts a new log
    const layerDrop = {
      p: cfg.layerDrop,
      schedule: cfg.layerDropSchedule,
      seed: cfg.seed,
    };
    const lrOf = (step: number) =>
      learningRate(step, {
        lr: cfg.lr,
        warmup: cfg.warmup,
        decay: cfg.decay,
        totalSteps: cfg.steps,
        minRatio: 0.1,
      });
    let savedStep = p.startStep > 0 ? p.startStep : undefined;
    let savedDir = p.resumedDir;
    const recent: number[] = [];
    let warned = false;
    const save = async (step: number) => {
      lock.assertHeld();
      savedDir = await saveRunCheckpoint(cfg.out, {
        step,
        config: cfg as unknown as Record<string, unknown>,
        model: model.config,
        stats: {
          initialLoss: stats.initialLoss,
          wallS: stats.wallS + (performance.now() - t0) / 1000,
          ...(strategy.lossScaleState?.()
            ? { lossScale: strategy.lossScaleState() }
            : {}),
        },
        vocab: ds.kind === 'text' ? ds.vocab.toJSON() : null,
        data: batcher.state(),
        params: await strategy.getParams(),
        optimizer: await strategy.getOptimizerState(),
      });
      savedStep = step;
    };
    const intact = () =>
      savedStep !== undefined
        ? `the checkpoint of step ${savedStep} in ${savedDir ?? cfg.out} is intact`
        : 'no checkpoint was saved yet';
    const advice = () =>
      `lower --lr (now ${cfg.lr})${cfg.clipNorm > 0 ? '' : ' or set --clip-norm'}`;
    /** A numeric fault of step `done`, found before any parameter was updated with it (see PipelineStrategy), with the step and advice. */
    const withStep = (e: unknown, done: number): unknown =>
      e instanceof NumericFaultError && e.step === undefined
        ? e.at(done, `nothing was updated with it; ${intact()}; ${advice()}`)
        : e;
    const due = (done: number, every: number) =>
      (every > 0 && done % every === 0) || done === cfg.steps;
    /** Records a submitted step once it is done: metrics, evaluation, checkpoint. */
    const finish = async (f: InFlight) => {
      const done = f.step + 1;
      let r: import('../strategies/strategy.js').StepReport;
      try {
        r = await f.done;
      } catch (e) {
        throw withStep(e, done);
      }
      const secs = f.seconds;
      if (!Number.isFinite(r.loss)) {
        const st = r.stageLosses.findIndex((l) => !Number.isFinite(l));
        const where =
          spec.stageLosses && st >= 0
            ? ` (first in the local loss of stage ${st})`
            : '';
        throw new NumericFaultError(`loss became ${r.loss}${where}`).at(
          done,
          `${intact()}; ${advice()}`,
        );
      }
      if (recent.length >= DIVERGENCE_WARMUP && !warned) {
        const median = [...recent].sort((a, b) => a - b)[
          Math.floor((recent.length - 1) / 2)
        ]!; // the lower median
        if (r.loss > DIVERGENCE_FACTOR * median) {
          warned = true;
          hooks.warn?.(
            `loss ${r.loss.toPrecision(3)} at step ${done} is more than ${DIVERGENCE_FACTOR}x its running median ${median.toPrecision(3)}: training may be diverging; consider a lower --lr (now ${cfg.lr})`,
          );
        }
      }
      recent.push(r.loss);
      if (recent.length > DIVERGENCE_WINDOW) recent.shift();
      stats.initialLoss ??= r.loss;
      recorder.add(done, r);
      const m = tally.step(r, {
        step: done,
        lr: f.lr,
        tokens: f.tokens,
        seconds: secs,
        // the first step of a process warms kernels up; throughput counts the rest
        counted: f.step > p.startStep || cfg.steps - p.startStep === 1,
        dropped: f.dropped,
      });
      if (due(done, cfg.evalEvery))
        tally.evaluation(m, await strategy.evaluate(valBatches));
      await log.append(m);
      last = m;
      hooks.onStep?.(m, cfg.steps);
      if (done === cfg.steps) {
        result = summarize();
        await log.summary(result);
      }
      if (due(done, cfg.saveEvery)) await save(done);
    };
    // Steps are submitted as soon as the strategy accepts the next one (local parallelism's
    // first stage is free once it has done its part; pipelines accept when the step is done),
    // with at most --queue-depth (default: one per device) unfinished steps. Evaluation and checkpoints wait for every
    // step before them, so they see exactly the state after their step.
    const inFlight: InFlight[] = [];
    const depth = cfg.queueDepth > 0 ? cfg.queueDepth : strategy.devices;
    try {
      // a step's seconds run from the previous step's acceptance to its own, so waiting for a
      // slower later stage (a full queue) counts; evaluation and checkpoints do not
      let mark = performance.now();
      for (let step = p.startStep; step < cfg.steps; step++) {
        while (inFlight.length >= depth) await finish(inFlight.shift()!);
        const batch = batcher.next();
        const lr = lrOf(step);
        const dropped = droppedBlocks(layerDrop, step, model.blocks.length);
        const sub = strategy.submit(batch, lr, dropped);
        inFlight.push({
          step,
          lr,
          tokens: batch.tokens,
          dropped,
          seconds: NaN,
          done: sub.done,
        });
        try {
          await sub.accepted;
        } catch (e) {
          throw withStep(e, step + 1);
        }
        const now = performance.now();
        inFlight[inFlight.length - 1].seconds = (now - mark) / 1000;
        mark = now;
        const done = step + 1;
        if (due(done, cfg.evalEvery) || due(done, cfg.saveEvery)) {
          // the last steps' remaining work is training time too; the evaluation is not
          const last = inFlight[inFlight.length - 1];
          await Promise.all(inFlight.map((f) => f.done));
          last.seconds += (performance.now() - mark) / 1000;
          while (inFlight.length) await finish(inFlight.shift()!);
          mark = performance.now();
        }
      }
      while (inFlight.length) await finish(inFlight.shift()!);
      if (strategy.drainServerSpans)
        recorder.addServerSpans(cfg.steps, await strategy.drainServerSpans());
    } finally {
      // a failure leaves later steps' promises behind: they reject with the same stage error
      for (const f of inFlight) f.done.catch(() => undefined);
    }
  } finally {
    await strategy.close();
  }
  const summary = result ?? summarize(); // a run that trained no step here
  if (!result) await log.summary(summary);
  const traceFiles =
    cfg.trace !== undefined ? await recorder.write(cfg.trace) : undefined;
  // one bubble for the run (summary.json's, printed by the CLI too): see Summary.bubble
  const stages = recorder.summary().map((st) => {
    const idlePct = 100 * (summary.bubble[st.stage] ?? 0);
    return { ...st, idlePct, busyPct: 100 - idlePct };
  });
  return { summary, outDir: cfg.out, stages, traceFiles };
}
