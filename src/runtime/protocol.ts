import type { MessagePort } from 'node:worker_threads';
import type { GpuCounts } from '../backend/gpu-counts.js';
import type { GpuBusy } from '../backend/gpu-queue.js';
import type { Precision } from '../backend/names.js';
import type { HostTensor } from '../data/microbatch.js';
/** Messages between the main thread and a stage worker, and between neighbouring stages. */
import type { ModelConfig } from '../model/model.js';
import type { StepNoise } from '../model/noise.js';
import type { OptimizerConfig, OptimizerState } from '../optim/optimizer.js';
import type { StageRange } from '../partition/balance.js';
import type { NumericFault, TraceSpan } from '../pipeline/executor.js';
import type { StageKindRef } from '../pipeline/stage-kind.js';
import type { Action } from '../schedule/schedule.js';

/**
 * A stage-to-stage link of a device server (runtime/grpc-link.ts): dial the next stage's device
 * at `connect` (HOST:PORT), or accept the neighbour's link (the previous stage's device, or this
 * coordinator dialling for a worker-thread neighbour; see runtime/links.ts).
 */
export type RemoteLink = { connect: string } | { accept: true };

/** Everything a worker needs to become stage `index` of a pipeline. */
export interface StageInit {
  index: number;
  backend: string;
  /** Threads of the device's kernels (see initBackend); undefined: the backend's default. */
  threads?: number;
  /** Compute precision of the device's products (see initBackend); undefined: fp32. */
  precision?: Precision;
  model: ModelConfig;
  range: StageRange;
  /** Initial parameter values of this stage's blocks, by parameter key. */
  params: Record<string, Float32Array>;
  optimizer: OptimizerConfig;
  /** The stage kind to create (its module and options), as the strategy's spec names it. */
  stage: StageKindRef;
  /** Device memory budget, bytes: the stage fails as soon as its engine holds more. */
  deviceMemory?: number;
  /** Strategy name, for the out-of-memory message. */
  strategy?: string;
  /** What the out-of-memory message suggests (the strategy's advice). */
  oomAdvice?: string;
  /**
   * The stages this device runs when it runs several (interleaved and V-shape schedules), each
   * with its blocks, initial parameters and kind; absent: the one stage of index, range, params
   * and stage above (then the first of these).
   */
  stages?: Array<{
    index: number;
    range: StageRange;
    params: Record<string, Float32Array>;
    stage: StageKindRef;
  }>;
  /** This device's index in the pipeline; absent: `index` (one stage per device). */
  device?: number;
  /** The device of each stage (schedule/schedule.ts placementOf); absent: stage s on device s. */
  placement?: number[];
  /** Link to the previous device (absent on the first device): a MessagePort (a thread's), or a gRPC link it accepts. */
  prev?: MessagePort | RemoteLink;
  /** Link to the next device (absent on the last device, but for a ring's wrap link): a MessagePort, the next device's address to dial, or a link it accepts. */
  next?: MessagePort | RemoteLink;
  /**
   * Data parallelism: this device's replica index and the replica count R (absent: one
   * replica), and its links in the ring of the devices that run the same stages in each
   * replica (two replicas: one link, `replicaNext` on replica 0, `replicaPrev` on replica 1).
   */
  replica?: { index: number; count: number };
  replicaPrev?: MessagePort | RemoteLink;
  replicaNext?: MessagePort | RemoteLink;
}

/** One training (or evaluation) step of one stage. */
export interface StageStep {
  actions: Action[];
  inputs?: HostTensor[];
  labels?: HostTensor[];
  m: number;
  lr: number;
  /** Diagnose a numeric fault: check every block's output and gradients, update nothing (see pipeline/executor.ts). */
  diagnose?: boolean;
  /** Blocks (model indices) skipped this step by --layer-drop (see model/layer-drop.ts). */
  dropped?: number[];
  /** Where the step's micro-batches sit, for Dropout's per-example noise (model/noise.ts); absent: none. */
  noise?: StepNoise;
  /** f16: the dynamic loss scale of this step (see optim/loss-scale.ts); default 1. */
  lossScale?: number;
}

/** What a stage reports after a step. */
export interface StageStepResult {
  /** Loss of each micro-batch (last stage; every stage under local parallelism), in micro-batch order. */
  losses: number[];
  /** Evaluation metrics of each micro-batch of the last stage (model/model.ts Model.metrics), in micro-batch order. */
  metrics?: Array<Record<string, number>>;
  trace: TraceSpan[];
  /** Peak bytes held by the device during the step. */
  peakBytes: number;
  /** Bytes held after the step (parameters, optimizer state). */
  bytes: number;
  /** wasm backend: size of its linear memory (heap) after the step, bytes (a high-water mark, capped at 4 GiB). */
  heapBytes?: number;
  /** Bytes uploaded from host memory to the device during the step (backend/memory.ts countTransfer: L2L's layer and stash uploads, and activations and gradients received from other stages). */
  hostToDeviceBytes?: number;
  /** Bytes downloaded from the device to host memory during the step (L2L's stash and gradients, what the stage sends to other stages). */
  deviceToHostBytes?: number;
  /** Wall time of the step on this stage, ms. */
  ms: number;
  /** When the stage began the step, ms since the Unix epoch (a clock shared by all threads). */
  startedAt: number;
  /** Non-finite values a diagnosing step found (see StageStep.diagnose). */
  faults?: NumericFault[];
  /** webgpu: what the step asked of the GPU (compute dispatches, queue submits, readbacks to the host, buffer copies). */
  gpu?: GpuCounts;
  /** native: stage steps of this device replayed from a captured step (pipeline/native-capture.ts), one a stage; absent where none was. */
  replayed?: number;
  /** webgpu with timestamp queries: the previous step's GPU busy seconds and wall seconds on this device (backend/gpu-queue.ts). */
  gpuBusy?: GpuBusy;
}

/** Methods of the worker's request/reply protocol and their arguments and results. */
export interface StageApi {
  init: [StageInit, { bytes: number }];
  step: [StageStep, StageStepResult];
  getParams: [null, Record<string, Float32Array>];
  getOptimizerState: [null, OptimizerState];
  setOptimizerState: [OptimizerState, null];
  dispose: [null, null];
  /** Frees everything, the backend included (a GPU device's queue drained), before the thread is stopped. */
  shutdown: [null, null];
}
