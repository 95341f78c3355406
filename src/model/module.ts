/**
 * A user's model from an ES module (`layerwise train --model ./my-model.js`). Its default export
 * is one of:
 * - a TF.js Layers model (`tf.sequential(...)`, or `tf.model(...)` whose layers form a chain),
 * - a function (sync or async) returning one of these,
 * - an array of layerwise {@link Block}s,
 * - a {@link ModelModuleSpec}: `{ model, groups?, loss? }` or `{ blocks, inputShape, inputDtype?, loss? }`.
 * Every device (worker thread) imports the module itself, as each rank of a torchrun job runs
 * the user's script, so the module must build the same model every time it is called. The
 * module must import TensorFlow.js from the same installation as layerwise (one tfjs-core).
 * A thread loads each module once; later loads return the same blocks.
 */

import { stat } from 'node:fs/promises';
import { resolve } from 'node:path';
import { pathToFileURL } from 'node:url';
import * as tf from '@tensorflow/tfjs-core';
import type * as tfl from '@tensorflow/tfjs-layers';
import { initBackend } from '../backend/index.js';
import { check, LayerwiseError } from '../util/errors.js';
import type { Block } from './block.js';
import { blocksFromLayersModel } from './layers-model.js';
import { LOSSES, type LossName } from './losses.js';

/** The object form of a model module's default export. */
export interface ModelModuleSpec {
  /** A Layers model, or a function building one. */
  model?: tfl.LayersModel | (() => tfl.LayersModel | Promise<tfl.LayersModel>);
  /** Layers per block, by name or by count (see layers-model.ts); default one layer per block. */
  groups?: string[][] | number[];
  /** Blocks written against layerwise's Block interface, instead of `model`. */
  blocks?: Block[];
  /** One example's input shape (without the batch axis); required with `blocks`. */
  inputShape?: number[];
  /** The input's dtype with `blocks`: float32 (default) or int32 (token ids). */
  inputDtype?: 'float32' | 'int32';
  /** The loss (see model/losses.ts); default: from the model's compile() or its last activation, else from the data. */
  loss?: LossName;
}

/** What a model module provides, after loading. */
export interface LoadedModule {
  /** The absolute path it was loaded from. */
  path: string;
  blocks: Block[];
  /** One example's input shape (batch axis excluded). */
  inputShape: number[];
  inputDtype: 'float32' | 'int32';
  /** The loss the module declares or implies, if any. */
  loss?: LossName;
  /** The Layers model's topology (`model.toJSON()`), for export; absent for block lists. */
  topology?: unknown;
}

const loaded = new Map<string, Promise<LoadedModule>>();

/** The absolute path of a model module given on the command line, checked to be a file. */
export async function resolveModulePath(path: string): Promise<string> {
  const abs = resolve(path);
  const st = await stat(abs).catch(() => undefined);
  check(
    st?.isFile() === true,
    () =>
      `model module ${path} ${st ? 'is not a file' : 'does not exist'} (resolved to ${abs}); give the path of an ES module (.js or .mjs) whose default export is a tf.layers model, a function returning one, or a block list`,
  );
  return abs;
}

/**
 * Imports the module at `path` (absolute) in this thread, once, and turns its default export into
 * blocks. `initialValues`: keep the model's initial weights (the coordinator needs them;
 * devices do not).
 * @throws LayerwiseError when the module does not load, throws, exports nothing usable, or
 *   its model cannot be split into blocks (see {@link blocksFromLayersModel}).
 */
export function loadModelModule(
  path: string,
  initialValues = true,
): Promise<LoadedModule> {
  let p = loaded.get(path);
  if (!p) {
    p = load(path, initialValues);
    loaded.set(path, p);
    p.catch(() => loaded.delete(path));
  }
  return p;
}

const isLayersModel = (v: unknown): v is tfl.LayersModel =>
  typeof v === 'object' &&
  v !== null &&
  Array.isArray((v as tfl.LayersModel).layers) &&
  Array.isArray((v as tfl.LayersModel).inputs) &&
  typeof (v as tfl.LayersModel).getClassName === 'function';

async function load(
  path: string,
  initialValues: boolean,
): Promise<LoadedModule> {
  // the module builds its model when it is called: a thread without a device yet (the
  // coordinator) builds it on the cpu backend, only to read its structure and initial weights
  if (!(tf.engine() as unknown as { backendName: string | null }).backendName)
    await initBackend('cpu');
  let mod: Record<string, unknown>;
  try {
    mod = (await import(pathToFileURL(path).href)) as Record<string, unknown>;
  } catch (e) {
    throw new LayerwiseError(
      `model module ${path} failed to load: ${(e as Error).message.split('\n')[0]}; fix the module (run it with node to see the full error)`,
    );
  }
  const where = `model module ${path}`;
  let v: unknown = mod.default;
  check(
    v !== undefined,
    () =>
      `${where} has no default export; export default a tf.layers model, a function returning one, or a block list`,
  );
  v = await call(v, where);
  let spec: ModelModuleSpec;
  if (isLayersModel(v)) spec = { model: v };
  else if (Array.isArray(v)) spec = { blocks: v as Block[] };
  else if (
    typeof v === 'object' &&
    v !== null &&
    ('model' in v || 'blocks' in v)
  )
    spec = v as ModelModuleSpec;
  else
    throw new LayerwiseError(
      `${where}'s default export is ${describe(v)}; export default a tf.layers model, a function returning one, a block list, or { model, groups?, loss? }`,
    );
  if (spec.loss !== undefined)
    check(
      LOSSES.includes(spec.loss),
      () =>
        `${where} declares loss '${spec.loss}'; valid: ${LOSSES.join(', ')}`,
    );
  if (spec.model !== undefined) {
    const m = await call(spec.model, where);
    check(
      isLayersModel(m),
      () => `${where}: model is ${describe(m)}, not a tf.layers model`,
    );
    return fromLayersModel(path, m, spec, initialValues);
  }
  return fromBlocks(path, spec);
}

