/**
 * Seeded, deterministic, resumable mini-batch sampling.
 *
 * The training split is viewed as a list of items: for text, windows of `context + 1`
 * consecutive tokens starting every `context` tokens (item i covers tokens
 * [i*context, i*context + context]; inputs are its first `context` tokens, targets the same
 * shifted by one, so each next-token pair of the stream is used once per epoch); for image and
 * tensor sets, the examples. Each epoch visits the items in the order of a permutation drawn with
 * a seeded Rng of (seed, epoch), in consecutive batches of `batchSize`; the last `items % batchSize`
 * items of the permutation are skipped (so every batch has the same shape) and, because the
 * permutation changes, different items are skipped each epoch.
 *
 * The sampler's whole position is `{epoch, cursor}` (plus the seed), so a batcher rebuilt from
 * {@link Batcher.state} yields exactly the batches the original would have yielded next.
 */
import { check, LayerwiseError } from '../util/errors.js';
import { Rng } from '../util/rng.js';
import type { ImageDataset } from './images.js';
import type { TensorDataset } from './tensors.js';
import type { TextDataset } from './text.js';

/** The data sets a batcher reads. */
type BatchableDataset = TextDataset | ImageDataset | TensorDataset;

/** One mini-batch. */
export interface Batch {
  /**
   * Text: Int32Array token ids [B, T]. Images: Float32Array pixels [B, H, W, C] in [0, 1].
   * Tensor sets: Float32Array features [B, ...xShape].
   */
  x: Float32Array | Int32Array;
  /** Shape of `x`: [B, T], [B, H, W, C] or [B, ...xShape]. */
  xShape: number[];
  /**
   * Text: next-token ids [B, T] (x shifted by one). Images and tensor sets with classes: class
   * labels [B], Int32Array. A Float32Array only for the regression targets of a tensor set
   * ([B, ...target.shape]); every other batch has an Int32Array here.
   */
  y: Int32Array | Float32Array;
  /** Shape of `y`: [B, T], [B] or [B, ...target.shape]. */
  yShape: number[];
  /** Number of examples B (windows for text, images or tensor examples otherwise). */
  examples: number;
  /** Number of predicted targets: B*T for text, B for images and tensor sets (one target each, whatever its shape). */
  tokens: number;
}

/** Options of {@link makeBatcher}. */
export interface BatcherOptions {
  /** Examples per batch, a positive integer. */
  batchSize: number;
  /** Text only: tokens per example T, a positive integer (required for text, ignored for images and tensors). */
  context?: number;
  /** Shuffling seed (an integer). Required unless a `state` is given, which carries its seed. */
  seed?: number;
}

/**
 * The position of a {@link Batcher}, small and JSON-able, saved with checkpoints. Besides the
 * position (`epoch`, `cursor`) it records what the position refers to, so that resuming with
 * another data set, batch size or context is reported instead of silently continuing wrongly.
 */
export interface BatcherState {
  version: 1;
  /** The data set kind the state belongs to. */
  kind: 'text' | 'image' | 'tensor';
  seed: number;
  /** Completed epochs (0-based index of the current epoch). */
  epoch: number;
  /** Index into the current epoch's permutation of the next item to yield. */
  cursor: number;
  batchSize: number;
  /** Tokens per example (0 for images and tensor sets). */
  context: number;
  /** Items (windows, images or tensor examples) per epoch before dropping the remainder. */
  items: number;
}

/** A resumable stream of training batches. */
export interface Batcher {
  /** The next training batch (never ends: epochs follow one another). */
  next(): Batch;
  /** The current position; `makeBatcher(ds, opts, b.state())` continues exactly from here. */
  state(): BatcherState;
  /** Current epoch (0-based). */
  readonly epoch: number;
  /** Full batches per epoch: floor(items / batchSize). */
  readonly batchesPerEpoch: number;
  /** Items (text windows, images or tensor examples) available per epoch. */
  readonly items: number;
}

function checkPositiveInt(
  v: unknown,
  what: string,
  fix: string,
): asserts v is number {
  check(
    typeof v === 'number' && Number.isInteger(v) && v > 0,
    () => `${what} must be a positive integer, got ${String(v)}; ${fix}`,
  );
}

