/**
 * The step messages the coordinator (coordinator.ts) sends its devices to run one schedule,
 * for every strategy that drives devices (the pipelines of single, gpipe and local, and L2L's
 * relay): the mini-batch cut into R x M micro-batches, replica r taking micro-batches
 * r*M .. r*M+M-1 (its 1/R of the examples), each device its actions, the micro-batches it
 * starts from, the labels it needs, LayerDrop's skipped blocks, where its micro-batches sit for
 * Dropout's per-example noise (model/noise.ts), the loss scale and the diagnosis flag.
 */
import type { Batch } from '../data/batcher.js';
import type { HostTensor } from '../data/microbatch.js';
import type { StageStep } from '../runtime/protocol.js';
import type { Schedule } from '../schedule/schedule.js';
import { microBatchesOf } from './stage-results.js';

/** One schedule run on every device of every replica. */
export interface StepPlan {
  /** Each device's actions (devices of one replica; every replica runs the same). */
  schedule: Schedule;
  /** The mini-batch, or null for a schedule without data (a flush). */
  batch: Batch | null;
  /** Micro-batches per replica, M. */
  m: number;
  /** Devices per replica, K. */
  k: number;
  /** Data-parallel replicas, R. */
  replicas: number;
  lr: number;
  /** The device (within a replica) of the model's first stage: it gets the inputs. */
  inputDevice: number;
  /** Whether device d (within a replica) gets the labels. */
  takesLabels(d: number): boolean;
  /** Give each device its own copy of the labels (several devices take them: a transfer moves the buffer). */
  copyLabels?: (t: HostTensor) => HostTensor;
  /** Blocks this step skips (LayerDrop), if any. */
  dropped?: readonly number[];
  /** The run's seed and this step's index: the step draws Dropout's noise. Absent: no noise. */
  noise?: { seed: number; step: number };
  /** The step's loss scale (f16), 1 if absent. */
  lossScale?: number;
  /** Diagnose a numeric fault (see pipeline/executor.ts StepInputs.diagnose). */
  diagnose?: boolean;
}

/**
 * The step message of each device, in device order (device g is replica floor(g / K)'s device
 * g mod K), with the host tensors each message moves (its inputs and labels, to transfer).
 */
export function stepMessages(
  plan: StepPlan,
): Array<{ step: StageStep; transfer: HostTensor[] }> {
  const { m, k, replicas, batch } = plan;
  const { inputs, labels } = batch
    ? microBatchesOf(batch, m * replicas)
    : { inputs: undefined, labels: undefined };
  return Array.from({ length: k * replicas }, (_, g) => {
    const d = g % k;
    const r = Math.floor(g / k);
    const part = (xs: HostTensor[] | undefined) =>
      xs?.slice(r * m, (r + 1) * m);
    const ins = d === plan.inputDevice ? part(inputs) : undefined;
    let labs = plan.takesLabels(d) ? part(labels) : undefined;
    if (labs && plan.copyLabels) labs = labs.map(plan.copyLabels);
    const step: StageStep = {
      actions: plan.schedule[d]!,
      m,
      lr: plan.lr,
      ...(ins ? { inputs: ins } : {}),
      ...(labs ? { labels: labs } : {}),
      ...(plan.lossScale !== undefined && plan.lossScale !== 1
        ? { lossScale: plan.lossScale }
        : {}),
      ...(plan.diagnose ? { diagnose: true } : {}),
      ...(plan.dropped?.length ? { dropped: [...plan.dropped] } : {}),
      ...(plan.noise && batch
        ? {
            noise: {
              ...plan.noise,
              offset: r * (batch.xShape[0]! / replicas),
            },
          }
        : {}),
    };
    return { step, transfer: [...(ins ?? []), ...(labs ?? [])] };
  });
}
