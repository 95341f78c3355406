/**
 * `layerwise train`: data -> model -> strategy -> the training loop (train/loop.ts, the same
 * as the browser page's) with the run folder's I/O: metrics.jsonl, atomic checkpoints, exact
 * resume, and summary.json written last.
 *
 * Everything that can be wrong with the input (config, data, checkpoint, balance) is checked
 * before anything is written, so a bad run leaves no files behind.
 */

import { existsSync } from 'node:fs';
import { readdir, readFile, rm } from 'node:fs/promises';
import { join, resolve } from 'node:path';
import {
  resolveConfig,
  runModelConfig,
  type TrainConfig,
} from '../config/config.js';
import {
  type BatcherState,
  makeBatcher,
  validationBatches,
} from '../data/batcher.js';
import { type Dataset, loadDataset, Vocab } from '../data/index.js';
import { type HostParams, initParams } from '../model/init.js';
import { checkLayerDrop } from '../model/layer-drop.js';
import { loadModel, type Model, modelParamCount } from '../model/model.js';
import type { LossScaleState } from '../optim/loss-scale.js';
import type { OptimizerState } from '../optim/optimizer.js';
import type { StageRange } from '../partition/balance.js';
import type { BudgetCheck } from '../plan/budget.js';
import { parseDevices } from '../runtime/devices.js';
import {
  createStrategy,
  resolveStages,
  validateStrategy,
} from '../strategies/index.js';
import type { Strategy } from '../strategies/strategy.js';
import { LayerwiseError, tagRunDir } from '../util/errors.js';
import { writeFileAtomic } from '../util/fsx.js';
import {
  CHECKPOINTS,
  type Checkpoint,
  cleanCheckpoints,
  findCheckpoint,
  hasCheckpoint,
  holdsRun,
  OLD_CHECKPOINT,
  saveRunCheckpoint,
} from './checkpoint-io.js';
import { type LoopIO, type RunSoFar, TrainingLoop } from './loop.js';
import {
  MetricsLog,
  PENDING_SUMMARY,
  promotePendingSummary,
  type StepMetrics,
  SUMMARY,
  type Summary,
} from './metrics.js';
import { checkRunPaths, lockRunFolder } from './run-folder.js';
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
  SUMMARY,
  PENDING_SUMMARY,
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
 * checkpoint folder to continue exactly from. Returns the summary written to summary.json
 * (written last, after the final checkpoint). Throws {@link LayerwiseError} for bad input
 * (before writing anything; a fresh run that fails on the user's input, a numeric fault say,
 * before its first checkpoint removes what it wrote) and StageError when a stage fails (after
 * stopping every worker).
 */
export async function train(
  raw: Parameters<typeof resolveConfig>[0],
  resume?: string,
  hooks: TrainHooks = {},
  opts: TrainOptions = {},
): Promise<TrainResult> {
  const t0 = performance.now();
  const p = await prepare(raw, resume, opts);
  const { cfg } = p;
  const valBatches = validationSet(p);
  // one writer per run folder: a second run on it fails here, before it writes anything
  const existed = existsSync(cfg.out);
  const lock = await lockRunFolder(cfg.out);
  let undo = false;
  try {
    await tidyRunFolder(p, existed);
    if (p.finished) await refuseFinished(p);
    if (!p.resumedDir && opts.argv)
      await writeFileAtomic(
        join(cfg.out, 'run.json'),
        `${JSON.stringify({ argv: opts.argv })}\n`,
      );
    const r = await run(p, t0, hooks, lock, valBatches);
    await rm(join(cfg.out, 'error.txt'), { force: true }); // a report of an earlier failure is stale now
    return r;
  } catch (e) {
    // a fresh run that failed on the user's input before its first checkpoint leaves nothing
    // (its corrected command then runs on the same --out); an internal error keeps the folder
    // for its report (error.txt), a lost device for its restart (run.json)
    undo = !p.resumedDir && isUserError(e) && !hasCheckpoint(cfg.out);
    throw undo ? e : tagRunDir(e, cfg.out);
  } finally {
    await lock.release();
    if (undo) await undoFreshRun(cfg.out, existed);
  }
}

