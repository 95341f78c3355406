/**
 * Generic tensor data sets: examples whose features x have any fixed shape (e.g. [4] or
 * [8, 8, 1]) and whose target y is a class label or a regression tensor, for training a user's
 * own model. Two sources:
 * - JSON lines (`.jsonl` / `.ndjson`): one `{"x": ..., "y": ...}` object per line;
 * - NumPy `.npy` files: `npy:X.npy,Y.npy` (optionally `,VAL_X.npy,VAL_Y.npy`).
 * Features are float32; labels int32; regression targets float32.
 */
import { basename } from 'node:path';
import { check, LayerwiseError } from '../util/errors.js';
import { readPair, readUtf8File } from './files.js';
import { splitExamples } from './images.js';
import { type NpyArray, pyShape, readNpyFile } from './npy.js';
import { checkValFraction, DEFAULT_VAL_FRACTION } from './text.js';

/** What y holds: class labels in [0, classes), or regression targets of a fixed shape. */
export type TensorTarget =
  | { kind: 'classes'; classes: number }
  | { kind: 'values'; shape: number[] };

/** Examples of one split of a {@link TensorDataset}. */
export interface TensorSplit {
  /** Features, N * prod(xShape) float32 values, example-major, row-major within an example. */
  x: Float32Array;
  /** Class labels (Int32Array, N values) or regression targets (Float32Array, N * prod(target.shape)). */
  y: Int32Array | Float32Array;
}

/** A data set of fixed-shape feature tensors with class labels or regression targets. */
export interface TensorDataset {
  kind: 'tensor';
  /** Short name for logs and checkpoints: the file's base name, or the `npy:` spec. */
  name: string;
  /** Shape of one example's features, e.g. [4] or [8, 8, 1]; a scalar x counts as [1]. */
  xShape: number[];
  /** Class labels (y Int32Array) or regression targets of `shape` per example (y Float32Array; [] for one number). */
  target:
    | { kind: 'classes'; classes: number }
    | { kind: 'values'; shape: number[] };
  train: { x: Float32Array; y: Int32Array | Float32Array };
  val: { x: Float32Array; y: Int32Array | Float32Array };
}

/** Options of the tensor loaders. */
export interface TensorOptions {
  /**
   * Fraction of examples held out for validation when the source marks no validation examples
   * (no `"split"` field in a JSONL file; no VAL_X/VAL_Y .npy files); in [0, 1), default 0.1.
   */
  valFraction?: number;
  /** Seed of the fixed permutation applied before such a split (never the training seed); default 0. */
  splitSeed?: number;
  /** Number of classes of a classification set (labels must be below it); default the largest label + 1. */
  classes?: number;
  /** Data set name; default the file's base name (JSONL) or the `npy:` spec. */
  name?: string;
}

/** Number of examples in a split of `ds`. */
export function tensorSplitSize(
  ds: TensorDataset,
  split: 'train' | 'val',
): number {
  return ds[split].y.length / yValuesPer(ds.target);
}

/** Values of y per example: 1 for class labels, prod(shape) for regression targets. */
export function yValuesPer(target: TensorTarget): number {
  return target.kind === 'classes'
    ? 1
    : target.shape.reduce((a, b) => a * b, 1);
}

const FLOAT32_MAX = 3.4028234663852886e38;
const JSONL_FORMAT =
  'one JSON object per line, {"x": <number or nested arrays of numbers>, "y": <class label or regression target>}';

function shapeStr(shape: number[]): string {
  return `[${shape.join(', ')}]`;
}

function sameShape(a: number[], b: number[]): boolean {
  return a.length === b.length && a.every((d, i) => d === b[i]);
}

/** A short description of a JSON value for messages: `"abc" (a string)`, `null`, `an object`. */
function describeJson(v: unknown): string {
  if (v === null) return 'null';
  if (Array.isArray(v)) return `an array of length ${v.length}`;
  if (typeof v === 'string')
    return `${JSON.stringify(v.length > 20 ? `${v.slice(0, 20)}...` : v)} (a string)`;
  if (typeof v === 'boolean') return `${v} (a boolean)`;
  if (typeof v === 'object') return 'an object';
  return String(v);
}

