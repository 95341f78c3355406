/**
 * `npm run bench -- l2l-max`: one large character Transformer trained for a few full L2L steps
 * on Moby-Dick on this machine, to find how large a model one device trains when only one
 * layer at a time lives on it. Defaults: 22 layers of width 2048, 1.1 billion parameters,
 * 4.4 GB of fp32 parameters. That is more than the wasm backend's whole 4 GiB heap, and
 * 13 GB with AdamW's two moments, all of it in the parameter server's host memory.
 * Reports, per step: seconds, loss, the device's peak tensor bytes, and the wasm heap size;
 * then the host's resident set size.
 *
 * Host memory is the limit here. The initial values are drawn straight into shared memory,
 * which the parameter server adopts without a copy, and clipping is off by default: with
 * clipping, the server holds the whole step's gradient (4 more bytes per parameter) until the
 * global norm is known.
 */
import { type Batch, makeBatcher } from '../data/batcher.js';
import { loadDataset } from '../data/index.js';
import { initParams } from '../model/init.js';
import { buildModel, type Model, modelParamCount } from '../model/model.js';
import { defaultOptimizerConfig } from '../optim/optimizer.js';
import { L2LStrategy } from '../strategies/l2l.js';
import { formatSize } from '../util/size.js';
import { markdownTable, reportBenchResults } from './report.js';

export interface L2LMaxOptions {
  layers: number;
  dModel: number;
  heads: number;
  context: number;
  batchSize: number;
  microBatches: number;
  steps: number;
  clipNorm: number;
  serverThreads: number;
  /** Learning rate (AdamW). */
  lr: number;
  backend: string;
  out: string;
}

/** One training step's figures. */
interface StepRow {
  step: number;
  seconds: number;
  loss: number;
  peak_device_bytes: number;
  wasm_heap_bytes: number | null;
  /** Seconds the device waited for the parameter server. */
  device_wait_s: number;
}

/** Runs the steps and writes l2l-max.json and l2l-max.md. Throws if moby-dick does not load as text. */
export async function benchL2LMax(
  o: L2LMaxOptions,
  log: (s: string) => void,
): Promise<void> {
  const ds = await loadDataset('moby-dick');
  if (ds.kind !== 'text') throw new Error('moby-dick is a text data set');
  const config = maxModelConfig(o, ds.vocab.size);
  const model = buildModel(config);
  const n = modelParamCount(model);
  log(
    `model: ${o.layers} layers x d ${o.dModel}, ${n.toLocaleString('en-US')} parameters, ${formatSize(4 * n)} fp32 (${((4 * n) / 1e9).toFixed(2)} GB); AdamW state ${formatSize(8 * n)}`,
  );
  const s = await startRelay(o, config, model, log);
  let steps: StepRow[];
  try {
    const batcher = makeBatcher(ds, {
      batchSize: o.batchSize,
      context: o.context,
      seed: 1,
    });
    steps = await trainSteps(o, s, () => batcher.next(), log);
    await settle(s, log);
  } finally {
    await s.close();
  }
  const rss = process.memoryUsage().rss;
  log(`host resident set: ${formatSize(rss)}`);
  await reportBenchResults(
    o.out,
    'l2l-max',
    {
      bench: 'l2l-max',
      options: o,
      params: n,
      param_bytes: 4 * n,
      steps,
      host_rss_bytes: rss,
    },
    l2lMaxMarkdown(o, n, rss, steps),
    log,
  );
}

/** The large character Transformer of `o` over a vocabulary of `vocab` characters. */
function maxModelConfig(o: L2LMaxOptions, vocab: number) {
  return {
    arch: 'charlm' as const,
    layers: o.layers,
    dModel: o.dModel,
    heads: o.heads,
    context: o.context,
    vocab,
  };
}

/**
 * Draws the initial parameters straight into shared memory and starts the L2L relay (AdamW,
 * host stash) whose parameter server adopts them without a copy; logs how long each took.
 */
