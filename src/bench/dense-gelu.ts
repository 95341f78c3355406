/**
 * `npm run bench -- dense-gelu`: the MLP's product + bias + GELU on webgpu as one op
 * (model/layers.ts denseGelu: one dispatch, backend/webgpu-matmul-gelu.ts) against `dense` then
 * `gelu` (two), on a Transformer MLP's first product: x [rows, d] times w [d, 4d] (default
 * charlm-small's at batch 8: rows 1,024, d 256). The forward alone and forward + backward
 * (tf.grads: the gradient's kernels, the same for both but for dense then gelu's reshapes) are
 * each timed over `reps` calls to the read of the last, the two variants alternated for
 * `rounds` rounds (the median reported: other processes share the machine); and the dispatches
 * of one call are counted (backend/gpu-queue.ts). Writes dense-gelu.json and dense-gelu.md.
 */
import { gpuQueue } from '../backend/gpu-queue.js';
import { initBackend } from '../backend/index.js';
import { tf } from '../backend/tfjs.js';
import { installDawn } from '../backend/webgpu.js';
import { dense, denseGelu, gelu } from '../model/layers.js';
import { markdownTable, writeBenchResults } from './report.js';

export interface DenseGeluBenchOptions {
  /** Activation rows (batch x context) and model width d (the product is [rows, d] x [d, 4d]). */
  rows: number;
  d: number;
  /** Calls per timing, and timings per variant (alternated). */
  reps: number;
  rounds: number;
  out: string;
}

type Op = (x: tf.Tensor, w: tf.Tensor, b: tf.Tensor) => tf.Tensor;

const VARIANTS: Array<[name: string, op: Op]> = [
  ['denseGelu (fused)', denseGelu],
  ['dense then gelu', (x, w, b) => gelu(dense(x, w, b))],
];

/** One call of `op`, forward only or with tf.grads's backward; returns what to read. */
function call(op: Op, xs: tf.Tensor[], dy: tf.Tensor, backward: boolean) {
  const [x, w, b] = xs as [tf.Tensor, tf.Tensor, tf.Tensor];
  return backward ? tf.grads(op)([x, w, b], dy) : [op(x, w, b)];
}

/** Seconds per call over `reps` calls, timed to the read of the last call's outputs. */
async function time(
  op: Op,
  xs: tf.Tensor[],
  dy: tf.Tensor,
  backward: boolean,
  reps: number,
): Promise<number> {
  let outs: tf.Tensor[] = [];
  const t0 = performance.now();
  for (let i = 0; i < reps; i++) {
    tf.dispose(outs);
    outs = tf.tidy(() => call(op, xs, dy, backward));
  }
  await Promise.all(outs.map((t) => t.data()));
  const s = (performance.now() - t0) / 1000 / reps;
  tf.dispose(outs);
  return s;
}

/** Dispatches of one call. */
async function dispatches(
  op: Op,
  xs: tf.Tensor[],
  dy: tf.Tensor,
  backward: boolean,
) {
  const before = gpuQueue()!.counts().dispatches;
  const outs = tf.tidy(() => call(op, xs, dy, backward));
  const n = gpuQueue()!.counts().dispatches - before;
  await Promise.all(outs.map((t) => t.data()));
  tf.dispose(outs);
  return n;
}

const median = (v: number[]) =>
  [...v].sort((a, b) => a - b)[Math.floor(v.length / 2)]!;

export async function benchDenseGelu(
  o: DenseGeluBenchOptions,
  log: (s: string) => void,
): Promise<void> {
  const adapter = await installDawn();
  await initBackend('webgpu');
  log(
    `adapter: ${adapter.description}; x [${o.rows}, ${o.d}] w [${o.d}, ${4 * o.d}]`,
  );
  const xs = [
    tf.randomNormal([o.rows, o.d], 0, 1, 'float32', 1),
    tf.randomNormal([o.d, 4 * o.d], 0, 1 / Math.sqrt(o.d), 'float32', 2),
    tf.randomNormal([4 * o.d], 0, 0.1, 'float32', 3),
  ];
  const dy = tf.randomNormal([o.rows, 4 * o.d], 0, 1, 'float32', 4);
  const rows: Array<{
    variant: string;
    pass: string;
    ms: number;
    ms_all: number[];
    dispatches: number;
  }> = [];
  for (const backward of [false, true]) {
    const pass = backward ? 'forward + backward' : 'forward';
    const all = VARIANTS.map(() => [] as number[]);
    for (const [, op] of VARIANTS) await time(op, xs, dy, backward, 1); // compile
    for (let r = 0; r < o.rounds; r++)
      for (const [i, [, op]] of VARIANTS.entries())
        all[i]!.push(1000 * (await time(op, xs, dy, backward, o.reps)));
    for (const [i, [variant, op]] of VARIANTS.entries()) {
      const n = await dispatches(op, xs, dy, backward);
      rows.push({
        variant,
        pass,
        ms: median(all[i]!),
        ms_all: all[i]!,
        dispatches: n,
      });
      log(
        `${pass}, ${variant}: ${median(all[i]!).toFixed(2)} ms (${all[i]!.map((v) => v.toFixed(2)).join(' ')}), ${n} dispatches`,
      );
    }
  }
  tf.dispose([...xs, dy]);
  const md =
    `# The MLP's product + bias + GELU on webgpu: one op vs dense then gelu\n\n` +
    `Adapter: ${adapter.description}. x [${o.rows}, ${o.d}] times w [${o.d}, ${4 * o.d}] plus b [${4 * o.d}], then GELU. ` +
    `Median over ${o.rounds} rounds (variants alternated) of the mean of ${o.reps} calls timed to the read of the last; ` +
    'the machine was shared with other processes.\n\n' +
    markdownTable({
      columns: [
        'pass',
        'variant',
        'ms per call (median)',
        'min - max',
        'dispatches per call',
      ],
      rows: rows.map((r) => [
        r.pass,
        r.variant,
        r.ms.toFixed(1),
        `${Math.min(...r.ms_all).toFixed(1)} - ${Math.max(...r.ms_all).toFixed(1)}`,
        r.dispatches,
      ]),
    });
  const files = await writeBenchResults(
    o.out,
    'dense-gelu',
    { adapter, options: o, rows },
    md,
  );
  log(`wrote ${files.join(', ')}`);
}