/** Growable array of float64 values. */
class Values {
  a = new Float64Array(1024);
  n = 0;
  push(v: number): void {
    if (this.n === this.a.length) {
      const b = new Float64Array(this.a.length * 2);
      b.set(this.a);
      this.a = b;
    }
    this.a[this.n++] = v;
  }
  get(): Float64Array {
    return this.a.subarray(0, this.n);
  }
}

/**
 * Shape of a JSON number or nested array, read along its first elements (validated later by
 * {@link collect}); a number has shape [].
 */
function probeShape(v: unknown): number[] {
  const shape: number[] = [];
  while (Array.isArray(v)) {
    shape.push(v.length);
    if (v.length === 0) break;
    v = v[0];
  }
  return shape;
}

/**
 * Append the values of `v`, which must be a rectangular nested array of `shape` (or a number
 * when shape is []), to `out`. Throws a plain Error whose message names the offending element
 * (`path`, e.g. `x[2][0]`) and the problem.
 */
function collect(
  v: unknown,
  shape: number[],
  depth: number,
  path: string,
  out: Values,
): void {
  if (depth === shape.length) {
    if (typeof v === 'number') {
      if (!Number.isFinite(v))
        throw new Error(
          `${path} is ${v} (out of range), not a finite number; remove the example or clip its values`,
        );
      out.push(v);
      return;
    }
    const hint =
      v === null
        ? ' (missing values, NaN, are often written as null: remove or impute such examples)'
        : typeof v === 'string'
          ? ' (write numbers without quotes)'
          : typeof v === 'boolean'
            ? ' (write 1 or 0)'
            : '';
    throw new Error(
      Array.isArray(v)
        ? `${path} is ${describeJson(v)} where ${path.replace(/\[\d+\]$/, '[0]')} is a number: ragged array; every element at one depth must have the same shape`
        : `${path} is ${describeJson(v)}, not a number${depth === 0 && typeof v === 'object' && v !== null ? ' or nested arrays of numbers' : ''}${hint}`,
    );
  }
  if (!Array.isArray(v)) {
    throw new Error(
      typeof v === 'number'
        ? `${path} is a number where ${path.replace(/\[\d+\]$/, '[0]')} is an array of length ${shape[depth]}: ragged array; every element at one depth must have the same shape`
        : `${path} is ${describeJson(v)}, not a number or an array of numbers`,
    );
  }
  if (v.length !== shape[depth]) {
    throw new Error(
      `${path} has ${v.length} elements but ${depth === 0 ? 'its shape is' : `${path.replace(/\[\d+\]$/, '[0]')} has`} ${shape[depth]}: ragged array; every row must have the same length`,
    );
  }
  for (let k = 0; k < v.length; k++)
    collect(v[k], shape, depth + 1, `${path}[${k}]`, out);
}

/** Read field `key` of a JSONL example as a shape and append its values; throws plain Errors. */
function readTensor(v: unknown, key: 'x' | 'y', out: Values): number[] {
  const shape = probeShape(v);
  check(
    !shape.includes(0),
    () =>
      `${key} has an empty array (shape ${shapeStr(shape)}); give at least one value per dimension`,
  );
  collect(v, shape, 0, key, out);
  return shape;
}

/** A JSONL file's examples as read line by line, before they become a data set. */
interface JsonlRows {
  /** Every example's x values, then its y values, in line order. */
  xs: Values;
  ys: Values;
  /** Per example: whether its "split" is "val", and its line number (from 1). */
  isVal: boolean[];
  lineOf: number[];
  /** Whether any line has a "split" field. */
  anySplit: boolean;
  /** The first example's x shape (a number's as [1]) and y shape, and its line; undefined before it. */
  xShape: number[] | undefined;
  yShape: number[] | undefined;
  firstLine: number;
  /** First line whose y is not a class label (a scalar integer >= 0), for messages. */
  notLabel: { line: number; y: string } | undefined;
}

