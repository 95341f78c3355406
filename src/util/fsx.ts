/**
 * Files are never left half-written: everything is written to a temporary path beside its
 * destination and renamed into place (rename is atomic on POSIX file systems).
 */
import { readdirSync, statSync } from 'node:fs';
import { mkdir, rename, rm, writeFile } from 'node:fs/promises';
import { basename, dirname, join } from 'node:path';

/*
 * Test-only fault injection: with LAYERWISE_TEST_KILL_WRITING=<file name> (e.g. run.json) the
 * process SIGKILLs itself inside {@link writeFileAtomic} of a file of that name, after its
 * temporary file is written and before the rename, so that tests can stop a real run there.
 */
const killWriting = process.env.LAYERWISE_TEST_KILL_WRITING;

/** Writes `data` to `path` atomically (temp file + rename), creating the folder if needed. */
export async function writeFileAtomic(
  path: string,
  data: string | Uint8Array,
): Promise<void> {
  await mkdir(dirname(path), { recursive: true });
  const tmp = `${path}.tmp-${process.pid}-${Date.now()}`;
  try {
    await writeFile(tmp, data);
    if (killWriting && basename(path) === killWriting)
      process.kill(process.pid, 'SIGKILL');
    await rename(tmp, path);
  } catch (e) {
    await rm(tmp, { force: true });
    throw e;
  }
}

/**
 * The temporary files {@link writeFileAtomic} of `path` left beside it (a writer killed
 * before its rename), newest first; none when the folder cannot be read.
 */
export function atomicLeftovers(path: string): string[] {
  const dir = dirname(path);
  const prefix = `${basename(path)}.tmp-`;
  let names: string[];
  try {
    names = readdirSync(dir).filter((n) => n.startsWith(prefix));
  } catch {
    return [];
  }
  const mtime = (p: string) => {
    try {
      return statSync(p).mtimeMs;
    } catch {
      return 0;
    }
  };
  return names
    .map((n) => join(dir, n))
    .map((p) => ({ p, t: mtime(p) }))
    .sort((a, b) => b.t - a.t)
    .map((x) => x.p);
}

/**
 * Replaces the folder `dest` by a folder filled by `fill` atomically: `fill` writes into a
 * temporary sibling folder, which then takes `dest`'s place; the previous `dest` is removed
 * only after the new one is in place. If `fill` throws, nothing at `dest` changes.
 */
export async function replaceDirAtomic(
  dest: string,
  fill: (dir: string) => Promise<void>,
): Promise<void> {
  const tmp = `${dest}.tmp-${process.pid}-${Date.now()}`;
  const old = `${dest}.old-${process.pid}-${Date.now()}`;
  await mkdir(tmp, { recursive: true });
  try {
    await fill(tmp);
  } catch (e) {
    await rm(tmp, { recursive: true, force: true });
    throw e;
  }
  let moved = false;
  try {
    await rename(dest, old);
    moved = true;
  } catch {
    // no previous folder
  }
  await rename(tmp, dest);
  if (moved) await rm(old, { recursive: true, force: true });
}
