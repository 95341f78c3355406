/**
 * The run's measured numbers, step by step: one place that turns a strategy's step reports and
 * evaluations into metrics.jsonl lines and summary.json's measured fields, used by the one
 * training loop (train/loop.ts) that the trainer (train/trainer.ts) and the browser page
 * (web/run.ts) share, so both write the same fields with the same definitions.
 */
import {
  type GpuCounts,
  type KernelTime,
  sumGpuCounts,
  sumKernelTimes,
} from '../backend/gpu-counts.js';
import type { Evaluation, StepReport } from '../strategies/strategy.js';
import type { StepMetrics, Summary } from './metrics.js';

/** What one finished step was, besides its report. */
export interface StepFacts {
  /** The step's number counted from 1 (metrics.jsonl's `step`). */
  step: number;
  lr: number;
  /** Targets (tokens, or examples for classifiers) the step trained on. */
  tokens: number;
  /** The step's wall time, s. */
  seconds: number;
  /** Whether the step counts toward throughput and the bubble (not a process's warm-up step). */
  counted: boolean;
  /** The blocks --layer-drop skipped (listed in metrics.jsonl when layer drop is on). */
  dropped?: number[];
}

/** summary.json's fields that the tally measures. */
export type MeasuredFields = Pick<
  Summary,
  | 'val_loss'
  | 'val_accuracy'
  | 'val_bpc'
  | 'val_perplexity'
  | 'val_aux_losses'
  | 'tokens_per_s'
  | 'examples_per_s'
  | 'peak_device_bytes'
  | 'host_to_device_bytes'
  | 'device_to_host_bytes'
  | 'bubble'
  | 'wasm_heap_bytes'
  | 'dispatches_per_step'
  | 'submits_per_step'
  | 'readbacks_per_step'
  | 'copies_per_step'
  | 'replayed_steps'
  | 'host_ms_per_step'
  | 'host_us_per_dispatch'
  | 'poll_ms_per_step'
  | 'gpu_busy'
  | 'gpu_kernels'
>;

/**
 * Folds step reports into metrics lines and summary fields. Units: bytes, s, targets per
 * second. The bubble is the mean of the counted steps' per-step bubbles; transfers are the mean
 * per step of the steps that count them; peaks are maxima over all steps.
 */
export class StepTally {
  private readonly peak: number[];
  private readonly bubbleSum: number[];
  private readonly heap: number[];
  private readonly h2d: number[];
  private readonly d2h: number[];
  private movedSteps = 0;
  /** webgpu: the counted steps' GPU counts, summed (host ms only where every step gave it), and how many steps reported them. */
  private gpu: GpuCounts | undefined;
  /** native: the counted steps' replayed forward-and-backwards (pipeline/native-capture.ts). */
  private replayed = 0;
  private gpuSteps = 0;
  /** webgpu with timestamp queries: the counted steps' GPU busy seconds and device wall seconds, summed. */
  private readonly busy = { busySeconds: 0, stepSeconds: 0 };
  /** With kernel times: the timed steps' GPU seconds by kernel, summed, and how many steps. */
  private kernels: Record<string, KernelTime> | undefined;
  private kernelSteps = 0;
  /** Whether the step before the one being folded in was counted (its busy time comes with the next report). */
  private previousCounted = false;
  private measured = 0;
  private targets = 0;
  private trainSeconds = 0;
  private valLoss = Number.NaN;
  private valFields: Pick<
    StepMetrics,
    'val_accuracy' | 'val_bpc' | 'val_perplexity' | 'val_aux_losses'
  > = {};

  /**
   * @param devices the strategy's devices (stages), the length of every per-stage array
   * @param text whether targets are characters (tokens_per_s, val_bpc, val_perplexity) rather than examples
   * @param stageLosses whether lines list each stage's local loss (local parallelism)
   * @param layerDrop whether lines list the dropped blocks (--layer-drop above 0)
   */
  constructor(
    devices: number,
    private readonly text: boolean,
    private readonly stageLosses = false,
    private readonly layerDrop = false,
  ) {
    this.peak = new Array<number>(devices).fill(0);
    this.bubbleSum = new Array<number>(devices).fill(0);
    this.heap = new Array<number>(devices).fill(0);
    this.h2d = new Array<number>(devices).fill(0);
    this.d2h = new Array<number>(devices).fill(0);
  }

  /** metrics.jsonl's name of the throughput field. */
  get targetName(): 'tokens_per_s' | 'examples_per_s' {
    return this.text ? 'tokens_per_s' : 'examples_per_s';
  }