/**
 * One line of a JSONL file as a JSON object with "x" and "y" fields (`at`: the file and line,
 * for messages). Throws {@link LayerwiseError} for invalid JSON (naming a NaN or Infinity
 * written as such), a value that is not an object, or a missing field.
 */
function parseJsonlLine(line: string, at: string): Record<string, unknown> {
  let obj: unknown;
  try {
    obj = JSON.parse(line);
  } catch (e) {
    const bad = /(?<![\w"])(-?Infinity|NaN)(?![\w"])/.exec(line);
    throw new LayerwiseError(
      bad
        ? `${at} contains ${bad[1]}, which is not a number in JSON (Python's json.dumps writes float nan/inf this way); remove or impute examples with NaN or infinite values.`
        : `${at} is not valid JSON (${(e as Error).message}); write ${JSONL_FORMAT}.`,
    );
  }
  check(
    typeof obj === 'object' && obj !== null && !Array.isArray(obj),
    () =>
      `${at} is ${describeJson(obj)}, not a JSON object; write ${JSONL_FORMAT}.`,
  );
  const o = obj as Record<string, unknown>;
  for (const key of ['x', 'y'] as const) {
    check(
      key in o,
      () =>
        `${at} has no "${key}" field (fields: ${
          Object.keys(o)
            .map((k) => JSON.stringify(k))
            .join(', ') || 'none'
        }); write ${JSONL_FORMAT}.`,
    );
  }
  return o;
}

/**
 * Checks that an example's x shape `xs1` and y shape `ys1` (line `at`) are those of the first
 * example, `xShape` and `yShape` of line `first`. Throws {@link LayerwiseError} for another x
 * shape, a mix of class labels and regression targets, or another target shape.
 */
function checkSameShapes(
  at: string,
  xs1: number[],
  ys1: number[],
  first: number,
  xShape: number[],
  ys0: number[],
): void {
  check(
    sameShape(xs1, xShape),
    () =>
      `${at}: x has shape ${shapeStr(xs1)} but line ${first}'s x has shape ${shapeStr(xShape)}; every example's x must have the same shape.`,
  );
  check(
    (ys1.length === 0) === (ys0.length === 0),
    () =>
      `${at}: y is ${ys1.length === 0 ? 'a number' : `an array of shape ${shapeStr(ys1)}`} but line ${first}'s y is ${ys0.length === 0 ? 'a number' : `an array of shape ${shapeStr(ys0)}`}; mixed label kinds: every y must be a class label (an integer >= 0) or every y a regression target of one shape.`,
  );
  check(
    sameShape(ys1, ys0),
    () =>
      `${at}: y has shape ${shapeStr(ys1)} but line ${first}'s y has shape ${shapeStr(ys0)}; every example's regression target must have the same shape.`,
  );
}

/**
 * Adds the example of JSONL object `o` (line `line`, `at` for messages) to `rows`: its split,
 * x and y values and shapes. Throws {@link LayerwiseError} for a bad "split", values that are
 * not numbers or ragged, or shapes that differ from the first example's.
 */
function addJsonlExample(
  rows: JsonlRows,
  o: Record<string, unknown>,
  line: number,
  at: string,
): void {
  if ('split' in o) {
    check(
      o.split === 'train' || o.split === 'val',
      () =>
        `${at} has "split": ${JSON.stringify(o.split)}; use "train" or "val" (or leave the field out).`,
    );
    rows.anySplit = true;
  }
  rows.isVal.push(o.split === 'val');
  rows.lineOf.push(line);
  let xs1: number[];
  let ys1: number[];
  try {
    xs1 = readTensor(o.x, 'x', rows.xs);
    ys1 = readTensor(o.y, 'y', rows.ys);
  } catch (e) {
    throw new LayerwiseError(`${at}: ${(e as Error).message}.`);
  }
  if (xs1.length === 0) xs1 = [1]; // a single feature
  if (rows.xShape === undefined) {
    rows.xShape = xs1;
    rows.yShape = ys1;
    rows.firstLine = line;
  } else {
    checkSameShapes(at, xs1, ys1, rows.firstLine, rows.xShape, rows.yShape!);
  }
  if (rows.notLabel === undefined) {
    const v = rows.ys.a[rows.ys.n - 1];
    if (ys1.length !== 0 || !Number.isInteger(v) || v < 0)
      rows.notLabel = { line, y: JSON.stringify(o.y).slice(0, 40) };
  }
}

