/**
 * `npm run bench -- webgpu-host`: the host's side of webgpu (issue 36: on a GPU the host bounds
 * a charlm-small step). Two figures, both thread CPU time (backend/gpu-queue.ts threadCpuMs,
 * Linux), so less sensitive than wall time to a shared machine:
 * - per call, the host microseconds of one dispatching kernel run through TF.js: a unary program
 *   of TF.js's (relu), layerwise's product (matMul) and layerwise's layer norm followed by a relu
 *   (a dispatch of layerwise's own pipelines next to one of TF.js's), `calls` calls a round,
 *   GPU-resident 8 x 16 operands (the GPU's share negligible), the median of `rounds` rounds;
 * - per training step, charlm-small single on webgpu with the GPU's share made small (batch 1,
 *   context 8, d_model 16, 2 heads): the device thread's host ms (CPU outside reads that wait for
 *   the GPU), its polling ms (CPU while they wait) and the step's wall ms, medians over `steps`
 *   steps after `warmup`, through TF.js and with the captured step (pipeline/captured-step.ts);
 * - the same step on a Stage in this thread, host ms through TF.js against the host ms of
 *   encoding and submitting its recorded commands again (bench/webgpu-replay.ts): the floor a
 *   step captured once and re-issued stands on.
 * Writes webgpu-host.json and webgpu-host.md.
 */
import { gpuQueue, threadCpuMs } from '../backend/gpu-queue.js';
import { initBackend } from '../backend/index.js';
import { tf } from '../backend/tfjs.js';
import { installDawn } from '../backend/webgpu.js';
import { layerNorm } from '../model/layers.js';
import { LayerwiseError } from '../util/errors.js';
import { median } from '../util/stats.js';
import { markdownTable, writeBenchResults } from './report.js';

export interface WebGPUHostBenchOptions {
  /** Kernel calls per round. */
  calls: number;
  rounds: number;
  /** Measured training steps (0: no training), after `warmup` ones. */
  steps: number;
  warmup: number;
  out: string;
}

/** The host microseconds per call of `f` (thread CPU), the median of `rounds` rounds of `calls` calls. */
async function hostUs(
  f: () => void,
  calls: number,
  rounds: number,
): Promise<number> {
  const q = gpuQueue()!;
  const per: number[] = [];
  for (let r = 0; r <= rounds; r++) {
    const c0 = threadCpuMs()!;
    for (let i = 0; i < calls; i++) {
      f();
      if (i % 20 === 19) await q.poll(); // Dawn's completions, as a step's waits let them in
    }
    const us = ((threadCpuMs()! - c0) * 1000) / calls;
    q.flush();
    await tf.tidy(() => tf.zeros([1]).add(1)).data(); // the GPU catches up between rounds
    if (r > 0) per.push(us); // round 0 warms up (pipelines compiled)
  }
  return median(per);
}

/** Host us per call of three dispatching kernel runs (see the module's comment). */
async function dispatchCosts(
  o: WebGPUHostBenchOptions,
): Promise<Array<{ kernel: string; dispatches: number; host_us: number }>> {
  await initBackend('webgpu');
  const resident = (t: tf.Tensor) => tf.tidy(() => tf.relu(t)); // made by a program: on the GPU only
  const x = resident(tf.randomNormal([8, 16], 0, 1, 'float32', 1));
  const w = resident(tf.randomNormal([16, 16], 0, 1, 'float32', 2));
  const g = resident(tf.ones([16]));
  const b = resident(tf.zeros([16]));
  const kernels: Array<[string, number, () => void]> = [
    ["relu (TF.js's unary program)", 1, () => tf.relu(x).dispose()],
    ["matMul (layerwise's product)", 1, () => tf.matMul(x, w).dispose()],
    [
      "layerNorm (layerwise's pipeline) + relu",
      2,
      () => tf.tidy(() => tf.relu(layerNorm(x, g, b))).dispose(),
    ],
  ];
  const rows = [];
  for (const [kernel, dispatches, f] of kernels)
    rows.push({
      kernel,
      dispatches,
      host_us: await hostUs(f, o.calls, o.rounds),
    });
  tf.dispose([x, w, g, b]);
  return rows;
}

