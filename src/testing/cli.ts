/**
 * Test helper: the layerwise CLI run in a child process, as a user runs it (never used by the
 * library itself).
 */
import { spawnSync } from 'node:child_process';
import { fileURLToPath } from 'node:url';

/** The built CLI entry point (dist/cli/main.js). */
export const CLI = fileURLToPath(new URL('../cli/main.js', import.meta.url));

/** What a CLI run left: its exit status (null when killed), the signal that killed it, its output. */
export interface CliRun {
  code: number | null;
  signal: NodeJS.Signals | null;
  out: string;
  err: string;
}

/**
 * Runs `layerwise <args>` and waits for it (at most `timeoutMs`, then it is killed). `env` is
 * laid over this process's environment; a variable set to undefined is left out.
 */
export function runCli(
  args: readonly string[],
  env: Record<string, string | undefined> = {},
  timeoutMs = 120_000,
): CliRun {
  const r = spawnSync(process.execPath, [CLI, ...args], {
    encoding: 'utf8',
    timeout: timeoutMs,
    env: { ...process.env, ...env },
  });
  return { code: r.status, signal: r.signal, out: r.stdout, err: r.stderr };
}
