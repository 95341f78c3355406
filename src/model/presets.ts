/** Named model presets. The CLI can override their shape (`--layers`, `--d-model`, ...). */
import { LayerwiseError } from '../util/errors.js';
import type { ModelConfig } from './model.js';

/** What the data set decides about a model: its vocabulary or its input shape and classes. */
export interface DataShape {
  vocab?: number;
  inputShape?: [number, number, number];
  classes?: number;
}

/** Shape overrides from the command line. */
export interface ShapeOverrides {
  layers?: number;
  dModel?: number;
  heads?: number;
  context?: number;
}

interface Preset {
  description: string;
  /** Which kind of data the preset trains on. */
  data: 'text' | 'image';
  defaultData: string;
  make(shape: DataShape, o: ShapeOverrides): ModelConfig;
}

function charlm(
  layers: number,
  dModel: number,
  heads: number,
  context: number,
): Preset['make'] {
  return (shape, o) => ({
    arch: 'charlm',
    layers: o.layers ?? layers,
    dModel: o.dModel ?? dModel,
    heads: o.heads ?? heads,
    context: o.context ?? context,
    vocab: need(shape.vocab, 'a vocabulary (a text data set)'),
  });
}

function need<T>(v: T | undefined, what: string): T {
  if (v === undefined)
    throw new LayerwiseError(
      `this preset needs ${what}; pick a matching --data`,
    );
  return v;
}

/** The presets by name. */
export const PRESETS: Record<string, Preset> = {
  'charlm-tiny': {
    description:
      'character Transformer LM, 2 layers, d_model 64, 2 heads, context 64',
    data: 'text',
    defaultData: 'moby-dick',
    make: charlm(2, 64, 2, 64),
  },
  'charlm-small': {
    description:
      'character Transformer LM, 4 layers, d_model 256, 4 heads, context 128',
    data: 'text',
    defaultData: 'moby-dick',
    make: charlm(4, 256, 4, 128),
  },
  'mlp-mnist': {
    description:
      'MLP 784-256-256-10 (hidden width from --d-model, depth from --layers)',
    data: 'image',
    defaultData: 'mnist',
    make: (s, o) => ({
      arch: 'mlp',
      inputShape: need(s.inputShape, 'images'),
      hidden: Array.from({ length: o.layers ?? 2 }, () => o.dModel ?? 256),
      classes: need(s.classes, 'class labels'),
    }),
  },
  'cnn-mnist': {
    description:
      'CNN conv16, max-pool, conv32, max-pool (3x3 convolutions with ReLU, 2x2 pooling), dense 128, classifier: 6 blocks',
    data: 'image',
    defaultData: 'mnist',
    make: (s, o) => ({
      arch: 'cnn',
      inputShape: need(s.inputShape, 'images'),
      channels: o.layers
        ? Array.from({ length: o.layers }, (_, i) => 16 * 2 ** i)
        : [16, 32],
      hidden: o.dModel ?? 128,
      classes: need(s.classes, 'class labels'),
    }),
  },
};

/** Looks a preset up by name; throws {@link LayerwiseError} listing the valid names. */
export function getPreset(name: string): Preset {
  const p = PRESETS[name];
  if (!p)
    throw new LayerwiseError(
      `unknown preset '${name}'; valid presets: ${Object.keys(PRESETS).join(', ')}`,
    );
  return p;
}
