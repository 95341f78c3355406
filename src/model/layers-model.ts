/**
 * A TF.js Layers model (`tf.sequential(...)`, or a functional `tf.model(...)` whose layers form
 * a chain) as layerwise blocks, the unit every strategy partitions: one layer per block, or
 * named groups of layers per block. GPipe's premise is "any network that can be expressed as a
 * sequence of layers" (Huang et al., 2019); torchgpipe takes any `nn.Sequential` the same way.
 *
 * How a layer runs on layerwise's parameters: each of the layer's weights (a tfjs-layers
 * `LayerVariable`) has its `read()` redirected to the tensor the strategy passes for it, so the
 * layer's own `call` (Dense, Conv2D, custom layers registered with
 * `tf.serialization.registerClass`, ...) computes with those and autodiff reaches them. The
 * layer's own weight tensors are copied out once (the initial values) and disposed, so a device
 * holds only what the strategy puts there.
 *
 * Initial values: the run's seed decides them, whoever wrote the model. Every weight a layer
 * creates goes through tfjs-layers' `Layer.addWeight(name, shape, dtype, initializer, ...)`;
 * this module records each weight's initializer there (any `Initializer`, custom ones too), and
 * the weight's {@link ParamSpec} draws it again from the parameter's own stream (seed, block,
 * parameter index; see model/init.ts), with that stream standing in for `Math.random`, the only
 * source TF.js's random ops take a seed from when an initializer has none. So two runs with one
 * `--seed` start from the same weights bit for bit, whatever order the model was built in, and
 * every strategy starts where single does. A weight whose values were set after it was drawn
 * (`setWeights`, `tf.loadLayersModel`: a pretrained model) keeps those values.
 *
 * Inside a group any topology works (skip connections, merges); between blocks the model must
 * be a chain: a layer may take its input only from the previous block's output.
 */
import * as tf from '@tensorflow/tfjs-core';
import * as tfl from '@tensorflow/tfjs-layers';
import { check, LayerwiseError } from '../util/errors.js';
import type { Rng } from '../util/rng.js';
import {
  type Block,
  type BlockParams,
  type Init,
  type ParamSpec,
  sizeOf,
} from './block.js';
import { currentNoise, exampleStream, type NoiseContext } from './noise.js';

type Layer = tfl.layers.Layer;
type Shape = Array<number | null>;

/** The name the model's input has in the blocks' wiring. */
const INPUT = '<input>';

/** Options of {@link blocksFromLayersModel}. */
export interface LayersModelOptions {
  /**
   * Layers per block, in model order, every layer (input layers aside) exactly once: by name
   * (`[['conv1', 'pool1'], ...]`) or by count (`[2, 2, 1]`). Default: one block per layer.
   */
  groups?: string[][] | number[];
  /**
   * Give each weight's {@link ParamSpec} its initial values (its initializer, drawn again from
   * the run's seed, or the values a loaded model holds), as the coordinator needs; devices skip
   * it. Default true.
   */
  initialValues?: boolean;
}

/** How a weight was first drawn: the initializer its layer passed to `addWeight`, with its shape and dtype. */
interface Drawing {
  initializer: { apply(shape: number[], dtype?: tf.DataType): tf.Tensor };
  shape: number[];
  dtype: tf.DataType;
}
/** Each weight (a `LayerVariable`) built in this thread since this module loaded, and how it was drawn. */
const drawings = new WeakMap<object, Drawing>();
/** Weights written after they were drawn (`setWeights`, loaded weights): they keep their values. */
const assigned = new WeakSet<object>();
/** Marks tfjs-layers' prototypes as recording, once per thread, whichever copy of layerwise patched them. */
const RECORDING = Symbol.for('layerwise.recordsInitializers');

type AddWeight = (
  this: { fastWeightInitDuringBuild?: boolean },
  name: string,
  shape: number[],
  dtype?: tf.DataType,
  initializer?: Drawing['initializer'],
  ...rest: unknown[]
) => tfl.LayerVariable;

