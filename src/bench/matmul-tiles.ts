/**
 * `npm run bench -- matmul-tiles`: layerwise's webgpu product (backend/webgpu-matmul.ts) in
 * each tiling of wgsl/matmul.ts TILINGS, forced (forceProductTiling), on the products of the
 * 8 x d1024 model at batch 32 x context 256 (issue 36's large model: 8,192 rows), forward and
 * gradient forms, beside the tiling the size rule picks ("auto"). Each (shape, tiling) runs a
 * warm-up product (shader compilation), then `reps` products of the same operands timed to the
 * read of one element of the last (a slice: the queue runs in order; reading the whole output
 * would time the read-back); the tilings of a shape are alternated over `rounds` rounds
 * (report.ts inRotatedRounds) and the median reported, as TFLOP/s (2 M N K per product). Each
 * tiling's output is checked against the 64 x 64 tiling's (worst difference scaled as the
 * tests do). Writes matmul-tiles.json and matmul-tiles.md.
 */
import { initBackend } from '../backend/index.js';
import { tf } from '../backend/tfjs.js';
import { installDawn } from '../backend/webgpu.js';
import { forceProductTiling, productTiling } from '../backend/webgpu-matmul.js';
import { TILINGS } from '../backend/wgsl/matmul.js';
import { LayerwiseError } from '../util/errors.js';
import { median, scaledDifference } from '../util/stats.js';
import { inRotatedRounds, markdownTable, writeBenchResults } from './report.js';

/** One product: C [m, n] = op(A) op(B) with inner size k; `tA` / `tB` the operand stored transposed. */
export interface TileShape {
  m: number;
  k: number;
  n: number;
  tA: boolean;
  tB: boolean;
}

/**
 * The 8 x d1024 model's products at 8,192 rows, as "MxKxN" with a T after the transposed
 * operand's letter: the MLP's x w1 and h w2, the attention projections, their input gradients
 * (dy w^T) and weight gradients (x^T dy).
 */
export const MODEL_SHAPES = [
  '8192x1024x4096',
  '8192x4096x1024',
  '8192x1024x1024',
  '8192x4096x1024:tB',
  '8192x1024x4096:tB',
  '1024x8192x4096:tA',
  '4096x8192x1024:tA',
  '1024x8192x1024:tA',
];

/**
 * Parses "MxKxN" with optional suffixes ":tA", ":tB" (or ":tA:tB", ":tAtB").
 * @throws LayerwiseError naming the text when it is not of that form.
 */
export function parseTileShape(text: string): TileShape {
  const [size = '', ...flags] = text.split(':');
  const m = /^(\d+)x(\d+)x(\d+)$/.exec(size);
  const given = flags.join('');
  if (!m || !['', 'tA', 'tB', 'tAtB'].includes(given))
    throw new LayerwiseError(
      `--shapes: '${text}' is not MxKxN, MxKxN:tA, :tB or :tA:tB`,
    );
  return {
    m: Number(m[1]),
    k: Number(m[2]),
    n: Number(m[3]),
    tA: given.startsWith('tA'),
    tB: given.endsWith('tB'),
  };
}

export interface MatMulTilesOptions {
  /** Shapes (see {@link parseTileShape}) and tiling names (TILINGS' keys). */
  shapes: string[];
  tilings: string[];
  /** Products per timing, and timings per tiling (alternated). */
  reps: number;
  rounds: number;
  out: string;
}

/** Seconds per product over `reps` products, to the read of one element of the last. */
async function time(
  a: tf.Tensor,
  b: tf.Tensor,
  s: TileShape,
  reps: number,
): Promise<number> {
  let out: tf.Tensor | undefined;
  const t0 = performance.now();
  for (let i = 0; i < reps; i++) {
    out?.dispose();
    out = tf.matMul(a, b, s.tA, s.tB);
  }
  const corner = tf.slice(out!, [0, 0], [1, 1]);
  await corner.data();
  const seconds = (performance.now() - t0) / 1000 / reps;
  tf.dispose([out!, corner]);
  return seconds;
}

/** One (shape, tiling) result. */
interface TileRow {
  shape: string;
  tiling: string;
  /** Whether the size rule picks this tiling for the shape. */
  auto: boolean;
  ms: number;
  ms_all: number[];
  tflops: number;
  /** Scaled worst difference of its output from the 64 x 64 tiling's. */
  worst_vs_t64: number;
}

