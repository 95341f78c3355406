/**
 * The device-memory budget's error (`--device-memory`), shared by the main thread (the
 * prediction before training, plan/budget.ts) and the stage workers (the exact byte counter,
 * backend/memory.ts). It imports no TF.js, so the main thread can load it for free.
 */
import { LayerwiseError } from '../util/errors.js';
import { formatSize } from '../util/size.js';

/** Where and how a budget was exceeded. */
export interface DeviceOutOfMemory {
  /** Bytes the device needs (predicted peak, or the engine's bytes at the allocation that crossed the budget). */
  needs: number;
  /** The budget, bytes. */
  budget: number;
  /** Stage (device) index, when known. */
  stage?: number;
  /** Strategy name, when known. */
  strategy?: string;
  /** 'predicted' before training (memory model), 'measured' by the engine's byte counter while running. */
  how: 'predicted' | 'measured';
  /** What to try instead (the strategy's advice, strategies/*.ts outOfMemoryAdvice). */
  advice?: string;
}

/**
 * A run needs more device memory than `--device-memory` allows. Message:
 * `device out of memory: needs 1.2 GiB, budget 512 MiB (stage 0 of gpipe, predicted); try --strategy l2l, or more --stages`.
 * A {@link LayerwiseError}, so the CLI prints the message alone and exits with status 2 when it
 * is thrown in the main thread; thrown in a stage worker it reaches the main thread as a
 * StageError `stage N: device out of memory: ...` whose `causeName` is this class's name.
 */
export class DeviceOutOfMemoryError extends LayerwiseError {
  override readonly name: string = 'DeviceOutOfMemoryError';
  constructor(readonly info: DeviceOutOfMemory) {
    super(formatDeviceOutOfMemory(info));
  }
}

/** The message of a {@link DeviceOutOfMemoryError} (see there). */
export function formatDeviceOutOfMemory(i: DeviceOutOfMemory): string {
  const where = [
    i.stage !== undefined ? `stage ${i.stage}` : '',
    i.strategy !== undefined
      ? `${i.stage !== undefined ? 'of ' : ''}${i.strategy}`
      : '',
  ]
    .filter(Boolean)
    .join(' ');
  return (
    `device out of memory: needs ${formatSize(i.needs)}, budget ${formatSize(i.budget)} (${where ? `${where}, ` : ''}${i.how}); ` +
    (i.advice ?? 'try --strategy l2l, or more --stages')
  );
}
