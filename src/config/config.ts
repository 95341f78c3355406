/**
 * The training configuration: one plain object, validated once, saved with every checkpoint.
 * Every field maps to a `layerwise train` flag of the same name in kebab-case.
 */

import { basename } from 'node:path';
import {
  BACKENDS,
  checkPrecision,
  defaultBackend,
  PRECISIONS,
  type Precision,
} from '../backend/names.js';
import { policyOf } from '../backend/precision.js';
import type { Dataset } from '../data/index.js';
import { BUILTIN_DATASETS } from '../data/index.js';
import {
  LAYER_DROP_SCHEDULES,
  type LayerDropSchedule,
} from '../model/layer-drop.js';
import {
  isClassification,
  LOSSES,
  type LossName,
} from '../model/loss-names.js';
import type { ModelConfig } from '../model/model.js';
import { getPreset } from '../model/presets.js';
import {
  defaultOptimizerConfig,
  OPTIMIZER_KINDS,
  type OptimizerConfig,
  type OptimizerKind,
} from '../optim/optimizer.js';
import { parseBalance } from '../partition/balance.js';
import { BALANCE_KINDS, type BalanceKind } from '../partition/stages.js';
import {
  DEFAULT_SCHEDULE,
  REMAT_MODES,
  type RematMode,
  SCHEDULE_KINDS,
  type ScheduleKind,
  scheduleSpec,
  stagesPerDevice,
} from '../schedule/schedule.js';
import { check, LayerwiseError } from '../util/errors.js';
import { parseSize } from '../util/size.js';
import {
  defaultStrategy,
  listNames,
  requireStrategies,
  strategiesWith,
  strategyFlagsOf,
} from './strategy-flags.js';

export { BALANCE_KINDS, type BalanceKind };

/** L2L: where the layer-boundary activations (the stash) live between forward and backward. */
export const STASH_PLACES = ['device', 'host'] as const;
export type StashPlace = (typeof STASH_PLACES)[number];

