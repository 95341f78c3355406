/** Run outputs: metrics.jsonl (one JSON line per step) and summary.json. */
import { existsSync, readFileSync } from 'node:fs';
import { appendFile, mkdir, readFile, rename } from 'node:fs/promises';
import { join } from 'node:path';
import { writeFileAtomic } from '../util/fsx.js';

/** One line of metrics.jsonl. Units: seconds, bytes, targets (tokens or examples) per second. */
export interface StepMetrics {
  step: number;
  loss: number;
  lr: number;
  /** Seconds of this training step (excluding evaluation and checkpointing). */
  step_s: number;
  tokens_per_s?: number;
  examples_per_s?: number;
  /** Peak device bytes per stage during the step (the TF.js engine's exact count of tensor bytes). */
  peak_device_bytes: number[];
  /**
   * wasm backend: the size of each stage's heap after the step, bytes, read from the backend
   * (a high-water mark that also holds XNNPACK's packed weights and allocator slack).
   */
  wasm_heap_bytes?: number[];
  /** Bytes moved host to device per stage during the step, where the strategy moves parameters or activations through host memory (l2l: layer and host-stash uploads; gpipe, 1F1B, local: what a stage receives from others). */
  host_to_device_bytes?: number[];
  /** Bytes moved device to host per stage during the step (l2l: layer gradients and host-stash downloads; gpipe, 1F1B, local: what a stage sends). */
  device_to_host_bytes?: number[];
  /** Measured idle (bubble) fraction per stage. */
  bubble: number[];
  /** webgpu (Linux): the step's host time, ms: CPU time of the devices' threads during it while no read waited for the GPU, all devices together (see Summary.host_ms_per_step). */
  host_ms?: number;
  val_loss?: number;
  /** Classifiers and language models: fraction of validation predictions whose arg-max is the label. */
  val_accuracy?: number;
  /** Text: validation bits per character (val_loss / ln 2). */
  val_bpc?: number;
  /** Text: validation perplexity, exp(val_loss) per character. */
  val_perplexity?: number;
  /** Local parallelism: each stage's local loss this step (auxiliary heads, then the model's). */
  stage_losses?: number[];
  /** With --layer-drop: the blocks (model indices) this step skipped. */
  dropped_blocks?: number[];
  /** f16: the dynamic loss scale of the step, whether its gradients overflowed (the step was skipped: nothing updated), and the overflows so far. */
  loss_scale?: number;
  skipped?: boolean;
  overflows?: number;
  /** Local parallelism: validation loss of each auxiliary head. */
  val_aux_losses?: number[];
}

/** summary.json, written at the end of a run (after its last checkpoint). */
export interface Summary {
  strategy: string;
  backend: string;
  /** Compute precision (`--precision`, backend/names.ts PRECISIONS). */
  precision: string;
  /** With a mixed precision: what it ran on (backend/names.ts precisionNote: e.g. oneDNN's ISA and whether it is emulated). */
  precision_note?: string;
  preset: string;
  params: number;
  /** Stages of the partition (with several per device, more than the devices). */
  stages: number;
  /** Devices, where a schedule runs several stages on each (interleaved-1f1b, zbv). */
  devices?: number;
  /** Stages per device, where more than one. */
  virtual_stages?: number;
  /** Data-parallel replicas, where more than one (then `devices` counts all of them: replicas x devices per replica). */
  replicas?: number;
  micro_batches: number;
  /** Re-materialization mode (`--checkpoint`): always, except_last or never. */
  rematerialization: string;
  schedule: string;
  balance: number[];
  batch_size: number;
  /** Kernel threads of each device (strategies/spec.ts deviceThreads: --threads or the cores divided among the devices; 1 off native). */
  threads_per_device?: number[];
  steps: number;
  initial_loss: number;
  final_loss: number;
  val_loss: number;
  /** As in {@link StepMetrics}: at the last validation. */
  val_accuracy?: number;
  val_bpc?: number;
  val_perplexity?: number;
  /** Local parallelism: validation loss of each auxiliary head. */
  val_aux_losses?: number[];
  tokens_per_s?: number;
  examples_per_s?: number;
  peak_device_bytes: number[];
  /** Per step, per stage: the mean of metrics.jsonl's host_to_device_bytes over the run's steps (where counted). */
  host_to_device_bytes?: number[];
  /** Per step, per stage: the mean of device_to_host_bytes (as above). */
  device_to_host_bytes?: number[];
  /** wasm backend: largest heap size per stage over the run, bytes. */
  wasm_heap_bytes?: number[];
  /** webgpu: compute dispatches per training step, all devices together (mean over the counted steps). */
  dispatches_per_step?: number;
  /** webgpu: queue submits per training step, all devices together (as above). */
  submits_per_step?: number;
  /** webgpu: reads of GPU buffers back to the host per training step, all devices together (as above). */
  readbacks_per_step?: number;
  /** webgpu: buffer-to-buffer copies recorded per training step, all devices together (uploads, reads' staging copies, the multi-tensor kernels'; as above). */
  copies_per_step?: number;
  /** webgpu and native (captured steps are on unless LAYERWISE_WEBGPU_CAPTURE=0 / LAYERWISE_NATIVE_CAPTURE=0): counted steps whose forward and backward were replayed from a captured step (pipeline/captured-step.ts, pipeline/native-capture.ts), each stage's (native: a pipeline of K stages counts K a step), all devices together; absent where none was. */
  replayed_steps?: number;
  /**
   * webgpu: the host's side of a training step, ms: CPU time of the devices' threads during the
   * step while no read waited for the GPU (all devices together; mean over the counted steps):
   * layerwise's and TF.js's JS, Dawn's encoding and submits on those threads; not the GPU's work,
   * not the coordinator's thread, not the polling while a read waits (poll_ms_per_step). Linux
   * only (/proc/thread-self/schedstat). Where it approaches the step's wall time, the host
   * bounds the step, not the GPU.
   */
  host_ms_per_step?: number;
  /** webgpu: CPU ms per step of the devices' threads while a read waited for the GPU (Dawn's Node bindings poll from event-loop turns; the read's copy out included). Linux only. */
  poll_ms_per_step?: number;
  /** webgpu: host_ms_per_step over dispatches_per_step, in microseconds: the host's cost per compute dispatch, everything a step does on the host included. */
  host_us_per_dispatch?: number;
  /** webgpu with timestamp queries: the GPUs' busy seconds over the devices' step seconds (0-1; each device's step reports its previous step's). */
  gpu_busy?: number;
  /**
   * webgpu with LAYERWISE_WEBGPU_KERNEL_TIMES=1 (backend/gpu-queue.ts KERNEL_TIMES_ENV): the
   * GPU's ms per step by kernel (program or pipeline, with its output shape; all devices
   * together, mean over the timed steps), slowest first, with dispatches per step.
   */
  gpu_kernels?: Array<{
    kernel: string;
    ms_per_step: number;
    dispatches_per_step: number;
  }>;
  /**
   * The run's bubble per stage, the one definition layerwise reports (also printed at the end
   * as "idle (bubble)"): the mean of the stage's per-step `bubble` of metrics.jsonl (time it
   * waited for other stages / its step time) over the steps throughput counts (all but a
   * process's first, which warms kernels up).
   */
  bubble: number[];
  /** With --device-memory: the budget and the peak predicted before training, bytes. */
  device_memory_budget?: number;
  predicted_peak_device_bytes?: number[] | null;
  wall_s: number;
}