/** charlm-small's shape in the step measurements: the GPU's share made small. */
const STEP_SHAPE = { dModel: 16, heads: 2, context: 8 };

/**
 * Per-step medians of the tiny charlm-small single run (see the module's comment); `captured`:
 * with the captured step on (pipeline/captured-step.ts: the environment variable set while the
 * device starts).
 */
async function stepCosts(o: WebGPUHostBenchOptions, captured = false) {
  const { resolveConfig, modelConfigFor } = await import('../config/config.js');
  const { loadDataset } = await import('../data/index.js');
  const { makeBatcher } = await import('../data/batcher.js');
  const { buildModel } = await import('../model/model.js');
  const { initParams } = await import('../model/init.js');
  const { createStrategy } = await import('../strategies/index.js');
  const shape = STEP_SHAPE;
  const cfg = resolveConfig({
    preset: 'charlm-small',
    backend: 'webgpu',
    batchSize: 1,
    ...shape,
  });
  const ds = await loadDataset(cfg.data);
  const model = buildModel(modelConfigFor(cfg, ds));
  const { withCapture } = await import('./webgpu-replay.js');
  const s = await withCapture(captured, () =>
    createStrategy(cfg, model, initParams(model.blocks, 1)),
  );
  try {
    const batcher = makeBatcher(ds, { batchSize: 1, context: 8, seed: 1 });
    const host: number[] = [];
    const poll: number[] = [];
    const wall: number[] = [];
    let dispatches = 0;
    let replayed = 0;
    for (let i = 0; i < o.warmup + o.steps; i++) {
      const t = performance.now();
      const r = await s.trainStep(batcher.next(), 1e-4);
      if (i < o.warmup) continue;
      wall.push(performance.now() - t);
      host.push(r.gpu?.hostMs ?? Number.NaN);
      poll.push(r.gpu?.pollMs ?? Number.NaN);
      dispatches = r.gpu?.dispatches ?? 0;
      replayed += r.gpu?.replays ?? 0;
    }
    return {
      shape,
      captured,
      /** Timed steps whose forward and backward were replayed. */
      replayed_steps: replayed,
      dispatches_per_step: dispatches,
      host_ms: median(host),
      poll_ms: median(poll),
      step_ms: median(wall),
    };
  } finally {
    await s.close();
  }
}

/** The in-thread step through TF.js and replayed (see bench/webgpu-replay.ts). */
async function replayedStep(o: WebGPUHostBenchOptions) {
  const { resolveConfig } = await import('../config/config.js');
  const { inThreadStage } = await import('./report.js');
  const { replayCosts } = await import('./webgpu-replay.js');
  const stage = await inThreadStage(
    resolveConfig({
      preset: 'charlm-small',
      backend: 'webgpu',
      batchSize: 1,
      ...STEP_SHAPE,
    }),
  );
  try {
    return await replayCosts(
      () => {
        stage.step();
      },
      o.warmup,
      Math.max(3, o.steps),
    );
  } finally {
    stage.dispose();
  }
}

/**
 * Checks the options: calls and rounds positive integers, steps and warmup integers >= 0.
 * @throws LayerwiseError naming the flag, the value and what it must be.
 */
function checkOptions(o: WebGPUHostBenchOptions): void {
  const flags: Array<[string, number, number]> = [
    ['--calls', o.calls, 1],
    ['--rounds', o.rounds, 1],
    ['--steps', o.steps, 0],
    ['--warmup', o.warmup, 0],
  ];
  for (const [flag, v, least] of flags)
    if (!Number.isInteger(v) || v < least)
      throw new LayerwiseError(
        `${flag}: must be an integer >= ${least}, got ${v}`,
      );
}

/**
 * Runs the bench and writes its results.
 * @throws LayerwiseError on a bad option (naming it), from installDawn where no WebGPU adapter
 *   can be made, and where the thread's CPU time cannot be read (not Linux).
 */