export interface TrainConfig {
  /** A preset's name (model/presets.ts), or 'module' for a model module (`model`). */
  preset: string;
  /** Path of a model module (model/module.ts) to train instead of a preset. */
  model?: string;
  /** The loss, overriding the one the model declares (model/losses.ts). */
  loss?: LossName;
  /** Which device runs each stage: thread | process[:ENV=V] | HOST:PORT, comma-separated (runtime/devices.ts); default threads. */
  devices?: string;
  /** Data set name or path (see data/index.ts); defaults to the preset's. */
  data: string;
  /** The strategy's name (strategies/index.ts STRATEGY_SPECS validates it). */
  strategy: string;
  /** Number of pipeline stages K (devices). */
  stages: number;
  /** Micro-batches M per mini-batch (per replica, with {@link replicas}). */
  microBatches: number;
  /**
   * Data-parallel replicas R (default 1): R copies of the run's devices (R*K in all), each on
   * 1/R of every mini-batch, gradients summed across replicas before the one step (a ring
   * all-reduce; for l2l, the parameter server sums the replicas' pushes). single, gpipe, l2l.
   */
  replicas: number;
  /** Mini-batch size N (examples). */
  batchSize: number;
  /** Re-materialization (activation checkpointing, flag `--checkpoint` as in torchgpipe): always | except_last | never. */
  remat: RematMode;
  schedule: ScheduleKind;
  /** Stages per device of `--schedule interleaved-1f1b` (at least 2; default 2). */
  virtualStages: number;
  /**
   * A schedule file in PyTorch pipelining's compute-only CSV (schedule/csv.ts), run instead of
   * {@link schedule} (gpipe only; checked by strategies/gpipe.ts before anything starts).
   */
  scheduleFile?: string;
  /**
   * Blocks per stage, or how to balance them: 'flops' (the blocks' FLOP counts, the default),
   * 'params' (parameter count), 'time' or 'memory'
   * (profiled on the backend; see cost/profile.ts).
   */
  balance: number[] | BalanceKind;
  steps: number;
  lr: number;
  warmup: number;
  decay: 'constant' | 'cosine';
  optimizer: OptimizerKind;
  weightDecay?: number;
  clipNorm: number;
  seed: number;
  /**
   * LayerDrop probability P in [0, 1) (model/layer-drop.ts): each training step skips each
   * block but the first and the last with probability P (or, progressive, by PLD); 0 = off.
   */
  layerDrop: number;
  /** How --layer-drop's probability is applied: 'constant' (LayerDrop) or 'progressive' (PLD). */
  layerDropSchedule: LayerDropSchedule;
  backend: string;
  /**
   * Compute precision (backend/names.ts PRECISIONS): 'fp32', or a mixed precision, one policy
   * of formats each (backend/precision.ts policyOf): products on low-precision operands with
   * float32 accumulation; master weights, optimizer state, norms, softmax, loss and gradient
   * sums float32; dynamic loss scaling where the policy has it.
   */
  precision: Precision;
  /** Where the precision policy scales the loss (f16): the initial dynamic loss scale (optim/loss-scale.ts; default 2^16, halved at each overflow, doubled after 2000 steps without). */
  lossScale: number;
  /** Threads of each device's kernels (native backend: its OpenMP team); 0 = the cores, less one in 8 for the host's threads from 8 cores up (strategies/spec.ts hostCores), divided among the devices. */
  threads: number;
  out: string;
  /** Evaluate the validation loss every this many steps (and at the end); 0 = only at the end. */
  evalEvery: number;
  /** Validation batches per evaluation. */
  evalBatches: number;
  /** Save a checkpoint every this many steps (and at the end); 0 = only at the end. */
  saveEvery: number;
  /** Local parallelism: blocks at the end of each stage also trained by the next stage's loss. */
  overlap: number;
  /**
   * Local parallelism: at most this many mini-batches in flight between the first and the last
   * stage (0: one per stage). A slow stage stalls the first one instead of letting its queue grow.
   */
  queueDepth: number;
  /** Local parallelism: fixed interleaving of overlap updates (reproducible) instead of free-running. */
  deterministic: boolean;
  /** Write a Chrome trace of every step to this file (and an SVG timeline beside it). */
  trace?: string;
  /**
   * L2L: where the layer-boundary activations wait between forward and backward: on the device
   * (faster, grows with depth) or in host memory (device memory constant in depth).
   */
  stash: StashPlace;
  /** L2L: worker threads of the eager parameter server's optimizer. */
  serverThreads: number;
  /**
   * Device memory budget per device, bytes (`--device-memory 512MB`). A run whose predicted
   * peak exceeds it fails before training; one that exceeds it while running fails at once.
   */
  deviceMemory?: number;
  layers?: number;
  dModel?: number;
  heads?: number;
  context?: number;
}

/**
 * Every flag's default but `--strategy`'s, which the registered strategies declare
 * (strategy-flags.ts defaultStrategy).
 */
export const DEFAULTS: Omit<
  TrainConfig,
  'preset' | 'data' | 'out' | 'strategy'
> = {
  stages: 1,
  microBatches: 1,
  batchSize: 32,
  remat: 'except_last',
  schedule: DEFAULT_SCHEDULE,
  virtualStages: 2,
  replicas: 1,
  balance: 'flops',
  steps: 100,
  lr: 3e-3,
  warmup: 10,
  decay: 'cosine',
  optimizer: 'adamw',
  clipNorm: 1,
  seed: 1,
  layerDrop: 0,
  layerDropSchedule: 'constant',
  backend: defaultBackend(),
  precision: 'fp32',
  lossScale: 65536,
  threads: 0,
  evalEvery: 50,
  evalBatches: 8,
  saveEvery: 0,
  overlap: 0,
  deterministic: false,
  queueDepth: 0,
  stash: 'host',
  serverThreads: 1,
};

function oneOf<T extends string>(
  name: string,
  v: string,
  valid: readonly T[],
): T {
  if (!valid.includes(v as T))
    throw new LayerwiseError(
      `unknown ${name} '${v}'; valid: ${valid.join(', ')}`,
    );
  return v as T;
}

function posInt(name: string, v: number, min = 1): number {
  check(
    Number.isInteger(v) && v >= min,
    `--${name} must be an integer >= ${min}, got ${v}`,
  );
  return v;
}

/**
 * Configuration keys of earlier versions, as saved in their checkpoints' config.json, and their
 * names now: `checkpoint` (the re-materialization mode) and `epsThreads` (the parameter server's
 * optimizer threads).
 */
