/**
 * The device side of L2L, layer-to-layer relay (Pudipeddi et al., 2020, arXiv 2002.05645):
 * one device runs the whole model, but holds only the layer (block) it is executing, plus
 * the next one being prefetched. Every parameter lives in the eager parameter server's shared
 * host memory (src/param-server/store.ts); a layer is uploaded from there when the relay schedule
 * loads it and freed when it releases it, and its gradient, accumulated over the mini-batch's
 * micro-batches, is downloaded and handed to the parameter server, which updates the host
 * copy in the background.
 *
 * Between forward and backward, the input of every layer for every micro-batch waits in the
 * stash: on the device (`stash: 'device'`, fast, grows with depth) or in host memory
 * (`'host'`, downloaded after the forward and uploaded again for the backward: the device then
 * holds at most two layers' parameters, one layer's gradient and the activations of the
 * micro-batches of one layer boundary, whatever the depth).
 *
 * Pipelined relay (L2L on K devices, schedule/schedule.ts relayPipelineSchedule): a stage relays
 * only its range of layers. Its first layer's input is the step's input or the activation the
 * previous stage sent; its last layer's output goes to the next stage (`putOutput`), and that
 * stage's gradient of it seeds the backward (`takeOutputGrad`); its first layer's input
 * gradient goes back (`putInputGrad`). There each layer's gradient is pushed per micro-batch
 * (the parameter server sums them), since micro-batches, not layers, are the outer loop.
 *
 * Correctness: the same math as single-device training on the whole mini-batch. The
 * mini-batch loss is the mean of the M micro-batch losses; backward re-computes each layer
 * from its stashed input (the activations of a layer's inside never outlive its call).
 */

import { gpuQueue, makeResident } from '../backend/gpu-queue.js';
import {
  activationFromNarrow,
  narrowValues,
  roundTensor,
  storesNarrow,
  tensorFromNarrow,
} from '../backend/low-precision.js';
import { countPrivateBytes, countTransfer } from '../backend/memory.js';
import { tf } from '../backend/tfjs.js';
import { type BlockParams, paramKey } from '../model/block.js';
import type { Model } from '../model/model.js';
import { microBatchNoise, withNoise } from '../model/noise.js';
import type { OptimizerConfig } from '../optim/optimizer.js';
import { ParamStore, type StoreLayout } from '../param-server/store.js';
import { recordEvaluation } from './evaluation.js';
import type { Handlers, LayerGrads, StageProgram, StepIO } from './executor.js';
import { PendingReads } from './pending-reads.js';
import { backwardRecorded, recordForward } from './rematerialize.js';
import type { StageContext } from './stage-kind.js';
import { GradAccumulator } from './stage-params.js';

/** Where the layer-boundary activations wait between forward and backward. */
export type StashPlace = 'device' | 'host';

/**
 * A stashed activation: a device tensor, or its values outside the engine: float32/int32 in
 * host memory, or (where the precision policy's stash format is 2 bytes, backend/precision.ts)
 * those 2-byte values in host memory or in device memory (`device`: counted as
 * the device's private bytes, backend/memory.ts).
 */
type Stashed =
  | tf.Tensor
  | {
      values: Float32Array | Int32Array;
      shape: number[];
      dtype: 'float32' | 'int32';
    }
  | { narrow: Uint16Array; shape: number[]; device: boolean };

/** The relay's options, sent by the L2L strategy: the parameter server's shared memory and the stash place. */
export interface RelayOptions {
  layout: StoreLayout;
  stash: StashPlace;
  /** Record the GPU's execution of each compute action and upload (webgpu; when a trace is written). */
  traceGpu?: boolean;
  /**
   * Whether the device sends each pushed gradient's sum of squares (for clipping; default
   * true). False where the parameter server sums several pushes per layer (a pipelined relay,
   * replicas) or scales the loss: it takes the norm of the sums itself.
   */
  deviceNorm?: boolean;
}

/**
 * Whether `tf.tensor(values)` on this backend copies `values` at once. Only wasm does (into
 * its heap); cpu stores the array itself, webgpu and tensorflow (tfjs-node) keep it until
 * first use (webgpu: until {@link makeResident}, which the relay's uploads call). Uploads from
 * the shared store are copied first where nothing copies them at once, so a background update
 * of the host copy can never change a tensor in use.
 */
const copiesOnCreation = () => tf.getBackend() === 'wasm';

