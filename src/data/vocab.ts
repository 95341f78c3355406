/**
 * Character vocabulary for character-level language models.
 *
 * A vocabulary is the sorted list of the distinct characters (Unicode code points, not UTF-16
 * code units) of a text; a character's id is its index in that list. Because the list is sorted
 * by code point, the same text always gives the same ids, and a vocabulary saved with a
 * checkpoint (via {@link Vocab.toJSON}) restores exactly.
 */
import { check, LayerwiseError } from '../util/errors.js';

/** The JSON form of a {@link Vocab}, stored with checkpoints. */
export interface VocabJSON {
  /** Always `'char'`: one token per Unicode code point. */
  kind: 'char';
  /** The characters, one code point per entry, strictly ascending by code point. */
  chars: string[];
}

/** What {@link Vocab.encode} does with a character that is not in the vocabulary. */
export type UnknownCharPolicy = 'throw' | 'skip';

/** Maximum number of characters shown when an error message quotes text. */
const QUOTE_MAX = 40;

function describeChar(ch: string): string {
  const cp = ch.codePointAt(0) ?? 0;
  return `${JSON.stringify(ch)} (U+${cp.toString(16).toUpperCase().padStart(4, '0')})`;
}

/** A sorted, duplicate-free character vocabulary mapping characters to ids `0 .. size-1`. */
export class Vocab {
  /** The characters, sorted by code point; `chars[id]` is the character with that id. */
  readonly chars: readonly string[];
  /** Ids of BMP code points (`< 0x10000`), -1 where absent: a fast path for encoding. */
  private readonly bmp: Int32Array;
  /** Ids of code points outside the BMP. */
  private readonly astral: Map<number, number>;

  /**
   * Build a vocabulary from an explicit character list.
   * @param chars one code point per entry, strictly ascending by code point, at least one.
   * @throws LayerwiseError if an entry is not exactly one code point, or the list is empty,
   *   unsorted or has duplicates (use {@link Vocab.fromText} to build one from raw text).
   */
  constructor(chars: Iterable<string>) {
    const list = Array.from(chars);
    check(
      list.length > 0,
      'A vocabulary needs at least one character; build it from a non-empty text.',
    );
    this.bmp = new Int32Array(0x10000).fill(-1);
    this.astral = new Map();
    let prev = -1;
    for (let id = 0; id < list.length; id++) {
      const ch = list[id];
      check(
        typeof ch === 'string' && ch.length > 0 && Array.from(ch).length === 1,
        () =>
          `Vocabulary entry ${id} is ${JSON.stringify(ch)}, not a single character; each entry must be exactly one Unicode code point.`,
      );
      const cp = ch.codePointAt(0)!;
      check(
        cp > prev,
        () =>
          `Vocabulary entry ${id} ${describeChar(ch)} is ${cp === prev ? 'a duplicate' : 'out of order'}; entries must be unique and sorted by code point (Vocab.fromText builds a valid one).`,
      );
      prev = cp;
      if (cp < 0x10000) this.bmp[cp] = id;
      else this.astral.set(cp, id);
    }
    this.chars = Object.freeze(list);
  }

  /**
   * The vocabulary of all distinct code points in `text`, sorted by code point.
   * @throws LayerwiseError if `text` is empty.
   */
  static fromText(text: string): Vocab {
    check(
      text.length > 0,
      'Cannot build a vocabulary from an empty text; give a non-empty text.',
    );
    const seen = new Set<number>();
    for (const ch of text) seen.add(ch.codePointAt(0)!);
    const cps = Array.from(seen).sort((a, b) => a - b);
    return new Vocab(cps.map((cp) => String.fromCodePoint(cp)));
  }

  /** Number of distinct characters (the number of classes of a language model's output). */
  get size(): number {
    return this.chars.length;
  }

  /** The id of character `ch` (one code point), or -1 if it is not in the vocabulary. */
  idOf(ch: string): number {
    const cp = ch.codePointAt(0);
    if (cp === undefined) return -1;
    return cp < 0x10000 ? this.bmp[cp] : (this.astral.get(cp) ?? -1);
  }

