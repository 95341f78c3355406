/**
 * `npm run bench -- param-server`: update rate, in parameters per second, of the eager parameter
 * server's AdamW (L2L, Pudipeddi et al., 2020, arXiv 2002.05645; a fused host Adam as in
 * ZeRO-Offload's CPU Adam) beside TF.js's own Adam (`tf.train.adam`) and layerwise's
 * DeviceOptimizer (AdamW) on the wasm backend, on the same parameters: by default 16M
 * parameters in 8 tensors of [2048, 1024]. Writes bench/results/param-server.json and param-server.md.
 */
import { availableParallelism, cpus } from 'node:os';
import type { Command } from 'commander';
import { initBackend } from '../backend/index.js';
import { nativeAddon, nativeUnavailable } from '../backend/native-addon.js';
import { tf } from '../backend/tfjs.js';
import { positiveInteger, resultsFolder } from '../cli/flags.js';
import type { HostParams } from '../model/init.js';
import {
  DeviceOptimizer,
  defaultOptimizerConfig,
  type OptimizerConfig,
} from '../optim/optimizer.js';
import {
  hostUpdate,
  nativeHostUpdate,
} from '../param-server/host-optimizer.js';
import { ParameterServer } from '../param-server/server.js';
import { check } from '../util/errors.js';
import { Rng } from '../util/rng.js';
import { median } from '../util/stats.js';
import { markdownTable, reportBenchResults } from './report.js';

/** One measured optimizer. */
export interface ServerBenchRow {
  /** What ran: 'hostUpdate (main thread)', 'ParameterServer', 'tf.train.adam', 'DeviceOptimizer'. */
  optimizer: string;
  /** Where: 'host' (JS loops over Float32Arrays) or the TF.js backend. */
  backend: string;
  /** Optimizer worker threads (ParameterServer rows only). */
  threads?: number;
  /** Parameters updated per second (median step). */
  paramsPerSecond: number;
  /** Median wall time of one step over all parameters, ms. */
  stepMs: number;
}

const TENSOR_COLS = 1024;

/**
 * Measures the AdamW update rate (parameters/s) of (a) {@link hostUpdate} in the calling
 * thread, (b) {@link ParameterServer} with 1 and 2 optimizer threads (4 layers of 2 tensors
 * pushed in backward order, timed from the first push until idle(); gradients are made before
 * the clock starts), (c) TF.js's `tf.train.adam` and (d) {@link DeviceOptimizer} on the wasm
 * backend. `params` (default 16,777,216) are split into 8 tensors of [params/8/1024, 1024];
 * each optimizer runs one warm-up step (slot creation) and `steps` (default 5) measured steps,
 * and reports the median. Leaves the calling thread's TF.js backend set to wasm.
 * Memory: about 4 x 4 bytes per parameter on the host, and about 6 x 4 on the wasm heap.
 * Throws a LayerwiseError if params is not a positive multiple of 8 x 1024.
 */
export async function benchServerUpdateRate(
  opts: { params?: number; steps?: number; log?: (s: string) => void } = {},
): Promise<ServerBenchRow[]> {
  const total = opts.params ?? 16 * 2 ** 20;
  const steps = opts.steps ?? 5;
  const log = opts.log ?? (() => undefined);
  const b = updateBench(total, steps);
  const rows: ServerBenchRow[] = [];
  const record = recorder(total, rows, log);
  // (a) hostUpdate in this thread
  record('hostUpdate (main thread)', 'host', timeHostSteps(b, hostUpdate));
  // (a') the native addon's AdamW in this thread, on 1 and 2 OpenMP threads
  timeNativeHostUpdate(b, record, log);
  // (b) the parameter server, 1 and 2 optimizer threads
  for (const threads of [1, 2]) await timeServer(b, threads, record);
  // (c) TF.js's Adam and (d) DeviceOptimizer, on wasm
  await timeOnWasm(b, record);
  return rows;
}

/** The bench's parameters and optimizer, as every measured optimizer gets them. */
interface UpdateBench {
  /** Measured steps (after one warm-up step). */
  steps: number;
  nTensors: number;
  /** Parameters per tensor. */
  per: number;
  /** Each tensor's shape: [per / TENSOR_COLS, TENSOR_COLS]. */
  shape: number[];
  /** Tensor keys `<layer>.w<0|1>`: 4 layers of 2 tensors. */
  keys: string[];
  /** Per layer, its tensors' keys. */
  layers: string[][];
  shapes: Record<string, number[]>;
  /** AdamW without clipping. */
  cfg: OptimizerConfig;
  lr: number;
  /** Every tensor's initial values (seed 1, N(0, 0.02^2)). */
  init: Float32Array;
  /** Every tensor's gradient (drawn after `init`, N(0, 1e-6)). */
  grad: Float32Array;
}

