/**
 * Errors that come from the user's input (configuration, data, checkpoints) rather than from a
 * bug. The CLI prints their message alone, without a stack, and exits with status 2.
 * Every message names the problem and what would fix it.
 */
export class LayerwiseError extends Error {
  /** 'LayerwiseError', or a subclass's name (e.g. 'DeviceOutOfMemoryError'). */
  override readonly name: string = 'LayerwiseError';
}

/** Throw a {@link LayerwiseError} with `message` unless `cond` holds. */
export function check(cond: unknown, message: string | (() => string)): asserts cond {
  if (!cond) throw new LayerwiseError(typeof message === 'function' ? message() : message);
}
