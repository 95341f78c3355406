/**
 * Device memory accounting: the peak of the bytes the TF.js engine holds in tensors on this
 * thread's backend (its `numBytes`, updated on every tensor allocation and free), measured
 * exactly rather than sampled between operations. The same hook enforces the device-memory
 * budget (`--device-memory`, {@link setDeviceBudget}): the allocation that would take the
 * engine above it throws, before the backend itself runs out.
 */
import { DeviceOutOfMemoryError, type DeviceOutOfMemory } from './out-of-memory.js';
import { tf } from './tfjs.js';

interface EngineState {
  numBytes: number;
}

/** Where the budget applies, for the error message. */
export type BudgetContext = Pick<DeviceOutOfMemory, 'stage' | 'strategy' | 'advice'>;

let installedOn: EngineState | null = null;
let current = 0;
let peak = 0;
let budget: number | undefined;
let budgetContext: BudgetContext = {};

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
      const grows = v > current;
      current = v;
      if (v > peak) peak = v;
      // only growth can cross the budget; frees never throw (a failing run must still clean up)
      if (grows && budget !== undefined && v > budget) {
        throw new DeviceOutOfMemoryError({ needs: v, budget, how: 'measured', ...budgetContext });
      }
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

/**
 * Sets this thread's device-memory budget, bytes (undefined: none, the default). From now on,
 * any tensor allocation that takes the engine's bytes above `bytes` throws
 * {@link DeviceOutOfMemoryError} `device out of memory: needs X, budget Y (stage S of STRATEGY,
 * measured); ADVICE` from inside the TF.js op that allocates (the tensor being created is
 * counted but lost, so the run should stop). `context` names the stage and strategy in the
 * message. Call it after the backend is initialised. Throws RangeError for a budget that is
 * not a positive finite number.
 */
export function setDeviceBudget(bytes: number | undefined, context: BudgetContext = {}): void {
  if (bytes !== undefined && !(Number.isFinite(bytes) && bytes > 0)) throw new RangeError(`device budget must be a positive number of bytes, got ${bytes}`);
  install();
  budget = bytes;
  budgetContext = { ...context };
}

/** This thread's device-memory budget in bytes, or undefined when there is none. */
export function deviceBudget(): number | undefined {
  return budget;
}