const LEGACY_KEYS: Record<string, keyof TrainConfig> = {
  checkpoint: 'remat',
  epsThreads: 'serverThreads',
};

function renameLegacyKeys<T extends object>(raw: T): T {
  const out = { ...raw } as Record<string, unknown>;
  for (const [old, now] of Object.entries(LEGACY_KEYS)) {
    if (old in out) {
      if (out[now] === undefined) out[now] = out[old];
      delete out[old];
    }
  }
  return out as T;
}

/** What {@link resolveConfig} takes: TrainConfig's fields, any missing, balance and deviceMemory as given on the command line. */
type RawConfig = Parameters<typeof resolveConfig>[0];

/**
 * The model a raw configuration names: a model module (--model, which needs --data) or a
 * preset; `modelName` names the default run folder. Throws {@link LayerwiseError} when both or
 * neither are given, for an unknown preset, or for --model without --data.
 */
function modelSource(raw: RawConfig): {
  module: boolean;
  preset: ReturnType<typeof getPreset> | undefined;
  modelName: string;
} {
  const module = raw.model !== undefined;
  check(
    !module || raw.preset === undefined || raw.preset === MODULE_PRESET,
    `--model and --preset ${raw.preset} both name a model; give one`,
  );
  check(
    module || raw.preset !== undefined,
    '--preset or --model is required; see layerwise train --help',
  );
  const preset = module ? undefined : getPreset(raw.preset!);
  const modelName = module
    ? basename(raw.model!).replace(/\.[^.]*$/, '')
    : raw.preset!;
  check(
    !module || raw.data !== undefined,
    `--data is required with --model: a built-in data set (${BUILTIN_DATASETS.join(', ')}), a .jsonl file or npy:X.npy,Y.npy`,
  );
  return { module, preset, modelName };
}

/**
 * The raw configuration over {@link DEFAULTS}, with the preset (or MODULE_PRESET), data set, run
 * folder, --balance (a kind or per-stage block counts) and --device-memory (bytes) resolved.
 * Throws {@link LayerwiseError} for an unparsable --balance or --device-memory.
 */
function withDefaults(
  raw: RawConfig,
  { module, preset, modelName }: ReturnType<typeof modelSource>,
): TrainConfig {
  const strategy = raw.strategy ?? defaultStrategy();
  return {
    strategy, // first, as config.json has always listed it
    ...DEFAULTS,
    ...Object.fromEntries(
      Object.entries(raw).filter(([, v]) => v !== undefined),
    ),
    preset: module ? MODULE_PRESET : raw.preset!,
    data: raw.data ?? preset!.defaultData,
    out: raw.out ?? `runs/${modelName}-${strategy}`,
    balance:
      typeof raw.balance === 'string'
        ? (BALANCE_KINDS as readonly string[]).includes(raw.balance)
          ? raw.balance
          : parseBalance(raw.balance)
        : (raw.balance ?? DEFAULTS.balance),
    deviceMemory:
      typeof raw.deviceMemory === 'string'
        ? parseSize(raw.deviceMemory)
        : raw.deviceMemory,
  } as TrainConfig;
}

/** Checks the backend, the precision and the loss scale (throws {@link LayerwiseError}). */
function checkNumerics(c: TrainConfig): void {
  oneOf('backend', c.backend, BACKENDS);
  oneOf('precision', c.precision, PRECISIONS);
  checkPrecision(c.precision, c.backend);
  check(
    c.lossScale > 0 && Number.isFinite(c.lossScale),
    `--loss-scale must be a positive number, got ${c.lossScale}`,
  );
  const refuses = strategyFlagsOf(c.strategy)?.refusesLossScaling;
  check(
    !policyOf(c.precision).lossScaling || refuses === undefined,
    () =>
      `--precision f16 (with dynamic loss scaling) runs --strategy ${listNames(
        strategiesWith((s) => s.refusesLossScaling === undefined),
        'and',
      )}, not ${c.strategy} (${refuses}): use --precision fp32`,
  );
}

