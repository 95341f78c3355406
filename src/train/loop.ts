/**
 * The one training loop, shared by `layerwise train` (train/trainer.ts) and the browser page
 * (web/run.ts): it submits the steps (up to the queue depth in flight, each with its learning
 * rate and its LayerDrop set), checks each step's loss (finite; the divergence warning), folds
 * the reports into metrics lines ({@link StepTally}), evaluates when due, stops when asked, and
 * gives summary.json's fields. What the caller does with the records (a run folder's
 * metrics.jsonl, checkpoints and summary.json; the page's memory and drawings) is passed in as
 * {@link LoopIO} callbacks, so both run exactly the same steps.
 */
import { precisionNote } from '../backend/names.js';
import { scheduleName, type TrainConfig } from '../config/config.js';
import type { Batch, Batcher } from '../data/batcher.js';
import { droppedBlocks } from '../model/layer-drop.js';
import { type Model, modelParamCount } from '../model/model.js';
import { learningRate } from '../optim/lr.js';
import type { StageRange } from '../partition/balance.js';
import type { BudgetCheck } from '../plan/budget.js';
import { specOf } from '../strategies/index.js';
import { deviceThreads } from '../strategies/spec.js';
import type { StepReport, Strategy } from '../strategies/strategy.js';
import { NumericFaultError } from '../util/errors.js';
import type { StepMetrics, Summary } from './metrics.js';
import { StepTally } from './step-tally.js';
import type { TraceRecorder } from './trace.js';

/** How far above its running median a loss must be for the divergence warning. */
const DIVERGENCE_FACTOR = 10;
/** Steps of loss history before the divergence guard speaks, and the window of its median. */
const DIVERGENCE_WARMUP = 2;
const DIVERGENCE_WINDOW = 50;

/** What the loop trains: the run's configuration, devices, data and records. */
export interface LoopSetup {
  cfg: TrainConfig;
  model: Model;
  /** The started strategy (its devices up; a resumed optimizer state already set). */
  strategy: Strategy;
  /** The training batches, positioned at `startStep` (a resumed batcher state). */
  batcher: Batcher;
  valBatches: Batch[];
  /** The stages' block ranges. */
  ranges: StageRange[];
  /** Whether targets are characters of a text (tokens/s, bits per character) rather than examples. */
  text: boolean;
  /** The timeline every step is added to (enabled or not by the caller). */
  recorder: TraceRecorder;
  /** Steps done before (a resumed checkpoint's step); default 0. */
  startStep?: number;
  /** A resumed checkpoint's records: the run's first loss and its wall seconds before this process. */
  resumed?: { initialLoss?: number; wallS: number };
  /** With --device-memory: the budget and predicted peaks (written to the summary). */
  budget?: BudgetCheck;
  /** performance.now() when this process began the run (wall_s counts from it); default: now. */
  t0?: number;
}

/** The run's records so far, handed to {@link LoopIO.save}. */
export interface RunSoFar {
  /** The loss of the run's first step. */
  initialLoss?: number;
  /** Wall seconds of the run so far, earlier processes included. */
  wallS: number;
  /** At the run's last step only: the finished run's summary (summary.json's fields). */
  summary?: Summary;
}

/** Where the loop's records go: the caller's I/O. */
export interface LoopIO {
  /** A finished step's metrics line (with its evaluation when one was due) and its report. */
  record(m: StepMetrics, r: StepReport): void | Promise<void>;
  /**
   * Saves the state after step `step` (counted from 1): called every --save-every steps and at
   * the last step, after that step's {@link record}, with every earlier step finished. Absent:
   * nothing is saved (the page).
   */
  save?(step: number, run: RunSoFar): Promise<void>;
  /** Asked before each submission: true ends the run once the steps already submitted finish. */
  stopRequested?(): boolean;
  /** A warning, at most once per run (the divergence guard). */
  warn?(msg: string): void;
  /** What a numeric fault's message says of the saved state (e.g. "the checkpoint of step 4 in D is intact"). */
  savedState?(): string;
}

