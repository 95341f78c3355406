/**
 * The runner of every strategy whose model is cut into stages on worker-thread devices
 * (single, gpipe, local): one device (worker thread, own TF.js engine) per stage, neighbours
 * linked directly; each step splits the mini-batch into M micro-batches and sends every stage
 * its list of the schedule, which the stage's executor runs against the stage kind the
 * strategy names; an all-reduce of the gradient norm joins the stages when the schedule has
 * one. What differs between the strategies is data ({@link PipelineKind}): the schedules, the
 * stage kind, where labels go and whether stages run free across mini-batches.
 */

import { MessageChannel, type MessagePort } from 'node:worker_threads';
import type { Precision } from '../backend/names.js';
import type { Batch } from '../data/batcher.js';
import { type HostTensor, splitMicroBatches } from '../data/microbatch.js';
import type { HostParams } from '../model/init.js';
import type { ModelConfig } from '../model/model.js';
import {
  clipScale,
  type OptimizerConfig,
  type OptimizerState,
} from '../optim/optimizer.js';
import type { StageRange } from '../partition/balance.js';
import { waitingMs } from '../pipeline/executor.js';
import type { StageKindRef } from '../pipeline/stage-kind.js';
import { type Device, StageError } from '../runtime/device.js';
import {
  allThreads,
  type DeviceOptions,
  type DeviceSpec,
  openDevices,
  remoteLinks,
} from '../runtime/devices.js';
import type { StageStepResult } from '../runtime/protocol.js';
import { copyWire, transferables } from '../runtime/serialize.js';
import type { Schedule } from '../schedule/schedule.js';
import { describeFaults } from './numeric-fault.js';
import {
  type Evaluation,
  MetricMeans,
  type StepReport,
  type Strategy,
  type Submission,
} from './strategy.js';

/** What a strategy runs on its stages (see gpipe.ts backpropPipeline, local.ts localPipeline). */
export interface PipelineKind {
  /** The training schedule: per stage, its actions for one mini-batch. */
  train: Schedule;
  /** The evaluation schedule (forward only). */
  eval: Schedule;
  /** Run after the last submitted step before evaluation or reading state, to collect outstanding work (local parallelism's free-running overlap). */
  flush?: Schedule;
  /** The stage kind of stage i of `stages`. */
  stage(i: number, stages: number): StageKindRef;
  /** Whether every stage gets the labels (local losses), not only the last. */
  labelsOnEveryStage: boolean;
  /** Whether the next mini-batch may be submitted as soon as the first stage is done with this one (stages run free). */
  freeRunning: boolean;
}

export interface PipelineOptions {
  /** Strategy name, for reports and messages. */
  name: string;
  backend: string;
  model: ModelConfig;
  /** Blocks of each stage. */
  ranges: StageRange[];
  microBatches: number;
  optimizer: OptimizerConfig;
  kind: PipelineKind;
  /** Device memory budget per stage, bytes: a stage fails as soon as its engine holds more. */
  deviceMemory?: number;
  /** What the out-of-memory message suggests. */
  oomAdvice?: string;
  /** Threads of each device's kernels (see initBackend). */
  threads?: number;
  /** Compute precision of every device's products (see initBackend); default fp32. */
  precision?: Precision;
  /** Which device runs each stage (runtime/devices.ts); default a worker thread each. */
  devices?: DeviceSpec[];
}

/** How long a failed step waits for the other stages' outcomes, to report the root cause, ms. */
const ROOT_CAUSE_WAIT_MS = 2000;

/**
 * The error to report for a failed step: a lost device (its process died, its link was cut:
 * a StageError the device handle raised, without a cause from inside the stage) rather than a
 * neighbour's complaint that its link to that device broke, which often arrives first.
 * Waits up to {@link ROOT_CAUSE_WAIT_MS} for the other stages to fail too, only after such a
 * complaint.
 */
async function rootCause(
  calls: ReadonlyArray<Promise<unknown>>,
  first: unknown,
): Promise<unknown> {
  // only a broken link points elsewhere; any other failure is its own cause
  if (
    !(first instanceof Error) ||
    !/the link to the (next|previous) stage was lost/.test(first.message)
  )
    return first;
  const settled = await Promise.race([
    Promise.allSettled(calls),
    new Promise<null>((r) =>
      setTimeout(() => r(null), ROOT_CAUSE_WAIT_MS).unref(),
    ),
  ]);
  if (!settled) return first;
  const errors = settled
    .filter((r): r is PromiseRejectedResult => r.status === 'rejected')
    .map((r) => r.reason as unknown);
  return (
    errors.find((e) => e instanceof StageError && e.causeName === undefined) ??
    first
  );
}

/** The stage that owns a parameter key (`<block>.<name>` or `aux<stage>.<name>`). */
export function ownerStage(key: string, ranges: readonly StageRange[]): number {
  const prefix = key.slice(0, key.indexOf('.'));
  if (prefix.startsWith('aux')) return Number(prefix.slice(3));
  const block = Number(prefix);
  return ranges.findIndex((r) => block >= r.from && block < r.to);
}