async function startRelay(
  o: L2LMaxOptions,
  config: ReturnType<typeof maxModelConfig>,
  model: Model,
  log: (s: string) => void,
): Promise<L2LStrategy> {
  let t = performance.now();
  const params = initParams(model.blocks, 1, 0, model.blocks.length, {
    shared: true,
  });
  log(`initialised in ${((performance.now() - t) / 1000).toFixed(1)} s`);
  const optimizer = {
    ...defaultOptimizerConfig('adamw'),
    clipNorm: o.clipNorm,
  };
  t = performance.now();
  const s = await L2LStrategy.create(
    {
      backend: o.backend,
      model: config,
      microBatches: o.microBatches,
      optimizer,
      stash: 'host',
      serverThreads: o.serverThreads,
      adoptParams: true,
    },
    model,
    params,
  );
  params.clear(); // the parameter server owns the memory now
  log(
    `parameter server and device started in ${((performance.now() - t) / 1000).toFixed(1)} s`,
  );
  return s;
}

/** `o.steps` training steps at `o.lr` on `next()`'s batches (no warm-up); logs and returns each step's figures. */
async function trainSteps(
  o: L2LMaxOptions,
  s: L2LStrategy,
  next: () => Batch,
  log: (s: string) => void,
): Promise<StepRow[]> {
  const steps: StepRow[] = [];
  for (let i = 0; i < o.steps; i++) {
    const t = performance.now();
    const r = await s.trainStep(next(), o.lr);
    const seconds = (performance.now() - t) / 1000;
    const row = {
      step: i + 1,
      seconds,
      loss: r.loss,
      peak_device_bytes: r.peakBytes[0],
      wasm_heap_bytes: r.heapBytes?.[0] ?? null,
      device_wait_s: r.bubble[0] * r.stageSeconds[0],
    };
    steps.push(row);
    log(
      `step ${row.step}: ${seconds.toFixed(1)} s, loss ${r.loss.toFixed(4)}, peak device ${formatSize(row.peak_device_bytes)}, ` +
        `wasm heap ${row.wasm_heap_bytes === null ? '-' : formatSize(row.wasm_heap_bytes)}, device waited ${row.device_wait_s.toFixed(1)} s for the parameter server`,
    );
  }
  return steps;
}

/** Waits until the parameter server has applied the last step's updates; logs how long that took. */
async function settle(s: L2LStrategy, log: (s: string) => void): Promise<void> {
  const t = performance.now();
  await (s as unknown as { settle(): Promise<void> }).settle();
  log(
    `last updates applied ${((performance.now() - t) / 1000).toFixed(1)} s after the last step`,
  );
}

/** l2l-max.md: the model, setting and host resident set (`rss`, bytes), then one table row per step. */
function l2lMaxMarkdown(
  o: L2LMaxOptions,
  n: number,
  rss: number,
  steps: StepRow[],
): string {
  return [
    `# l2l: the largest model trained on one device\n`,
    `charlm ${o.layers} layers x d_model ${o.dModel} (${o.heads} heads, context ${o.context}), ${n.toLocaleString('en-US')} parameters = ${((4 * n) / 1e9).toFixed(2)} GB (${formatSize(4 * n)}) of fp32 parameters, ` +
      `plus ${formatSize(8 * n)} of AdamW moments in the parameter server. Mini-batch ${o.batchSize} x ${o.context} tokens of Moby-Dick, ${o.microBatches} micro-batch(es), stash in host memory, ` +
      `AdamW lr ${o.lr}, clip-norm ${o.clipNorm}, ${o.serverThreads} optimizer thread(s), backend ${o.backend}. Host resident set at the end: ${formatSize(rss)}.\n`,
    markdownTable({
      columns: [
        'step',
        'seconds',
        'loss',
        'peak device tensors',
        'wasm heap',
        'device waiting for the PS (s)',
      ],
      rows: steps.map((r) => [
        r.step,
        r.seconds.toFixed(1),
        r.loss.toFixed(4),
        formatSize(r.peak_device_bytes),
        r.wasm_heap_bytes === null ? '-' : formatSize(r.wasm_heap_bytes),
        r.device_wait_s.toFixed(1),
      ]),
    }),
  ].join('\n');
}