/**
 * The examples of a JSON-lines file's text, blank lines skipped (`source`: the file, for
 * messages). Throws {@link LayerwiseError} as {@link parseJsonlLine} and
 * {@link addJsonlExample}, and for a file without examples.
 */
function readJsonlRows(
  source: string,
  text: string,
): JsonlRows & { xShape: number[]; yShape: number[] } {
  const rows: JsonlRows = {
    xs: new Values(),
    ys: new Values(),
    isVal: [],
    lineOf: [],
    anySplit: false,
    xShape: undefined,
    yShape: undefined,
    firstLine: 0,
    notLabel: undefined,
  };
  const lines = text.split('\n');
  for (let li = 0; li < lines.length; li++) {
    const line = lines[li];
    if (line.trim() === '') continue;
    const at = `${source} line ${li + 1}`;
    addJsonlExample(rows, parseJsonlLine(line, at), li + 1, at);
  }
  const { xShape, yShape } = rows;
  check(
    xShape !== undefined && yShape !== undefined,
    () =>
      `JSONL file ${source} has no examples (it is empty or only blank lines); write ${JSONL_FORMAT}.`,
  );
  return { ...rows, xShape, yShape };
}

/**
 * The features (float32, N * prod(xShape)) and targets of a JSONL file's examples: class labels
 * (int32 [N]; `classes` or the largest + 1) when every y is one, else regression targets
 * (float32). Throws {@link LayerwiseError} for values beyond float32, labels beyond int32 or not
 * below `classes`, and for targets that are not labels when `classes` is given.
 */
function jsonlValues(
  source: string,
  rows: JsonlRows & { yShape: number[] },
  classes: number | undefined,
): { x: Float32Array; y: Int32Array | Float32Array; target: TensorTarget } {
  const { xs, ys, lineOf, notLabel } = rows;
  const n = rows.isVal.length;
  const x = toFloat32(
    xs.get(),
    (i) => `${source} line ${lineOf[Math.floor(i / (xs.n / n))]}: x`,
  );
  if (notLabel === undefined) {
    const y = toLabels(ys.get(), (i) => `${source} line ${lineOf[i]}: y`);
    return {
      x,
      y,
      target: { kind: 'classes', classes: classesOf([y], classes, source) },
    };
  }
  check(
    classes === undefined,
    () =>
      `${source} line ${notLabel.line}: y is ${notLabel.y}, not a class label, but ${classes} classes were asked for; class labels must be integers >= 0 (or ask for no classes to train on regression targets).`,
  );
  const y = toFloat32(
    ys.get(),
    (i) => `${source} line ${lineOf[Math.floor(i / (ys.n / n))]}: y`,
  );
  return { x, y, target: { kind: 'values', shape: rows.yShape } };
}

/**
 * The training and validation splits of a JSONL file's examples as their "split" fields mark
 * them (x: `xPer` values per example, y: `yPer`), in line order. Throws {@link LayerwiseError}
 * when every example is marked "val".
 */
function markedSplits(
  source: string,
  isVal: boolean[],
  x: Float32Array,
  y: Int32Array | Float32Array,
  xPer: number,
  yPer: number,
  valFraction: number,
): { train: TensorSplit; val: TensorSplit } {
  const n = isVal.length;
  const nVal = isVal.filter(Boolean).length;
  check(
    nVal < n,
    () =>
      `JSONL file ${source} has "split": "val" on all ${n} examples, leaving none for training; mark some "train", or leave out every "split" field to hold out a random ${valFraction} of the examples.`,
  );
  const pick = (want: boolean): TensorSplit => {
    const m = want ? nVal : n - nVal;
    const px = new Float32Array(m * xPer);
    const py =
      y instanceof Float32Array
        ? new Float32Array(m * yPer)
        : new Int32Array(m * yPer);
    let k = 0;
    for (let i = 0; i < n; i++) {
      if (isVal[i] !== want) continue;
      px.set(x.subarray(i * xPer, (i + 1) * xPer), k * xPer);
      py.set(y.subarray(i * yPer, (i + 1) * yPer), k * yPer);
      k++;
    }
    return { x: px, y: py };
  };
  return { train: pick(false), val: pick(true) };
}

