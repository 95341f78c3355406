import type { NativeAddon } from '../backend/native-addon.js';

/**
 * Test helper: runs `body` and then puts this thread's native OpenMP team back to the size it
 * had before (`NativeAddon.threads()`), whether `body` returns or throws, or, where it returns a
 * promise, once that settles; for tests that set the team (`setThreads`) to compare results at
 * several sizes.
 */
export function withThreadsRestored<T>(
  lib: Pick<NativeAddon, 'threads' | 'setThreads'>,
  body: () => T,
): T {
  const before = lib.threads();
  const restore = () => lib.setThreads(before);
  let result: T;
  try {
    result = body();
  } catch (e) {
    restore();
    throw e;
  }
  if (result instanceof Promise) return result.finally(restore) as T;
  restore();
  return result;
}
