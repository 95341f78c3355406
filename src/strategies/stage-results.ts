/**
 * What the coordinator (coordinator.ts: pipelines and L2L's relay) makes of its devices'
 * results, and of a step's mini-batch: a mini-batch cut into the micro-batches a step carries, a step's report from its
 * stages' results, the evaluation over validation batches, and a submitted step.
 */
import {
  type GpuCounts,
  type KernelTime,
  sumGpuCounts,
  sumKernelTimes,
} from '../backend/gpu-counts.js';
import type { GpuBusy } from '../backend/gpu-queue.js';
import type { Batch } from '../data/batcher.js';
import { type HostTensor, splitMicroBatches } from '../data/microbatch.js';
import { waitingMs } from '../pipeline/executor.js';
import type { StageStepResult } from '../runtime/protocol.js';
import {
  type Evaluation,
  MetricMeans,
  type StepReport,
  type Submission,
} from './strategy.js';

/** A mini-batch's inputs and labels, each cut into `m` micro-batches. */
export function microBatchesOf(
  batch: Batch,
  m: number,
): { inputs: HostTensor[]; labels: HostTensor[] } {
  return {
    inputs: splitMicroBatches({ data: batch.x, shape: batch.xShape }, m),
    labels: splitMicroBatches({ data: batch.y, shape: batch.yShape }, m),
  };
}

const mean = (xs: readonly number[]): number =>
  xs.reduce((a, b) => a + b, 0) / xs.length;

/**
 * One step's report from its devices' results, in device order: the loss is the mean over
 * micro-batches of device `lossDevice` (default the last: the one running the model's last
 * stage; device 0 in a V-shape schedule) of every replica, replica r's devices being
 * `results[r * perReplica ..]` (default one replica); each device's bubble is its time waiting
 * (receives, the norm all-reduce, L2L's parameter server) over its step time.
 */
export function stepReport(
  results: readonly StageStepResult[],
  lossDevice = results.length - 1,
  perReplica = results.length,
): StepReport {
  const losses = results.flatMap((r, i) =>
    i % perReplica === lossDevice ? r.losses : [],
  );
  return {
    loss: mean(losses),
    stageLosses: results.map((r) => (r.losses.length ? mean(r.losses) : NaN)),
    peakBytes: results.map((r) => r.peakBytes),
    heapBytes: results.map((r) => r.heapBytes),
    ...(results.some((r) => r.hostToDeviceBytes !== undefined)
      ? {
          hostToDeviceBytes: results.map((r) => r.hostToDeviceBytes ?? 0),
          deviceToHostBytes: results.map((r) => r.deviceToHostBytes ?? 0),
        }
      : {}),
    stageSeconds: results.map((r) => r.ms / 1000),
    ...gpuCountsOf(results),
    ...replayedOf(results),
    bubble: results.map((r) => (r.ms > 0 ? waitingMs(r.trace) / r.ms : 0)),
    traces: results.map((r) => r.trace),
    startedAt: results.map((r) => r.startedAt),
  };
}

/**
 * Evaluates batch after batch, `run` giving one batch's device results (of an evaluation
 * schedule): the loss and metrics are device `lossDevice`'s (default the last) means over
 * every micro-batch; with `auxLosses` (local parallelism's auxiliary heads), also every other
 * stage's mean loss.
 */
export async function evaluateBatches(
  batches: readonly Batch[],
  run: (b: Batch) => Promise<readonly StageStepResult[]>,
  auxLosses: boolean,
  lossDevice?: number,
): Promise<Evaluation> {
  let losses: number[][] = [];
  const metrics = new MetricMeans();
  for (const b of batches) {
    const rs = await run(b);
    if (!losses.length) losses = rs.map(() => []);
    metrics.add(rs[lossDevice ?? rs.length - 1]!.metrics);
    rs.forEach((r, i) => losses[i]!.push(...r.losses));
  }
  const means = losses.map((ls) => (ls.length ? mean(ls) : NaN));
  const m = metrics.means();
  return {
    loss: means.length ? means[lossDevice ?? means.length - 1]! : NaN,
    ...(m ? { metrics: m } : {}),
    ...(auxLosses && means.length > 1 ? { auxLosses: means.slice(0, -1) } : {}),
  };
}

/**
 * The results of R data-parallel replicas of K devices each (`rs[r * K + d]`) as one replica's
 * K results whose losses and metrics are every replica's, replica after replica (each replica
 * ran equal micro-batches, so their mean is the mini-batch's). The rest is replica 0's.
 */
export function mergeReplicas(
  rs: readonly StageStepResult[],
  k: number,
): StageStepResult[] {
  const r = rs.length / k;
  if (r === 1) return [...rs];
  return rs.slice(0, k).map((first, d) => {
    const mine = Array.from({ length: r }, (_, i) => rs[i * k + d]!);
    const metrics = mine.flatMap((x) => x.metrics ?? []);
    return {
      ...first,
      losses: mine.flatMap((x) => x.losses),
      ...(metrics.length ? { metrics } : {}),
    };
  });
}

/**
 * A submitted step: `done` gives its report; `accepted` (default: `done`) says when the next
 * step may be submitted. Neither becomes an unhandled rejection: callers may await only one.
 */
export function submission(
  done: Promise<StepReport>,
  accepted: Promise<unknown> = done,
): Submission {
  done.catch(() => undefined);
  const a = accepted.then(() => undefined);
  a.catch(() => undefined);
  return { accepted: a, done };
}

/** `{ kernels }` summed over devices where some device timed its kernels, else nothing. */
function kernelsOf(
  all: ReadonlyArray<Record<string, KernelTime> | undefined>,
): { kernels?: Record<string, KernelTime> } {
  const kernels = sumKernelTimes(all);
  return kernels ? { kernels } : {};
}

/** `{ replayed }`: the devices' replayed forward-and-backwards summed (native), or nothing where none was. */
function replayedOf(results: readonly StageStepResult[]): {
  replayed?: number;
} {
  const n = results.reduce((s, r) => s + (r.replayed ?? 0), 0);
  return n > 0 ? { replayed: n } : {};
}

/** The devices' GPU counts of a step (their host CPU ms where every device gave it), and their GPU busy and wall seconds where timestamp queries gave them, summed (webgpu; nothing where no device reported any). */
function gpuCountsOf(results: readonly StageStepResult[]): {
  gpu?: GpuCounts;
  gpuBusy?: GpuBusy;
} {
  const counted = results.filter((r) => r.gpu !== undefined);
  if (counted.length === 0) return {};
  const timed = results.filter((r) => r.gpuBusy !== undefined);
  return {
    gpu: sumGpuCounts(counted.map((r) => r.gpu!)),
    ...(timed.length > 0
      ? {
          gpuBusy: {
            busySeconds: timed.reduce((s, r) => s + r.gpuBusy!.busySeconds, 0),
            stepSeconds: timed.reduce((s, r) => s + r.gpuBusy!.stepSeconds, 0),
            ...kernelsOf(timed.map((r) => r.gpuBusy!.kernels)),
          },
        }
      : {}),
  };
}