  /** Whether every character of `text` is in the vocabulary. */
  covers(text: string): boolean {
    for (const ch of text) if (this.idOf(ch) < 0) return false;
    return true;
  }

  /**
   * Encode `text` into ids, one per code point.
   * @param onUnknown `'throw'` (default) or `'skip'` characters missing from the vocabulary.
   * @returns Int32Array of length = number of code points kept, values in `[0, size)`.
   * @throws LayerwiseError naming the first unknown character and its position when
   *   `onUnknown` is `'throw'`.
   */
  encode(text: string, onUnknown: UnknownCharPolicy = 'throw'): Int32Array {
    const out = new Int32Array(text.length); // code points <= UTF-16 units
    let n = 0;
    let pos = 0;
    for (const ch of text) {
      const id = this.idOf(ch);
      if (id >= 0) out[n++] = id;
      else if (onUnknown === 'throw') {
        const ctx = Array.from(text)
          .slice(Math.max(0, pos - 10), pos + 10)
          .join('');
        throw new LayerwiseError(
          `Character ${describeChar(ch)} at position ${pos} (near ${JSON.stringify(ctx.slice(0, QUOTE_MAX))}) is not in the ${this.size}-character vocabulary; remove it from the text, or use a model trained on text that contains it.`,
        );
      }
      pos++;
    }
    return n === out.length ? out : out.slice(0, n);
  }

  /**
   * Decode ids back into text.
   * @param ids integers in `[0, size)`.
   * @throws LayerwiseError if an id is not an integer in range.
   */
  decode(ids: ArrayLike<number>): string {
    const parts = new Array<string>(ids.length);
    for (let i = 0; i < ids.length; i++) {
      const id = ids[i];
      check(
        Number.isInteger(id) && id >= 0 && id < this.chars.length,
        () =>
          `Token id ${id} at position ${i} is outside the vocabulary (ids 0..${this.chars.length - 1}); the ids must come from a model using this vocabulary.`,
      );
      parts[i] = this.chars[id];
    }
    return parts.join('');
  }

  /** The JSON form, for saving with a checkpoint; restore with {@link Vocab.fromJSON}. */
  toJSON(): VocabJSON {
    return { kind: 'char', chars: [...this.chars] };
  }

  /** Whether `other` has exactly the same characters in the same order (hence the same ids). */
  equals(other: Vocab): boolean {
    return (
      this.chars.length === other.chars.length &&
      this.chars.every((c, i) => c === other.chars[i])
    );
  }

  /**
   * Restore a vocabulary from {@link Vocab.toJSON} output (already parsed from JSON).
   * @throws LayerwiseError if `json` is not `{kind: 'char', chars: string[]}` with single,
   *   unique, sorted code points.
   */
  static fromJSON(json: unknown): Vocab {
    const fix =
      "the checkpoint's vocabulary is damaged; use an intact checkpoint or retrain.";
    check(
      typeof json === 'object' && json !== null && !Array.isArray(json),
      `Vocabulary must be an object {kind: 'char', chars: [...]}, got ${Array.isArray(json) ? 'an array' : json === null ? 'null' : typeof json}; ${fix}`,
    );
    const o = json as Record<string, unknown>;
    check(
      o.kind === 'char',
      () =>
        `Vocabulary kind is ${JSON.stringify(o.kind)}, expected "char"; ${fix}`,
    );
    check(
      Array.isArray(o.chars),
      () =>
        `Vocabulary "chars" must be an array of single characters, got ${typeof o.chars}; ${fix}`,
    );
    const chars = o.chars as unknown[];
    chars.forEach((c, i) =>
      check(
        typeof c === 'string',
        () => `Vocabulary entry ${i} is a ${typeof c}, not a string; ${fix}`,
      ),
    );
    try {
      return new Vocab(chars as string[]);
    } catch (e) {
      if (e instanceof LayerwiseError)
        throw new LayerwiseError(
          `${e.message} (while reading a saved vocabulary: ${fix})`,
        );
      throw e;
    }
  }
}