export class RelayStage implements StageProgram {
  readonly kind = 'L2L relay stage';
  /** Loss of each micro-batch this step (recorded at the last layer). */
  readonly losses = new Map<number, number>();
  /** Evaluation metrics of each micro-batch (evaluation only). */
  readonly metrics = new Map<number, Record<string, number>>();
  /** The gradient of the layer in backward, summed over micro-batches until it is pushed. */
  private readonly grads = new GradAccumulator();
  /** Parameters of the layers on the device now, by layer, then by parameter name in the block. */
  private readonly loaded = new Map<number, BlockParams>();
  /** stash[l][mb]: the input of layer l for micro-batch mb (layer 0: the model input). */
  private readonly stash = new Map<number, Map<number, Stashed>>();
  /** Gradient of the current backward layer's output, per micro-batch. */
  private dys = new Map<number, tf.Tensor>();
  /** Training steps handed to the parameter server: the version every layer must reach before it is used. */
  private stepsDone = 0;
  /** Milliseconds the last {@link load} waited for the parameter server. */
  lastWaitMs = 0;
  /** Losses and metrics read off the device at the step's end. */
  private readonly reads = new PendingReads();
  /**
   * A host-stash download still under way (backends with a GPU queue: webgpu). At most one: the
   * next stash waits for it, so the device holds at most one activation more than with
   * synchronous downloads, while the GPU computes that micro-batch and the host goes on to the
   * next action (the next layer's upload).
   */
  private download: Promise<void> | null = null;

  /** Reads what the step left pending on the device into {@link losses} and {@link metrics}. */
  async flush(): Promise<void> {
    await this.settleDownload();
    await this.reads.flush();
  }

  /** Drops what a failed step left pending, unread. */
  discard(): void {
    this.download = null; // its tensor is freed when the read ends; its error was already caught
    this.reads.clear();
  }

  /** Waits for the host-stash download under way, if any; rethrows its error. */
  private async settleDownload(): Promise<void> {
    const d = this.download;
    this.download = null;
    if (d) await d;
  }

  /**
   * @param model the whole model
   * @param store views of the parameter server's shared host memory (parameters, versions)
   * @param stashPlace where layer inputs wait between forward and backward
   * @param traceGpu record the GPU's spans (see StageProgram.traceGpu)
   * @param range the layers (model blocks) this stage relays; default every one
   */
  constructor(
    readonly model: Model,
    private readonly store: ParamStore,
    readonly stashPlace: StashPlace,
    private readonly optimizer: OptimizerConfig,
    readonly traceGpu = false,
    readonly range: { from: number; to: number } = {
      from: 0,
      to: model.blocks.length,
    },
    private readonly deviceNorm = true,
  ) {}

  readonly handlers: Handlers = {
    load_layer: async (a, io) => {
      await this.settleDownload(); // the previous layer's stash is complete before the next layer
      if (await this.load(a.layer)) io.gpuWork();
      io.phase('wait_params', this.lastWaitMs, 'upload');
    },
    prefetch_layer: (a, io) => {
      if (this.prefetch(a.layer)) io.gpuWork();
    },
    layer_forward: async (a, io) => {
      await this.layerForward(a.layer, a.mb, a.grad, io);
      io.gpuWork(); // on webgpu: submitted now, so the GPU runs it while the host goes on (to the next upload)
    },
    layer_backward: async (a, io) => {
      await this.settleDownload();
      this.layerBackward(a.layer, a.mb, io);
      io.gpuWork();
    },
    push_grads: async (a, io) =>
      io.pushGrads(await this.takeLayerGrads(a.layer)),
    release_layer: (a) => this.release(a.layer),
    optimizer_step: () => this.step(),
  };

  get layers(): number {
    return this.model.blocks.length;
  }

  /** The first layer of this stage that the step runs (LayerDrop may skip the range's first). */
  private firstLayer(io: StepIO): number {
    let l = this.range.from;
    while (l < this.range.to - 1 && io.dropped.has(l)) l++;
    return l;
  }

  /** The next layer after l that the step runs (LayerDrop skips some; never the model's last). */
  private nextLayer(l: number, io: StepIO): number {
    let next = l + 1;
    while (next < this.range.to && io.dropped.has(next)) next++;
    return next;
  }

  /** Parameter names and keys of layer l, in the store's order. */
  private layerKeys(l: number): Array<[string, string]> {
    return this.model.blocks[l].params.map((spec) => [
      spec.name,
      paramKey(l, spec.name),
    ]);
  }

