/**
 * `layerwise plan`: builds the model a preset gives on its data, profiles its blocks (and, for
 * local parallelism, the auxiliary heads a stage could end with) on the backend (in this
 * thread), runs the planner and renders the result as text.
 */

import { totalmem } from 'node:os';
import type { Precision } from '../backend/names.js';
import {
  optimizerConfigOf,
  resolveConfig,
  runModelConfig,
  type TrainConfig,
} from '../config/config.js';
import { type ModelProfile, optimizerSlots } from '../cost/costs.js';
import { profileModel } from '../cost/profile.js';
import { divisors } from '../cost/strategy-plan.js';
import { loadDataset } from '../data/index.js';
import { paramCount } from '../model/block.js';
import { loadModel, type Model, modelParamCount } from '../model/model.js';
import type { OptimizerConfig } from '../optim/optimizer.js';
import { profileAuxHeads } from '../plan/budget.js';
import {
  checkRequest,
  describe,
  label,
  type Plan,
  type PlanRequest,
  plan,
} from '../plan/plan.js';
import { specOf } from '../strategies/index.js';
import { formatSize, parseSize } from '../util/size.js';

/** The flags of `layerwise plan`. */
export interface PlanOptions {
  /** A preset's name, or undefined with `model`. */
  preset?: string;
  /** Path of a model module (model/module.ts). */
  model?: string;
  /** A size such as 512MB, 1.5GiB or 2e9; default: this machine's memory divided among the stages. */
  deviceMemory?: string;
  /** Devices; default: train's (config DEFAULTS). */
  stages?: number;
  /** Mini-batch size; default: train's (config DEFAULTS). */
  batchSize?: number;
  microBatches?: number;
  backend?: string;
  /** Compute precision: fp32 (default) or the native backend's mixed precision (`--precision`); the blocks are profiled at it. */
  precision?: Exclude<Precision, 'f16'>;
  optimizer?: 'adamw' | 'sgd';
  data?: string;
  layers?: number;
  dModel?: number;
  heads?: number;
  context?: number;
}

/** The micro-batch sizes to profile at: the smallest, the largest and one in between of the candidates (and N for single). */
export function profileSizes(
  batchSize: number,
  microBatches?: number,
): number[] {
  const cands = [
    ...new Set([
      ...(microBatches ? [microBatches] : divisors(batchSize)).map(
        (m) => batchSize / m,
      ),
      batchSize,
    ]),
  ].sort((a, b) => a - b);
  if (cands.length <= 3) return cands;
  return [
    cands[0],
    cands[Math.floor((cands.length - 1) / 2)],
    cands[cands.length - 1],
  ];
}

/**
 * The device memory to plan for, in bytes: --device-memory parsed, else this machine's memory
 * divided among the stages (the CPU backends' devices share it; other devices' memory is not
 * known here); `assumed`, the report's note when it was not given ('' when given). Throws
 * {@link LayerwiseError} for an unparsable size.
 */
function deviceBudget(
  deviceMemoryFlag: string | undefined,
  stages: number,
): { deviceMemory: number; assumed: string } {
  const deviceMemory =
    deviceMemoryFlag !== undefined
      ? parseSize(deviceMemoryFlag)
      : Math.floor(totalmem() / stages);
  const assumed =
    deviceMemoryFlag === undefined
      ? ` (assumed: this machine's ${formatSize(totalmem())} of memory shared by ${stages} device${stages > 1 ? 's' : ''}; give --device-memory to plan for another budget)`
      : '';
  return { deviceMemory, assumed };
}

/**
 * Profiles the model's blocks at the micro-batch sizes `sizes` and, for two or more stages,
 * the auxiliary head any stage but the last could end with (local parallelism). Returns the
 * profile and the seconds profiling took.
 */
async function profileForPlan(
  model: Model,
  cfg: TrainConfig,
  opt: OptimizerConfig,
  sizes: number[],
): Promise<{ profile: ModelProfile; secs: number }> {
  const t0 = performance.now();
  const profile = await profileModel(model, {
    backend: cfg.backend,
    microBatchSizes: sizes,
    optimizer: opt,
    precision: cfg.precision,
  });
  if (cfg.stages >= 2) {
    // local parallelism: the auxiliary head any stage but the last could end with
    profile.auxHeads = await profileAuxHeads(
      model,
      Array.from({ length: model.blocks.length - 1 }, (_, i) => i + 1),
      {
        backend: cfg.backend,
        microBatchSizes: sizes,
        optimizer: opt,
        precision: cfg.precision,
      },
    );
  }
  const secs = (performance.now() - t0) / 1000;
  return { profile, secs };
}

/** The report's table: one row per strategy plan (an unavailable one says why). */
function strategyTable(p: Plan, req: PlanRequest): string {
  const rows = p.strategies.map((s) =>
    s.unavailable
      ? [s.strategy, '-', '-', '-', '-', '-', '-', s.unavailable, '', '', '']
      : [
          label(s),
          s.fits ? 'yes' : 'NO',
          String(s.stages),
          String(s.microBatches),
          s.display.remat,
          s.display.schedule,
          `${s.balance.join(',')}${s.balancedBy === 'whole model' ? '' : ` (${s.balancedBy})`}`,
          s.peakBytes.map(formatSize).join(' / '),
          `${s.bubble.map((b) => b.toFixed(2)).join('/')} vs ${s.exact ? s.idealBubble.toFixed(2) : '-'}`,
          (1000 * s.stepSeconds).toFixed(1),
          req.tokensPerExample! > 1
            ? `${Math.round(s.tokensPerSecond)} tok/s`
            : `${Math.round(s.examplesPerSecond)} ex/s`,
        ],
  );
  return renderTable(
    [
      'strategy',
      'fits',
      'K',
      'M',
      'checkpoint',
      'schedule',
      'balance',
      'peak device bytes per stage',
      'bubble (pred vs ideal)',
      'step ms',
      'throughput',
    ],
    rows,
  );
}

