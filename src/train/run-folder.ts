/**
 * The run folder (--out) and the other paths of a run: checked before any work starts, and
 * one writer per folder.
 *
 * - {@link checkRunPaths}: --out is a folder (or can be created as one) that this process can
 *   write, and --trace goes into a folder that exists (or into --out). Throws
 *   {@link LayerwiseError} naming the flag, the path and the fix. Writes nothing.
 * - {@link lockRunFolder}: a lock (proper-lockfile: a `.lock` folder inside the run folder,
 *   refreshed while the run lives) so that a second run on the same folder fails at once,
 *   naming the folder and the process holding it, instead of overwriting the first run's
 *   checkpoint. The holder's pid and host are written to `.lock-owner.json` beside it; the
 *   lock of a run that was killed is taken over, at once when its pid is gone on this host,
 *   else once it has not been refreshed for {@link STALE_MS}.
 * - {@link releaseRunLocksSync}: releases every lock this process holds, synchronously, for a
 *   SIGINT/SIGTERM handler that exits right after (no stale `.lock-owner.json` is left).
 */
import {
  accessSync,
  constants,
  readFileSync,
  rmSync,
  type Stats,
  statSync,
  utimesSync,
} from 'node:fs';
import { mkdir, rm, writeFile } from 'node:fs/promises';
import { hostname } from 'node:os';
import { dirname, isAbsolute, join, relative, resolve } from 'node:path';
import lockfile from 'proper-lockfile';
import { LayerwiseError } from '../util/errors.js';

/** A lock not refreshed for this long belongs to a run that died (refreshed every STALE_MS / 4). */
export const STALE_MS = 20_000;
export const LOCK_DIR = '.lock';
export const LOCK_OWNER = '.lock-owner.json';

function statOrNull(p: string): Stats | null {
  try {
    return statSync(p);
  } catch {
    return null;
  }
}

function writable(p: string): boolean {
  try {
    accessSync(p, constants.W_OK | constants.X_OK);
    return true;
  } catch {
    return false;
  }
}

/** The nearest existing path at or above `p`, and what it is. */
function nearestExisting(p: string): { path: string; stat: Stats } {
  let cur = resolve(p);
  for (;;) {
    const st = statOrNull(cur);
    if (st) return { path: cur, stat: st };
    const up = dirname(cur);
    if (up === cur) throw new LayerwiseError(`no folder of ${p} exists`);
    cur = up;
  }
}

/** Whether `child` is `parent` or lies inside it. */
function within(child: string, parent: string): boolean {
  const r = relative(resolve(parent), resolve(child));
  return r === '' || (!r.startsWith('..') && !isAbsolute(r));
}

/**
 * Checks that `out` is, or can be created as, a folder this process can write. Throws
 * {@link LayerwiseError} naming `flag`, the path and the fix.
 */
export function checkOutFolder(out: string, flag = '--out'): void {
  const st = statOrNull(out);
  if (st) {
    if (!st.isDirectory())
      throw new LayerwiseError(
        `${flag} ${out} is an existing file, not a folder; give a folder path (a new one, or an earlier run's folder)`,
      );
    if (!writable(out))
      throw new LayerwiseError(
        `${flag} ${out} is not writable (permission denied); choose a folder you can write to`,
      );
    return;
  }
  const near = nearestExisting(out);
  if (!near.stat.isDirectory()) {
    throw new LayerwiseError(
      `${flag} ${out} cannot be created: ${near.path} is a file, not a folder; choose another ${flag}`,
    );
  }
  if (!writable(near.path)) {
    throw new LayerwiseError(
      `${flag} ${out} cannot be created: ${near.path} is not writable (permission denied); choose a folder you can write to`,
    );
  }
}

/** Checks a file to be written at the end of the run (e.g. --trace): its folder exists (or is inside `out`) and is writable. */
export function checkOutputFile(path: string, flag: string, out: string): void {
  const st = statOrNull(path);
  if (st?.isDirectory())
    throw new LayerwiseError(
      `${flag} ${path} is a folder; give a file path, e.g. ${join(path, 'trace.json')}`,
    );
  if (st && !writable(path) && !writable(dirname(resolve(path))))
    throw new LayerwiseError(
      `${flag} ${path} is not writable (permission denied); choose a file you can write`,
    );
  const dir = dirname(resolve(path));
  if (within(dir, out)) return; // created with the run folder (checked as --out)
  const dst = statOrNull(dir);
  if (!dst)
    throw new LayerwiseError(
      `${flag} ${path}: its folder ${dirname(path)} does not exist; create it first, or write the file into the --out folder`,
    );
  if (!dst.isDirectory())
    throw new LayerwiseError(
      `${flag} ${path}: ${dirname(path)} is a file, not a folder; choose another path`,
    );
  if (!writable(dir))
    throw new LayerwiseError(
      `${flag} ${path}: folder ${dirname(path)} is not writable (permission denied); choose a folder you can write to`,
    );
}