  /**
   * Waits until the parameter server has applied every update handed to it before this step
   * to layer l, then uploads its parameters (no-op if loaded). Sets {@link lastWaitMs}.
   * Returns whether it uploaded (false: a prefetch already had).
   */
  async load(l: number): Promise<boolean> {
    this.lastWaitMs = 0;
    if (this.loaded.has(l)) return false;
    if (this.store.version(l) < this.stepsDone) {
      const t0 = performance.now();
      await this.store.waitVersion(l, this.stepsDone);
      this.lastWaitMs = performance.now() - t0;
    }
    this.upload(l);
    return true;
  }

  /** Uploads layer l now if its parameters are ready, without waiting; returns whether it did. */
  prefetch(l: number): boolean {
    if (l < 0 || l >= this.layers || this.loaded.has(l)) return false;
    if (this.store.version(l) < this.stepsDone) return false;
    this.upload(l);
    return true;
  }

  /**
   * Puts layer l's parameters on the device, resident at once (on webgpu the values are copied
   * into GPU buffers here, not at their first use, so a prefetch moves them while the GPU still
   * runs the previous actions).
   */
  private upload(l: number): void {
    const resident = gpuQueue() !== null; // webgpu: makeResident below copies the values out of the store
    const copy = !copiesOnCreation() && !resident;
    const p: BlockParams = {};
    this.loaded.set(l, p); // registered first: a failing upload leaves nothing unreleased
    for (const [name, key] of this.layerKeys(l)) {
      const low = this.store.low(key);
      if (low !== undefined && storesNarrow('params')) {
        // the policy's parameter format: 2 bytes per element cross, and stay on the device as such
        p[name] = tensorFromNarrow(low.slice(), this.store.shape(key));
        countTransfer('h2d', low.byteLength);
        continue;
      }
      const host = this.store.param(key);
      p[name] = tf.tensor(
        copy ? host.slice() : host,
        this.store.shape(key),
        'float32',
      );
      countTransfer('h2d', host.byteLength);
    }
    makeResident(Object.values(p));
  }

  /** Frees layer l's parameters on the device. */
  release(l: number): void {
    const p = this.loaded.get(l);
    if (!p) return;
    for (const t of Object.values(p)) t.dispose();
    this.loaded.delete(l);
  }

  private layerParams(l: number): BlockParams {
    const p = this.loaded.get(l);
    if (!p)
      throw new Error(
        `layer ${l} used while not on the device (schedule must load_layer first)`,
      );
    return p;
  }

  /** Stashes `t` (owned from now on) as the input of layer l for mb: on the device, or downloaded to the host and freed. */
  private async putStash(l: number, mb: number, t: tf.Tensor): Promise<void> {
    let s = this.stash.get(l);
    if (!s) this.stash.set(l, (s = new Map()));
    if (l > 0 && t.dtype === 'float32' && storesNarrow('stash')) {
      // the layer boundary waits in the policy's stash format, 2 bytes per element (issue 23 item 4)
      const shape = t.shape.slice();
      let narrow: Uint16Array;
      try {
        narrow = narrowValues((await t.data()) as Float32Array);
      } finally {
        t.dispose();
      }
      const device = this.stashPlace === 'device';
      if (device) countPrivateBytes(narrow.byteLength);
      else countTransfer('d2h', narrow.byteLength);
      s.set(mb, { narrow, shape, device });
      return;
    }
    if (this.stashPlace === 'host' && l > 0) {
      const shape = t.shape.slice();
      const dtype = t.dtype as 'float32' | 'int32';
      const entries = s;
      const download = async () => {
        let v: Float32Array | Int32Array;
        try {
          v = (await t.data()) as Float32Array | Int32Array;
        } finally {
          t.dispose();
        }
        // wasm's reads are already a fresh copy of its heap; other backends may return their own storage
        entries.set(mb, {
          values: copiesOnCreation() ? v : v.slice(),
          shape,
          dtype,
        });
        countTransfer('d2h', v.byteLength);
      };
      if (gpuQueue() === null) return download(); // a host backend: the values are there already
      // a GPU: the read waits for the GPU to compute t; let the host go on meanwhile
      await this.settleDownload();
      const d = download();
      d.catch(() => undefined); // rethrown by settleDownload
      this.download = d;
    } else {
      s.set(mb, t);
    }
  }