/** Number of windows of `context + 1` tokens, starting every `context` tokens, in a stream of `length` tokens. */
export function windowCount(length: number, context: number): number {
  return length > context ? Math.floor((length - 1) / context) : 0;
}

/** Per-example sizes of a data set: values of x per example, of y per example, and shapes. */
interface Layout {
  kind: 'text' | 'image' | 'tensor';
  context: number;
  xPer: number;
  yPer: number;
  /** Whether y is float32 (regression targets of a tensor set) rather than int32. */
  yFloat: boolean;
  /** Predicted targets per example (T for text, 1 otherwise). */
  tokensPer: number;
  xShape: (b: number) => number[];
  yShape: (b: number) => number[];
  items: (split: 'train' | 'val') => number;
  fill: (
    split: 'train' | 'val',
    item: number,
    x: Float32Array | Int32Array,
    y: Int32Array | Float32Array,
    slot: number,
  ) => void;
}

function layoutOf(ds: BatchableDataset, context: number | undefined): Layout {
  if (ds.kind === 'text') {
    checkPositiveInt(
      context,
      'Context length (tokens per example)',
      'set the context, e.g. 128.',
    );
    const T = context;
    const stream = (s: 'train' | 'val') => (s === 'train' ? ds.train : ds.val);
    return {
      kind: 'text',
      context: T,
      xPer: T,
      yPer: T,
      yFloat: false,
      tokensPer: T,
      xShape: (b) => [b, T],
      yShape: (b) => [b, T],
      items: (s) => windowCount(stream(s).length, T),
      fill: (s, item, x, y, slot) => {
        const src = stream(s);
        const start = item * T;
        x.set(src.subarray(start, start + T), slot * T);
        y.set(src.subarray(start + 1, start + T + 1), slot * T);
      },
    };
  }
  if (ds.kind === 'image') {
    const [h, w, c] = ds.shape;
    const P = h * w * c;
    const split = (s: 'train' | 'val') => (s === 'train' ? ds.train : ds.val);
    return {
      kind: 'image',
      context: 0,
      xPer: P,
      yPer: 1,
      yFloat: false,
      tokensPer: 1,
      xShape: (b) => [b, h, w, c],
      yShape: (b) => [b],
      items: (s) => split(s).y.length,
      fill: (s, item, x, y, slot) => {
        const d = split(s);
        x.set(d.x.subarray(item * P, (item + 1) * P), slot * P);
        y[slot] = d.y[item];
      },
    };
  }
  if (ds.kind === 'tensor') {
    const xShape = ds.xShape.slice();
    const yShape = ds.target.kind === 'classes' ? [] : ds.target.shape.slice();
    const X = xShape.reduce((a, b) => a * b, 1);
    const Y = yShape.reduce((a, b) => a * b, 1);
    const yFloat = ds.target.kind === 'values';
    const split = (s: 'train' | 'val') => (s === 'train' ? ds.train : ds.val);
    for (const s of ['train', 'val'] as const) {
      const d = split(s);
      check(
        d.y instanceof (yFloat ? Float32Array : Int32Array) &&
          d.x.length * Y === d.y.length * X,
        () =>
          `Tensor data set "${ds.name}" has an inconsistent ${s} split (${d.x.length} x values for shape [${xShape.join(', ')}], ${d.y.length} y values in a ${d.y.constructor.name} for ${ds.target.kind === 'classes' ? 'class labels' : `targets [${yShape.join(', ')}]`}); load it with loadDataset().`,
      );
    }
    return {
      kind: 'tensor',
      context: 0,
      xPer: X,
      yPer: Y,
      yFloat,
      tokensPer: 1,
      xShape: (b) => [b, ...xShape],
      yShape: (b) => [b, ...yShape],
      items: (s) => split(s).y.length / Y,
      fill: (s, item, x, y, slot) => {
        const d = split(s);
        x.set(d.x.subarray(item * X, (item + 1) * X), slot * X);
        y.set(d.y.subarray(item * Y, (item + 1) * Y), slot * Y);
      },
    };
  }
  throw new LayerwiseError(
    `Unknown data set kind ${JSON.stringify((ds as { kind: unknown }).kind)}; load data sets with loadDataset().`,
  );
}