export class PipelineStrategy implements Strategy {
  readonly name: string;
  readonly devices: number;
  private readonly train: Schedule;
  private closed = false;
  /** Schedules sent to the stages that have not finished yet. */
  private readonly inflight = new Set<Promise<unknown>>();

  private constructor(
    private readonly opts: PipelineOptions,
    private readonly workers: Device[],
  ) {
    this.name = opts.name;
    this.devices = workers.length;
    const k = workers.length;
    if (opts.kind.train.length !== k)
      throw new Error(
        `a schedule of ${opts.kind.train.length} stages for ${k} devices`,
      );
    this.train = opts.kind.train;
  }

  /**
   * Starts one worker per stage, links neighbours with MessageChannels and uploads each stage's
   * initial parameters. Throws (after stopping the workers) if any stage fails to start.
   */
  static async create(
    opts: PipelineOptions,
    params: HostParams,
  ): Promise<PipelineStrategy> {
    const k = opts.ranges.length;
    const specs =
      opts.devices ??
      Array.from({ length: k }, () => ({ kind: 'thread' as const }));
    if (specs.length !== k)
      throw new Error(`${specs.length} devices for ${k} stages`);
    const workers = await openDevices(specs);
    const s = new PipelineStrategy(opts, workers);
    try {
      // neighbours: MessagePorts between threads, direct gRPC links between processes
      const threads = allThreads(specs);
      const ports = threads
        ? Array.from({ length: k - 1 }, () => new MessageChannel())
        : [];
      await Promise.all(
        workers.map((w, i) => {
          const r = opts.ranges[i];
          const own: Record<string, Float32Array> = {};
          for (const [key, v] of params)
            if (ownerStage(key, opts.ranges) === i) own[key] = v.slice();
          const { prev, next } = threads
            ? {
                prev: i > 0 ? ports[i - 1].port2 : undefined,
                next: i < k - 1 ? ports[i].port1 : undefined,
              }
            : remoteLinks(workers, i);
          const transfer = threads
            ? [
                ...Object.values(own).map((a) => a.buffer as ArrayBuffer),
                ...(prev ? [prev as MessagePort] : []),
                ...(next ? [next as MessagePort] : []),
              ]
            : [];
          return w.call(
            'init',
            {
              index: i,
              backend: (specs[i] as DeviceOptions).backend ?? opts.backend,
              threads: (specs[i] as DeviceOptions).threads ?? opts.threads,
              precision: opts.precision,
              model: opts.model,
              range: r,
              params: own,
              optimizer: opts.optimizer,
              stage: opts.kind.stage(i, k),
              prev,
              next,
              deviceMemory: opts.deviceMemory,
              strategy: opts.name,
              oomAdvice: opts.oomAdvice,
            },
            transfer,
          );
        }),
      );
    } catch (e) {
      await s.close();
      throw e;
    }
    return s;
  }

  /**
   * Sends one schedule to every stage (with the batch's micro-batches, if any); all-reduces the
   * gradient norm when the schedule has a reduce_grad_norm. `first` resolves when stage 0 is
   * done, `all` when every stage is. If a stage fails, every worker is stopped and both reject.
   */
  private dispatch(
    schedule: Schedule,
    batch: Batch | null,
    lr: number,
    diagnose = false,
  ): {
    first: Promise<unknown>;
    all: Promise<StageStepResult[]>;
    fault: { sums?: number[] };
  } {
    const fault: { sums?: number[] } = {};
    const m = this.opts.microBatches;
    const k = this.workers.length;
    const inputs = batch
      ? splitMicroBatches({ data: batch.x, shape: batch.xShape }, m)
      : undefined;
    const labels = batch
      ? splitMicroBatches({ data: batch.y, shape: batch.yShape }, m)
      : undefined;
    const calls = this.workers.map((w, i) => {
      const withLabels = i === k - 1 || this.opts.kind.labelsOnEveryStage;
      const step = {
        actions: schedule[i],
        m,
        lr,
        inputs: i === 0 ? inputs : undefined,
        labels: withLabels ? labels?.map(copyWire) : undefined,
        ...(diagnose ? { diagnose } : {}),
      };
      return w.call(
        'step',
        step,
        transferables([
          ...(step.inputs ?? []),
          ...(step.labels ?? []),
        ] as HostTensor[]),
      );
    });
    const reduce = schedule.some((acts) =>
      acts.some((a) => a.op === 'reduce_grad_norm'),
    );
    const all = (async () => {
      const everything = Promise.all(calls);
      try {
        if (reduce) {
          const norms = Promise.all(
            this.workers.map((w) => w.recvGradNorm()),
          ).then((sq) => {
            // a non-finite loss or gradient anywhere (each stage's sum of squares is NaN or
            // Infinity then): no stage updates (scale NaN), and submit() locates the fault
            const total = sq.reduce((a, b) => a + b, 0);
            if (!Number.isFinite(total)) fault.sums = sq;
            const scale =
              Number.isFinite(total) && !diagnose
                ? clipScale(total, this.opts.optimizer.clipNorm)
                : NaN;
            for (const w of this.workers) w.sendScale(scale);
          });
          norms.catch(() => undefined); // a failing stage is reported through `everything`
          // a stage that fails before its norm rejects `everything`, which ends the wait
          await Promise.race([norms, everything]);
        }
        return await everything;
      } catch (e) {
        everything.catch(() => undefined);
        const root = await rootCause(calls, e);
        await this.close();
        throw root;
      }
    })();
    all.catch(() => undefined); // handled by whoever awaits it; never an unhandled rejection
    const first = calls[0].catch(async (e) => {
      await all; // the strategy is stopped before `first` rejects, with the run's root cause
      throw e;
    });
    first.catch(() => undefined);
    this.inflight.add(all);
    all.finally(() => this.inflight.delete(all)).catch(() => undefined);
    return { first, all, fault };
  }