/** How the loop ended: the steps done (counted from 1, earlier processes included) and whether a stop was asked. */
export interface LoopEnd {
  steps: number;
  stopped: boolean;
}

/** A step handed to the strategy whose report has not been recorded yet. */
interface InFlight {
  /** The step's index, 0-based. */
  step: number;
  lr: number;
  tokens: number;
  /** Blocks the step skips (--layer-drop). */
  dropped: number[];
  /** The step's share of the training wall time, seconds (see {@link TrainingLoop.run}). */
  seconds: number;
  done: Promise<StepReport>;
  /** Whether `done` has settled (the step finished or failed), so recording it does not wait. */
  settled: boolean;
}

/**
 * One run's training steps. Construct it with the started strategy and the caller's I/O, call
 * {@link run} once, then {@link summary} for summary.json's fields.
 */
export class TrainingLoop {
  private readonly tally: StepTally;
  private readonly recent: number[] = [];
  private warned = false;
  private initialLoss: number | undefined;
  private last: StepMetrics | undefined;
  private reached: number;
  private readonly start: number;
  private readonly t0: number;

  constructor(
    private readonly s: LoopSetup,
    private readonly io: LoopIO,
  ) {
    this.start = s.startStep ?? 0;
    this.reached = this.start;
    this.initialLoss = s.resumed?.initialLoss;
    this.t0 = s.t0 ?? performance.now();
    this.tally = new StepTally(
      s.strategy.devices,
      s.text,
      specOf(s.cfg.strategy).stageLosses,
      s.cfg.layerDrop > 0,
    );
  }

  /** Wall seconds of the run so far, earlier processes (a resumed checkpoint's) included. */
  wallSeconds(): number {
    return (this.s.resumed?.wallS ?? 0) + (performance.now() - this.t0) / 1000;
  }

  /**
   * Trains from the start step to --steps (or until {@link LoopIO.stopRequested}): steps are
   * submitted as soon as the strategy accepts the next one (local parallelism's first stage is
   * free once it has done its part; pipelines accept when the step is done), with at most
   * --queue-depth (default: one per device) unfinished. A step already done is recorded (its
   * metrics line, the hooks) after the next one is submitted, while that one runs: the
   * recording is off the devices' path (a pipeline's devices would otherwise wait for it, about
   * a millisecond a step). Evaluations and saves wait for every step before them, so they see
   * exactly the state after their step. A step's seconds run from the previous step's
   * acceptance to its own, so waiting for a slower later stage (a full queue) counts;
   * evaluation and saves do not. Throws {@link NumericFaultError} (a LayerwiseError) at the
   * step whose loss is not finite (the next step, already submitted, updates nothing that is
   * saved: the run ends there), and what the strategy or the I/O throws.
   */
  async run(): Promise<LoopEnd> {
    const { cfg, strategy } = this.s;
    const inFlight: InFlight[] = [];
    const depth = cfg.queueDepth > 0 ? cfg.queueDepth : strategy.devices;
    let stopped = false;
    let next: InFlight | undefined;
    try {
      let mark = performance.now();
      for (let step = this.start; step < cfg.steps; step++) {
        while (inFlight.filter((g) => !g.settled).length >= depth)
          await this.finish(inFlight.shift()!);
        if (this.io.stopRequested?.()) {
          stopped = true;
          break;
        }
        const sub = this.submit(step);
        next = sub.f;
        while (inFlight[0]?.settled) await this.finish(inFlight.shift()!);
        const f = await this.accept(sub);
        next = undefined;
        inFlight.push(f);
        const now = performance.now();
        f.seconds = (now - mark) / 1000;
        mark = now;
        if (this.flushDue(step + 1)) {
          // the last steps' remaining work is training time too; the evaluation is not
          await Promise.all(inFlight.map((g) => g.done));
          f.seconds += (performance.now() - mark) / 1000;
          while (inFlight.length) await this.finish(inFlight.shift()!);
          mark = performance.now();
        }
      }
      while (inFlight.length) await this.finish(inFlight.shift()!);
      if (strategy.drainServerSpans)
        this.s.recorder.addServerSpans(
          this.reached,
          await strategy.drainServerSpans(),
        );
    } finally {
      // a failure leaves later steps' promises behind: they reject with the same stage error
      for (const f of next ? [...inFlight, next] : inFlight)
        f.done.catch(() => undefined);
    }
    return { steps: this.reached, stopped };
  }