/** Adds one row (median of `times`, ms) to the results and logs it. */
type RecordRow = (
  optimizer: string,
  backend: string,
  times: number[],
  threads?: number,
) => void;

/**
 * The bench's tensors for `total` parameters in 8 tensors, and its optimizer. Throws a
 * LayerwiseError if `total` is not a positive multiple of 8 x {@link TENSOR_COLS}.
 */
function updateBench(total: number, steps: number): UpdateBench {
  const nTensors = 8;
  check(
    Number.isInteger(total) &&
      total > 0 &&
      total % (nTensors * TENSOR_COLS) === 0,
    `--params must be a positive multiple of ${nTensors * TENSOR_COLS} (${nTensors} tensors of ${TENSOR_COLS} columns), got ${total}`,
  );
  const per = total / nTensors;
  const shape = [per / TENSOR_COLS, TENSOR_COLS];
  const keys = Array.from(
    { length: nTensors },
    (_, i) => `${Math.floor(i / 2)}.w${i % 2}`,
  );
  const layers = [0, 1, 2, 3].map((l) =>
    keys.filter((k) => k.startsWith(`${l}.`)),
  );
  const shapes = Object.fromEntries(keys.map((k) => [k, shape]));
  const cfg: OptimizerConfig = {
    ...defaultOptimizerConfig('adamw'),
    clipNorm: 0,
  };
  const rng = new Rng(1);
  const init = new Float32Array(per).map(() => rng.normal() * 0.02);
  const grad = new Float32Array(per).map(() => rng.normal() * 1e-3);
  return {
    steps,
    nTensors,
    per,
    shape,
    keys,
    layers,
    shapes,
    cfg,
    lr: 1e-3,
    init,
    grad,
  };
}

/** A {@link RecordRow} that pushes rows to `rows` (rates over `total` parameters) and logs each. */
function recorder(
  total: number,
  rows: ServerBenchRow[],
  log: (s: string) => void,
): RecordRow {
  return (optimizer, backend, times, threads) => {
    const ms = median(times);
    const row: ServerBenchRow = {
      optimizer,
      backend,
      ...(threads !== undefined ? { threads } : {}),
      paramsPerSecond: total / (ms / 1000),
      stepMs: ms,
    };
    rows.push(row);
    log(
      `${optimizer}${threads !== undefined ? ` (${threads} threads)` : ''} on ${backend}: ${(row.paramsPerSecond / 1e6).toFixed(1)}M params/s (${ms.toFixed(1)} ms per step)`,
    );
  };
}

/** Calls `step(t)` for t = 1 .. steps + 1; returns the milliseconds of each call but the first (the warm-up). */
function msAfterWarmUp(steps: number, step: (t: number) => void): number[] {
  const times: number[] = [];
  for (let t = 1; t <= steps + 1; t++) {
    const t0 = performance.now();
    step(t);
    if (t > 1) times.push(performance.now() - t0);
  }
  return times;
}

/** Times `update` (one step t over every tensor, in this thread) on fresh copies: `steps` steps after one warm-up. */
function timeHostSteps(b: UpdateBench, update: typeof hostUpdate): number[] {
  const ps = b.keys.map(() => b.init.slice());
  const gs = b.keys.map(() => b.grad.slice());
  const slots = b.keys.map(() => ({
    m: new Float32Array(b.per),
    v: new Float32Array(b.per),
  }));
  return msAfterWarmUp(b.steps, (t) => {
    for (let i = 0; i < b.nTensors; i++)
      update(b.cfg, 2, ps[i]!, gs[i]!, slots[i]!, b.lr, 1, t);
  });
}

/**
 * The native addon's AdamW in this thread on 1 and 2 OpenMP threads (then back to all cores);
 * logs why it is skipped without the addon.
 */
function timeNativeHostUpdate(
  b: UpdateBench,
  record: RecordRow,
  log: (s: string) => void,
): void {
  const lib = nativeAddon();
  if (lib) {
    for (const threads of [1, 2]) {
      lib.setThreads(threads);
      record(
        'native adamw (main thread)',
        'host',
        timeHostSteps(b, (...args) => nativeHostUpdate(lib, ...args)),
        threads,
      );
    }
    lib.setThreads(availableParallelism());
  } else {
    log(`native adamw: skipped (${nativeUnavailable()})`);
  }
}

/**
 * A {@link ParameterServer} with `threads` optimizer threads: per step, fresh gradients pushed
 * layer by layer in backward order, timed from the first push until idle(); records the row of
 * `steps` steps after one warm-up. Closes the server.
 */