/** Appends step lines to `<out>/metrics.jsonl`. */
export class MetricsLog {
  private readonly path: string;
  constructor(private readonly out: string) {
    this.path = join(out, 'metrics.jsonl');
  }
  async append(m: StepMetrics): Promise<void> {
    await mkdir(this.out, { recursive: true });
    await appendFile(this.path, `${JSON.stringify(m)}\n`);
  }
  /** Writes summary.json atomically. */
  async summary(s: Summary): Promise<void> {
    await writeFileAtomic(join(this.out, SUMMARY), summaryText(s));
  }
  /**
   * Writes the finished run's summary beside summary.json ({@link PENDING_SUMMARY}), before its
   * last checkpoint is saved: {@link commitSummary} makes it summary.json once that save is
   * complete, so a summary never stands beside an older checkpoint, and a run killed between
   * the two finds it on resume ({@link promotePendingSummary}).
   */
  async pendingSummary(s: Summary): Promise<void> {
    await writeFileAtomic(join(this.out, PENDING_SUMMARY), summaryText(s));
  }
  /** Makes the pending summary summary.json (one atomic rename). */
  async commitSummary(): Promise<void> {
    await rename(join(this.out, PENDING_SUMMARY), join(this.out, SUMMARY));
  }
}

/** The file name of a run's summary. */
export const SUMMARY = 'summary.json';
/** A finished run's summary while its last checkpoint is being saved (see {@link MetricsLog.pendingSummary}). */
export const PENDING_SUMMARY = 'summary.pending.json';

function summaryText(s: Summary): string {
  return `${JSON.stringify(s, null, 2)}\n`;
}

/**
 * For a run folder `out` whose last checkpoint (of step `step`) is saved but whose summary.json
 * is missing (a run killed right after that save): makes its pending summary summary.json when
 * that summary is of `step`. Resolves with whether `out` now holds summary.json.
 */
export async function promotePendingSummary(
  out: string,
  step: number,
): Promise<boolean> {
  const path = join(out, SUMMARY);
  if (existsSync(path)) return true;
  const pending = join(out, PENDING_SUMMARY);
  let steps: unknown;
  try {
    steps = (JSON.parse(await readFile(pending, 'utf8')) as Summary).steps;
  } catch {
    return false; // none, or unreadable
  }
  if (steps !== step) return false;
  await rename(pending, path);
  return true;
}

/** The step lines of run folder `out`'s metrics.jsonl, in order (what {@link MetricsLog} appended). */
export function readStepMetrics(out: string): StepMetrics[] {
  return readFileSync(join(out, 'metrics.jsonl'), 'utf8')
    .trim()
    .split('\n')
    .map((l) => JSON.parse(l) as StepMetrics);
}