/** Checks every path a run will write (--out, --trace) before any work starts. Writes nothing. */
export function checkRunPaths(cfg: { out: string; trace?: string }): void {
  if (typeof cfg.out !== 'string' || cfg.out.trim() === '')
    throw new LayerwiseError('--out must name a folder');
  checkOutFolder(cfg.out);
  if (cfg.trace !== undefined) {
    if (typeof cfg.trace !== 'string' || cfg.trace.trim() === '')
      throw new LayerwiseError(
        '--trace must name a file, e.g. runs/x/trace.json',
      );
    checkOutputFile(cfg.trace, '--trace', cfg.out);
  }
}

interface Owner {
  pid: number;
  host: string;
  started: string;
  command?: string;
}

function readOwner(dir: string): Owner | null {
  try {
    const o = JSON.parse(readFileSync(join(dir, LOCK_OWNER), 'utf8')) as Owner;
    return Number.isInteger(o.pid) && typeof o.host === 'string' ? o : null;
  } catch {
    return null;
  }
}

function alive(pid: number): boolean {
  try {
    process.kill(pid, 0);
    return true;
  } catch (e) {
    return (e as NodeJS.ErrnoException).code === 'EPERM'; // exists, owned by someone else
  }
}

/** A held run-folder lock. */
export interface RunLock {
  readonly dir: string;
  /** Throws {@link LayerwiseError} if the lock was lost (another process took the folder over). */
  assertHeld(): void;
  release(): Promise<void>;
}

/** The locks this process holds: their synchronous release -> their run folder. */
const held = new Map<() => void, string>();

/**
 * Releases every run-folder lock this process holds, synchronously (for a SIGINT or SIGTERM
 * handler: the process exits right after), and returns their run folders. A lock another
 * process took over is left to it.
 */
export function releaseRunLocksSync(): string[] {
  const dirs: string[] = [];
  for (const [release, dir] of [...held]) {
    release();
    dirs.push(dir);
  }
  return dirs;
}

/**
 * Creates `dir` if needed and takes its lock. Throws {@link LayerwiseError} when another live
 * run holds it, naming the folder and that run's pid, host and start time.
 */
export async function lockRunFolder(
  dir: string,
  opts: { staleMs?: number } = {},
): Promise<RunLock> {
  await mkdir(dir, { recursive: true });
  const stale = opts.staleMs ?? STALE_MS;
  let compromised: Error | undefined;
  const options = {
    lockfilePath: join(dir, LOCK_DIR),
    realpath: false,
    retries: 0,
    stale,
    update: Math.max(1000, stale / 4),
    onCompromised: (e: Error) => {
      compromised = e;
    },
  };
  let releaseFn: () => Promise<void>;
  try {
    releaseFn = await lockfile.lock(dir, options);
  } catch (e) {
    if ((e as NodeJS.ErrnoException).code !== 'ELOCKED') throw e;
    const owner = readOwner(dir);
    if (
      owner &&
      owner.host === hostname() &&
      owner.pid !== process.pid &&
      !alive(owner.pid)
    ) {
      // the run that held it was killed: age its lock so that the lock library removes it and
      // takes it (its own stale-lock path, which re-checks the lock as it goes)
      try {
        utimesSync(join(dir, LOCK_DIR), new Date(0), new Date(0));
      } catch {
        // gone meanwhile
      }
      try {
        releaseFn = await lockfile.lock(dir, options);
      } catch (e2) {
        if ((e2 as NodeJS.ErrnoException).code !== 'ELOCKED') throw e2;
        throw inUse(dir, readOwner(dir));
      }
    } else {
      throw inUse(dir, owner);
    }
  }
  const me: Owner = {
    pid: process.pid,
    host: hostname(),
    started: new Date().toISOString(),
    command: process.argv.slice(1).join(' '),
  };
  await writeFile(join(dir, LOCK_OWNER), `${JSON.stringify(me)}\n`);
  let released = false;
  const releaseSync = () => {
    if (released) return;
    released = true;
    held.delete(releaseSync);
    if (compromised) return;
    rmSync(join(dir, LOCK_OWNER), { force: true });
    try {
      lockfile.unlockSync(dir, {
        lockfilePath: options.lockfilePath,
        realpath: false,
      });
    } catch {
      // released meanwhile, or its folder is gone
    }
  };
  held.set(releaseSync, dir);
  return {
    dir,
    assertHeld() {
      if (compromised) {
        throw new LayerwiseError(
          `lost the lock on run folder ${dir} (${compromised.message}); another process may be writing it: check who, then resume with --resume ${dir}`,
        );
      }
    },
    async release() {
      if (released) return;
      released = true;
      held.delete(releaseSync);
      if (compromised) return;
      await rm(join(dir, LOCK_OWNER), { force: true });
      await releaseFn().catch(() => undefined);
    },
  };
}

function inUse(dir: string, owner: Owner | null): LayerwiseError {
  const who = owner
    ? `process ${owner.pid} on ${owner.host}, started ${owner.started}`
    : 'another process';
  return new LayerwiseError(
    `run folder ${dir} is in use by another layerwise run (${who}); wait for it to finish, stop it, or give another --out`,
  );
}
