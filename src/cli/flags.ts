/**
 * commander parsers for flag values, shared by `layerwise` (cli/main.ts) and the benchmarks
 * (bench/main.ts): each returns the flag's value (a number, numbers, a folder), or throws commander's
 * InvalidArgumentError, which commander prints as the flag's one-line error (`error: option
 * '--steps <n>' argument 'x' is invalid. must be a whole number, 1 or more, got 'x'`) before
 * anything runs; both commands then exit with status 2. `layerwise train` checks its ranges
 * again against the whole configuration (config/config.ts), so its flags take any integer or
 * number here; a benchmark's flags have no later check, so each takes only what it can run.
 */
import { statSync } from 'node:fs';
import { dirname, resolve } from 'node:path';
import { type Command, InvalidArgumentError } from 'commander';

const INTEGER = /^[-+]?\d+$/;

function parsed(
  v: string,
  ok: (x: number) => boolean,
  what: string,
  integer: boolean,
): number {
  const s = v.trim();
  const x = Number(s);
  if (
    s === '' ||
    (integer && !INTEGER.test(s)) ||
    !Number.isFinite(x) ||
    !ok(x)
  )
    throw new InvalidArgumentError(`must be ${what}, got '${v}'`);
  return x;
}

/** Any integer, written in decimal digits (not 1e3, 0x10 or 2.0). */
export const integer = (v: string): number =>
  parsed(v, () => true, 'an integer', true);

/** Any finite number. */
export const number = (v: string): number =>
  parsed(v, () => true, 'a number', false);

/** An integer, 1 or more: a count of steps, rounds, rows, stages. */
export const positiveInteger = (v: string): number =>
  parsed(v, (x) => x >= 1, 'a whole number, 1 or more', true);

/** An integer, 0 or more: a count where 0 means none (`--warmup`). */
export const wholeNumber = (v: string): number =>
  parsed(v, (x) => x >= 0, 'a whole number, 0 or more', true);

/** A number above 0: seconds, MiB, a learning rate. */
export const positiveNumber = (v: string): number =>
  parsed(v, (x) => x > 0, 'a number above 0', false);

/** A number, 0 or more (`--clip-norm`, 0: off). */
export const nonNegativeNumber = (v: string): number =>
  parsed(v, (x) => x >= 0, 'a number, 0 or more', false);

/** A probability in [0, 1) (LayerDrop's). */
export const probability = (v: string): number =>
  parsed(
    v,
    (x) => x >= 0 && x < 1,
    'a probability, 0 or more and below 1',
    false,
  );

/**
 * Comma-separated integers, each 1 or more (`--threads 1,2`: OpenMP team sizes); the error names
 * the item that is not.
 */
export function positiveIntegers(v: string): number[] {
  return v.split(',').map((item) => {
    try {
      return positiveInteger(item);
    } catch {
      throw new InvalidArgumentError(
        `must be whole numbers, 1 or more, separated by commas (e.g. 1,2), got '${item}'`,
      );
    }
  });
}

/**
 * `--out <dir>`: a results folder, made if missing where results are written. Throws when the
 * path or the nearest part of it that exists is a file, where the results could not be written
 * after the runs.
 */
export function resultsFolder(v: string): string {
  for (let p = resolve(v); ; p = dirname(p)) {
    let isFolder: boolean;
    try {
      isFolder = statSync(p).isDirectory();
    } catch {
      if (dirname(p) === p) return v; // nothing of it exists: made when written
      continue;
    }
    if (isFolder) return v;
    throw new InvalidArgumentError(
      `'${p}' is a file, not a folder: give a folder for the results (it is made if missing)`,
    );
  }
}

/**
 * Makes a bad command line (a flag's value, an unknown flag or command: commander has printed
 * its one line) exit with status 2 in `program` and each of its commands, as bad input found
 * later does; `--help` still exits 0. Call it once every command is registered.
 */
export function exitTwoOnBadCommandLine(program: Command): void {
  for (const c of [program, ...program.commands]) {
    c.exitOverride((err) => {
      process.exit(err.exitCode === 0 ? 0 : 2);
    });
  }
}
