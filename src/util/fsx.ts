/**
 * Files are never left half-written: everything is written to a temporary path beside its
 * destination and renamed into place (rename is atomic on POSIX file systems).
 */
import { mkdir, rename, rm, writeFile } from 'node:fs/promises';
import { dirname } from 'node:path';

/** Writes `data` to `path` atomically (temp file + rename), creating the folder if needed. */
export async function writeFileAtomic(
  path: string,
  data: string | Uint8Array,
): Promise<void> {
  await mkdir(dirname(path), { recursive: true });
  const tmp = `${path}.tmp-${process.pid}-${Date.now()}`;
  try {
    await writeFile(tmp, data);
    await rename(tmp, path);
  } catch (e) {
    await rm(tmp, { force: true });
    throw e;
  }
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
