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
import { Rng } from '../util/rng.js';
import { median } from '../util/stats.js';
import { markdownTable, writeBenchResults } from './report.js';

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
 * Throws if params is not a positive multiple of 8 x 1024.
 */
export async function benchServerUpdateRate(
  opts: { params?: number; steps?: number; log?: (s: string) => void } = {},
): Promise<ServerBenchRow[]> {
  const total = opts.params ?? 16 * 2 ** 20;
  const steps = opts.steps ?? 5;
  const log = opts.log ?? (() => undefined);
  const nTensors = 8;
  if (
    !(
      Number.isInteger(total) &&
      total > 0 &&
      total % (nTensors * TENSOR_COLS) === 0
    )
  ) {
    throw new RangeError(
      `params must be a positive multiple of ${nTensors * TENSOR_COLS}, got ${total}`,
    );
  }
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
  const lr = 1e-3;
  const rng = new Rng(1);
  const init = new Float32Array(per).map(() => rng.normal() * 0.02);
  const grad = new Float32Array(per).map(() => rng.normal() * 1e-3);
  const rows: ServerBenchRow[] = [];
  const record = (
    optimizer: string,
    backend: string,
    times: number[],
    threads?: number,
  ) => {
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

  /** Times `update` (one step t over every tensor, in this thread) on fresh copies: `steps` steps after one warm-up. */
  const timeHostSteps = (update: typeof hostUpdate): number[] => {
    const ps = keys.map(() => init.slice());
    const gs = keys.map(() => grad.slice());
    const slots = keys.map(() => ({
      m: new Float32Array(per),
      v: new Float32Array(per),
    }));
    const times: number[] = [];
    for (let t = 1; t <= steps + 1; t++) {
      const t0 = performance.now();
      for (let i = 0; i < nTensors; i++)
        update(cfg, 2, ps[i]!, gs[i]!, slots[i]!, lr, 1, t);
      if (t > 1) times.push(performance.now() - t0);
    }
    return times;
  };

  // (a) hostUpdate in this thread
  record('hostUpdate (main thread)', 'host', timeHostSteps(hostUpdate));

  // (a') the native addon's AdamW in this thread, on 1 and 2 OpenMP threads
  const lib = nativeAddon();
  if (lib) {
    for (const threads of [1, 2]) {
      lib.setThreads(threads);
      record(
        'native adamw (main thread)',
        'host',
        timeHostSteps((...args) => nativeHostUpdate(lib, ...args)),
        threads,
      );
    }
    lib.setThreads(availableParallelism());
  } else {
    log(`native adamw: skipped (${nativeUnavailable()})`);
  }

  // (b) the parameter server, 1 and 2 optimizer threads
  for (const threads of [1, 2]) {
    const params: HostParams = new Map(keys.map((k) => [k, init]));
    const server = await ParameterServer.create({
      params,
      layers,
      shapes,
      optimizer: cfg,
      threads,
    });
    try {
      const times: number[] = [];
      for (let t = 1; t <= steps + 1; t++) {
        const grads = layers.map((ks) =>
          Object.fromEntries(ks.map((k) => [k, grad.slice()])),
        );
        const t0 = performance.now();
        server.beginStep(lr);
        for (let l = layers.length - 1; l >= 0; l--)
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

  // (c) TF.js's Adam and (d) DeviceOptimizer, on wasm
  await initBackend('wasm');
  const vars = keys.map((k) => {
    const t0 = tf.tensor(init, shape);
    const v = tf.variable(t0, true, `eps_bench_${k}`);
    t0.dispose();
    return v;
  });
  const gts = keys.map(() => tf.tensor(grad, shape));
  try {
    {
      const adam = tf.train.adam(lr, cfg.beta1, cfg.beta2, cfg.epsilon);
      const named = vars.map((v, i) => ({ name: v.name, tensor: gts[i] }));
      const times: number[] = [];
      for (let t = 1; t <= steps + 1; t++) {
        const t0 = performance.now();
        adam.applyGradients(named);
        if (t > 1) times.push(performance.now() - t0);
      }
      adam.dispose();
      record('tf.train.adam', 'wasm', times);
    }
    {
      const dev = new DeviceOptimizer(cfg);
      const pm = new Map(keys.map((k, i) => [k, vars[i]]));
      const gm = new Map<string, tf.Tensor>(keys.map((k, i) => [k, gts[i]]));
      const times: number[] = [];
      for (let t = 1; t <= steps + 1; t++) {
        const t0 = performance.now();
        dev.apply(pm, gm, lr, 1);
        if (t > 1) times.push(performance.now() - t0);
      }
      dev.dispose();
      record('DeviceOptimizer (AdamW)', 'wasm', times);
    }
  } finally {
    for (const v of vars) v.dispose();
    for (const g of gts) g.dispose();
  }
  return rows;
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
  const files = await writeBenchResults(
    o.out,
    'param-server',
    { bench: 'param-server', options: o, cores: cpus().length, rows },
    md,
  );
  log(`wrote ${files.join(', ')}`);
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
      (v) => Number(v),
      16 * 2 ** 20,
    )
    .option('--steps <n>', 'measured steps per optimizer', (v) => Number(v), 5)
    .option('--out <dir>', 'results folder', 'bench/results')
    .action(async (o) => {
      await benchEps(o, (s) => console.log(s));
    });
}
