/**
 * The interface every training strategy implements, so that one trainer loop serves them all.
 * Parameters and optimizer state cross this interface on the host, keyed by parameter key
 * (`<block>.<name>`), independent of how the model is partitioned: a checkpoint written by one
 * strategy resumes under another.
 */

import type { GpuCounts } from '../backend/gpu-counts.js';
import type { GpuBusy } from '../backend/gpu-queue.js';
import type { Batch } from '../data/batcher.js';
import type { HostParams } from '../model/init.js';
import type { LossScaleState } from '../optim/loss-scale.js';
import type { OptimizerState } from '../optim/optimizer.js';
import type { ServerSpan } from '../param-server/server.js';
import type { TraceSpan } from '../pipeline/executor.js';

/** What one training step reports. */
export interface StepReport {
  /** Mean loss over the mini-batch (nats per target), of the model's output (the last stage). */
  loss: number;
  /** Per stage, its mean loss (NaN where a stage has none; local parallelism: its local loss). */
  stageLosses: number[];
  /** Per stage (device): peak bytes held during the step. */
  peakBytes: number[];
  /** Per stage, wasm backend only: its heap (linear memory) size in bytes, a high-water mark. */
  heapBytes?: Array<number | undefined>;
  /** Per stage (device): bytes moved host to device during the step, where the strategy counts them (l2l; stages' messages). */
  hostToDeviceBytes?: number[];
  /** Per stage (device): bytes moved device to host during the step (as above). */
  deviceToHostBytes?: number[];
  /** Per stage: wall time of the step, seconds. */
  stageSeconds: number[];
  /** webgpu: what the step asked of the GPUs, all devices together (compute dispatches, queue submits, readbacks, buffer copies). */
  gpu?: GpuCounts;
  /** webgpu with timestamp queries: the GPUs' busy seconds and the devices' wall seconds of their previous step, summed over devices (backend/gpu-queue.ts). */
  gpuBusy?: GpuBusy;
  /** native: forward-and-backwards replayed from captured steps, all devices together (pipeline/native-capture.ts); absent where none was. */
  replayed?: number;
  /** Per stage: fraction of the step spent waiting for other stages (the measured bubble). */
  bubble: number[];
  /** Per stage: the executed actions (ms since the stage began the step). */
  traces: TraceSpan[][];
  /** Per stage: when it began the step, ms since the Unix epoch. */
  startedAt: number[];
  /** L2L: the parameter server's optimizer updates finished since the previous report. */
  serverSpans?: ServerSpan[];
  /** f16: the loss scale this step ran with, whether it overflowed (skipped: nothing updated), and the overflows so far. */
  lossScale?: number;
  skipped?: boolean;
  overflows?: number;
}

/** Validation result: the model's loss and, for local parallelism, each auxiliary head's. */
export interface Evaluation {
  loss: number;
  /** Means of the model's evaluation metrics over the batches (e.g. accuracy), where it has any. */
  metrics?: Record<string, number>;
  /** Local parallelism: mean loss of the auxiliary head of each stage but the last. */
  auxLosses?: number[];
}

/**
 * A submitted training step: `accepted` resolves when the strategy can take the next step (for
 * local parallelism, when the first stage is done with this one; otherwise when the step is
 * done), `done` with the step's report. Both reject if a stage fails.
 */
export interface Submission {
  accepted: Promise<void>;
  done: Promise<StepReport>;
}

/** Means over micro-batches of per-micro-batch metric records (as the loss is averaged). */
export class MetricMeans {
  private readonly sums = new Map<string, number>();
  private n = 0;
  add(records: ReadonlyArray<Record<string, number>> | undefined): void {
    for (const r of records ?? []) {
      for (const [k, v] of Object.entries(r))
        this.sums.set(k, (this.sums.get(k) ?? 0) + v);
      this.n++;
    }
  }
  /** The means, or undefined when nothing was recorded. */
  means(): Record<string, number> | undefined {
    return this.n
      ? Object.fromEntries([...this.sums].map(([k, s]) => [k, s / this.n]))
      : undefined;
  }
}

export interface Strategy {
  readonly name: string;
  /** Number of devices (stages) used. */
  readonly devices: number;
  /** One training step on a mini-batch with learning rate `lr`; resolves when it is done. */
  trainStep(batch: Batch, lr: number): Promise<StepReport>;
  /**
   * Submits a training step without waiting for it to finish (see {@link Submission}).
   * `dropped`: blocks (model indices) the step skips (--layer-drop, model/layer-drop.ts): not
   * computed, no gradient, not stepped; only strategies whose spec accepts --layer-drop get any.
   * `step`: the step's index (0-based); with it, Dropout and its kin draw their noise per
   * example from the run's seed, the step and the example's place in the mini-batch
   * (model/noise.ts), the same under every strategy; without it they draw none.
   */
  submit(
    batch: Batch,
    lr: number,
    dropped?: readonly number[],
    step?: number,
  ): Submission;
  /** Mean loss over these batches, without updating anything. */
  evaluate(batches: Batch[]): Promise<Evaluation>;
  /** Current parameters (host copies). */
  getParams(): Promise<HostParams>;
  /** Current optimizer state, merged over devices. */
  getOptimizerState(): Promise<OptimizerState>;
  /** Restores an optimizer state from {@link getOptimizerState}. */
  setOptimizerState(s: OptimizerState): Promise<void>;
  /** f16: the dynamic loss scaler's state (checkpoints carry it); absent without loss scaling. */
  lossScaleState?(): LossScaleState | undefined;
  /** f16: continues from a checkpoint's loss scaler state. */
  setLossScaleState?(s: LossScaleState): void;
  /**
   * L2L: waits until the parameter server has applied every update and returns the spans of
   * the updates not yet reported with a step (for the trace; the last step's updates finish
   * after its report).
   */
  drainServerSpans?(): Promise<ServerSpan[]>;
  /** Stops every worker. Safe to call twice. */
  close(): Promise<void>;
}