/** The validation batches of a prepared run; throws {@link LayerwiseError} when there is not one batch. */
function validationSet(p: Prepared): ReturnType<typeof validationBatches> {
  const { cfg, ds, model } = p;
  const context =
    model.config.arch === 'charlm' ? model.config.context : undefined;
  const valBatches = validationBatches(ds, {
    batchSize: cfg.batchSize,
    context,
    maxBatches: cfg.evalBatches,
  });
  if (valBatches.length > 0) return valBatches;
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

/**
 * Before a run starts in its (locked) folder: a resumed run removes what a crash left behind
 * (interrupted saves, checkpoints older or broken newer than its own, a stale pending summary);
 * a fresh run (--overwrite, or a restart before the first checkpoint) removes the old run.
 */
async function tidyRunFolder(p: Prepared, existed: boolean): Promise<void> {
  const { cfg } = p;
  if (p.resumedDir) {
    await cleanCheckpoints(cfg.out, p.resumedDir);
    if (!p.finished) await rm(join(cfg.out, PENDING_SUMMARY), { force: true });
  } else if (existed) {
    await removeRunOutputs(cfg.out);
  }
}

/**
 * A resume of a run whose checkpoint already reaches --steps (tidied already): when the run was
 * killed after its last checkpoint and before its summary.json, its pending summary becomes
 * summary.json, so the run is complete. Then throws {@link LayerwiseError} saying so.
 */
async function refuseFinished(p: Prepared): Promise<never> {
  await promotePendingSummary(p.cfg.out, p.startStep);
  throw alreadyReaches(p.startStep, p.cfg);
}

/** Removes from run folder `out` everything a run writes there ({@link RUN_OUTPUTS}). */
async function removeRunOutputs(out: string): Promise<void> {
  for (const n of await readdir(out))
    if (
      RUN_OUTPUTS.includes(n) ||
      n.startsWith(`${OLD_CHECKPOINT}.`) ||
      n.startsWith('run.json.tmp-') // a write of run.json a kill interrupted
    )
      await rm(join(out, n), { recursive: true, force: true });
}

/** After a fresh run failed before its first checkpoint: what it wrote goes, and its folder if it made it and nothing else is there. */
async function undoFreshRun(out: string, existed: boolean): Promise<void> {
  if (!existsSync(out)) return;
  await removeRunOutputs(out);
  if (!existed && (await readdir(out)).length === 0)
    await rm(out, { recursive: true, force: true });
}

/** Whether `e` comes from the user's input (exit 2): a {@link LayerwiseError}, also from inside a stage. */
function isUserError(e: unknown): boolean {
  const cause = (e as { causeName?: unknown } | null)?.causeName;
  return (
    e instanceof LayerwiseError ||
    cause === 'LayerwiseError' ||
    cause === 'NumericFaultError' ||
    cause === 'DeviceOutOfMemoryError'
  );
}

/** Trains the prepared run in its locked folder: the loop with the run folder's I/O. */
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
  const strategy: Strategy = await createStrategy(cfg, model, p.params, ranges);
  const recorder = traceRecorder(cfg, strategy.devices);
  const log = new MetricsLog(cfg.out);
  let written: Summary | undefined;
  const io = runFolderIO(p, strategy, batcher, log, lock, hooks, (s) => {
    written = s;
  });
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
      startStep: p.startStep,
      resumed: p.stats,
      budget: p.budget,
      t0,
    },
    io,
  );
  try {
    if (p.optimizer) await strategy.setOptimizerState(p.optimizer);
    if (p.stats.lossScale) strategy.setLossScaleState?.(p.stats.lossScale);
    await truncateMetrics(cfg.out, p.startStep); // a fresh run into an old folder starts a new log
    await loop.run();
  } finally {
    await strategy.close();
  }
  const summary = written ?? loop.summary(); // the last step always writes it; kept for safety
  if (!written) await log.summary(summary);
  const traceFiles =
    cfg.trace !== undefined ? await recorder.write(cfg.trace) : undefined;
  // one bubble for the run (summary.json's, printed by the CLI too): see Summary.bubble
  const stages = recorder.summary().map((st) => {
    const idlePct = 100 * (summary.bubble[st.stage] ?? 0);
    return { ...st, idlePct, busyPct: 100 - idlePct };
  });
  return { summary, outDir: cfg.out, stages, traceFiles };
}

/** The run's trace recorder (on with --trace); with data-parallel replicas device d is replica floor(d / K)'s device d mod K. */
function traceRecorder(cfg: TrainConfig, devices: number): TraceRecorder {
  const perReplica = devices / cfg.replicas;
  return new TraceRecorder(
    cfg.trace !== undefined,
    cfg.replicas > 1
      ? (d) => `replica ${Math.floor(d / perReplica)} stage ${d % perReplica}`
      : undefined,
  );
}

/**
 * The training loop's I/O into the run folder: metrics lines appended to metrics.jsonl (and
 * shown by the hooks), checkpoints saved crash-safely, and at the last step the summary written
 * last: pending beside summary.json before the final checkpoint, summary.json once that save is
 * complete (so a summary never stands beside an older checkpoint). `onSummary` hears it.
 */
function runFolderIO(
  p: Prepared,
  strategy: Strategy,
  batcher: ReturnType<typeof makeBatcher>,
  log: MetricsLog,
  lock: { assertHeld(): void },
  hooks: TrainHooks,
  onSummary: (s: Summary) => void,
): LoopIO {
  const { cfg, model, ds } = p;
  let savedStep = p.startStep > 0 ? p.startStep : undefined;
  let savedDir = p.resumedDir;
  const saveCheckpoint = async (step: number, so: RunSoFar) => {
    lock.assertHeld();
    const lossScale = strategy.lossScaleState?.();
    savedDir = await saveRunCheckpoint(cfg.out, {
      step,
      config: cfg as unknown as Record<string, unknown>,
      model: model.config,
      stats: {
        initialLoss: so.initialLoss,
        wallS: so.wallS,
        ...(lossScale ? { lossScale } : {}),
      },
      vocab: ds.kind === 'text' ? ds.vocab.toJSON() : null,
      data: batcher.state(),
      params: await strategy.getParams(),
      optimizer: await strategy.getOptimizerState(),
    });
    savedStep = step;
  };
  return {
    async record(m) {
      await log.append(m);
      hooks.onStep?.(m, cfg.steps);
    },
    async save(step, so) {
      if (so.summary) await log.pendingSummary(so.summary);
      await saveCheckpoint(step, so);
      if (!so.summary) return;
      await log.commitSummary();
      onSummary(so.summary);
    },
    warn: (msg) => hooks.warn?.(msg),
    savedState: () =>
      savedStep !== undefined
        ? `the checkpoint of step ${savedStep} in ${savedDir ?? cfg.out} is intact`
        : 'no checkpoint was saved yet',
  };
}