/**
 * Build a tensor data set from the text of a JSON-lines file.
 * @param source the file name, used in error messages.
 * @throws LayerwiseError naming `source`, the line and the problem for invalid JSON, missing
 *   fields, non-numeric/NaN/Infinity values, ragged arrays, x or y shapes that differ between
 *   lines, a mix of class labels and regression targets, a bad `"split"` value, an empty file,
 *   labels not below `opts.classes`, or an impossible split.
 */
export function tensorDatasetFromJsonl(
  source: string,
  text: string,
  opts: TensorOptions = {},
): TensorDataset {
  const valFraction = opts.valFraction ?? DEFAULT_VAL_FRACTION;
  checkValFraction(valFraction);
  if (opts.classes !== undefined) checkClassesOption(opts.classes);
  const rows = readJsonlRows(source, text);
  const { xShape } = rows;
  const { x, y, target } = jsonlValues(source, rows, opts.classes);
  const xPer = xShape.reduce((a, b) => a * b, 1);
  const yPer = yValuesPer(target);
  const { train, val } = rows.anySplit
    ? markedSplits(source, rows.isVal, x, y, xPer, yPer, valFraction)
    : splitExamples<Int32Array | Float32Array>(
        { x, y },
        xPer,
        valFraction,
        opts.splitSeed ?? 0,
        yPer,
      );
  return {
    kind: 'tensor',
    name: opts.name ?? basename(source),
    xShape,
    target,
    train,
    val,
  };
}

function checkClassesOption(classes: number): void {
  check(
    Number.isInteger(classes) && classes >= 1,
    () => `Number of classes ${classes} is invalid; give a positive integer.`,
  );
}

/** `opts.classes` or the largest label + 1, after checking that every label is below it. */
function classesOf(
  ys: Int32Array[],
  given: number | undefined,
  source: string,
): number {
  let max = -1;
  for (const y of ys)
    for (let i = 0; i < y.length; i++) if (y[i] > max) max = y[i];
  if (given === undefined) return max + 1;
  check(
    max < given,
    () =>
      `${source} has class label ${max}, but ${given} classes were asked for (labels must be in [0, ${given})); ask for at least ${max + 1} classes or fix the labels.`,
  );
  return given;
}

/** float32 copy of `v`, rejecting NaN, infinities and values beyond float32's range. */
function toFloat32(
  v: ArrayLike<number>,
  where: (i: number) => string,
): Float32Array {
  const out = new Float32Array(v.length);
  for (let i = 0; i < v.length; i++) {
    const a = v[i];
    if (!(Math.abs(a) <= FLOAT32_MAX)) {
      throw new LayerwiseError(
        Number.isNaN(a)
          ? `${where(i)} has a NaN value; remove or impute examples with missing values.`
          : `${where(i)} has value ${a}, ${Number.isFinite(a) ? 'beyond float32 range (±3.4e38)' : 'which is not finite'}; remove the example or rescale its values.`,
      );
    }
    out[i] = a;
  }
  return out;
}

/** int32 class labels from integer values, rejecting negative ones and ones beyond int32. */
function toLabels(
  v: ArrayLike<number>,
  where: (i: number) => string,
): Int32Array {
  const out = new Int32Array(v.length);
  for (let i = 0; i < v.length; i++) {
    const a = v[i];
    check(
      Number.isInteger(a) && a >= 0,
      () =>
        `${where(i)} is class label ${a}; labels must be class numbers 0, 1, 2, ...`,
    );
    check(
      a <= 0x7fffffff,
      () =>
        `${where(i)} is class label ${a}, too large (labels must be below 2^31); number the classes 0, 1, 2, ...`,
    );
    out[i] = a;
  }
  return out;
}