  /** summary.json's fields from the steps recorded so far (`steps`: the steps done). */
  summary(): Summary {
    const { cfg, ranges, budget } = this.s;
    return {
      ...runShape(
        cfg,
        ranges,
        modelParamCount(this.s.model),
        specOf(cfg.strategy).deviceLoads?.(cfg, this.s.model, ranges),
      ),
      steps: this.reached,
      initial_loss: this.initialLoss ?? Number.NaN,
      final_loss: this.last?.loss ?? Number.NaN,
      ...this.tally.summaryFields(),
      // with --device-memory: the budget and the peak predicted before training, beside the measured one
      ...(budget
        ? {
            device_memory_budget: budget.budget,
            predicted_peak_device_bytes:
              budget.predicted?.map(Math.round) ?? null,
          }
        : {}),
      wall_s: this.wallSeconds(),
    };
  }

  /** Submits step `step` (0-based) to the strategy: the step in flight, and when the strategy accepts the next one. */
  private submit(step: number): { f: InFlight; accepted: Promise<void> } {
    const { cfg, model, batcher, strategy } = this.s;
    const batch = batcher.next();
    const lr = learningRate(step, {
      lr: cfg.lr,
      warmup: cfg.warmup,
      decay: cfg.decay,
      totalSteps: cfg.steps,
      minRatio: 0.1,
    });
    const layerDrop = {
      p: cfg.layerDrop,
      schedule: cfg.layerDropSchedule,
      seed: cfg.seed,
    };
    const dropped = droppedBlocks(layerDrop, step, model.blocks.length);
    const sub = strategy.submit(batch, lr, dropped, step); // step: 0-based, seeds dropout
    const f: InFlight = {
      step,
      lr,
      tokens: batch.tokens,
      dropped,
      seconds: Number.NaN,
      done: sub.done,
      settled: false,
    };
    const settle = () => {
      f.settled = true;
    };
    sub.done.then(settle, settle);
    return { f, accepted: sub.accepted };
  }

  /** Waits until the strategy accepts the step after `sub` (its failure: the step's error, with the step). */
  private async accept(sub: {
    f: InFlight;
    accepted: Promise<void>;
  }): Promise<InFlight> {
    try {
      await sub.accepted;
    } catch (e) {
      sub.f.done.catch(() => undefined); // rejects with the same error
      throw this.withStep(e, sub.f.step + 1);
    }
    return sub.f;
  }

  /** Whether every step in flight must finish after step `done` (counted from 1): an evaluation or a save follows it. */
  private flushDue(done: number): boolean {
    const { cfg } = this.s;
    return (
      this.due(done, cfg.evalEvery) ||
      (this.io.save !== undefined && this.due(done, cfg.saveEvery))
    );
  }

  private due(done: number, every: number): boolean {
    return (every > 0 && done % every === 0) || done === this.s.cfg.steps;
  }