/** Checks the re-materialization mode, the schedule and the strategies it needs (throws {@link LayerwiseError}). */
function checkSchedule(c: TrainConfig): void {
  oneOf('checkpoint mode', c.remat, REMAT_MODES);
  oneOf('schedule', c.schedule, SCHEDULE_KINDS);
  posInt('virtual-stages', c.virtualStages);
  check(
    c.virtualStages >= 2 || !scheduleSpec(c.schedule).takesVirtualStages,
    `--schedule ${c.schedule} runs several stages per device: --virtual-stages must be at least 2, got ${c.virtualStages}`,
  );
  const places = strategyFlagsOf(c.strategy)?.placesStages === true;
  const placers = () =>
    listNames(
      strategiesWith((s) => !!s.placesStages),
      'or',
    );
  check(
    stagesPerDevice(c.schedule) === 1 || places,
    () =>
      `--schedule ${c.schedule} runs several stages per device, a ${placers()} schedule: it needs --strategy ${placers()}, not ${c.strategy}`,
  );
  check(
    c.scheduleFile === undefined || places,
    () =>
      `--schedule-file runs a pipeline schedule: it needs --strategy ${placers()}, not ${c.strategy}`,
  );
}

/** Checks the optimizer, the stash place, the thread counts and --device-memory (throws {@link LayerwiseError}). */
function checkOptimizerAndDevices(c: TrainConfig): void {
  oneOf('optimizer', c.optimizer, OPTIMIZER_KINDS);
  oneOf('stash place', c.stash, STASH_PLACES);
  posInt('server-threads', c.serverThreads);
  posInt('threads', c.threads, 0);
  check(
    c.deviceMemory === undefined ||
      (Number.isFinite(c.deviceMemory) && c.deviceMemory > 0),
    `--device-memory must be a positive size such as 512MB, got ${c.deviceMemory}`,
  );
}

/**
 * Checks the counts of the run (stages, micro-batches, replicas, batch, steps, evaluation,
 * saves, overlap, queue) and the training numbers (seed, lr, clipping, layer drop) (throws
 * {@link LayerwiseError}).
 */
function checkRun(c: TrainConfig): void {
  oneOf('decay', c.decay, ['constant', 'cosine'] as const);
  posInt('stages', c.stages);
  posInt('micro-batches', c.microBatches);
  posInt('replicas', c.replicas);
  const refuses = strategyFlagsOf(c.strategy)?.refusesReplicas;
  check(
    c.replicas === 1 || refuses === undefined,
    () =>
      `--replicas ${c.replicas}: data-parallel replicas run ${listNames(
        strategiesWith((s) => s.refusesReplicas === undefined),
        'and',
      )}, whose updates are the mini-batch's; ${refuses}; drop --replicas`,
  );
  posInt('batch-size', c.batchSize);
  posInt('steps', c.steps);
  posInt('warmup', c.warmup, 0);
  posInt('eval-every', c.evalEvery, 0);
  posInt('eval-batches', c.evalBatches);
  posInt('save-every', c.saveEvery, 0);
  posInt('overlap', c.overlap, 0);
  posInt('queue-depth', c.queueDepth, 0);
  check(
    c.overlap === 0 || strategyFlagsOf(c.strategy)?.overlap === true,
    () =>
      `--overlap applies to --strategy ${listNames(
        strategiesWith((s) => !!s.overlap),
        'or',
      )} only`,
  );
  check(Number.isInteger(c.seed), `--seed must be an integer, got ${c.seed}`);
  check(
    c.lr > 0 && Number.isFinite(c.lr),
    `--lr must be a positive number, got ${c.lr}`,
  );
  check(
    c.clipNorm >= 0,
    `--clip-norm must be >= 0 (0 disables clipping), got ${c.clipNorm}`,
  );
  check(
    c.layerDrop >= 0 && c.layerDrop < 1,
    `--layer-drop must be a probability in [0, 1), got ${c.layerDrop}`,
  );
  oneOf('layer-drop schedule', c.layerDropSchedule, LAYER_DROP_SCHEDULES);
}