  /**
   * The stashed input of layer l for mb as a device tensor the caller owns. `keep`: a host
   * stash entry stays (the caller gets an uploaded copy); otherwise the entry is removed.
   */
  private takeStash(
    l: number,
    mb: number,
    io: StepIO,
    keep = false,
  ): tf.Tensor {
    const s = this.stash.get(l)?.get(mb);
    if (s && 'narrow' in s) {
      if (!keep) {
        this.stash.get(l)!.delete(mb);
        if (s.device) countPrivateBytes(-s.narrow.byteLength);
      }
      if (!s.device) countTransfer('h2d', s.narrow.byteLength);
      // held as its 2-byte values where the backend can (taken over: a copy if the stash keeps them)
      return activationFromNarrow(keep ? s.narrow.slice() : s.narrow, s.shape);
    }
    if (s) {
      const host = !(s instanceof tf.Tensor);
      if (!(keep && host)) this.stash.get(l)!.delete(mb);
      if (!host) return s;
      countTransfer('h2d', s.values.byteLength);
      return tf.tensor(s.values, s.shape, s.dtype);
    }
    // the step's input, or the previous stage's activation: the stage owns it now
    if (l === this.firstLayer(io)) return io.takeInput(mb);
    throw new Error(
      `layer ${l}, micro-batch ${mb}: no stashed input (schedule out of order)`,
    );
  }

  /**
   * Forward of micro-batch mb through layer l. With `grad`, the input stays stashed for the
   * backward and the output is stashed as layer l+1's input; without, the input is freed and
   * the last layer records the micro-batch loss in {@link losses}.
   */
  async layerForward(
    l: number,
    mb: number,
    grad: boolean,
    io: StepIO,
  ): Promise<void> {
    if (io.dropped.has(l)) {
      // LayerDrop skipped every layer of this stage: the micro-batch goes on as it came
      io.putOutput(mb, io.takeInput(mb));
      return;
    }
    const p = this.layerParams(l);
    const block = this.model.blocks[l];
    if (l === this.layers - 1 && grad)
      throw new Error(
        "the relay fuses the last layer's forward into its backward; schedule layer_backward",
      );
    // a host-stashed (or 2-byte-stashed) input stays in the stash for the backward: only its
    // upload is freed here (the stage's first layer takes its input from the step, and stashes it)
    const hostKept =
      grad &&
      l !== this.firstLayer(io) &&
      (this.stashPlace === 'host' || storesNarrow('stash'));
    const x = this.takeStash(l, mb, io, hostKept);
    // training draws the layer's Dropout noise for these examples (model/noise.ts)
    const noise = grad ? microBatchNoise(io.noise, mb, x.shape[0]!) : undefined;
    try {
      if (l === this.layers - 1) {
        const labels = io.takeLabels(mb);
        try {
          const out = tf.tidy(() => block.forward(p, x));
          recordEvaluation(
            this.reads,
            this.model,
            out,
            labels,
            (loss, metrics) => {
              this.losses.set(mb, loss);
              this.metrics.set(mb, metrics);
            },
          );
          out.dispose();
        } finally {
          labels.dispose();
        }
        return;
      }
      const next = this.nextLayer(l, io);
      const y = tf.tidy(() => withNoise(noise, () => block.forward(p, x)));
      // the stage's last layer: the output goes to the next stage
      if (next >= this.range.to) io.putOutput(mb, y);
      else await this.putStash(next, mb, y);
    } finally {
      if (grad && !hostKept)
        await this.putStash(l, mb, x); // device stash, or layer 0's tokens
      else x.dispose();
    }
  }