/**
 * Load a JSON-lines file (`.jsonl` / `.ndjson`, UTF-8): one example per line,
 * `{"x": <number or nested arrays of numbers>, "y": <label or target>}`; blank lines are
 * skipped and fields other than x, y and split are ignored.
 * - x: every line's x has the same shape (that of the nested arrays; a plain number is [1]).
 * - y: if every y is a scalar integer >= 0, they are class labels (classes = largest + 1, or
 *   `opts.classes`); otherwise every y is a regression target of one shape (float32). To
 *   regress on integer values, write each y as a one-element array, e.g. `"y": [3]`.
 * - `"split": "val"` puts a line in the validation split (`"train"` or no field: training). If
 *   no line has a `"split"` field, a fixed random `valFraction` of the examples (permutation
 *   seeded by `splitSeed`) is held out instead.
 * @throws LayerwiseError if the file is missing or unreadable, or as {@link tensorDatasetFromJsonl}.
 */
export async function loadJsonlDataset(
  path: string,
  opts: TensorOptions = {},
): Promise<TensorDataset> {
  const text = await readUtf8File(
    path,
    'JSONL',
    'a .jsonl file',
    'write it as UTF-8 JSON.',
  );
  return tensorDatasetFromJsonl(path, text, opts);
}

const INT_DTYPES = new Set([
  'bool',
  'uint8',
  'int8',
  'uint16',
  'int16',
  'uint32',
  'int32',
  'uint64',
  'int64',
]);

/** The values of an .npy array as JS numbers (int64/uint64 converted with Number). */
function numbersOf(a: NpyArray): ArrayLike<number> {
  if (a.data instanceof BigInt64Array || a.data instanceof BigUint64Array) {
    const out = new Float64Array(a.data.length);
    for (let i = 0; i < out.length; i++) out[i] = Number(a.data[i]);
    return out;
  }
  return a.data;
}

/** Convert one X/Y pair of .npy arrays into a split, with its feature shape and target. */
function npySplit(
  X: NpyArray,
  Y: NpyArray,
  where: { x: string; y: string },
): {
  split: TensorSplit;
  xShape: number[];
  target: { kind: 'classes' } | { kind: 'values'; shape: number[] };
} {
  check(
    X.shape.length >= 1,
    () =>
      `.npy file ${where.x} holds a 0-d array (header field 'shape' is ()); features need shape (N, ...) with one row per example.`,
  );
  const n = X.shape[0];
  check(
    n > 0,
    () =>
      `.npy file ${where.x} has no examples (header field 'shape' is ${pyShape(X.shape)}); give a file with at least one example.`,
  );
  check(
    X.shape.every((d) => d > 0),
    () =>
      `.npy file ${where.x} has an empty feature dimension (header field 'shape' is ${pyShape(X.shape)}); every example needs at least one value.`,
  );
  check(
    Y.shape.length >= 1 && Y.shape[0] === n,
    () =>
      `Size mismatch: ${where.x} has ${n} examples (shape ${pyShape(X.shape)}) but ${where.y} has ${Y.shape.length === 0 ? 'a 0-d array' : `${Y.shape[0]} (shape ${pyShape(Y.shape)})`}; give the targets that belong to these features, one row per example.`,
  );
  const xShape = X.shape.length === 1 ? [1] : X.shape.slice(1);
  const perX = X.data.length / n;
  const x = toFloat32(
    numbersOf(X),
    (i) =>
      `.npy file ${where.x}: example ${Math.floor(i / perX)} (flat index ${i})`,
  );
  if (INT_DTYPES.has(Y.dtype)) {
    check(
      Y.shape.length === 1,
      () =>
        `.npy file ${where.y} has integer dtype ${Y.dtype} and shape ${pyShape(Y.shape)}; integer targets are class labels of shape (N,): for one-hot labels save y.argmax(1), for regression targets save y.astype('<f4').`,
    );
    const y = toLabels(
      numbersOf(Y),
      (i) => `.npy file ${where.y}: example ${i}`,
    );
    return { split: { x, y }, xShape, target: { kind: 'classes' } };
  }
  check(
    Y.shape.slice(1).every((d) => d > 0),
    () =>
      `.npy file ${where.y} has an empty target dimension (header field 'shape' is ${pyShape(Y.shape)}); every example needs at least one target value.`,
  );
  const perY = Y.data.length / n;
  const y = toFloat32(
    numbersOf(Y),
    (i) =>
      `.npy file ${where.y}: example ${Math.floor(i / perY)} (flat index ${i})`,
  );
  return {
    split: { x, y },
    xShape,
    target: { kind: 'values', shape: Y.shape.slice(1) },
  };
}

