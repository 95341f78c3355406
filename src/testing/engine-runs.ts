import * as tf from '@tensorflow/tfjs-core';

/**
 * Test helper: runs `f` and counts the engine's kernel runs by kernel name meanwhile (the ops'
 * runs, `tf.engine().runKernel`; a kernel a gradient runs on views, backend/dense.ts
 * kernelOnViews, is not one). Restores the engine whether `f` returns or throws.
 */
export function engineRuns<T>(f: () => T): {
  result: T;
  runs: Map<string, number>;
} {
  const engine = tf.engine();
  const run = engine.runKernel.bind(engine);
  const runs = new Map<string, number>();
  engine.runKernel = ((name: string, ...rest: unknown[]) => {
    runs.set(name, (runs.get(name) ?? 0) + 1);
    return (run as (...a: unknown[]) => unknown)(name, ...rest);
  }) as typeof engine.runKernel;
  try {
    return { result: f(), runs };
  } finally {
    engine.runKernel = run;
  }
}