/**
 * The report's recommendation; where one fits, with the `layerwise train` command that runs it,
 * carrying the flags that define the model and the run the plan was made for, so the command
 * line trains exactly that.
 */
function recommendationText(
  o: PlanOptions,
  batchSize: number,
  p: Plan,
): string {
  const given: Array<[string, unknown]> = [
    ['--data', o.data],
    ['--layers', o.layers],
    ['--d-model', o.dModel],
    ['--heads', o.heads],
    ['--context', o.context],
    ['--optimizer', o.optimizer],
    ['--backend', o.backend],
    ['--precision', o.precision],
  ];
  const sameModel = given
    .filter(([, v]) => v !== undefined)
    .map(([f, v]) => ` ${f} ${String(v)}`)
    .join('');
  return p.recommended
    ? `recommendation: ${p.recommendation}\n  run: layerwise train --preset ${o.preset}${sameModel} ${describe(p.recommendedPlan!)} --batch-size ${batchSize}${o.deviceMemory !== undefined ? ` --device-memory ${o.deviceMemory}` : ''}`
    : `recommendation: ${p.recommendation}`;
}

/** The report's notes, each once: the throughput assumption, the strategies' own notes, replicas. */
function planNotes(p: Plan): string[] {
  return [
    ...new Set([
      'throughput assumes one device per stage (a core or an accelerator each)',
      ...p.strategies.flatMap((s) =>
        s.unavailable ? [] : (specOf(s.strategy).planNote ?? []),
      ),
      ...(p.strategies.some((s) => s.replicas)
        ? [
            "a row with replicas: R copies of the strategy's devices, each on 1/R of the mini-batch; peaks are one replica's, the gradient all-reduce is taken as free",
          ]
        : []),
    ]),
  ];
}

/**
 * Plans a preset for a memory budget: validates the request, profiles the model's blocks and
 * returns the plan, the profile and a text report. Throws {@link LayerwiseError} for bad input
 * (unknown preset or backend, unparsable size, micro-batches that do not divide the batch,
 * more stages than blocks) before profiling.
 */
export async function runPlan(
  o: PlanOptions,
): Promise<{ plan: Plan; profile: ModelProfile; text: string }> {
  const cfg = resolveConfig({
    preset: o.preset,
    model: o.model,
    data: o.data,
    batchSize: o.batchSize,
    stages: o.stages,
    backend: o.backend,
    precision: o.precision,
    optimizer: o.optimizer,
    layers: o.layers,
    dModel: o.dModel,
    heads: o.heads,
    context: o.context,
  });
  const { deviceMemory, assumed } = deviceBudget(o.deviceMemory, cfg.stages);
  const ds = await loadDataset(cfg.data);
  const model = await loadModel(await runModelConfig(cfg, ds));
  const opt = optimizerConfigOf(cfg);
  const req: PlanRequest = {
    deviceMemory,
    stages: cfg.stages,
    batchSize: cfg.batchSize,
    microBatches: o.microBatches,
    slots: optimizerSlots(opt),
    clip: opt.clipNorm > 0,
    tokensPerExample: model.config.arch === 'charlm' ? model.config.context : 1,
    paramCounts: model.blocks.map(paramCount),
  };
  checkRequest(req, model.blocks.length);
  const sizes = profileSizes(cfg.batchSize, o.microBatches);
  const { profile, secs } = await profileForPlan(model, cfg, opt, sizes);
  const p = plan(profile, req);
  const head = [
    `plan for ${o.preset}: ${model.blocks.length} blocks, ${modelParamCount(model).toLocaleString('en-US')} parameters, ${cfg.optimizer}, mini-batch ${cfg.batchSize}`,
    `budget ${formatSize(deviceMemory)} per device${assumed}, ${cfg.stages} device${cfg.stages > 1 ? 's' : ''}; profiled on ${cfg.backend} (${cfg.precision}) at micro-batch sizes ${sizes.join(', ')} in ${secs.toFixed(1)} s`,
    '',
  ];
  const table = strategyTable(p, req);
  const rec = recommendationText(o, cfg.batchSize, p);
  const notes = planNotes(p);
  return {
    plan: p,
    profile,
    text: [...head, table, rec, ...notes.map((n) => `note: ${n}`)].join('\n'),
  };
}

function renderTable(columns: string[], rows: string[][]): string {
  const w = columns.map((c, i) =>
    Math.max(c.length, ...rows.map((r) => (r[i] ?? '').length)),
  );
  const line = (cells: string[]) =>
    cells
      .map((c, i) => (c ?? '').padEnd(w[i]))
      .join('  ')
      .trimEnd();
  return `${[line(columns), line(w.map((n) => '-'.repeat(n))), ...rows.map(line)].join('\n')}\n`;
}