async function call(v: unknown, where: string): Promise<unknown> {
  if (typeof v !== 'function' || isLayersModel(v)) return v;
  try {
    return await (v as () => unknown)();
  } catch (e) {
    throw new LayerwiseError(
      `${where}: building the model threw: ${(e as Error).message.split('\n')[0]}; fix the module`,
    );
  }
}

function describe(v: unknown): string {
  if (v === null) return 'null';
  if (Array.isArray(v)) return 'an array';
  return typeof v === 'object'
    ? `an object with keys ${Object.keys(v as object).join(', ') || '(none)'}`
    : `a ${typeof v}`;
}

/** tfjs-layers loss names of a compiled model, as layerwise losses. */
const COMPILED: Record<string, LossName> = {
  sparseCategoricalCrossentropy: 'sparse-categorical-crossentropy',
  meanSquaredError: 'mse',
  mse: 'mse',
  MSE: 'mse',
};

function fromLayersModel(
  path: string,
  m: tfl.LayersModel,
  spec: ModelModuleSpec,
  initialValues: boolean,
): LoadedModule {
  const where = `model module ${path}`;
  check(
    m.trainableWeights.length > 0,
    () =>
      `${where}: model "${m.name}" has no trainable weights; there is nothing to train`,
  );
  const w = m.trainableWeights[0]!.read();
  check(
    w instanceof tf.Tensor,
    () =>
      `${where}: the model was built with another copy of TensorFlow.js than layerwise's; import @tensorflow/tfjs (or tfjs-layers) from the same installation as layerwise`,
  );
  const input = m.inputs[0]!;
  const inputShape = input.shape.slice(1);
  check(
    inputShape.every((d) => typeof d === 'number' && d > 0),
    () =>
      `${where}: the model's input shape ${JSON.stringify(input.shape)} has undefined dimensions besides the batch; give the input layer a fixed shape`,
  );
  let loss = spec.loss;
  if (loss === undefined && typeof m.loss === 'string') {
    loss = COMPILED[m.loss];
    check(
      loss !== undefined,
      () =>
        `${where}: the model is compiled with loss '${m.loss}', which layerwise does not train; compile with sparseCategoricalCrossentropy or meanSquaredError, or declare loss: ${LOSSES.join(' | ')}`,
    );
  }
  if (loss === undefined) {
    const last = m.layers[m.layers.length - 1]!.getConfig() as {
      activation?: string;
    };
    if (last.activation === 'softmax') loss = 'sparse-categorical-crossentropy';
  }
  const topology = m.toJSON(undefined, false);
  const blocks = blocksFromLayersModel(m, {
    groups: spec.groups,
    initialValues,
  });
  return {
    path,
    blocks,
    inputShape: inputShape as number[],
    inputDtype: input.dtype === 'int32' ? 'int32' : 'float32',
    loss,
    topology,
  };
}

function fromBlocks(path: string, spec: ModelModuleSpec): LoadedModule {
  const where = `model module ${path}`;
  const blocks = spec.blocks!;
  check(
    Array.isArray(blocks) && blocks.length > 0,
    () => `${where}: blocks must be a non-empty array of blocks`,
  );
  blocks.forEach((b, i) => {
    const ok =
      typeof b === 'object' &&
      b !== null &&
      typeof b.name === 'string' &&
      Array.isArray(b.params) &&
      typeof b.forward === 'function' &&
      typeof b.outputShape === 'function' &&
      typeof b.flops === 'function';
    check(
      ok,
      () =>
        `${where}: blocks[${i}] is not a block; a block has name, params, forward(p, x), outputShape(shape) and flops(shape) (see Block in model/block.ts)`,
    );
  });
  check(
    blocks.some((b) => b.params.length > 0),
    () => `${where}: no block has parameters; there is nothing to train`,
  );
  const shape = spec.inputShape;
  check(
    Array.isArray(shape) &&
      shape.length > 0 &&
      shape.every((d) => Number.isInteger(d) && d > 0),
    () =>
      `${where}: a block list needs inputShape, one example's input shape without the batch axis (e.g. [28, 28, 1])`,
  );
  const dtype = spec.inputDtype ?? 'float32';
  check(
    dtype === 'float32' || dtype === 'int32',
    () =>
      `${where}: inputDtype must be 'float32' or 'int32', got ${JSON.stringify(dtype)}`,
  );
  return {
    path,
    blocks,
    inputShape: shape,
    inputDtype: dtype,
    loss: spec.loss,
  };
}
