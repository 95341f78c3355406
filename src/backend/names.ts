/**
 * The names of the backends a device can run, without loading TF.js (the main thread validates
 * configurations before any device exists). 'wasm' and 'cpu' ship with layerwise; 'native' is
 * its own addon (native/, built by npm ci where libdnnl-dev and a compiler are installed);
 * 'tensorflow' and 'webgpu' are optional installs.
 */
import { nativeAddon } from './native-addon.js';

export const BACKENDS = [
  'wasm',
  'cpu',
  'native',
  'tensorflow',
  'webgpu',
] as const;
export type BackendName = (typeof BACKENDS)[number];

/**
 * The backend a run uses unless told otherwise: 'native' where its addon loads (checked once,
 * in this thread, without TF.js), else 'wasm'.
 */
export function defaultBackend(): BackendName {
  return nativeAddon() ? 'native' : 'wasm';
}