export async function benchWebGPUHost(
  o: WebGPUHostBenchOptions,
  log: (s: string) => void,
): Promise<void> {
  checkOptions(o);
  const adapter = await installDawn();
  if (threadCpuMs() === undefined)
    throw new LayerwiseError(
      'webgpu-host measures thread CPU time from /proc/thread-self/schedstat: run it on Linux',
    );
  log(`adapter: ${adapter.description} (${adapter.featureLevel})`);
  const kernels = await dispatchCosts(o);
  for (const k of kernels) log(`${k.kernel}: ${k.host_us.toFixed(1)} us`);
  const step = o.steps > 0 ? await stepCosts(o) : undefined;
  const capturedStep = o.steps > 0 ? await stepCosts(o, true) : undefined;
  for (const c of [step, capturedStep])
    if (c)
      log(
        `charlm-small step${c.captured ? `, captured (${c.replayed_steps} of ${o.steps} replayed)` : ''}: host ${c.host_ms.toFixed(2)} ms, polling ${c.poll_ms.toFixed(2)} ms, wall ${c.step_ms.toFixed(2)} ms`,
      );
  const replay = o.steps > 0 ? await replayedStep(o) : undefined;
  if (replay)
    log(
      `the same step in this thread: host ${replay.host_ms_tfjs.toFixed(2)} ms through TF.js, ${replay.host_ms_replay.toFixed(2)} ms replayed (${replay.ops.dispatch} dispatches, ${replay.ops.copy} copies, ${replay.ops.submit} submits)${replay.replay_error ? `; the replay's error: ${replay.replay_error}` : ''}`,
    );
  const md =
    `# The host's side of webgpu\n\nAdapter: ${adapter.description} (${adapter.featureLevel} feature level). Thread CPU time (Linux /proc/thread-self/schedstat); the machine may be shared.\n\n` +
    `## Host us per kernel call (${o.calls} calls a round, median of ${o.rounds} rounds; 8 x 16 operands on the GPU)\n\n` +
    markdownTable({
      columns: ['kernel', 'dispatches', 'host us per call'],
      rows: kernels.map((k) => [k.kernel, k.dispatches, k.host_us.toFixed(1)]),
    }) +
    (step && capturedStep
      ? `\n## charlm-small single, batch 1, context 8, d_model 16, 2 heads (medians of ${o.steps} steps after ${o.warmup})\n\nThrough TF.js, and with the captured step (\`LAYERWISE_WEBGPU_CAPTURE=1\`, pipeline/captured-step.ts: forward and backward re-issued from a recording once two steps matched).\n\n${markdownTable(
          {
            columns: [
              'run',
              'replayed steps',
              'dispatches per step',
              'host ms',
              'polling ms',
              'step ms (wall)',
            ],
            rows: [step, capturedStep].map((c) => [
              c.captured ? 'captured step' : 'through TF.js',
              c.replayed_steps,
              c.dispatches_per_step,
              c.host_ms.toFixed(2),
              c.poll_ms.toFixed(2),
              c.step_ms.toFixed(2),
            ]),
          },
        )}`
      : '') +
    (replay
      ? `\n## The same step on a Stage in this thread: through TF.js, and its recorded commands replayed (medians of ${Math.max(3, o.steps)} each)\n\nThe replay encodes and submits the step's recorded compute passes, pipelines, bind groups, dispatches, copies and submits again, with no TF.js, tape or layerwise JS (bench/webgpu-replay.ts): the host's floor for a step captured once and re-issued.${replay.replay_error ? ` Dawn reported during the replays: ${replay.replay_error}` : ''}\n\n${markdownTable(
          {
            columns: [
              'dispatches',
              'copies',
              'submits',
              'host ms through TF.js',
              'host ms replayed',
            ],
            rows: [
              [
                replay.ops.dispatch,
                replay.ops.copy,
                replay.ops.submit,
                replay.host_ms_tfjs.toFixed(2),
                replay.host_ms_replay.toFixed(2),
              ],
            ],
          },
        )}`
      : '');
  const files = await writeBenchResults(
    o.out,
    'webgpu-host',
    { adapter, options: o, kernels, step, captured_step: capturedStep, replay },
    md,
  );
  log(`wrote ${files.join(', ')}`);
}
