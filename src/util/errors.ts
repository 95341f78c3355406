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
export function check(
  cond: unknown,
  message: string | (() => string),
): asserts cond {
  if (!cond)
    throw new LayerwiseError(
      typeof message === 'function' ? message() : message,
    );
}

/**
 * A non-finite value (loss, activation or gradient) in training: a user's doing (the learning
 * rate, the data), so it prints as one line and exits with status 2. `detail` says where it was
 * found (stage, block, micro-batch); {@link at} adds the step and the advice.
 */
export class NumericFaultError extends LayerwiseError {
  override readonly name: string = 'NumericFaultError';
  constructor(
    readonly detail: string,
    readonly step?: number,
  ) {
    super(step === undefined ? detail : `${detail} at step ${step}`);
  }
  /** The same fault at `step`, with what was (not) written and what to do. */
  at(step: number, advice: string): NumericFaultError {
    const e = new NumericFaultError(this.detail, step);
    e.message = `non-finite value at step ${step}: ${this.detail}; ${advice}`;
    return e;
  }
}

/** Marks an error with the run folder it happened in (where the CLI writes its full report). */
export function tagRunDir(e: unknown, dir: string): unknown {
  if (e && typeof e === 'object' && !('runDir' in e)) {
    try {
      Object.defineProperty(e, 'runDir', { value: dir, enumerable: false });
    } catch {
      // a frozen error: no report file
    }
  }
  return e;
}

/** The run folder {@link tagRunDir} marked `e` with, if any. */
export function runDirOf(e: unknown): string | undefined {
  return e && typeof e === 'object' && 'runDir' in e
    ? String((e as { runDir: unknown }).runDir)
    : undefined;
}