  /** Records a submitted step once it is done: checks, metrics line, evaluation, save. */
  private async finish(f: InFlight): Promise<void> {
    const { cfg, strategy } = this.s;
    const done = f.step + 1;
    let r: StepReport;
    try {
      r = await f.done;
    } catch (e) {
      throw this.withStep(e, done);
    }
    this.checkLoss(r, done);
    this.watchDivergence(r.loss, done);
    this.initialLoss ??= r.loss;
    this.s.recorder.add(done, r);
    const m = this.tally.step(r, {
      step: done,
      lr: f.lr,
      tokens: f.tokens,
      seconds: f.seconds,
      // the first step of a process warms kernels up; throughput counts the rest
      counted: f.step > this.start || cfg.steps - this.start === 1,
      dropped: f.dropped,
    });
    if (this.due(done, cfg.evalEvery))
      this.tally.evaluation(m, await strategy.evaluate(this.s.valBatches));
    this.last = m;
    this.reached = done;
    await this.io.record(m, r);
    if (this.io.save && this.due(done, cfg.saveEvery))
      await this.io.save(done, {
        initialLoss: this.initialLoss,
        wallS: this.wallSeconds(),
        summary: done === cfg.steps ? this.summary() : undefined,
      });
  }

  /** Throws a {@link NumericFaultError} when step `done`'s loss is not finite, naming the stage whose local loss was first. */
  private checkLoss(r: StepReport, done: number): void {
    if (Number.isFinite(r.loss)) return;
    const st = r.stageLosses.findIndex((l) => !Number.isFinite(l));
    const where =
      specOf(this.s.cfg.strategy).stageLosses && st >= 0
        ? ` (first in the local loss of stage ${st})`
        : '';
    throw new NumericFaultError(`loss became ${r.loss}${where}`).at(
      done,
      this.advice(),
    );
  }

  /** Warns once when a loss is more than {@link DIVERGENCE_FACTOR}x its running median. */
  private watchDivergence(loss: number, done: number): void {
    const recent = this.recent;
    if (recent.length >= DIVERGENCE_WARMUP && !this.warned) {
      const median = [...recent].sort((a, b) => a - b)[
        Math.floor((recent.length - 1) / 2)
      ]!; // the lower median
      if (loss > DIVERGENCE_FACTOR * median) {
        this.warned = true;
        this.io.warn?.(
          `loss ${loss.toPrecision(3)} at step ${done} is more than ${DIVERGENCE_FACTOR}x its running median ${median.toPrecision(3)}: training may be diverging; consider a lower --lr (now ${this.s.cfg.lr})`,
        );
      }
    }
    recent.push(loss);
    if (recent.length > DIVERGENCE_WINDOW) recent.shift();
  }

  /** The saved state (where the caller says) and what to change, for a numeric fault's message. */
  private advice(): string {
    const { cfg } = this.s;
    const saved = this.io.savedState?.();
    return `${saved ? `${saved}; ` : ''}lower --lr (now ${cfg.lr})${cfg.clipNorm > 0 ? '' : ' or set --clip-norm'}`;
  }

  /** A numeric fault of step `done`, found before any parameter was updated with it (see PipelineStrategy), with the step and advice. */
  private withStep(e: unknown, done: number): unknown {
    return e instanceof NumericFaultError && e.step === undefined
      ? e.at(done, `nothing was updated with it; ${this.advice()}`)
      : e;
  }
}

/** summary.json's fields that describe the run's set-up (strategy, backend, partition, batch). */
export function runShape(
  cfg: TrainConfig,
  ranges: StageRange[],
  params: number,
  loads?: readonly number[],
): Pick<
  Summary,
  | 'strategy'
  | 'backend'
  | 'precision'
  | 'precision_note'
  | 'preset'
  | 'params'
  | 'stages'
  | 'devices'
  | 'virtual_stages'
  | 'replicas'
  | 'micro_batches'
  | 'rematerialization'
  | 'schedule'
  | 'balance'
  | 'batch_size'
  | 'threads_per_device'
> {
  const spec = specOf(cfg.strategy);
  return {
    strategy: cfg.strategy,
    backend: cfg.backend,
    precision: cfg.precision,
    ...(cfg.precision !== 'fp32'
      ? { precision_note: precisionNote(cfg.precision) }
      : {}),
    preset: cfg.preset,
    params,
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
    threads_per_device: deviceThreads(cfg, spec.oneDevice, undefined, loads),
  };
}