/** Checks that the micro-batches and replicas divide the batch, and the model's size flags (throws {@link LayerwiseError}). */
function checkShapes(c: TrainConfig): void {
  check(
    c.batchSize % c.microBatches === 0,
    `--micro-batches ${c.microBatches} must divide --batch-size ${c.batchSize}; pick a divisor of ${c.batchSize}`,
  );
  check(
    c.batchSize % (c.microBatches * c.replicas) === 0,
    `--batch-size ${c.batchSize} must be a multiple of --replicas ${c.replicas} x --micro-batches ${c.microBatches} = ${c.microBatches * c.replicas} (each replica takes an equal share, cut in M micro-batches)`,
  );
  for (const k of ['layers', 'dModel', 'heads', 'context'] as const) {
    if (c[k] !== undefined)
      posInt(
        k.replace(/[A-Z]/g, (m) => `-${m.toLowerCase()}`),
        c[k]!,
      );
  }
}

/**
 * Fills defaults and validates everything that can be checked without the data or the model,
 * the strategy-dependent checks from the strategies' registered flags (strategy-flags.ts: load
 * strategies/index.js first). Throws {@link LayerwiseError} naming the flag and the valid
 * values, or that no strategy is registered.
 */
export function resolveConfig(
  raw: Partial<Omit<TrainConfig, 'balance' | 'deviceMemory' | 'preset'>> & {
    preset?: string;
    balance?: string | number[];
    deviceMemory?: string | number;
  },
): TrainConfig {
  requireStrategies(); // their flags answer the checks below
  raw = renameLegacyKeys(raw);
  const source = modelSource(raw);
  if (raw.loss !== undefined) oneOf('loss', raw.loss, LOSSES);
  const c = withDefaults(raw, source);
  checkNumerics(c);
  checkSchedule(c);
  checkOptimizerAndDevices(c);
  checkRun(c);
  checkShapes(c);
  return c;
}

/** The initial dynamic loss scale where the run's precision policy scales the loss, else undefined. */
export function lossScalingOf(
  cfg: Pick<TrainConfig, 'precision' | 'lossScale'>,
): number | undefined {
  return policyOf(cfg.precision).lossScaling ? cfg.lossScale : undefined;
}

/**
 * The optimizer a configuration asks for: the kind's defaults (optim/optimizer.ts) with the
 * run's --clip-norm and, when given, --weight-decay. Every strategy, the planner and the
 * device budget build their optimizer with this.
 */
export function optimizerConfigOf(
  cfg: Pick<TrainConfig, 'optimizer' | 'clipNorm' | 'weightDecay'>,
): OptimizerConfig {
  const o = {
    ...defaultOptimizerConfig(cfg.optimizer),
    clipNorm: cfg.clipNorm,
  };
  if (cfg.weightDecay !== undefined) o.weightDecay = cfg.weightDecay;
  return o;
}

/** The `preset` of a configuration that trains a model module. */
export const MODULE_PRESET = 'module';

/**
 * The model configuration of a run: the preset's on this data set, or the model module's, with
 * its loss resolved (--loss, else what the module declares, else softmax cross-entropy on
 * logits for classes and mean squared error for values) and checked against the data.
 * @throws LayerwiseError when the module does not load or does not fit the data (input shape,
 *   classes, loss).
 */
