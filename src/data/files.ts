/**
 * Reading a data set's files, with the errors the loaders share: a missing or unreadable path, a
 * folder where a file belongs, text that is not UTF-8, and one of a pair of files (images and
 * labels, X and Y) failing.
 */
import { readFile, stat } from 'node:fs/promises';
import { check, LayerwiseError } from '../util/errors.js';

/**
 * The UTF-8 text of the file at `path`. `kind` names the file in messages ('text', 'JSONL').
 * @throws LayerwiseError when the path does not exist ("<Kind> file ... does not exist"), is not a
 *   regular file ("... give the path of `expected`"), cannot be read, or is not valid UTF-8
 *   (followed by `notUtf8Advice`).
 */
export async function readUtf8File(
  path: string,
  kind: string,
  expected: string,
  notUtf8Advice: string,
): Promise<string> {
  const Kind = kind.charAt(0).toUpperCase() + kind.slice(1);
  let bytes: Buffer;
  try {
    const st = await stat(path);
    check(
      st.isFile(),
      `${Kind} data path ${path} is not a regular file; give the path of ${expected}.`,
    );
    bytes = await readFile(path);
  } catch (e) {
    if (e instanceof LayerwiseError) throw e;
    const code = (e as NodeJS.ErrnoException).code;
    if (code === 'ENOENT')
      throw new LayerwiseError(
        `${Kind} file ${path} does not exist; check the path (relative paths are resolved from ${process.cwd()}).`,
      );
    throw new LayerwiseError(
      `Cannot read ${kind} file ${path}: ${(e as Error).message}; check that it exists and is readable.`,
    );
  }
  try {
    return new TextDecoder('utf-8', { fatal: true, ignoreBOM: false }).decode(
      bytes,
    );
  } catch {
    throw new LayerwiseError(
      `${Kind} file ${path} is not valid UTF-8; ${notUtf8Advice}`,
    );
  }
}

/**
 * Reads two files of a pair concurrently with `read`; when both fail, the first one's error is
 * the one reported (the order the user wrote them in), not whichever read failed first.
 */
export async function readPair<T>(
  read: (path: string) => Promise<T>,
  first: string,
  second: string,
): Promise<[T, T]> {
  const [a, b] = await Promise.allSettled([read(first), read(second)]);
  if (a.status === 'rejected') throw a.reason;
  if (b.status === 'rejected') throw b.reason;
  return [a.value, b.value];
}
