/**
 * Data sets by name, and the data module's public API. Everything here produces plain typed
 * arrays; nothing depends on TensorFlow.js.
 */
import { stat } from 'node:fs/promises';
import { check, LayerwiseError } from '../util/errors.js';
import {
  FASHION_MNIST_DIR,
  type ImageDataset,
  loadFashionMnist,
  loadIdxImages,
  loadMnist,
} from './images.js';
import {
  loadJsonlDataset,
  loadNpyDataset,
  type TensorDataset,
  tensorSplitSize,
} from './tensors.js';
import { loadMobyDick, loadTextFile, type TextDataset } from './text.js';
import type { Vocab } from './vocab.js';

export {
  type Batch,
  type Batcher,
  type BatcherOptions,
  type BatcherState,
  epochOrder,
  makeBatcher,
  type ValidationOptions,
  validationBatches,
  windowCount,
} from './batcher.js';
export {
  encodeIdx,
  type IdxArray,
  type IdxData,
  type IdxDtype,
  isGzip,
  parseIdx,
  readIdxFile,
} from './idx.js';
export {
  FASHION_MNIST_DIR,
  type ImageDataset,
  type ImageOptions,
  type ImageSplit,
  imageSplitFromIdx,
  loadFashionMnist,
  loadIdxImages,
  loadMnist,
  splitExamples,
  splitSize,
} from './images.js';
export {
  type NpyArray,
  type NpyData,
  type NpyDtype,
  parseNpy,
  readNpyFile,
} from './npy.js';
export {
  loadJsonlDataset,
  loadNpyDataset,
  type TensorDataset,
  type TensorOptions,
  type TensorSplit,
  type TensorTarget,
  tensorDatasetFromJsonl,
  tensorSplitSize,
  yValuesPer,
} from './tensors.js';
export {
  DEFAULT_VAL_FRACTION,
  loadMobyDick,
  loadTextFile,
  mobyDickText,
  type TextDataset,
  type TextOptions,
  textDatasetFromString,
} from './text.js';
export { type UnknownCharPolicy, Vocab, type VocabJSON } from './vocab.js';

/**
 * Any data set: a character-level text, an image classification set, or a tensor set (features
 * of any shape with class labels or regression targets, from JSONL or .npy files).
 */
export type Dataset = TextDataset | ImageDataset | TensorDataset;

/** Built-in data set names accepted by {@link loadDataset}. */
export const BUILTIN_DATASETS = [
  'moby-dick',
  'mnist',
  'fashion-mnist',
] as const;

/** Options of {@link loadDataset}. */
export interface LoadOptions {
  /** Fraction held out for validation where the source has no test split; in [0, 1), default 0.1. */
  valFraction?: number;
  /** Seed of the fixed pre-split permutation of image and tensor sets without a test split; default 0. */
  splitSeed?: number;
  /** Tensor sets with class labels: the number of classes (default the largest label + 1). */
  classes?: number;
  /** Text only: encode with this vocabulary (e.g. a checkpoint's) instead of building one. */
  vocab?: Vocab;
  /** Directory of the Fashion-MNIST IDX files; default {@link FASHION_MNIST_DIR}. */
  fashionMnistDir?: string;
}

const USAGE =
  "use one of 'moby-dick', 'mnist', 'fashion-mnist', a path to a UTF-8 .txt file, 'idx:IMAGES,LABELS' (optionally 'idx:IMAGES,LABELS,VAL_IMAGES,VAL_LABELS') with IDX file paths, a path to a .jsonl/.ndjson file of {\"x\": [...], \"y\": ...} lines, or 'npy:X.npy,Y.npy' (optionally 'npy:X.npy,Y.npy,VAL_X.npy,VAL_Y.npy')";