/**
 * Load a tensor data set from NumPy `.npy` files: features X of shape (N, ...) (any numeric
 * dtype, converted to float32 unchanged: uint8 is not rescaled) and targets Y of shape (N,)
 * with an integer dtype (class labels) or a float dtype of shape (N, ...) (regression
 * targets). With `valX`/`valY` too, those are the validation split; otherwise a fixed random
 * `valFraction` of the examples is held out.
 * @throws LayerwiseError if a file is missing or malformed (see {@link parseNpy}), the example
 *   counts of X and Y differ, values are NaN or infinite, labels are negative, or the
 *   validation files do not match the training files' shapes and target kind.
 */
export async function loadNpyDataset(
  paths: { x: string; y: string; valX?: string; valY?: string },
  opts: TensorOptions = {},
): Promise<TensorDataset> {
  const valFraction = opts.valFraction ?? DEFAULT_VAL_FRACTION;
  checkValFraction(valFraction);
  if (opts.classes !== undefined) checkClassesOption(opts.classes);
  const name = opts.name ?? `npy:${paths.x},${paths.y}`;
  const [tx, ty] = await readPair(readNpyFile, paths.x, paths.y);
  const tr = npySplit(tx, ty, paths);
  let train: TensorSplit;
  let val: TensorSplit;
  const yPer =
    tr.target.kind === 'classes'
      ? 1
      : tr.target.shape.reduce((a, b) => a * b, 1);
  if (paths.valX !== undefined || paths.valY !== undefined) {
    check(
      paths.valX !== undefined && paths.valY !== undefined,
      'Give both validation .npy files (features and targets), or neither.',
    );
    const vp = { x: paths.valX, y: paths.valY };
    const [vx, vy] = await readPair(readNpyFile, vp.x, vp.y);
    const va = npySplit(vx, vy, vp);
    check(
      sameShape(va.xShape, tr.xShape),
      () =>
        `Validation features ${vp.x} have shape ${shapeStr(va.xShape)} per example but training features ${paths.x} have ${shapeStr(tr.xShape)}; give files of the same data set.`,
    );
    const desc = (t: typeof tr.target) =>
      t.kind === 'classes'
        ? 'integer class labels'
        : `float targets of shape ${shapeStr(t.shape)}`;
    check(
      va.target.kind === tr.target.kind &&
        (va.target.kind === 'classes' ||
          sameShape(va.target.shape, (tr.target as { shape: number[] }).shape)),
      () =>
        `Validation targets ${vp.y} are ${desc(va.target)} but training targets ${paths.y} are ${desc(tr.target)}; give files of the same data set (same dtype kind and shape).`,
    );
    train = tr.split;
    val = va.split;
  } else {
    const xPer = tr.xShape.reduce((a, b) => a * b, 1);
    ({ train, val } = splitExamples<Int32Array | Float32Array>(
      tr.split,
      xPer,
      valFraction,
      opts.splitSeed ?? 0,
      yPer,
    ));
  }
  const target: TensorTarget =
    tr.target.kind === 'classes'
      ? {
          kind: 'classes',
          classes: classesOf(
            [train.y as Int32Array, val.y as Int32Array],
            opts.classes,
            paths.valY ? `${paths.y} or ${paths.valY}` : paths.y,
          ),
        }
      : tr.target;
  check(
    opts.classes === undefined || target.kind === 'classes',
    () =>
      `.npy file ${paths.y} has float targets (regression) but ${opts.classes} classes were asked for; save class labels with an integer dtype, e.g. y.astype('<i8').`,
  );
  return { kind: 'tensor', name, xShape: tr.xShape, target, train, val };
}
