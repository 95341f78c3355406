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
 * Inside a group any topology works (skip connections, merges); between blocks the model must
 * be a chain: a layer may take its input only from the previous block's output.
 */
import type * as tf from '@tensorflow/tfjs-core';
import type * as tfl from '@tensorflow/tfjs-layers';
import { check, LayerwiseError } from '../util/errors.js';
import {
  type Block,
  type BlockParams,
  type ParamSpec,
  sizeOf,
} from './block.js';

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
   * Copy each weight's initial values into its {@link ParamSpec} (`init: {kind: 'values'}`), as
   * the coordinator needs; devices skip the copy. Default true.
   */
  initialValues?: boolean;
}

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
  const byName = new Map(layers.map((l) => [l.name, l]));
  for (const l of layers) {
    const fixed = l.nonTrainableWeights;
    check(
      fixed.length === 0,
      () =>
        `layer "${l.name}" (${l.getClassName()}) has non-trainable weights (${fixed.map(shortName).join(', ')}); layerwise trains every weight: remove the layer or make it trainable (BatchNormalization's moving statistics are not supported yet)`,
    );
  }
  const order = layers.map((l) => l.name);
  const groups =
    opts.groups === undefined
      ? layers.map((l) => [l.name])
      : groupsByName(opts.groups, order);
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
  const blockOf = new Map<string, number>();
  groups.forEach((g, b) => g.forEach((n) => blockOf.set(n, b)));
  blockOf.set(INPUT, -1);

  // each block reads exactly one tensor from outside: the previous block's output (or the input)
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

function makeBlock(
  layers: Layer[],
  output: string,
  copyInitial: boolean,
): Block {
  const params: ParamSpec[] = [];
  // the strategy's tensors for this call; the layers' weights read from here
  let current: BlockParams | null = null;
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
      const values = copyInitial
        ? (w.read().dataSync() as Float32Array).slice()
        : undefined;
      params.push({
        name,
        shape,
        init: values ? { kind: 'values', values } : { kind: 'zeros' },
      });
      w.dispose();
      (w as { read: () => tf.Tensor }).read = () => {
        const t = current?.[name];
        if (!t)
          throw new Error(`weight ${name} read outside its block's forward`);
        return t;
      };
    }
  });
  const names = layers.map((l) => l.name);
  const run = (x: tf.Tensor | tfl.SymbolicTensor): Map<string, unknown> => {
    const out = new Map<string, unknown>([[INPUT, x]]);
    for (const l of layers) {
      const ins = inboundOf(l).map((s) =>
        out.get(names.includes(s) ? s : INPUT),
      );
      out.set(
        l.name,
        l.apply(
          ins.length === 1 ? (ins[0] as tf.Tensor) : (ins as tf.Tensor[]),
        ),
      );
    }
    return out;
  };
  return {
    name:
      layers.length === 1
        ? names[0]!
        : `${names[0]}..${names[names.length - 1]}`,
    params,
    outputShape(inputShape) {
      const shapes = new Map<string, Shape>([[INPUT, inputShape]]);
      for (const l of layers) {
        const ins = inboundOf(l).map(
          (s) => shapes.get(names.includes(s) ? s : INPUT)!,
        );
        const s = l.computeOutputShape(
          ins.length === 1 ? ins[0]! : ins,
        ) as Shape;
        shapes.set(l.name, s);
      }
      return shapes
        .get(output)!
        .map((d, i) => (d === null ? (i === 0 ? inputShape[0]! : NaN) : d));
    },
    forward(p, x) {
      current = p;
      try {
        return run(x).get(output) as tf.Tensor;
      } finally {
        current = null;
      }
    },
    flops(inputShape) {
      // 2 * (kernel elements) * (output positions) per weight of rank >= 2 (dense, conv, embedding-free
      // matrices), plus one per output element: exact for dense and convolution layers
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
    },
  };
}