/**
 * Load a data set by name:
 * - `'moby-dick'`: Moby-Dick, character level (~1.21M characters, 89-character vocabulary);
 * - `'mnist'`: the `mnist` package's 10000 digits, 28×28×1, split 9000/1000 by default;
 * - `'fashion-mnist'`: 60000 + 10000 28×28×1 images from Debian's IDX files;
 * - a path ending in `.txt` (or any existing regular file): that UTF-8 text, character level;
 * - `'idx:IMAGES,LABELS'` or `'idx:IMAGES,LABELS,VAL_IMAGES,VAL_LABELS'`: IDX files (raw or .gz);
 * - a path ending in `.jsonl` or `.ndjson`: a tensor set, one `{"x": ..., "y": ...}` example per
 *   line (see {@link loadJsonlDataset});
 * - `'npy:X.npy,Y.npy'` or `'npy:X.npy,Y.npy,VAL_X.npy,VAL_Y.npy'`: a tensor set from NumPy files
 *   (see {@link loadNpyDataset}).
 * Text sets hold out the last `valFraction` of the text; image and tensor sets without their own
 * validation examples hold out a fixed random `valFraction` of the examples.
 * @throws LayerwiseError for unknown names and missing or malformed files, saying what would fix it.
 */
export async function loadDataset(
  name: string,
  opts: LoadOptions = {},
): Promise<Dataset> {
  check(
    typeof name === 'string' && name.trim() !== '',
    `No data set given; ${USAGE}.`,
  );
  const textOpts = { valFraction: opts.valFraction, vocab: opts.vocab };
  const imageOpts = {
    valFraction: opts.valFraction,
    splitSeed: opts.splitSeed,
  };
  const tensorOpts = { ...imageOpts, classes: opts.classes };
  switch (name) {
    case 'moby-dick':
      return loadMobyDick(textOpts);
    case 'mnist':
      return loadMnist(imageOpts);
    case 'fashion-mnist':
      return loadFashionMnist(opts.fashionMnistDir ?? FASHION_MNIST_DIR);
  }
  if (name.startsWith('idx:')) {
    const paths = name.slice(4).split(',');
    check(
      (paths.length === 2 || paths.length === 4) &&
        paths.every((p) => p !== ''),
      () =>
        `Data set "${name}" should list 2 or 4 comma-separated IDX paths after "idx:" (images,labels[,val_images,val_labels]), got ${paths.filter((p) => p !== '').length}; e.g. idx:train-images-idx3-ubyte.gz,train-labels-idx1-ubyte.gz.`,
    );
    const [images, labels, valImages, valLabels] = paths;
    return loadIdxImages(
      { images, labels, valImages, valLabels },
      { ...imageOpts, name },
    );
  }
  if (name.startsWith('npy:')) {
    const paths = name.slice(4).split(',');
    check(
      (paths.length === 2 || paths.length === 4) &&
        paths.every((p) => p !== ''),
      () =>
        `Data set "${name}" should list 2 or 4 comma-separated .npy paths after "npy:" (x,y[,val_x,val_y]), got ${paths.filter((p) => p !== '').length}; e.g. npy:x_train.npy,y_train.npy.`,
    );
    const [x, y, valX, valY] = paths;
    return loadNpyDataset({ x, y, valX, valY }, { ...tensorOpts, name });
  }
  if (/\.(jsonl|ndjson)$/i.test(name))
    return loadJsonlDataset(name, tensorOpts);
  if (name.toLowerCase().endsWith('.txt')) return loadTextFile(name, textOpts);
  const st = await stat(name).catch(() => undefined);
  if (st?.isFile()) return loadTextFile(name, textOpts);
  throw new LayerwiseError(
    st?.isDirectory()
      ? `Data set "${name}" is a directory; give a file inside it, or ${USAGE}.`
      : /[/\\.]/.test(name)
        ? `Data set "${name}" is neither a built-in name nor an existing file (relative paths are resolved from ${process.cwd()}); ${USAGE}.`
        : `Unknown data set "${name}"; ${USAGE}.`,
  );
}

/** A one-line human description of a data set: name, kind, sizes. */
export function describeDataset(ds: Dataset): string {
  if (ds.kind === 'text') {
    return `${ds.name}: text, ${ds.train.length + ds.val.length} characters (${ds.train.length} train, ${ds.val.length} val), vocabulary ${ds.vocab.size}`;
  }
  if (ds.kind === 'tensor') {
    const target =
      ds.target.kind === 'classes'
        ? `${ds.target.classes} classes`
        : `regression targets [${ds.target.shape.join(', ')}]`;
    return `${ds.name}: tensors [${ds.xShape.join(', ')}], ${target}, ${tensorSplitSize(ds, 'train')} train, ${tensorSplitSize(ds, 'val')} val`;
  }
  return `${ds.name}: images ${ds.shape.join('x')}, ${ds.classes} classes, ${ds.train.y.length} train, ${ds.val.y.length} val`;
}