function makeBatch(
  L: Layout,
  split: 'train' | 'val',
  order: ArrayLike<number> | null,
  from: number,
  count: number,
): Batch {
  const x =
    L.kind === 'text'
      ? new Int32Array(count * L.xPer)
      : new Float32Array(count * L.xPer);
  const y = L.yFloat
    ? new Float32Array(count * L.yPer)
    : new Int32Array(count * L.yPer);
  for (let k = 0; k < count; k++)
    L.fill(split, order ? order[from + k] : from + k, x, y, k);
  return {
    x,
    xShape: L.xShape(count),
    y,
    yShape: L.yShape(count),
    examples: count,
    tokens: count * L.tokensPer,
  };
}

/** The permutation of `items` item indices used in `epoch` for `seed`. */
export function epochOrder(
  items: number,
  seed: number,
  epoch: number,
): Int32Array {
  const perm = new Int32Array(items);
  for (let i = 0; i < items; i++) perm[i] = i;
  // hash (seed, epoch) so that seed s in epoch 1 does not repeat seed s+1's epoch 0
  return new Rng(
    (Math.imul(seed ^ 0x5bd1e995, 0x27d4eb2d) +
      Math.imul(epoch + 1, 0x165667b1)) >>>
      0,
  ).shuffle(perm);
}

function validateState(
  s: unknown,
  expect: Omit<BatcherState, 'epoch' | 'cursor' | 'seed'>,
  seed: number | undefined,
): BatcherState {
  const fix =
    'resume with the same data set, batch size and context as the saved run, or start a new run without --resume';
  check(
    typeof s === 'object' && s !== null,
    `Saved batcher state is ${s === null ? 'null' : typeof s}, not an object; the checkpoint is damaged: ${fix}.`,
  );
  const o = s as Record<string, unknown>;
  check(
    o.version === 1,
    () =>
      `Saved batcher state has version ${JSON.stringify(o.version)}, expected 1; it was written by an incompatible version: ${fix}.`,
  );
  for (const k of [
    'seed',
    'epoch',
    'cursor',
    'batchSize',
    'context',
    'items',
  ] as const) {
    check(
      typeof o[k] === 'number' &&
        Number.isInteger(o[k]) &&
        (k === 'seed' || (o[k] as number) >= 0),
      () =>
        `Saved batcher state field "${k}" is ${JSON.stringify(o[k])}, not ${k === 'seed' ? 'an integer' : 'a non-negative integer'}; the checkpoint is damaged: ${fix}.`,
    );
  }
  check(
    o.kind === expect.kind,
    () =>
      `Saved batcher state is for a ${String(o.kind)} data set but this one is ${expect.kind}; ${fix}.`,
  );
  check(
    o.batchSize === expect.batchSize,
    () =>
      `Saved batcher state has batch size ${o.batchSize} but ${expect.batchSize} was requested; ${fix}.`,
  );
  check(
    o.context === expect.context,
    () =>
      `Saved batcher state has context ${o.context} but ${expect.context} was requested; ${fix}.`,
  );
  check(
    o.items === expect.items,
    () =>
      `Saved batcher state counts ${o.items} items per epoch but this data set has ${expect.items}; the data changed since the checkpoint: ${fix}.`,
  );
  check(
    seed === undefined || seed === o.seed,
    () =>
      `Saved batcher state has seed ${o.seed} but seed ${seed} was requested; resume with seed ${o.seed} (or omit the seed).`,
  );
  check(
    (o.cursor as number) <= expect.items,
    () =>
      `Saved batcher state cursor ${o.cursor} is past the ${expect.items} items of an epoch; the checkpoint is damaged: ${fix}.`,
  );
  return {
    version: 1,
    kind: expect.kind,
    seed: o.seed as number,
    epoch: o.epoch as number,
    cursor: o.cursor as number,
    batchSize: expect.batchSize,
    context: expect.context,
    items: expect.items,
  };
}

/**
 * Make a resumable training batcher over `ds.train`.
 * @param opts batch size B, context T (text), seed.
 * @param state a {@link BatcherState} from a previous batcher on the same data, to continue it.
 * @returns text batches x,y Int32Array [B, T]; image batches x Float32Array [B, H, W, C], y [B];
 *   tensor batches x Float32Array [B, ...xShape], y Int32Array [B] (classes) or Float32Array
 *   [B, ...target.shape] (regression).
 * @throws LayerwiseError if options are invalid, the training split has fewer than B items
 *   (windows or examples), or `state` is malformed or belongs to other data/options.
 */
