/**
 * Finds and starts the Chromium that drives the page in tests and for the README's screenshot:
 * Debian's chromium-headless-shell (`apt-get install chromium-headless-shell`), driven with
 * playwright-core, with WebGPU on SwiftShader (Chromium's software GPU:
 * `--enable-unsafe-webgpu --use-webgpu-adapter=swiftshader`).
 */
import { accessSync, constants } from 'node:fs';
import { delimiter, join } from 'node:path';

/** Where Debian and Ubuntu put Chromium's executables, after $PATH. */
const KNOWN = [
  '/usr/lib/chromium/chromium-headless-shell',
  '/usr/lib/chromium/chromium',
  '/usr/bin/chromium',
];

/** The command-line switches every launch passes: WebGPU on SwiftShader. */
export const CHROMIUM_ARGS = [
  '--enable-unsafe-webgpu',
  '--use-webgpu-adapter=swiftshader',
];

/**
 * The path of a Chromium executable: $LAYERWISE_CHROMIUM if set, else chromium-headless-shell
 * on $PATH, else Debian's known paths; undefined when none is installed.
 */
export function findChromium() {
  const given = process.env.LAYERWISE_CHROMIUM;
  const onPath = (process.env.PATH ?? '')
    .split(delimiter)
    .filter(Boolean)
    .map((d) => join(d, 'chromium-headless-shell'));
  for (const p of [...(given ? [given] : []), ...onPath, ...KNOWN]) {
    try {
      accessSync(p, constants.X_OK);
      return p;
    } catch {}
  }
  return undefined;
}

/**
 * Launches Chromium headless (playwright-core's `chromium.launch`) with {@link CHROMIUM_ARGS};
 * resolves with the Browser. Throws when no Chromium is found (install chromium-headless-shell).
 */
export async function launchChromium() {
  const executablePath = findChromium();
  if (!executablePath)
    throw new Error(
      'no Chromium found: install chromium-headless-shell (apt-get install chromium-headless-shell) or set LAYERWISE_CHROMIUM',
    );
  const { chromium } = await import('playwright-core');
  return chromium.launch({ executablePath, args: CHROMIUM_ARGS });
}