/** Every tiling of `o` on one shape: checked against t64, then timed in rotated rounds. */
async function measureShape(
  text: string,
  o: MatMulTilesOptions,
): Promise<TileRow[]> {
  const s = parseTileShape(text);
  const auto = productTiling(s.m, s.n, 1).name;
  const a = tf.randomNormal(s.tA ? [s.k, s.m] : [s.m, s.k], 0, 1, 'float32', 1);
  const b = tf.randomNormal(s.tB ? [s.n, s.k] : [s.k, s.n], 0, 1, 'float32', 2);
  try {
    // each tiling's output against the 64 x 64 one's (and the warm-up: compilation)
    const product = async (tiling: string) => {
      forceProductTiling(tiling);
      const c = tf.matMul(a, b, s.tA, s.tB);
      const v = (await c.data()) as Float32Array;
      c.dispose();
      return v;
    };
    const want = await product('t64');
    const worst: number[] = [];
    for (const t of o.tilings)
      worst.push(scaledDifference(await product(t), want).worst);
    const ms = await inRotatedRounds(o.tilings.length, o.rounds, (i) => {
      forceProductTiling(o.tilings[i]);
      return time(a, b, s, o.reps).then((sec) => 1000 * sec);
    });
    return o.tilings.map((tiling, i) => {
      const med = median(ms[i]!);
      return {
        shape: text,
        tiling,
        auto: tiling === auto,
        ms: med,
        ms_all: ms[i]!,
        tflops: (2 * s.m * s.n * s.k) / (med / 1000) / 1e12,
        worst_vs_t64: worst[i]!,
      };
    });
  } finally {
    forceProductTiling(undefined);
    tf.dispose([a, b]);
  }
}

/** The results as Markdown. */
function markdown(adapter: string, o: MatMulTilesOptions, rows: TileRow[]) {
  return (
    '# layerwise webgpu products by tiling\n\n' +
    `Adapter: ${adapter}. \`npm run bench -- matmul-tiles\`: each tiling of wgsl/matmul.ts TILINGS forced; ` +
    `median over ${o.rounds} rounds (tilings alternated) of the mean of ${o.reps} products timed to the read of one element of the last; ` +
    '"auto": the tiling the size rule picks (backend/webgpu-matmul.ts productTiling). Shapes MxKxN, :tA / :tB an operand stored transposed.\n\n' +
    markdownTable({
      columns: [
        'shape',
        'tiling',
        'auto',
        'ms per product (median)',
        'min - max',
        'TFLOP/s',
        'worst vs t64',
      ],
      rows: rows.map((r) => [
        r.shape,
        r.tiling,
        r.auto ? 'yes' : '',
        r.ms.toFixed(3),
        `${Math.min(...r.ms_all).toFixed(3)} - ${Math.max(...r.ms_all).toFixed(3)}`,
        r.tflops.toPrecision(3),
        r.worst_vs_t64.toExponential(1),
      ]),
    })
  );
}

/**
 * Runs the bench (see the module's comment) and writes its results under `o.out`.
 * @throws LayerwiseError when a shape does not parse or a tiling is unknown (before any work).
 */
export async function benchMatMulTiles(
  o: MatMulTilesOptions,
  log: (s: string) => void,
): Promise<void> {
  o.shapes.forEach(parseTileShape);
  for (const t of o.tilings)
    if (!(t in TILINGS))
      throw new LayerwiseError(
        `--tilings: unknown '${t}' (valid: ${Object.keys(TILINGS).join(', ')})`,
      );
  const adapter = await installDawn();
  await initBackend('webgpu');
  log(`adapter: ${adapter.description}`);
  const rows: TileRow[] = [];
  for (const text of o.shapes)
    for (const r of await measureShape(text, o)) {
      rows.push(r);
      log(
        `${r.shape} ${r.tiling}${r.auto ? ' (auto)' : ''}: ${r.ms.toFixed(3)} ms, ${r.tflops.toPrecision(3)} TFLOP/s (${r.ms_all.map((v) => v.toFixed(3)).join(' ')}), vs t64 ${r.worst_vs_t64.toExponential(1)}`,
      );
    }
  const files = await writeBenchResults(
    o.out,
    'matmul-tiles',
    { adapter, options: o, rows },
    markdown(adapter.description, o, rows),
  );
  log(`wrote ${files.join(', ')}`);
}