/**
 * Wraps tfjs-layers' `Layer.prototype.addWeight` to record each new weight's initializer, and
 * `LayerVariable.prototype.write` to note weights set afterwards. Idempotent. Runs when this
 * module loads, before any user model module is imported (model/module.ts imports this one).
 */
function recordInitializers(): void {
  const layer = tfl.layers.Layer.prototype as unknown as {
    addWeight: AddWeight;
    [RECORDING]?: true;
  };
  if (layer[RECORDING]) return;
  layer[RECORDING] = true;
  const addWeight = layer.addWeight;
  layer.addWeight = function (this, name, shape, dtype, initializer, ...rest) {
    const w = addWeight.call(this, name, shape, dtype, initializer, ...rest);
    // a model being loaded from saved weights draws nothing (zeros, then the loaded values)
    if (initializer && !this.fastWeightInitDuringBuild)
      drawings.set(w, {
        initializer,
        shape: [...shape],
        dtype: dtype ?? 'float32',
      });
    return w;
  };
  const variable = tfl.LayerVariable.prototype as unknown as {
    write(v: tf.Tensor): unknown;
  };
  const write = variable.write;
  variable.write = function (this: object, v: tf.Tensor) {
    assigned.add(this);
    return write.call(this, v);
  };
}
recordInitializers();

/**
 * The draw of a recorded weight: its initializer run again with `random` as `Math.random`
 * (restored after, also when the initializer throws). float32 values, row-major.
 */
function redraw(d: Drawing): (random: () => number) => Float32Array {
  return (random) => {
    const own = Math.random;
    Math.random = random;
    try {
      const t = tf.tidy(() =>
        tf.cast(d.initializer.apply(d.shape, d.dtype), 'float32'),
      );
      try {
        return (t.dataSync() as Float32Array).slice();
      } finally {
        t.dispose();
      }
    } finally {
      Math.random = own;
    }
  };
}

/** A weight's initial values: its initializer drawn again from the run's seed, else its current values (a loaded model's). */
function initOf(w: tfl.LayerVariable): Init {
  const d = drawings.get(w);
  if (d && !assigned.has(w)) return { kind: 'initializer', draw: redraw(d) };
  return {
    kind: 'values',
    values: (w.read().dataSync() as Float32Array).slice(),
  };
}

/**
 * `[rows, ...noiseShape]` noise for `x` ([rows, ...]), each row drawn from its example's own
 * stream (model/noise.ts) by `draw`, float32.
 */
function perExample(
  x: tf.Tensor,
  noiseShape: number[],
  ctx: NoiseContext,
  layer: number,
  draw: (rng: Rng) => number,
): tf.Tensor {
  const rows = x.shape[0]!;
  const n = sizeOf(noiseShape);
  const data = new Float32Array(rows * n);
  for (let r = 0; r < rows; r++) {
    const rng = exampleStream(ctx, r, layer);
    for (let j = 0; j < n; j++) data[r * n + j] = draw(rng);
  }
  return tf.tensor(data, [rows, ...noiseShape], 'float32');
}

/** A dropout mask's shape without the batch axis: the layer's noiseShape (null: x's size), else x's. */
function maskShape(
  x: tf.Tensor,
  noiseShape?: Array<number | null> | null,
): number[] {
  const rest = x.shape.slice(1);
  if (!noiseShape) return rest;
  return noiseShape.slice(1).map((d, i) => d ?? rest[i]!);
}

/** A dropout with keep probability 1 - rate over a mask of `shape` (batch axis excluded), scaled by 1 / keep as TF.js's. */
function dropout(
  x: tf.Tensor,
  rate: number,
  shape: number[],
  ctx: NoiseContext,
  layer: number,
): tf.Tensor {
  if (!(rate > 0 && rate < 1)) return x;
  const keep = 1 - rate;
  const mask = perExample(x, shape, ctx, layer, (rng) =>
    rng.next() < keep ? 1 / keep : 0,
  );
  return tf.mul(x, mask);
}