export function makeBatcher(
  ds: BatchableDataset,
  opts: BatcherOptions,
  state?: BatcherState,
): Batcher {
  checkPositiveInt(
    opts.batchSize,
    'Batch size',
    'set the batch size, e.g. 32.',
  );
  const L = layoutOf(ds, opts.context);
  const B = opts.batchSize;
  const items = L.items('train');
  check(items >= B, () =>
    L.kind === 'text'
      ? `Training text of "${ds.name}" has ${ds.kind === 'text' ? ds.train.length : 0} tokens, only ${items} windows of context ${L.context} + 1, fewer than batch size ${B}; lower the batch size or context, or use a longer text.`
      : `Training split of "${ds.name}" has ${items} ${L.kind === 'image' ? 'images' : 'examples'}, fewer than batch size ${B}; lower the batch size.`,
  );
  if (opts.seed !== undefined)
    check(
      Number.isSafeInteger(opts.seed),
      `Seed must be an integer, got ${opts.seed}; give an integer seed.`,
    );
  let seed: number;
  let epoch = 0;
  let cursor = 0;
  if (state !== undefined) {
    const s = validateState(
      state,
      { version: 1, kind: L.kind, batchSize: B, context: L.context, items },
      opts.seed,
    );
    ({ seed, epoch, cursor } = s);
  } else {
    check(
      opts.seed !== undefined,
      'A seed is required to start a batcher; give an integer seed.',
    );
    seed = opts.seed;
  }
  if (cursor + B > items) {
    epoch++;
    cursor = 0;
  }
  let orderEpoch = -1;
  let order: Int32Array = new Int32Array(0);
  const batchesPerEpoch = Math.floor(items / B);
  return {
    next(): Batch {
      if (orderEpoch !== epoch) {
        order = epochOrder(items, seed, epoch);
        orderEpoch = epoch;
      }
      const batch = makeBatch(L, 'train', order, cursor, B);
      cursor += B;
      if (cursor + B > items) {
        epoch++;
        cursor = 0;
      }
      return batch;
    },
    state(): BatcherState {
      return {
        version: 1,
        kind: L.kind,
        seed,
        epoch,
        cursor,
        batchSize: B,
        context: L.context,
        items,
      };
    },
    get epoch() {
      return epoch;
    },
    batchesPerEpoch,
    items,
  };
}

/** Options of {@link validationBatches}. */
export interface ValidationOptions {
  /** Examples per batch, a positive integer. */
  batchSize: number;
  /** Text only: tokens per example (required for text, ignored for images and tensors). */
  context?: number;
  /** At most this many batches (the first ones); default: all. */
  maxBatches?: number;
  /** Also return a final smaller batch with the leftover items; default false (all batches have B examples). */
  partial?: boolean;
}

/**
 * The validation split as a fixed list of batches, in data order (no shuffling): text windows
 * as in training (stride `context`), or images / tensor examples. Deterministic: same data and options, same
 * batches. May be empty, when the validation split has fewer than `batchSize` items (or none,
 * with valFraction 0) and `partial` is off.
 * @returns batches shaped as in {@link makeBatcher}.
 * @throws LayerwiseError if options are invalid.
 */
export function validationBatches(
  ds: BatchableDataset,
  opts: ValidationOptions,
): Batch[] {
  checkPositiveInt(
    opts.batchSize,
    'Validation batch size',
    'set the batch size, e.g. 32.',
  );
  const L = layoutOf(ds, opts.context);
  const max = opts.maxBatches ?? Infinity;
  check(
    max === Infinity || (Number.isInteger(max) && max >= 0),
    () => `maxBatches must be a non-negative integer, got ${max}.`,
  );
  const B = opts.batchSize;
  const items = L.items('val');
  const out: Batch[] = [];
  for (let from = 0; from < items && out.length < max; from += B) {
    const count = Math.min(B, items - from);
    if (count < B && !opts.partial) break;
    out.push(makeBatch(L, 'val', null, from, count));
  }
  return out;
}