  /**
   * Runs the training step on `batch` again, diagnosing (every block's output, the loss and
   * every block's gradients checked; nothing updated), and throws the NumericFaultError that
   * names where the first non-finite value appeared.
   */
  private async locate(
    batch: Batch,
    lr: number,
    sums: number[],
  ): Promise<never> {
    const rs = await this.dispatch(this.train, batch, lr, true).all;
    throw describeFaults(
      rs.flatMap((r) => r.faults ?? []),
      sums,
      this.opts.ranges,
    );
  }

  /** Waits for every submitted step; then runs the kind's flush schedule, if any. */
  private async settle(): Promise<void> {
    await Promise.all([...this.inflight]);
    if (this.opts.kind.flush)
      await this.dispatch(this.opts.kind.flush, null, 0).all;
  }

  submit(batch: Batch, lr: number): Submission {
    const { first, all, fault } = this.dispatch(this.train, batch, lr);
    const done = all.then((rs) =>
      fault.sums ? this.locate(batch, lr, fault.sums) : report(rs),
    );
    done.catch(() => undefined);
    // stages that run free: the first stage can take the next mini-batch while later ones finish
    const accepted = (this.opts.kind.freeRunning ? first : done).then(
      () => undefined,
    );
    accepted.catch(() => undefined); // callers may await only `done`
    return { accepted, done };
  }

  async trainStep(batch: Batch, lr: number): Promise<StepReport> {
    return this.submit(batch, lr).done;
  }

  async evaluate(batches: Batch[]): Promise<Evaluation> {
    await this.settle();
    const sched = this.opts.kind.eval;
    const sums = new Array<number>(this.workers.length).fill(0);
    const counts = new Array<number>(this.workers.length).fill(0);
    const metrics = new MetricMeans();
    for (const b of batches) {
      const { all } = this.dispatch(sched, b, 0);
      const rs = await all;
      metrics.add(rs[rs.length - 1]!.metrics);
      rs.forEach((r, i) => {
        for (const l of r.losses) {
          sums[i] += l;
          counts[i]++;
        }
      });
    }
    const means = sums.map((s, i) => (counts[i] ? s / counts[i] : NaN));
    const m = metrics.means();
    return {
      loss: means[means.length - 1],
      ...(m ? { metrics: m } : {}),
      ...(this.opts.kind.labelsOnEveryStage && means.length > 1
        ? { auxLosses: means.slice(0, -1) }
        : {}),
    };
  }

  async getParams(): Promise<HostParams> {
    await this.settle();
    const parts = await Promise.all(
      this.workers.map((w) => w.call('getParams', null)),
    );
    return new Map(parts.flatMap((p) => Object.entries(p)));
  }

  async getOptimizerState(): Promise<OptimizerState> {
    await this.settle();
    const parts = await Promise.all(
      this.workers.map((w) => w.call('getOptimizerState', null)),
    );
    return {
      step: parts[0].step,
      slots: Object.assign({}, ...parts.map((p) => p.slots)),
    };
  }

  async setOptimizerState(s: OptimizerState): Promise<void> {
    await this.settle();
    await Promise.all(
      this.workers.map((w, i) => {
        const slots: OptimizerState['slots'] = {};
        for (const [key, v] of Object.entries(s.slots))
          if (ownerStage(key, this.opts.ranges) === i) slots[key] = v;
        return w.call('setOptimizerState', { step: s.step, slots });
      }),
    );
  }

  async close(): Promise<void> {
    if (this.closed) return;
    this.closed = true;
    // one at a time: GPU drivers (Mesa under Dawn) crashed when two device threads tore down at once
    for (const w of this.workers) await w.terminate();
  }
}

/** Mean loss and per-stage measurements of one step. */
function report(results: StageStepResult[]): StepReport {
  const losses = results[results.length - 1].losses;
  const mean = (xs: number[]) => xs.reduce((a, b) => a + b, 0) / xs.length;
  return {
    loss: mean(losses),
    stageLosses: results.map((r) => (r.losses.length ? mean(r.losses) : NaN)),
    peakBytes: results.map((r) => r.peakBytes),
    heapBytes: results.map((r) => r.heapBytes),
    stageSeconds: results.map((r) => r.ms / 1000),
    bubble: results.map((r) => (r.ms > 0 ? waitingMs(r.trace) / r.ms : 0)),
    traces: results.map((r) => r.trace),
    startedAt: results.map((r) => r.startedAt),
  };
}