/**
 * The training-time forward of the layers that draw noise, drawn per example from the run's
 * seed (model/noise.ts) rather than by the layer's own unseeded `call`: x -> y of x's shape.
 * Other layers with training-time randomness ({@link INFERENCE_ONLY}) run in inference mode.
 */
const NOISE_LAYERS: Record<
  string,
  (l: Layer, x: tf.Tensor, ctx: NoiseContext, layer: number) => tf.Tensor
> = {
  Dropout: (l, x, ctx, layer) => {
    const c = l.getConfig() as {
      rate: number;
      noiseShape?: Array<number | null> | null;
    };
    return dropout(x, c.rate, maskShape(x, c.noiseShape), ctx, layer);
  },
  SpatialDropout1D: (l, x, ctx, layer) =>
    dropout(
      x,
      (l.getConfig() as { rate: number }).rate,
      [1, x.shape[2]!],
      ctx,
      layer,
    ),
  GaussianNoise: (l, x, ctx, layer) => {
    const { stddev } = l.getConfig() as { stddev: number };
    return tf.add(
      x,
      perExample(
        x,
        x.shape.slice(1),
        ctx,
        layer,
        (rng) => rng.normal() * stddev,
      ),
    );
  },
  GaussianDropout: (l, x, ctx, layer) => {
    const { rate } = l.getConfig() as { rate: number };
    if (!(rate > 0 && rate < 1)) return x;
    const std = Math.sqrt(rate / (1 - rate));
    return tf.mul(
      x,
      perExample(
        x,
        x.shape.slice(1),
        ctx,
        layer,
        (rng) => 1 + rng.normal() * std,
      ),
    );
  },
};

/** Layers with training-time randomness that layerwise does not draw per example: they run in inference mode (no noise). */
export const INFERENCE_ONLY: readonly string[] = ['AlphaDropout'];

const isInputLayer = (l: Layer): boolean => l.getClassName() === 'InputLayer';

/** Short weight name within its layer: 'kernel', 'bias', ... */
function shortName(w: tfl.LayerVariable): string {
  const n = w.originalName ?? w.name;
  return n.slice(n.lastIndexOf('/') + 1);
}

/** The layers a layer reads from (input layers as {@link INPUT}). */
function inboundOf(l: Layer): string[] {
  check(
    l.inboundNodes.length === 1,
    () =>
      `layer "${l.name}" is applied ${l.inboundNodes.length} times (a shared or unused layer); layerwise needs each layer applied exactly once: give each use its own layer`,
  );
  return l.inboundNodes[0]!.inboundLayers.map((i) =>
    isInputLayer(i as Layer) ? INPUT : i.name,
  );
}

/**
 * The layers of a Layers model but its input layer, after checking that the model has one input
 * and one output, some layer, and no layer with non-trainable weights (throws
 * {@link LayerwiseError}).
 */
function trainableLayers(model: tfl.LayersModel): Layer[] {
  check(
    model.inputs.length === 1 && model.outputs.length === 1,
    () =>
      `model "${model.name}" has ${model.inputs.length} inputs and ${model.outputs.length} outputs; layerwise trains models with one input and one output`,
  );
  const layers = model.layers.filter((l) => !isInputLayer(l));
  check(
    layers.length > 0,
    () => `model "${model.name}" has no layers besides its input`,
  );
  for (const l of layers) {
    const fixed = l.nonTrainableWeights;
    check(
      fixed.length === 0,
      () =>
        `layer "${l.name}" (${l.getClassName()}) has non-trainable weights (${fixed.map(shortName).join(', ')}); layerwise trains every weight: remove the layer or make it trainable (BatchNormalization's moving statistics are not supported yet)`,
    );
  }
  return layers;
}

