/**
 * `npm run bench -- kernels`: where a training step's time goes, per TF.js kernel, on one
 * backend: single-device training of a preset in this thread (one plain-backprop Stage), every
 * kernel of the backend wrapped with a timer. Writes kernels.json and kernels.md (ms per step
 * and calls per kernel, the step's time and tokens/s). The timings include each kernel's output
 * allocation; with `--shapes` the rows are split by input shapes.
 */
import * as tf from '@tensorflow/tfjs-core';
import { initBackend, type Precision } from '../backend/index.js';
import { optimizerConfigOf, resolveConfig } from '../config/config.js';
import { makeBatcher } from '../data/batcher.js';
import { type Model, modelParamCount } from '../model/model.js';
import { Stage } from '../pipeline/stage.js';
import { loadBenchModel, markdownTable, reportBenchResults } from './report.js';

export interface KernelsBenchOptions {
  preset: string;
  batchSize: number;
  backend: string;
  /** Compute precision of the products (native only for bf16). */
  precision?: Precision;
  /** Measured steps (after one warm-up step). */
  steps: number;
  /** Split rows by input shapes. */
  shapes: boolean;
  out: string;
}

/** Each kernel's (or kernel and input shapes') total milliseconds and calls while timing is on. */
interface KernelTimer {
  times: Map<string, { ms: number; calls: number }>;
  /** Whether kernels are timed now (off during the warm-up step). */
  timing: boolean;
}

/** One table row: a kernel's mean milliseconds and calls per measured step. */
interface KernelRow {
  kernel: string;
  ms_per_step: number;
  calls_per_step: number;
}

/** What the measured steps took: the model, milliseconds summed over them, tokens per step. */
interface Steps {
  model: Model;
  stepMs: number;
  tokens: number;
}

/** Times every kernel of `o.backend` over `o.steps` training steps; writes kernels-<backend>[-bf16].{json,md}. */
export async function benchKernels(
  o: KernelsBenchOptions,
  log: (s: string) => void,
): Promise<void> {
  await initBackend(o.backend, { precision: o.precision ?? 'fp32' });
  const timer = wrapKernels(o.backend, o.shapes);
  const { model, stepMs, tokens } = await trainSteps(o, timer);
  const perStep = stepMs / o.steps;
  const kernelMs =
    [...timer.times.values()].reduce((a, e) => a + e.ms, 0) / o.steps;
  const rows = kernelRows(timer, o.steps);
  log(
    `${o.backend} ${o.precision ?? 'fp32'}: ${perStep.toFixed(0)} ms per step (${((tokens / perStep) * 1000).toFixed(0)} tokens/s), ${kernelMs.toFixed(0)} ms in kernels`,
  );
  for (const r of rows.slice(0, 12))
    log(
      `  ${r.kernel.padEnd(32)} ${r.ms_per_step.toFixed(1).padStart(8)} ms  ${r.calls_per_step} calls`,
    );
  await reportBenchResults(
    o.out,
    `kernels-${o.backend}${o.precision === 'bf16' ? '-bf16' : ''}`,
    {
      bench: 'kernels',
      options: o,
      step_ms: perStep,
      kernel_ms: kernelMs,
      tokens,
      rows,
    },
    kernelsMarkdown(o, model, { perStep, kernelMs, tokens }, rows),
    log,
  );
}

/**
 * Registers every kernel of `backend` again wrapped with a timer: while `timing` is on, each
 * call adds its milliseconds (output allocation included) and one call to its row, keyed by the
 * kernel's name (`byShapes`: and its inputs' shapes, e.g. `MatMul [32,64] [64,64]`).
 */
function wrapKernels(backend: string, byShapes: boolean): KernelTimer {
  const timer: KernelTimer = { times: new Map(), timing: false };
  for (const k of tf.getKernelsForBackend(backend)) {
    const f = k.kernelFunc;
    tf.unregisterKernel(k.kernelName, backend);
    tf.registerKernel({
      ...k,
      kernelFunc: (args) => {
        if (!timer.timing) return f(args);
        const t0 = performance.now();
        const r = f(args);
        const key = byShapes
          ? `${k.kernelName} ${Object.values(args.inputs)
              .map((t) => `[${(t as tf.TensorInfo | undefined)?.shape}]`)
              .join(' ')}`
          : k.kernelName;
        const e = timer.times.get(key) ?? { ms: 0, calls: 0 };
        e.ms += performance.now() - t0;
        e.calls++;
        timer.times.set(key, e);
        return r;
      },
    });
  }
  return timer;
}

/**
 * Trains `o.preset` on one plain-backprop Stage in this thread: one warm-up step with the timer
 * off, then `o.steps` steps with it on (forward, backward, optimizer step at lr 1e-4). Returns
 * the model, the measured steps' total milliseconds and the tokens of one step. Disposes the stage.
 */
async function trainSteps(
  o: KernelsBenchOptions,
  timer: KernelTimer,
): Promise<Steps> {
  const cfg = resolveConfig({
    preset: o.preset,
    batchSize: o.batchSize,
    backend: o.backend,
  });
  const { ds, model, params, context } = await loadBenchModel(cfg);
  const stage = new Stage(
    model,
    { from: 0, to: model.blocks.length },
    params,
    optimizerConfigOf(cfg),
  );
  const batcher = makeBatcher(ds, { batchSize: o.batchSize, context, seed: 1 });
  let stepMs = 0;
  let tokens = 0;
  try {
    for (let s = 0; s <= o.steps; s++) {
      const b = batcher.next();
      timer.timing = s > 0;
      const t0 = performance.now();
      stage.forward(0, tf.tensor(b.x, b.xShape, model.inputDtype), {
        keep: true,
        grad: true,
        labels: tf.tensor(b.y, b.yShape, 'int32'),
      });
      stage.backward(0, null, 1);
      stage.step(1e-4, 1);
      if (s > 0) stepMs += performance.now() - t0;
      tokens = b.tokens;
    }
  } finally {
    stage.dispose();
  }
  return { model, stepMs, tokens };
}

/** The timer's rows as means per step over `steps` steps, slowest first. */
function kernelRows(timer: KernelTimer, steps: number): KernelRow[] {
  return [...timer.times]
    .map(([kernel, e]) => ({
      kernel,
      ms_per_step: e.ms / steps,
      calls_per_step: e.calls / steps,
    }))
    .sort((a, b) => b.ms_per_step - a.ms_per_step);
}

/** kernels.md: the setting and step time (ms per step, in kernels), then one table row per kernel. */
function kernelsMarkdown(
  o: KernelsBenchOptions,
  model: Model,
  step: { perStep: number; kernelMs: number; tokens: number },
  rows: KernelRow[],
): string {
  const { perStep, kernelMs, tokens } = step;
  return [
    `# kernels benchmark\n`,
    `Model ${o.preset} (${modelParamCount(model).toLocaleString('en-US')} parameters), mini-batch ${o.batchSize}, backend ${o.backend}, single-device training in one thread, mean of ${o.steps} steps after one warm-up step: ${perStep.toFixed(0)} ms per step (${((tokens / perStep) * 1000).toFixed(0)} tokens/s), ${kernelMs.toFixed(0)} ms of it in kernels (each kernel's time includes allocating its output).\n`,
    markdownTable({
      columns: ['kernel', 'ms per step', 'share of the step', 'calls per step'],
      rows: rows.map((r) => [
        r.kernel,
        r.ms_per_step.toFixed(1),
        `${((100 * r.ms_per_step) / perStep).toFixed(1)}%`,
        r.calls_per_step,
      ]),
    }),
  ].join('\n');
}