async function timeServer(
  b: UpdateBench,
  threads: number,
  record: RecordRow,
): Promise<void> {
  const params: HostParams = new Map(b.keys.map((k) => [k, b.init]));
  const server = await ParameterServer.create({
    params,
    layers: b.layers,
    shapes: b.shapes,
    optimizer: b.cfg,
    threads,
  });
  try {
    const times: number[] = [];
    for (let t = 1; t <= b.steps + 1; t++) {
      const grads = b.layers.map((ks) =>
        Object.fromEntries(ks.map((k) => [k, b.grad.slice()])),
      );
      const t0 = performance.now();
      server.beginStep(b.lr);
      for (let l = b.layers.length - 1; l >= 0; l--)
        server.push(l, grads[l], 0);
      await server.idle();
      if (t > 1) times.push(performance.now() - t0);
    }
    server.takeSpans();
    record('ParameterServer', 'host', times, threads);
  } finally {
    await server.close();
  }
}

/**
 * On the wasm backend (left set): TF.js's `tf.train.adam` and then {@link DeviceOptimizer} over
 * variables of the bench's tensors; records a row for each. Disposes the tensors.
 */
async function timeOnWasm(b: UpdateBench, record: RecordRow): Promise<void> {
  await initBackend('wasm');
  const vars = b.keys.map((k) => {
    const t0 = tf.tensor(b.init, b.shape);
    const v = tf.variable(t0, true, `eps_bench_${k}`);
    t0.dispose();
    return v;
  });
  const gts = b.keys.map(() => tf.tensor(b.grad, b.shape));
  try {
    {
      const adam = tf.train.adam(b.lr, b.cfg.beta1, b.cfg.beta2, b.cfg.epsilon);
      const named = vars.map((v, i) => ({ name: v.name, tensor: gts[i] }));
      const times = msAfterWarmUp(b.steps, () => adam.applyGradients(named));
      adam.dispose();
      record('tf.train.adam', 'wasm', times);
    }
    {
      const dev = new DeviceOptimizer(b.cfg);
      const pm = new Map(b.keys.map((k, i) => [k, vars[i]]));
      const gm = new Map<string, tf.Tensor>(b.keys.map((k, i) => [k, gts[i]]));
      const times = msAfterWarmUp(b.steps, () => dev.apply(pm, gm, b.lr, 1));
      dev.dispose();
      record('DeviceOptimizer (AdamW)', 'wasm', times);
    }
  } finally {
    for (const v of vars) v.dispose();
    for (const g of gts) g.dispose();
  }
}

/** Runs {@link benchServerUpdateRate} and writes `<out>/param-server.json` and `<out>/param-server.md`. */
export async function benchEps(
  o: { params: number; steps: number; out: string },
  log: (s: string) => void,
): Promise<void> {
  const rows = await benchServerUpdateRate({
    params: o.params,
    steps: o.steps,
    log,
  });
  const ref = rows.find(
    (r) => r.optimizer === 'tf.train.adam',
  )!.paramsPerSecond;
  const md = [
    `# param-server benchmark: host optimizer update rate\n`,
    `AdamW (TF.js's tf.train.adam is plain Adam) over ${o.params.toLocaleString('en-US')} parameters in 8 tensors, median of ${o.steps} steps after one warm-up step, on this machine (${cpus().length} cores, Node ${process.versions.node}). ` +
      `ParameterServer: 4 layers of 2 tensors pushed in backward order, timed from the first push until idle(). Speed-up is against tf.train.adam on wasm.\n`,
    markdownTable({
      columns: [
        'optimizer',
        'backend',
        'threads',
        'M params/s',
        'ms per step',
        'vs tf.train.adam',
      ],
      rows: rows.map((r) => [
        r.optimizer,
        r.backend,
        r.threads ?? '-',
        (r.paramsPerSecond / 1e6).toFixed(1),
        r.stepMs.toFixed(1),
        `${(r.paramsPerSecond / ref).toFixed(2)}x`,
      ]),
    }),
  ].join('\n');
  await reportBenchResults(
    o.out,
    'param-server',
    { bench: 'param-server', options: o, cores: cpus().length, rows },
    md,
    log,
  );
}

/** Adds the `param-server` command to the bench CLI (src/bench/main.ts). */
export function registerParamServerBench(program: Command): void {
  program
    .command('param-server')
    .alias('eps')
    .description(
      "update rate (parameters/s) of the eager parameter server's AdamW vs TF.js's Adam and DeviceOptimizer on wasm",
    )
    .option(
      '--params <n>',
      'parameters (a multiple of 8192)',
      positiveInteger,
      16 * 2 ** 20,
    )
    .option('--steps <n>', 'measured steps per optimizer', positiveInteger, 5)
    .option('--out <dir>', 'results folder', resultsFolder, 'bench/results')
    .action(async (o) => {
      await benchEps(o, (s) => console.log(s));
    });
}