/**
 * The layer names of each block: `groups` (names, or layer counts) or one layer per block,
 * checked to name the model's layers (`order`, `byName`) once each, in model order, no group
 * empty (throws {@link LayerwiseError}).
 */
function blockGroups(
  model: tfl.LayersModel,
  groups0: string[][] | number[] | undefined,
  order: string[],
  byName: Map<string, Layer>,
): string[][] {
  const groups =
    groups0 === undefined
      ? order.map((n) => [n])
      : groupsByName(groups0, order);
  const flat = groups.flat();
  for (const n of flat)
    check(
      byName.has(n),
      () =>
        `block groups name layer "${n}", which model "${model.name}" does not have; its layers: ${order.join(', ')}`,
    );
  check(
    flat.length === order.length &&
      flat.every((n, i) => n === order[i]) &&
      groups.every((g) => g.length > 0),
    () =>
      `block groups must list every layer once, in model order, no group empty: ${order.join(', ')}; got ${JSON.stringify(groups)}`,
  );
  return groups;
}

/**
 * The layer each block ends in, after checking that each block reads exactly one tensor from
 * outside, the previous block's output (or the model input), and ends in one layer. Throws
 * {@link LayerwiseError} naming a connection that crosses a block boundary and the group that
 * would contain it, or a block with several outputs.
 */
function blockOutputs(
  groups: string[][],
  order: string[],
  byName: Map<string, Layer>,
): string[] {
  const blockOf = new Map<string, number>();
  groups.forEach((g, b) => g.forEach((n) => blockOf.set(n, b)));
  blockOf.set(INPUT, -1);
  const outputs: string[] = [];
  groups.forEach((g, b) => {
    const members = new Set(g);
    const consumed = new Set<string>();
    for (const n of g) {
      for (const src of inboundOf(byName.get(n)!)) {
        if (members.has(src)) {
          consumed.add(src);
          continue;
        }
        const from = blockOf.get(src)!;
        const expected = b === 0 ? INPUT : outputs[b - 1];
        if (src !== expected) {
          const span = order.slice(
            Math.max(0, order.indexOf(src)),
            order.indexOf(n) + 1,
          );
          throw new LayerwiseError(
            `layer "${n}" (block ${b}) reads "${src}" (${src === INPUT ? 'the model input' : `block ${from}`}), a connection that crosses a block boundary; ` +
              `put the layers from "${span[0]}" to "${n}" in one block, e.g. groups: ${JSON.stringify([span])}`,
          );
        }
      }
    }
    const outs = g.filter((n) => !consumed.has(n));
    check(
      outs.length === 1,
      () =>
        `block ${b} (${g.join(', ')}) has ${outs.length} layers whose output leaves it (${outs.join(', ')}); a block must end in one layer`,
    );
    outputs.push(outs[0]!);
  });
  return outputs;
}

/**
 * The blocks of a Layers model. Each block's parameters are its layers' trainable weights, named
 * by the weight (`kernel`, `bias`) in a one-layer block and `<layer position>/<weight>` in a
 * group, with the model's own initial values. Blocks are named after their layers.
 * Input: the model's single input, [B, ...inputShape]; output of the last block: the model's
 * single output.
 * @throws LayerwiseError for a model with several inputs or outputs, a shared layer, a layer
 *   with non-trainable weights (BatchNormalization's moving statistics, `trainable: false`),
 *   groups that do not cover the layers in order, or a connection that crosses a block boundary
 *   (naming both layers and the group that would contain it).
 */
