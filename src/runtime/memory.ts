/**
 * Device memory accounting: the peak of the bytes the TF.js engine holds in tensors on this
 * thread's backend (its `numBytes`, updated on every tensor allocation and free), measured
 * exactly rather than sampled between operations.
 */
import { tf } from './tfjs.js';

interface EngineState {
  numBytes: number;
}

let installedOn: EngineState | null = null;
let current = 0;
let peak = 0;

function install(): void {
  const state = (tf.engine() as unknown as { state: EngineState }).state;
  if (installedOn === state) return;
  current = state.numBytes;
  peak = current;
  Object.defineProperty(state, 'numBytes', {
    configurable: true,
    enumerable: true,
    get: () => current,
    set: (v: number) => {
      current = v;
      if (v > peak) peak = v;
    },
  });
  installedOn = state;
}

/** Bytes currently held in tensors by this thread's engine. */
export function deviceBytes(): number {
  install();
  return current;
}

/** Peak bytes held since the last {@link resetPeakBytes} (or since start). */
export function peakBytes(): number {
  install();
  return peak;
}

/** Starts a new peak measurement from the current level. */
export function resetPeakBytes(): void {
  install();
  peak = current;
}
