/**
 * Device memory accounting: the bytes of the data buffers this thread's backend holds for
 * tensors, and their peak, measured exactly on every allocation and free rather than sampled
 * between operations. A buffer is counted once however many tensors share it: TF.js's own
 * `tf.memory().numBytes` adds a tensor's size for every handle, so a reshape, a variable made
 * from a tensor or a kept alias counts its buffer twice (on l2l charlm-small `--layers 16`,
 * micro-batch 2, that over-count was 27 of the 56.6 MiB it reported). The same hook enforces
 * the device-memory budget (`--device-memory`, {@link setDeviceBudget}): the allocation that
 * would take the device above it throws, before the backend itself runs out.
 */
import {
  type DeviceOutOfMemory,
  DeviceOutOfMemoryError,
} from './out-of-memory.js';
import { tf } from './tfjs.js';

interface TensorLike {
  dataId: object;
  dtype: string;
  size: number;
}

/** The engine internals the accounting hooks (tfjs-core 4.22 Engine). */
interface EngineInternals {
  state: { numBytes: number; tensorInfo: WeakMap<object, { bytes: number }> };
  trackTensor(a: TensorLike, backend: unknown): void;
  disposeTensor(a: TensorLike): void;
}

/** Where the budget applies, for the error message. */
export type BudgetContext = Pick<
  DeviceOutOfMemory,
  'stage' | 'strategy' | 'advice'
>;

let installedOn: EngineInternals | null = null;
let current = 0;
let peak = 0;
let budget: number | undefined;
let budgetContext: BudgetContext = {};
/** Tensor disposals under way, and the private bytes the backend counted during them. */
let disposing = 0;
let deferred = 0;

/** Tensors whose bytes TF.js counts here (complex ones through their parts, strings as they are written: neither here). */
const counted = (a: TensorLike): boolean =>
  a.dtype !== 'string' && a.dtype !== 'complex64';

function install(): void {
  const engine = tf.engine() as unknown as EngineInternals;
  if (installedOn === engine) return;
  current = engine.state.numBytes; // tensors made before the first call (normally none)
  peak = current;
  const track = engine.trackTensor.bind(engine);
  const dispose = engine.disposeTensor.bind(engine);
  engine.trackTensor = (a, backend) => {
    // a new buffer: the first tensor on this data id (later ones share it)
    if (counted(a) && !engine.state.tensorInfo.has(a.dataId)) {
      const bytes = a.size * tf.util.bytesPerElement(a.dtype as tf.DataType);
      // only growth can cross the budget; frees never throw (a failing run must still clean up)
      if (budget !== undefined && bytes > 0 && current + bytes > budget) {
        throw new DeviceOutOfMemoryError({
          needs: current + bytes,
          budget,
          how: 'measured',
          ...budgetContext,
        });
      }
      current += bytes;
      if (current > peak) peak = current;
    }
    track(a, backend);
  };
  engine.disposeTensor = (a) => {
    const info = engine.state.tensorInfo.get(a.dataId);
    disposing++;
    try {
      dispose(a);
    } finally {
      disposing--;
    }
    // the buffer is gone once the last tensor on it is disposed
    if (
      info !== undefined &&
      counted(a) &&
      !engine.state.tensorInfo.has(a.dataId)
    )
      current -= info.bytes;
    // what the backend counted while freeing (a bf16-only tensor's private part), after the
    // tensor's own bytes: a free never raises the peak
    if (disposing === 0 && deferred !== 0) {
      current += deferred;
      deferred = 0;
    }
  };
  installedOn = engine;
}

/**
 * Counts `delta` bytes the backend holds privately, behind its tensors (the native backend's bf16
 * copies of parameters and activations: backend/native.ts), as device bytes: positive when it
 * allocates them (checked against the budget like a tensor, throwing
 * {@link DeviceOutOfMemoryError} before counting), negative when it frees them.
 */
export function countPrivateBytes(delta: number): void {
  install();
  if (disposing > 0) {
    deferred += delta; // settled by the disposal under way, after its tensor's bytes
    return;
  }
  if (delta > 0 && budget !== undefined && current + delta > budget) {
    throw new DeviceOutOfMemoryError({
      needs: current + delta,
      budget,
      how: 'measured',
      ...budgetContext,
    });
  }
  current += delta;
  if (current > peak) peak = current;
}

/** Bytes of the data buffers this thread's backend holds for live tensors (each buffer once), and its private buffers ({@link countPrivateBytes}). */
export function deviceBytes(): number {
  install();
  return current;
}

/**
 * An identity op whose gradient notes {@link deviceBytes} when a backward reaches it: put on a
 * block's input, it reads what the block's backward still holds at its last step (the profiler's
 * `bwdHeldBytes`). `bytes()` is the last figure noted (0 before any backward).
 */
export function backwardBytesProbe(): {
  probe: (x: tf.Tensor) => tf.Tensor;
  bytes: () => number;
} {
  let noted = 0;
  const probe = tf.customGrad(((x: tf.Tensor) => ({
    value: tf.clone(x),
    gradFunc: (dy: tf.Tensor) => {
      noted = deviceBytes();
      return [tf.clone(dy)];
    },
  })) as unknown as Parameters<typeof tf.customGrad>[0]) as (
    x: tf.Tensor,
  ) => tf.Tensor;
  return { probe, bytes: () => noted };
}

/** Peak bytes held since the last {@link resetPeakBytes} (or since start). */
export function peakBytes(): number {
  install();
  return peak;
}

let toDevice = 0;
let toHost = 0;

/**
 * Counts `bytes` moved between host memory and this thread's device in one direction
 * ('h2d': an upload, e.g. an L2L layer or a host-stashed activation; 'd2h': a download, e.g. a
 * layer gradient for the parameter server). The payload as it crosses, so a bf16 upload counts
 * 2 bytes per element. Read and reset per step with {@link takeTransferBytes}.
 */
export function countTransfer(direction: 'h2d' | 'd2h', bytes: number): void {
  if (direction === 'h2d') toDevice += bytes;
  else toHost += bytes;
}

/** Bytes counted by {@link countTransfer} since the last call, by direction; resets both. */
export function takeTransferBytes(): {
  hostToDevice: number;
  deviceToHost: number;
} {
  const r = { hostToDevice: toDevice, deviceToHost: toHost };
  toDevice = 0;
  toHost = 0;
  return r;
}

/** Starts a new peak measurement from the current level. */
export function resetPeakBytes(): void {
  install();
  peak = current;
}

/**
 * Sets this thread's device-memory budget, bytes (undefined: none, the default). From now on,
 * any tensor allocation that takes the device's buffer bytes above `bytes` throws
 * {@link DeviceOutOfMemoryError} `device out of memory: needs X, budget Y (stage S of STRATEGY,
 * measured); ADVICE` from inside the TF.js op that allocates (the tensor being created is
 * lost, so the run should stop). `context` names the stage and strategy in the
 * message. Call it after the backend is initialised. Throws RangeError for a budget that is
 * not a positive finite number.
 */
export function setDeviceBudget(
  bytes: number | undefined,
  context: BudgetContext = {},
): void {
  if (bytes !== undefined && !(Number.isFinite(bytes) && bytes > 0))
    throw new RangeError(
      `device budget must be a positive number of bytes, got ${bytes}`,
    );
  install();
  budget = bytes;
  budgetContext = { ...context };
}

/** This thread's device-memory budget in bytes, or undefined when there is none. */
export function deviceBudget(): number | undefined {
  return budget;
}