  /** Folds one finished step in and returns its metrics line (without evaluation fields). */
  step(r: StepReport, f: StepFacts): StepMetrics {
    if (f.counted) {
      this.targets += f.tokens;
      this.trainSeconds += f.seconds;
      r.bubble.forEach((b, i) => (this.bubbleSum[i]! += b));
      this.measured++;
      this.replayed += r.replayed ?? 0;
      if (r.gpu) {
        this.gpu = sumGpuCounts(this.gpu ? [this.gpu, r.gpu] : [r.gpu]);
        this.gpuSteps++;
      }
      // a report carries its previous step's busy time: counted where that step was
      if (r.gpuBusy && this.previousCounted) {
        this.busy.busySeconds += r.gpuBusy.busySeconds;
        this.busy.stepSeconds += r.gpuBusy.stepSeconds;
        if (r.gpuBusy.kernels) {
          this.kernels = sumKernelTimes([this.kernels, r.gpuBusy.kernels]);
          this.kernelSteps++;
        }
      }
    }
    this.previousCounted = f.counted;
    r.peakBytes.forEach((b, i) => (this.peak[i] = Math.max(this.peak[i]!, b)));
    const moved = r.hostToDeviceBytes && r.deviceToHostBytes;
    if (moved) {
      r.hostToDeviceBytes!.forEach((b, i) => (this.h2d[i]! += b));
      r.deviceToHostBytes!.forEach((b, i) => (this.d2h[i]! += b));
      this.movedSteps++;
    }
    r.heapBytes?.forEach(
      (b, i) =>
        (this.heap[i] =
          b === undefined ? Number.NaN : Math.max(this.heap[i]!, b)),
    );
    return {
      step: f.step,
      loss: r.loss,
      lr: f.lr,
      step_s: f.seconds,
      [this.targetName]: f.tokens / f.seconds,
      peak_device_bytes: r.peakBytes,
      ...(moved
        ? {
            host_to_device_bytes: r.hostToDeviceBytes,
            device_to_host_bytes: r.deviceToHostBytes,
          }
        : {}),
      bubble: r.bubble,
      ...(r.gpu?.hostMs !== undefined ? { host_ms: r.gpu.hostMs } : {}),
      ...(r.heapBytes?.every((h) => h !== undefined)
        ? { wasm_heap_bytes: r.heapBytes as number[] }
        : {}),
      ...(this.stageLosses ? { stage_losses: r.stageLosses } : {}),
      ...(this.layerDrop ? { dropped_blocks: f.dropped ?? [] } : {}),
      ...(r.lossScale !== undefined
        ? {
            loss_scale: r.lossScale,
            skipped: r.skipped === true,
            overflows: r.overflows ?? 0,
          }
        : {}),
    };
  }

  /** Folds an evaluation into the tally and into its step's line `m` (val_loss and the rest). */
  evaluation(m: StepMetrics, ev: Evaluation): void {
    this.valLoss = ev.loss;
    this.valFields = {
      ...(ev.metrics?.accuracy !== undefined
        ? { val_accuracy: ev.metrics.accuracy }
        : {}),
      // a character model's loss is nats per character
      ...(this.text
        ? { val_bpc: ev.loss / Math.LN2, val_perplexity: Math.exp(ev.loss) }
        : {}),
      ...(ev.auxLosses ? { val_aux_losses: ev.auxLosses } : {}),
    };
    Object.assign(m, { val_loss: ev.loss }, this.valFields);
  }

  /** summary.json's measured fields, from the steps and evaluations folded in so far. */
  summaryFields(): MeasuredFields {
    return {
      val_loss: this.valLoss,
      ...this.valFields,
      [this.targetName]:
        this.trainSeconds > 0 ? this.targets / this.trainSeconds : undefined,
      peak_device_bytes: [...this.peak],
      ...(this.movedSteps > 0
        ? {
            host_to_device_bytes: this.h2d.map((b) => b / this.movedSteps),
            device_to_host_bytes: this.d2h.map((b) => b / this.movedSteps),
          }
        : {}),
      bubble: this.bubbleSum.map((b) =>
        this.measured ? b / this.measured : 0,
      ),
      ...(this.heap.every((h) => h > 0)
        ? { wasm_heap_bytes: [...this.heap] }
        : {}),
      ...this.gpuFields(),
      ...(this.replayed > 0 ? { replayed_steps: this.replayed } : {}),
    };
  }

  /** summary.json's webgpu counts per step (none where no step reported any). */
  private gpuFields(): Partial<MeasuredFields> {
    const g = this.gpu;
    const steps = this.gpuSteps;
    if (g === undefined || steps === 0) return {};
    return {
      dispatches_per_step: g.dispatches / steps,
      submits_per_step: g.submits / steps,
      readbacks_per_step: g.readbacks / steps,
      copies_per_step: g.copies / steps,
      ...(g.replays ? { replayed_steps: g.replays } : {}),
      ...(g.hostMs !== undefined && g.dispatches > 0
        ? {
            host_ms_per_step: g.hostMs / steps,
            host_us_per_dispatch: (1000 * g.hostMs) / g.dispatches,
            poll_ms_per_step: (g.pollMs ?? 0) / steps,
          }
        : {}),
      ...(this.busy.stepSeconds > 0
        ? { gpu_busy: this.busy.busySeconds / this.busy.stepSeconds }
        : {}),
      ...(this.kernels && this.kernelSteps > 0
        ? {
            gpu_kernels: Object.entries(this.kernels)
              .map(([kernel, t]) => ({
                kernel,
                ms_per_step: (1000 * t.seconds) / this.kernelSteps,
                dispatches_per_step: t.dispatches / this.kernelSteps,
              }))
              .sort((a, b) => b.ms_per_step - a.ms_per_step),
          }
        : {}),
    };
  }
}
