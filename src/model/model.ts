/**
 * A model is an ordered list of blocks plus a loss. It is built from a {@link ModelConfig},
 * plain JSON, so that every worker thread can rebuild the same model from the same config.
 */
import type * as tf from '@tensorflow/tfjs-core';
import { check, LayerwiseError } from '../util/errors.js';
import type { Block } from './block.js';
import { paramCount } from './block.js';
import { softmaxCrossEntropy } from './layers.js';
import {
  accuracy,
  isClassification,
  type LossName,
  lossFunction,
} from './losses.js';
import { type LoadedModule, loadModelModule } from './module.js';
import { decoderBlock, embedding, lmHead } from './transformer.js';
import { convBlock, denseBlock, features, maxPoolBlock } from './vision.js';

/** Character-level causal Transformer language model. */
export interface CharLmConfig {
  arch: 'charlm';
  layers: number;
  dModel: number;
  heads: number;
  context: number;
  vocab: number;
}
/** Multi-layer perceptron classifier over images [H, W, C]. */
export interface MlpConfig {
  arch: 'mlp';
  inputShape: [number, number, number];
  hidden: number[];
  classes: number;
}
/** Convolutional classifier: conv+pool blocks, then a hidden dense layer and the classifier. */
export interface CnnConfig {
  arch: 'cnn';
  inputShape: [number, number, number];
  channels: number[];
  hidden: number;
  classes: number;
}
/** A user's model from an ES module (model/module.ts), with its loss and input resolved. */
export interface ModuleConfig {
  arch: 'module';
  /** Absolute path of the module. */
  path: string;
  loss: LossName;
  /** One example's input shape (batch axis excluded). */
  inputShape: number[];
  inputDtype: 'int32' | 'float32';
}
export type ModelConfig = CharLmConfig | MlpConfig | CnnConfig | ModuleConfig;

/** A built model: its blocks in order, input type and loss. */
export interface Model {
  config: ModelConfig;
  blocks: Block[];
  /** dtype of the model's input: int32 token ids or float32 pixels. */
  inputDtype: 'int32' | 'float32';
  /** Input shape for a batch of `n` examples. */
  inputShape(n: number): number[];
  /** Scalar mean loss of the last block's output (logits) against the labels. */
  loss(logits: tf.Tensor, labels: tf.Tensor): tf.Scalar;
  /**
   * Evaluation metrics of the last block's output against the labels, each a scalar mean over
   * the micro-batch's predictions (e.g. `accuracy` for classifiers and language models).
   */
  metrics?(output: tf.Tensor, labels: tf.Tensor): Record<string, tf.Scalar>;
}

/** The evaluation metrics of a classifier (and of a language model: next-token accuracy). */
const classification = (
  output: tf.Tensor,
  labels: tf.Tensor,
): Record<string, tf.Scalar> => ({ accuracy: accuracy(output, labels) });

/** Model modules this thread has loaded, by path (see {@link loadModel}). */
const modules = new Map<string, LoadedModule>();

/**
 * Builds a model from its config, loading a model module first where the config names one
 * (each thread imports it once). `initialValues`: keep a module model's own initial weights
 * (the coordinator's initParams needs them; devices do not).
 * @throws LayerwiseError as {@link buildModel} and model/module.ts loadModelModule.
 */
export async function loadModel(
  config: ModelConfig,
  opts: { initialValues?: boolean } = {},
): Promise<Model> {
  if (config.arch === 'module' && !modules.has(config.path))
    modules.set(
      config.path,
      await loadModelModule(config.path, opts.initialValues ?? true),
    );
  return buildModel(config);
}

/**
 * A module model (model/module.ts) from the blocks this thread loaded for it, with the loss
 * its config names. Throws {@link LayerwiseError} when {@link loadModel} has not loaded it.
 */