export function blocksFromLayersModel(
  model: tfl.LayersModel,
  opts: LayersModelOptions = {},
): Block[] {
  const layers = trainableLayers(model);
  const byName = new Map(layers.map((l) => [l.name, l]));
  const order = layers.map((l) => l.name);
  const groups = blockGroups(model, opts.groups, order, byName);
  // each block reads exactly one tensor from outside: the previous block's output (or the input)
  const outputs = blockOutputs(groups, order, byName);
  const modelOut = model.outputs[0]!.sourceLayer.name;
  check(
    outputs[outputs.length - 1] === modelOut,
    () =>
      `the last block ends in "${outputs[outputs.length - 1]}" but the model's output is "${modelOut}"; the model's layers must end in its output layer`,
  );

  const copy = opts.initialValues ?? true;
  return groups.map((g, b) =>
    makeBlock(
      g.map((n) => byName.get(n)!),
      outputs[b]!,
      copy,
      (n) => order.indexOf(n),
    ),
  );
}

function groupsByName(
  groups: string[][] | number[],
  order: string[],
): string[][] {
  if (!groups.every((g) => typeof g === 'number')) return groups as string[][];
  const counts = groups as number[];
  check(
    counts.every((c) => Number.isInteger(c) && c > 0) &&
      counts.reduce((a, c) => a + c, 0) === order.length,
    () =>
      `block groups ${JSON.stringify(counts)} must be positive layer counts summing to the model's ${order.length} layers (${order.join(', ')})`,
  );
  let at = 0;
  return counts.map((c) => order.slice(at, (at += c)));
}

/** Where a block's layers read their weights: the strategy's tensors for the forward running now, else null. */
interface WeightSlot {
  current: BlockParams | null;
}

/**
 * The parameter specs of a block's layers' trainable weights (by position in the block, with
 * the weight's initial values when `copyInitial`, else zeros), each weight disposed and made to
 * read its tensor from `slot`. Throws {@link LayerwiseError} for two weights of a layer with one
 * name or a weight of undefined shape.
 */
function bindWeights(
  layers: Layer[],
  copyInitial: boolean,
  slot: WeightSlot,
): ParamSpec[] {
  const params: ParamSpec[] = [];
  layers.forEach((l, li) => {
    for (const w of l.trainableWeights) {
      // by position in the block: auto-generated layer names (dense_Dense3) depend on how many
      // layers the thread built before, and every device must agree on the keys
      const name = layers.length === 1 ? shortName(w) : `${li}/${shortName(w)}`;
      check(
        !params.some((p) => p.name === name),
        () =>
          `layer "${l.name}" has two weights named "${shortName(w)}"; give its weights distinct names`,
      );
      const shape = w.shape.map((d) => {
        check(
          typeof d === 'number' && d >= 0,
          () =>
            `weight ${name} has an undefined shape ${JSON.stringify(w.shape)}; build the model with a fixed input shape`,
        );
        return d as number;
      });
      params.push({
        name,
        shape,
        init: copyInitial ? initOf(w) : { kind: 'zeros' },
      });
      w.dispose();
      (w as { read: () => tf.Tensor }).read = () => {
        const t = slot.current?.[name];
        if (!t)
          throw new Error(`weight ${name} read outside its block's forward`);
        return t;
      };
    }
  });
  return params;
}

/**
 * Applies a block's layers (`names`: theirs) in order to `x`: every layer's output by name, the
 * input under {@link INPUT}. A noise layer draws per example while a training noise context is
 * set (`layerIndex`: the layer's position in the model, its stream).
 */
function applyLayers(
  layers: Layer[],
  names: string[],
  x: tf.Tensor | tfl.SymbolicTensor,
  layerIndex: (name: string) => number,
): Map<string, unknown> {
  const out = new Map<string, unknown>([[INPUT, x]]);
  for (const l of layers) {
    const ins = inboundOf(l).map((s) => out.get(names.includes(s) ? s : INPUT));
    const noise = currentNoise();
    const draw = noise && NOISE_LAYERS[l.getClassName()];
    out.set(
      l.name,
      draw
        ? draw(l, ins[0] as tf.Tensor, noise, layerIndex(l.name))
        : l.apply(
            ins.length === 1 ? (ins[0] as tf.Tensor) : (ins as tf.Tensor[]),
          ),
    );
  }
  return out;
}