  /**
   * Backward of micro-batch mb through layer l: re-computes the layer from its stashed input
   * and backpropagates the output gradient (on the last layer: the loss, seeded with 1/M),
   * accumulating the parameter gradients; the input gradient becomes the incoming gradient of
   * layer l-1.
   */
  layerBackward(l: number, mb: number, io: StepIO): void {
    if (io.dropped.has(l)) {
      io.putInputGrad(mb, io.takeOutputGrad(mb)); // a skipped stage: the gradient goes back as it came
      return;
    }
    const p = this.layerParams(l);
    const block = this.model.blocks[l];
    const names = this.layerKeys(l).map(([n]) => n);
    const last = l === this.layers - 1;
    // the stage's last layer (not the model's): the next stage's gradient of its output
    const fromNext = !last && this.nextLayer(l, io) >= this.range.to;
    const seed = last
      ? tf.scalar(io.lossSeed)
      : fromNext
        ? io.takeOutputGrad(mb)
        : this.dys.get(mb);
    if (!seed)
      throw new Error(`layer ${l}, micro-batch ${mb}: no incoming gradient`);
    this.dys.delete(mb);
    const toPrev = l === this.firstLayer(io) && l > 0; // the input gradient goes to the previous stage
    let x: tf.Tensor | undefined;
    let labels: tf.Tensor | undefined;
    try {
      x = this.takeStash(l, mb, io);
      labels = last ? io.takeLabels(mb) : undefined;
      const input = x;
      const wantInput = l > 0;
      const noise = microBatchNoise(io.noise, mb, x.shape[0]!); // as the forward drew it
      const f = (...args: tf.Tensor[]) => {
        const q: BlockParams = {};
        names.forEach((n, i) => (q[n] = args[i]));
        const y = withNoise(noise, () =>
          block.forward(q, wantInput ? args[names.length] : input),
        );
        return last ? this.model.loss(y, labels!) : y;
      };
      const xs = [...names.map((n) => p[n]), ...(wantInput ? [x] : [])];
      if (xs.length === 0) return;
      const rec = recordForward(() => f(...xs));
      if (last)
        this.reads.scalar(tf.clone(rec.y), (v) => this.losses.set(mb, v));
      const grads = backwardRecorded(rec, xs, seed);
      // the stage's accumulators hold only the current layer's gradient (pushed before the next layer)
      this.grads.add(
        this.layerKeys(l).map(([, key]) => key),
        grads,
      );
      if (wantInput) {
        // the boundary's gradient in the policy's activation format, as applyBlocks rounds it
        const dx = grads[names.length]!;
        if (toPrev) io.putInputGrad(mb, dx);
        else if (storesNarrow('activations')) {
          this.dys.set(mb, roundTensor(dx));
          dx.dispose();
        } else this.dys.set(mb, dx);
      }
    } finally {
      seed.dispose();
      x?.dispose();
      labels?.dispose();
    }
  }

  /**
   * Downloads layer l's accumulated gradient (float32, host copies that can be transferred)
   * and its sum of squares; frees the device copies. The sums of squares and every gradient go
   * in one read ({@link PendingReads}: on a GPU one round trip a layer, not one a tensor).
   */
  async takeLayerGrads(l: number): Promise<LayerGrads> {
    const reads = new PendingReads();
    // the server needs the norm only for global clipping
    const total =
      this.optimizer.clipNorm > 0 && this.deviceNorm
        ? this.grads.squaresInto(reads)
        : null;
    const grads: Record<string, Float32Array> = {};
    const copy = !copiesOnCreation(); // wasm's reads are already a fresh copy of the heap
    for (const [, key] of this.layerKeys(l)) {
      const g = this.grads.get(key);
      if (!g) continue;
      reads.read(tf.clone(g), (v) => {
        // a slice of a joined read shares its buffer with the others: copied, each transferable
        const f = v as Float32Array;
        grads[key] =
          copy || f.byteLength !== f.buffer.byteLength ? f.slice() : f;
        countTransfer('d2h', v.byteLength);
      });
    }
    await reads.flush();
    const sumSquares = total ? await total() : 0;
    this.grads.clear();
    return { layer: l, grads, sumSquares };
  }

  /** Ends a training step: every layer's gradient has gone to the parameter server. */
  step(): void {
    this.stepsDone++;
    this.reset();
  }

  /** Frees the step's gradients, stash, incoming gradients and loaded layers. */
  reset(): void {
    this.grads.clear();
    for (const s of this.stash.values())
      for (const t of s.values())
        if (t instanceof tf.Tensor) t.dispose();
        else if ('narrow' in t && t.device)
          countPrivateBytes(-t.narrow.byteLength);
    this.stash.clear();
    for (const t of this.dys.values()) t.dispose();
    this.dys.clear();
    for (const l of [...this.loaded.keys()]) this.release(l);
  }

  dispose(): void {
    this.reset();
  }
}

/** The L2L relay stage kind, as a device worker creates it (options: {@link RelayOptions}). */
export function createStage(ctx: StageContext, options: unknown): RelayStage {
  const o = options as RelayOptions;
  return new RelayStage(
    ctx.model,
    ParamStore.attach(o.layout),
    o.stash,
    ctx.optimizer,
    o.traceGpu === true,
    ctx.range,
    o.deviceNorm !== false,
  );
}
