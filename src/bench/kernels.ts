/**
 * `npm run bench -- kernels`: where a training step's time goes, per TF.js kernel, on one
 * backend: single-device training of a preset in this thread (one plain-backprop Stage), every
 * kernel of the backend wrapped with a timer. Writes kernels.json and kernels.md (ms per step
 * and calls per kernel, the step's time and tokens/s). The timings include each kernel's output
 * allocation; with `--shapes` the rows are split by input shapes.
 */
import * as tf from '@tensorflow/tfjs-core';
import { initBackend, type Precision } from '../backend/index.js';
import {
  modelConfigFor,
  optimizerConfigOf,
  resolveConfig,
} from '../config/config.js';
import { makeBatcher } from '../data/batcher.js';
import { loadDataset } from '../data/index.js';
import { initParams } from '../model/init.js';
import { buildModel, modelParamCount } from '../model/model.js';
import { Stage } from '../pipeline/stage.js';
import { markdownTable, writeBenchResults } from './report.js';

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

export async function benchKernels(
  o: KernelsBenchOptions,
  log: (s: string) => void,
): Promise<void> {
  await initBackend(o.backend, { precision: o.precision ?? 'fp32' });
  const times = new Map<string, { ms: number; calls: number }>();
  let timing = false;
  for (const k of tf.getKernelsForBackend(o.backend)) {
    const f = k.kernelFunc;
    tf.unregisterKernel(k.kernelName, o.backend);
    tf.registerKernel({
      ...k,
      kernelFunc: (args) => {
        if (!timing) return f(args);
        const t0 = performance.now();
        const r = f(args);
        const key = o.shapes
          ? `${k.kernelName} ${Object.values(args.inputs)
              .map((t) => `[${(t as tf.TensorInfo | undefined)?.shape}]`)
              .join(' ')}`
          : k.kernelName;
        const e = times.get(key) ?? { ms: 0, calls: 0 };
        e.ms += performance.now() - t0;
        e.calls++;
        times.set(key, e);
        return r;
      },
    });
  }
  const cfg = resolveConfig({
    preset: o.preset,
    batchSize: o.batchSize,
    backend: o.backend,
  });
  const ds = await loadDataset(cfg.data);
  const model = buildModel(modelConfigFor(cfg, ds));
  const stage = new Stage(
    model,
    { from: 0, to: model.blocks.length },
    initParams(model.blocks, cfg.seed),
    optimizerConfigOf(cfg),
  );
  const context =
    model.config.arch === 'charlm' ? model.config.context : undefined;
  const batcher = makeBatcher(ds, { batchSize: o.batchSize, context, seed: 1 });
  let stepMs = 0;
  let tokens = 0;
  try {
    for (let s = 0; s <= o.steps; s++) {
      const b = batcher.next();
      timing = s > 0;
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
  const perStep = stepMs / o.steps;
  const kernelMs = [...times.values()].reduce((a, e) => a + e.ms, 0) / o.steps;
  const rows = [...times]
    .map(([kernel, e]) => ({
      kernel,
      ms_per_step: e.ms / o.steps,
      calls_per_step: e.calls / o.steps,
    }))
    .sort((a, b) => b.ms_per_step - a.ms_per_step);
  log(
    `${o.backend} ${o.precision ?? 'fp32'}: ${perStep.toFixed(0)} ms per step (${((tokens / perStep) * 1000).toFixed(0)} tokens/s), ${kernelMs.toFixed(0)} ms in kernels`,
  );
  for (const r of rows.slice(0, 12))
    log(
      `  ${r.kernel.padEnd(32)} ${r.ms_per_step.toFixed(1).padStart(8)} ms  ${r.calls_per_step} calls`,
    );
  const md = [
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
  const files = await writeBenchResults(
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
    md,
  );
  log(`wrote ${files.join(', ')}`);
}
