/**
 * The commit a build of layerwise came from, written into dist/ by `npm run build` (this module
 * run as a script: dist/build-info.json, `{ commit, dirty }`) and read back by the benches that
 * name it in their results. A bench run elsewhere from a copy of dist/ (a device bundle, whose
 * checkout copy's git metadata may be older than the build) still names the build's own commit;
 * `git rev-parse` in the working directory is the fallback where no build-info.json is found.
 */
import { spawnSync } from 'node:child_process';
import { readFileSync, writeFileSync } from 'node:fs';
import { fileURLToPath } from 'node:url';

/** dist/build-info.json beside this module's folder (dist/util -> dist). */
const INFO = fileURLToPath(new URL('../build-info.json', import.meta.url));

/** `git rev-parse --short HEAD` and whether tracked files differ from it, in `cwd`; undefined outside a checkout. */
function gitCommit(
  cwd?: string,
): { commit: string; dirty: boolean } | undefined {
  const r = spawnSync('git', ['rev-parse', '--short', 'HEAD'], {
    encoding: 'utf8',
    cwd,
  });
  if (r.status !== 0) return undefined;
  const d = spawnSync('git', ['diff', '--quiet', 'HEAD', '--'], { cwd });
  return { commit: r.stdout.trim(), dirty: d.status === 1 };
}

/**
 * The build's commit, e.g. `2c9f136` or `2c9f136+changes` (tracked files differed from it at
 * build time); from dist/build-info.json, else git in the working directory, else 'unknown'.
 */
export function buildCommit(): string {
  let info: { commit: string; dirty: boolean } | undefined;
  try {
    info = JSON.parse(readFileSync(INFO, 'utf8')) as typeof info;
  } catch {
    info = gitCommit();
  }
  if (!info) return 'unknown';
  return info.dirty ? `${info.commit}+changes` : info.commit;
}

// run as a script (the build's last step): record the checkout's commit
if (process.argv[1] === fileURLToPath(import.meta.url)) {
  const root = fileURLToPath(new URL('../..', import.meta.url));
  const info = gitCommit(root);
  if (info) writeFileSync(INFO, `${JSON.stringify(info)}\n`);
}
