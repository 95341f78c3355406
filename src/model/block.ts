import type * as tf from '@tensorflow/tfjs-core';

/** How a parameter's initial values are drawn (on the host, from the run's seed). */
export type Init =
  | { kind: 'zeros' }
  | { kind: 'ones' }
  | { kind: 'normal'; std: number }
  /** Glorot/He-style uniform in [-limit, limit]. */
  | { kind: 'uniform'; limit: number }
  /** Given values (a user model's loaded weights), row-major, as many as the shape has. */
  | { kind: 'values'; values: Float32Array }
  /**
   * Drawn by a user model's own initializer (any tfjs-layers `Initializer`, custom ones too):
   * `draw(random)` runs it with `random` standing in for `Math.random`, the only source TF.js's
   * random ops take a seed from when the initializer has none, and returns the values,
   * row-major. {@link initParams} passes the parameter's own seeded stream, so the run's seed
   * decides the values (see model/layers-model.ts).
   */
  | { kind: 'initializer'; draw(random: () => number): Float32Array };

/** One parameter of a block: its name (unique within the block), shape and initializer. */
export interface ParamSpec {
  name: string;
  shape: number[];
  init: Init;
  /**
   * Read by a gather (an embedding table), not as a product's operand: under a precision policy
   * with 2-byte parameter copies (backend/precision.ts) such a parameter keeps float32 values on
   * the device, since the single device's products do not round it (see {@link readByProducts}).
   */
  gathered?: boolean;
}

/**
 * Whether a parameter is read only as an operand of products (matmul, convolution: rank >= 2
 * and not {@link ParamSpec.gathered}), which under a policy with 2-byte parameter copies read its
 * rounding to that format: such a parameter can be shipped to a device in it with the same
 * results (the L2L relay, issue 23 item 4). Biases and normalisation parameters (rank 1) stay float32.
 */
export function readByProducts(spec: ParamSpec): boolean {
  return spec.shape.length >= 2 && spec.gathered !== true;
}

/** A block's parameters as tensors, keyed by {@link ParamSpec.name}. */
export type BlockParams = Record<string, tf.Tensor>;

/**
 * The unit of partitioning: a block declares its parameters and a pure forward function of
 * (parameters, input) to output. It owns no device memory, so any strategy can place it on any
 * device: the strategy creates the tensors for `params` and passes them in.
 */
export interface Block {
  /** Human-readable name, e.g. `decoder3`. */
  name: string;
  params: ParamSpec[];
  /** Output shape for an input of the given shape (batch dimension included). */
  outputShape(inputShape: number[]): number[];
  /** Forward pass. `x` has the shape the previous block produces (or the model's input). */
  forward(p: BlockParams, x: tf.Tensor): tf.Tensor;
  /** Floating-point operations of one forward pass for an input of this shape (for balancing). */
  flops(inputShape: number[]): number;
  /**
   * What the run should tell its user about this block's training, one line each (a layer
   * that runs in inference mode, say); printed when training starts. Optional.
   */
  notes?: string[];
}

/** Number of elements of a shape. */
export function sizeOf(shape: readonly number[]): number {
  let n = 1;
  for (const d of shape) n *= d;
  return n;
}

/** Number of parameters (elements) of a block. */
export function paramCount(block: Block): number {
  return block.params.reduce((s, p) => s + sizeOf(p.shape), 0);
}

/** Global parameter key: `<block index>.<param name>`, unique within a model. */
export function paramKey(blockIndex: number, name: string): string {
  return `${blockIndex}.${name}`;
}