/** The block's notes: each layer of it that runs in inference mode ({@link INFERENCE_ONLY}). */
function inferenceOnlyNotes(layers: Layer[]): string[] {
  return layers
    .filter((l) => INFERENCE_ONLY.includes(l.getClassName()))
    .map(
      (l) =>
        `layer "${l.name}" (${l.getClassName()}) runs in inference mode, without noise: layerwise draws the noise of ${Object.keys(NOISE_LAYERS).join(', ')} per example from --seed, the same under every strategy, but not this layer's`,
    );
}

/**
 * The shape of layer `output`'s output for a block input of `inputShape`: the batch size where
 * a layer leaves it open, NaN for another open size.
 */
function blockOutputShape(
  layers: Layer[],
  names: string[],
  output: string,
  inputShape: number[],
): number[] {
  const shapes = new Map<string, Shape>([[INPUT, inputShape]]);
  for (const l of layers) {
    const ins = inboundOf(l).map(
      (s) => shapes.get(names.includes(s) ? s : INPUT)!,
    );
    const s = l.computeOutputShape(ins.length === 1 ? ins[0]! : ins) as Shape;
    shapes.set(l.name, s);
  }
  return shapes
    .get(output)!
    .map((d, i) => (d === null ? (i === 0 ? inputShape[0]! : NaN) : d));
}

/**
 * Floating-point operations of a block's forward on an input of `inputShape`: 2 * (kernel
 * elements) * (output positions) per weight of rank >= 2 (dense, conv, embedding-free
 * matrices), plus one per output element: exact for dense and convolution layers.
 */
function blockFlops(
  layers: Layer[],
  names: string[],
  inputShape: number[],
): number {
  let total = 0;
  const shapes = new Map<string, number[]>([[INPUT, inputShape]]);
  for (const l of layers) {
    const ins = inboundOf(l).map(
      (s) => shapes.get(names.includes(s) ? s : INPUT)!,
    );
    const out = (
      l.computeOutputShape(ins.length === 1 ? ins[0]! : ins) as Shape
    ).map((d, i) => (d === null ? (i === 0 ? inputShape[0]! : 1) : d));
    shapes.set(l.name, out);
    const outSize = sizeOf(out);
    total += outSize;
    if (l.getClassName() === 'Embedding') continue; // a lookup, no products
    for (const w of l.trainableWeights) {
      if (w.shape.length >= 2)
        total +=
          2 *
          sizeOf(w.shape as number[]) *
          (outSize / (out[out.length - 1] || 1));
    }
  }
  return total;
}

/**
 * The block of `layers` (in model order) that ends in layer `output`: its parameters are the
 * layers' trainable weights ({@link bindWeights}), its forward runs the layers' own calls on
 * the strategy's tensors. Throws {@link LayerwiseError} as {@link bindWeights}.
 */
function makeBlock(
  layers: Layer[],
  output: string,
  copyInitial: boolean,
  layerIndex: (name: string) => number,
): Block {
  // the strategy's tensors for this call; the layers' weights read from here
  const slot: WeightSlot = { current: null };
  const params = bindWeights(layers, copyInitial, slot);
  const names = layers.map((l) => l.name);
  const notes = inferenceOnlyNotes(layers);
  return {
    ...(notes.length ? { notes } : {}),
    name:
      layers.length === 1
        ? names[0]!
        : `${names[0]}..${names[names.length - 1]}`,
    params,
    outputShape(inputShape) {
      return blockOutputShape(layers, names, output, inputShape);
    },
    forward(p, x) {
      slot.current = p;
      try {
        return applyLayers(layers, names, x, layerIndex).get(
          output,
        ) as tf.Tensor;
      } finally {
        slot.current = null;
      }
    },
    flops(inputShape) {
      return blockFlops(layers, names, inputShape);
    },
  };
}
