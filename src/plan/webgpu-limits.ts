/**
 * A model against a WebGPU adapter's buffer limits, before training. TF.js's webgpu backend
 * keeps each tensor in one GPUBuffer and binds it as a storage buffer, and it asks the device
 * for the adapter's own `maxBufferSize` and `maxStorageBufferBindingSize`
 * (tfjs-backend-webgpu's `requiredLimits`): a tensor over either fails inside WebGPU (a device
 * error, or a tab that stops answering), so the page checks the model first. Measured: Chromium's
 * SwiftShader adapter reports 1 GiB for both, Mesa's lavapipe 128 MiB per binding; discrete GPUs
 * 2-4 GiB. WebGPU reports no total memory, so only single tensors are checked here.
 */
import { sizeOf } from '../model/block.js';
import type { Model } from '../model/model.js';
import { LayerwiseError } from '../util/errors.js';
import { formatSize } from '../util/size.js';

/** The two limits of a GPUAdapter (`adapter.limits`) a tensor must fit, bytes. */
export interface WebGpuBufferLimits {
  maxBufferSize: number;
  maxStorageBufferBindingSize: number;
}

/** The largest tensor a model trains with, as {@link largestTensor} finds it. */
export interface LargestTensor {
  /** 'parameter <name> of block <i> (<block name>)', 'output of block <i> (<block name>)' or 'input'. */
  what: string;
  shape: number[];
  /** float32 or int32: 4 bytes an element. */
  bytes: number;
  kind: 'parameter' | 'activation';
}

/**
 * The model's largest tensor among its parameters (each also has a gradient and AdamW slots of
 * the same shape) and its blocks' inputs and outputs for a micro-batch of `microBatch`
 * examples (activations, their gradients). A block's intermediates inside its forward (e.g.
 * attention scores) are not counted: the check is a floor, not a bound.
 */
export function largestTensor(model: Model, microBatch: number): LargestTensor {
  let best: LargestTensor = {
    what: 'input',
    shape: model.inputShape(microBatch),
    bytes: 4 * sizeOf(model.inputShape(microBatch)),
    kind: 'activation',
  };
  let shape = best.shape;
  model.blocks.forEach((b, i) => {
    for (const p of b.params) {
      const bytes = 4 * sizeOf(p.shape);
      if (bytes > best.bytes)
        best = {
          what: `parameter ${p.name} of block ${i} (${b.name})`,
          shape: p.shape,
          bytes,
          kind: 'parameter',
        };
    }
    shape = b.outputShape(shape);
    const bytes = 4 * sizeOf(shape);
    if (bytes > best.bytes)
      best = {
        what: `output of block ${i} (${b.name})`,
        shape,
        bytes,
        kind: 'activation',
      };
  });
  return best;
}

/**
 * Throws a {@link LayerwiseError} naming the limit, the tensor, its size and the fix when the
 * model's largest tensor at `microBatch` examples is over `limits` (see {@link largestTensor}).
 */
export function checkWebGpuLimits(
  model: Model,
  microBatch: number,
  limits: WebGpuBufferLimits,
): void {
  const t = largestTensor(model, microBatch);
  const [name, limit] =
    limits.maxStorageBufferBindingSize <= limits.maxBufferSize
      ? ['maxStorageBufferBindingSize', limits.maxStorageBufferBindingSize]
      : ['maxBufferSize', limits.maxBufferSize];
  if (t.bytes <= limit) return;
  // stages and the L2L relay split a model by blocks, never a tensor: they help only the sum
  const fix =
    t.kind === 'parameter'
      ? 'use a smaller model (a smaller d-model or vocabulary: stages and l2l split a model by blocks, never one tensor), or the wasm backend'
      : 'use more micro-batches or a smaller batch size (a smaller micro-batch), a smaller model, or the wasm backend';
  throw new LayerwiseError(
    `the model does not fit this WebGPU adapter: its largest tensor, the ${t.what} [${t.shape.join(', ')}], takes ${formatSize(t.bytes)}, over the adapter's ${name} of ${formatSize(limit)}; ${fix}`,
  );
}