function buildModuleModel(config: ModuleConfig): Model {
  const m = modules.get(config.path);
  if (!m)
    throw new LayerwiseError(
      `model module ${config.path} is not loaded in this thread; build it with loadModel()`,
    );
  return {
    config,
    blocks: m.blocks,
    inputDtype: config.inputDtype,
    inputShape: (n) => [n, ...config.inputShape],
    loss: lossFunction(config.loss),
    ...(isClassification(config.loss) ? { metrics: classification } : {}),
  };
}

/**
 * The character-level Transformer: an embedding, `layers` decoder blocks and the LM head, on
 * int32 token ids [n, context]. Throws {@link LayerwiseError} for a size that is not a positive
 * integer or a d_model not divisible by the number of heads.
 */
function buildCharLm(config: CharLmConfig): Model {
  const { layers, dModel, heads, context, vocab } = config;
  for (const [k, v] of Object.entries({
    layers,
    dModel,
    heads,
    context,
    vocab,
  })) {
    check(
      Number.isInteger(v) && v > 0,
      `model ${k} must be a positive integer, got ${v}`,
    );
  }
  check(
    dModel % heads === 0,
    `--d-model ${dModel} must be divisible by --heads ${heads}`,
  );
  const blocks: Block[] = [embedding('embed', vocab, context, dModel)];
  for (let i = 0; i < layers; i++)
    blocks.push(decoderBlock(`decoder${i}`, dModel, heads, layers));
  blocks.push(lmHead('head', dModel, vocab));
  return {
    config,
    blocks,
    inputDtype: 'int32',
    inputShape: (n) => [n, context],
    loss: softmaxCrossEntropy,
    metrics: classification,
  };
}

/** The MLP classifier: dense blocks (ReLU but the last) over the flattened image [n, H, W, C]. */
function buildMlp(config: MlpConfig): Model {
  const sizes = [features(config.inputShape), ...config.hidden, config.classes];
  const blocks = sizes
    .slice(1)
    .map((out, i) =>
      denseBlock(`dense${i}`, sizes[i], out, i < sizes.length - 2),
    );
  return imageClassifier(config, blocks);
}

/** An image classifier of these blocks: float32 images [n, ...inputShape], logits, softmax cross-entropy, accuracy. */
function imageClassifier(
  config: MlpConfig | CnnConfig,
  blocks: Block[],
): Model {
  return {
    config,
    blocks,
    inputDtype: 'float32',
    inputShape: (n) => [n, ...config.inputShape],
    loss: softmaxCrossEntropy,
    metrics: classification,
  };
}

/** The CNN classifier: a conv block and a pooling block per channel count, a hidden dense block and the classifier, on images [n, H, W, C]. */
function buildCnn(config: CnnConfig): Model {
  const [h, w, c] = config.inputShape;
  const blocks: Block[] = [];
  let shape = [1, h, w, c];
  let cin = c;
  config.channels.forEach((cout, i) => {
    for (const b of [
      convBlock(`conv${i}`, cin, cout),
      maxPoolBlock(`pool${i}`),
    ]) {
      blocks.push(b);
      shape = b.outputShape(shape);
    }
    cin = cout;
  });
  const flat = features(shape.slice(1));
  blocks.push(denseBlock('dense0', flat, config.hidden, true));
  blocks.push(denseBlock('classifier', config.hidden, config.classes, false));
  return imageClassifier(config, blocks);
}

/**
 * Builds the blocks of a model. Throws {@link LayerwiseError} when the shape makes no sense
 * (for example d_model not divisible by the number of heads), and for a module model this
 * thread has not loaded with {@link loadModel}.
 */
export function buildModel(config: ModelConfig): Model {
  switch (config.arch) {
    case 'module':
      return buildModuleModel(config);
    case 'charlm':
      return buildCharLm(config);
    case 'mlp':
      return buildMlp(config);
    case 'cnn':
      return buildCnn(config);
    default:
      throw new LayerwiseError(
        `unknown model architecture ${(config as { arch: string }).arch}`,
      );
  }
}

/** Total number of parameters (elements) of a model. */
export function modelParamCount(model: Model): number {
  return model.blocks.reduce((s, b) => s + paramCount(b), 0);
}
