/**
 * Byte sizes on the command line: `512MB` (SI, 10^6), `1.5GiB` (IEC, 2^30), `2e9` or `4096`
 * (bytes). Parsing of unit suffixes is bytes-iec's.
 */
import bytes from 'bytes-iec';
import { LayerwiseError } from './errors.js';

/**
 * Parses a size: a plain or scientific number of bytes (`2e9`), or a number with a unit
 * (B, kB, MB, GB, TB as powers of 1000; KiB, MiB, GiB, TiB as powers of 1024; case-insensitive).
 * Returns whole bytes (rounded down). Throws {@link LayerwiseError} naming `flag` for anything
 * else, or a size that is not positive.
 */
export function parseSize(text: string, flag = '--device-memory'): number {
  const t = text.trim();
  const v = /^\d+(\.\d+)?(e\+?\d+)?$/i.test(t)
    ? Number(t)
    : bytes.parse(
        t.replace(
          /^(\d+(?:\.\d+)?)\s*(ki|mi|gi|ti|pi)b$/i,
          (_, n: string, u: string) => `${n}${u[0]}iB`,
        ),
      );
  if (v === null || !Number.isFinite(v) || v < 1) {
    throw new LayerwiseError(
      `${flag} '${text}' is not a positive size; write e.g. 512MB, 1.5GiB or 2e9 (bytes)`,
    );
  }
  return Math.floor(v);
}

/** Formats bytes with binary units, e.g. `1.5 GiB`, `512 B`. */
export function formatSize(n: number): string {
  return (
    bytes.format(Math.round(n), {
      mode: 'binary',
      decimalPlaces: 1,
      unitSeparator: ' ',
    }) ?? `${n} B`
  );
}
