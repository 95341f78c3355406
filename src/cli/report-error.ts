/**
 * The CLI's one error path. Every failure prints one line on stderr (a bad schedule file also its grid), never a bare stack:
 *
 * - a user's error ({@link LayerwiseError}: bad flags, data, checkpoints, a numeric fault, a run
 *   folder in use; a device over its --device-memory budget; a file-system error on a path the
 *   user gave) names the problem and the fix, and exits with status 2 (a bad schedule file's
 *   message also prints the schedule below it, the faulty action marked `<-- ERROR HERE`); so does a lost device
 *   (its process killed, its host gone) once --max-restarts is used up, naming the command that
 *   resumes the run;
 * - anything else is an internal failure: one line with the cause and where the full report
 *   is (`error.txt` in the run folder when there is one; `--debug` prints it on stderr), exit 1.
 */
import { writeFileSync } from 'node:fs';
import { join } from 'node:path';
import { isDeviceLoss } from '../runtime/device.js';
import { LayerwiseError, runDirOf } from '../util/errors.js';

/** File-system error codes a user's paths cause, and what to do about them. */
const FS_ADVICE: Record<string, string> = {
  EACCES:
    'permission denied; choose a path you can write, or fix its permissions',
  EPERM:
    'operation not permitted; choose a path you can write, or fix its permissions',
  EROFS: 'the file system is read-only; choose another path',
  ENOSPC:
    'no space left on the device; free some space or choose another --out',
  EDQUOT: 'disk quota exceeded; free some space or choose another --out',
  EEXIST: 'a file is in the way; remove it or choose another path',
  ENOTDIR: 'a part of the path is a file, not a folder; choose another path',
  EISDIR: 'it is a folder, not a file; give a file path',
  ENOENT: 'no such file or folder; check the path',
  EMFILE: 'too many open files; raise the limit (ulimit -n)',
};

interface ErrLike extends Error {
  code?: string;
  path?: string;
  syscall?: string;
  causeName?: string;
  schedule?: string;
}

function firstLine(s: string): string {
  const l = s.split('\n').find((x) => x.trim() !== '') ?? s;
  return l.trim();
}

/** The full report of an internal error: message, stack, the failing stage's schedule. */
export function fullReport(
  e: unknown,
  argv: readonly string[] = process.argv,
): string {
  const err = e as ErrLike;
  const lines = [
    `layerwise internal error, ${new Date().toISOString()}`,
    `command: ${argv.slice(2).join(' ')}`,
    `node ${process.version} on ${process.platform}-${process.arch}`,
    '',
    err?.stack ?? String(e),
  ];
  if (err?.schedule)
    lines.push('', 'schedule of the failing stage:', err.schedule);
  return `${lines.join('\n')}\n`;
}

/**
 * Prints `e` as described above (with `debug`: plus the full report) and returns the exit
 * status. Writes `error.txt` into the run folder of an internal error when it has one.
 */
export function reportError(
  e: unknown,
  opts: { debug?: boolean; print?: (line: string) => void } = {},
): number {
  const print = opts.print ?? ((l: string) => process.stderr.write(`${l}\n`));
  const err = (e instanceof Error ? e : new Error(String(e))) as ErrLike;
  if (err instanceof LayerwiseError) {
    // one line, but for what a message shows below it on purpose (a schedule file's grid with
    // the faulty action marked <-- ERROR HERE)
    print(`layerwise: error: ${err.message.trim()}`);
    if (opts.debug) print(fullReport(err));
    return 2;
  }
  // a device that crossed --device-memory while running is a configuration problem, like the predicted case
  if (
    err.causeName === 'DeviceOutOfMemoryError' ||
    err.name === 'DeviceOutOfMemoryError' ||
    err.causeName === 'LayerwiseError' ||
    err.causeName === 'NumericFaultError'
  ) {
    print(`layerwise: error: ${firstLine(err.message)}`);
    if (opts.debug) print(fullReport(err));
    return 2;
  }
  // a lost device is the machine's fault, not the program's: the run resumes from its checkpoint
  if (isDeviceLoss(err)) {
    const dir = runDirOf(err);
    print(
      `layerwise: error: ${firstLine(err.message)}; continue the run with 'layerwise train --resume ${dir ?? '<its --out folder>'}' (add --max-restarts N to restart lost devices by itself)`,
    );
    if (opts.debug) print(fullReport(err));
    return 2;
  }
  if (typeof err.code === 'string' && FS_ADVICE[err.code] && err.path) {
    print(
      `layerwise: error: cannot ${err.syscall ?? 'use'} ${err.path}: ${FS_ADVICE[err.code]}`,
    );
    if (opts.debug) print(fullReport(err));
    return 2;
  }
  let where = 'rerun with --debug to print the full report';
  const dir = runDirOf(err);
  if (dir) {
    const file = join(dir, 'error.txt');
    try {
      writeFileSync(file, fullReport(err));
      where = `full report in ${file} (or rerun with --debug)`;
    } catch {
      // the run folder is gone or not writable: --debug still prints it
    }
  }
  print(
    `layerwise: internal error: ${firstLine(err.message || err.name)}; ${where}`,
  );
  if (opts.debug) print(fullReport(err));
  return 1;
}