export async function runModelConfig(
  cfg: TrainConfig,
  ds: Dataset,
): Promise<ModelConfig> {
  if (cfg.model === undefined) return modelConfigFor(cfg, ds);
  const { loadModelModule, resolveModulePath } = await import(
    '../model/module.js'
  ); // loads TF.js
  const path = await resolveModulePath(cfg.model);
  const m = await loadModelModule(path);
  const classes =
    ds.kind === 'text'
      ? ds.vocab.size
      : ds.kind === 'image'
        ? ds.classes
        : datasetClasses(ds);
  const loss =
    cfg.loss ??
    m.loss ??
    (classes !== undefined ? 'softmax-cross-entropy' : 'mse');
  const where = `model module ${cfg.model}`;
  const exampleShape =
    ds.kind === 'text'
      ? [cfg.context ?? m.inputShape[0]!]
      : ds.kind === 'image'
        ? ds.shape
        : datasetExampleShape(ds);
  check(
    JSON.stringify(exampleShape) === JSON.stringify(m.inputShape),
    () =>
      `${where} takes inputs of shape [${m.inputShape.join(', ')}] but ${ds.name} gives [${exampleShape.join(', ')}]; make the model's input shape match the data`,
  );
  const wantDtype = ds.kind === 'text' ? 'int32' : 'float32';
  check(
    m.inputDtype === wantDtype,
    () =>
      `${where} takes ${m.inputDtype} inputs but ${ds.name} gives ${wantDtype}${wantDtype === 'int32' ? ' token ids' : ' values'}; set the input layer's dtype to ${wantDtype}`,
  );
  // the output must fit the loss: probe the blocks' output shapes for a batch of 2
  const out = m.blocks.reduce((s, b) => b.outputShape(s), [2, ...m.inputShape]);
  if (isClassification(loss)) {
    check(
      classes !== undefined,
      () =>
        `loss ${loss} needs class labels but ${ds.name} has value targets; use --loss mse`,
    );
    const labelRank = ds.kind === 'text' ? 2 : 1;
    check(
      out.length === labelRank + 1 && out[out.length - 1]! >= classes!,
      () =>
        `${where} outputs [${out.join(', ')}] for a batch of 2, but loss ${loss} on ${ds.name} needs [${ds.kind === 'text' ? `2, ${exampleShape[0]}, ` : '2, '}C] scores with C >= ${classes} classes; change the last layer's units or --loss`,
    );
  } else {
    const target = datasetTargetShape(ds);
    const size = (s: number[]) => s.reduce((a, b) => a * b, 1);
    // the loss reshapes the targets to the output: a [B] target fits a [B, 1] output
    check(
      target !== undefined && size(out.slice(1)) === size(target),
      () =>
        `${where} outputs [${out.slice(1).join(', ')}] per example but loss mse on ${ds.name} needs ${target ? `[${target.join(', ')}]` : 'value targets (this data set has class labels; use a classification loss)'}`,
    );
  }
  return {
    arch: 'module',
    path,
    loss,
    inputShape: m.inputShape,
    inputDtype: m.inputDtype,
  };
}

/** Classes of a tensor data set with class labels (undefined for value targets). */
const datasetClasses = (ds: Dataset): number | undefined =>
  ds.kind === 'tensor' && ds.target.kind === 'classes'
    ? ds.target.classes
    : undefined;
const datasetExampleShape = (ds: Dataset): number[] =>
  ds.kind === 'tensor' ? ds.xShape : [];
/** One example's target shape for value (regression) targets; undefined for class labels. */
const datasetTargetShape = (ds: Dataset): number[] | undefined =>
  ds.kind === 'tensor' && ds.target.kind === 'values'
    ? ds.target.shape
    : undefined;

/** The model configuration a preset gives on a data set, with shape overrides. */
export function modelConfigFor(cfg: TrainConfig, ds: Dataset): ModelConfig {
  if (cfg.model !== undefined)
    throw new LayerwiseError(
      `a model module's configuration is resolved by runModelConfig (it loads the module)`,
    );
  const preset = getPreset(cfg.preset);
  if (preset.data !== ds.kind) {
    throw new LayerwiseError(
      `preset ${cfg.preset} trains on ${preset.data} data but --data ${cfg.data} is ${ds.kind} data; use e.g. --data ${preset.defaultData}`,
    );
  }
  const shape =
    ds.kind === 'text'
      ? { vocab: ds.vocab.size }
      : { inputShape: ds.shape, classes: ds.classes };
  return preset.make(shape, cfg);
}

/**
 * Stages of a run's partition: --stages K devices times the stages each runs (a strategy that
 * places a schedule's stages, gpipe, with an interleaved or V-shape schedule; a schedule file's
 * own count, found by reading it, is checked by strategies/gpipe.ts), else K.
 */
export function stageCount(cfg: TrainConfig): number {
  if (
    strategyFlagsOf(cfg.strategy)?.placesStages !== true ||
    cfg.scheduleFile !== undefined
  )
    return cfg.stages;
  return cfg.stages * stagesPerDevice(cfg.schedule, cfg.virtualStages);
}

/** Examples per micro-batch of a run: the mini-batch cut among its replicas, then in M micro-batches. */
export function microBatchSize(cfg: TrainConfig): number {
  return cfg.batchSize / (cfg.microBatches * cfg.replicas);
}

/** The schedule a run names (summary.json, the run's first lines): the kind, or the file it ran. */
export function scheduleName(cfg: TrainConfig): string {
  return cfg.scheduleFile !== undefined
    ? `file ${cfg.scheduleFile}`
    : cfg.schedule;
}
