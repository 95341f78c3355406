/**
 * `npm run bench -- bf16-matmul`: the native addon's float32 product (oneDNN sgemm) against its
 * bf16 product (oneDNN's bf16 matmul primitive, float32 accumulation) on the products of a
 * charlm-small training step (rows = batch 32 x context 128 = 4096): forward x W, the input
 * gradient dy W^T and the weight gradient x^T dy. bf16 is timed three ways: operands already
 * bf16 (the kernel alone), the weight cached and the activation converted per product (what
 * training does: parameters are converted once per version), and both converted per product;
 * the conversion alone too. Variants alternate within each repetition and the median is kept,
 * so a contended machine slows them alike. Writes bench/results/bf16-matmul.{json,md} with the
 * CPU's ISA and oneDNN's implementation name.
 */
import { bf16Support } from '../backend/names.js';
import {
  type NativeAddon,
  nativeAddon,
  nativeUnavailable,
} from '../backend/native-addon.js';
import { LayerwiseError } from '../util/errors.js';
import { markdownTable, reportBenchResults } from './report.js';

export interface Bf16MatmulBenchOptions {
  /** Rows of the activations (batch x context). */
  rows: number;
  /** Repetitions per variant (after one warm-up each). */
  reps: number;
  /** OpenMP threads (default: the addon's team). */
  threads?: number;
  out: string;
}

/** A product: name, m, n, k, transA, transB, and which operand is the weight (cached). */
interface Shape {
  name: string;
  m: number;
  n: number;
  k: number;
  tA: boolean;
  tB: boolean;
  weight: 'a' | 'b' | 'none';
}

function shapes(rows: number): Shape[] {
  const out: Shape[] = [];
  for (const [din, dout] of [
    [256, 768],
    [256, 1024],
    [1024, 256],
  ] as const) {
    out.push(
      {
        name: `x W [${rows},${din}]x[${din},${dout}]`,
        m: rows,
        n: dout,
        k: din,
        tA: false,
        tB: false,
        weight: 'b',
      },
      {
        name: `dy W^T [${rows},${dout}]x[${din},${dout}]^T`,
        m: rows,
        n: din,
        k: dout,
        tA: false,
        tB: true,
        weight: 'b',
      },
      {
        name: `x^T dy [${rows},${din}]^T x[${rows},${dout}]`,
        m: din,
        n: dout,
        k: rows,
        tA: true,
        tB: false,
        weight: 'none',
      },
    );
  }
  return out;
}

const median = (xs: number[]) => {
  const s = [...xs].sort((a, b) => a - b);
  return s[Math.floor(s.length / 2)]!;
};

/** What bf16 runs on here: oneDNN's ISA, bf16 instructions, the line for logs. */
type Bf16Support = ReturnType<typeof bf16Support>;

/** One product's row: median ms of each variant, GFLOP/s, speed-ups over fp32, oneDNN's implementation. */
type ProductRow = ReturnType<typeof productRow>;

/** The totals over all products of each variant's median ms. */
interface Summary {
  fp32_ms: number;
  bf16_kernel_ms: number;
  bf16_training_ms: number;
  bf16_convert_both_ms: number;
}

/** A product's operands: random float32 in [-0.5, 0.5), their bf16 copies, and the output. */
interface Operands {
  a: Float32Array;
  b: Float32Array;
  c: Float32Array;
  a16: Uint16Array;
  b16: Uint16Array;
}

/**
 * Times each of charlm-small's products in every variant and writes bf16-matmul.{json,md}.
 * Throws {@link LayerwiseError} without the native addon.
 */
export async function benchBf16Matmul(
  o: Bf16MatmulBenchOptions,
  log: (s: string) => void,
): Promise<void> {
  const lib = nativeAddon();
  if (!lib)
    throw new LayerwiseError(
      `bf16-matmul needs the native addon: ${nativeUnavailable()}`,
    );
  if (o.threads !== undefined) lib.setThreads(o.threads);
  const support = bf16Support();
  log(support.note);
  const rows: Array<Record<string, number | string>> = [];
  for (const s of shapes(o.rows))
    rows.push(measureProduct(lib, s, o.reps, log));
  const summary = summaryOf(rows);
  log(
    `all products: fp32 ${summary.fp32_ms.toFixed(1)} ms, bf16 x${(summary.fp32_ms / summary.bf16_kernel_ms).toFixed(2)} (kernel), ` +
      `x${(summary.fp32_ms / summary.bf16_training_ms).toFixed(2)} (weights cached), x${(summary.fp32_ms / summary.bf16_convert_both_ms).toFixed(2)} (both converted)`,
  );
  const threads = lib.threads();
  await reportBenchResults(
    o.out,
    'bf16-matmul',
    {
      bench: 'bf16-matmul',
      options: o,
      threads,
      isa: support.isa,
      native_bf16: support.nativeBf16,
      conversion: support.conversion,
      rows,
      summary,
    },
    bf16Markdown(o, { threads, support, rows, summary }),
    log,
  );
}

/**
 * Times the product `s` on fresh random operands in every variant (alternating, `reps` times,
 * after one warm-up each) and logs its row: medians in ms and the speed-ups over fp32.
 */
function measureProduct(
  lib: NativeAddon,
  s: Shape,
  reps: number,
  log: (s: string) => void,
): ProductRow {
  const ops = operands(lib, s);
  let impl = '';
  const variants = productVariants(lib, s, ops, (name) => {
    impl = name;
  });
  const row = productRow(s, alternatingMedians(variants, reps), impl);
  log(
    `${s.name.padEnd(36)} fp32 ${row.fp32_ms.toFixed(2)} ms, bf16 ${row.bf16_kernel_ms.toFixed(2)} (x${row.speedup_kernel.toFixed(2)}), ` +
      `weight cached ${row.bf16_training_ms.toFixed(2)} (x${row.speedup_training.toFixed(2)}), both converted ${row.bf16_convert_both_ms.toFixed(2)} (x${row.speedup_convert_both.toFixed(2)}) [${impl}]`,
  );
  return row;
}

/** Random float32 operands of `s` (a: m x k, then b: k x n, from Math.random), their bf16 copies and an m x n output. */
function operands(lib: NativeAddon, s: Shape): Operands {
  const aLen = s.m * s.k;
  const bLen = s.k * s.n;
  const a = Float32Array.from({ length: aLen }, () => Math.random() - 0.5);
  const b = Float32Array.from({ length: bLen }, () => Math.random() - 0.5);
  const c = new Float32Array(s.m * s.n);
  const [a16, b16] = [new Uint16Array(aLen), new Uint16Array(bLen)];
  lib.toBf16(a, a16);
  lib.toBf16(b, b16);
  return { a, b, c, a16, b16 };
}

/**
 * The variants of product `s`, by name: fp32; bf16 on bf16 operands (`onImpl` hears oneDNN's
 * implementation name); bf16 with the weight cached and the other operand converted (training);
 * bf16 with both converted; and the conversion alone.
 */
function productVariants(
  lib: NativeAddon,
  s: Shape,
  ops: Operands,
  onImpl: (impl: string) => void,
): Record<string, () => void> {
  const { a, b, c, a16, b16 } = ops;
  const args = [1, 0, 0, s.m, s.n, s.k, s.tA, s.tB] as const;
  return {
    fp32: () => lib.matmul(a, b, c, ...args),
    bf16_kernel: () => {
      onImpl(lib.matmulBf16(a16, b16, c, ...args));
    },
    bf16_training: () =>
      lib.matmulBf16(
        s.weight === 'a' ? a16 : a,
        s.weight === 'b' ? b16 : b,
        c,
        ...args,
      ),
    bf16_convert_both: () => lib.matmulBf16(a, b, c, ...args),
    convert_activations: () => {
      // what bf16_training converts per product
      if (s.weight !== 'a') lib.toBf16(a, a16);
      if (s.weight !== 'b') lib.toBf16(b, b16);
    },
  };
}

/**
 * Runs each variant once (warm-up: primitive creation, page faults), then `reps` rounds of all
 * variants in turn; returns each variant's median milliseconds.
 */
function alternatingMedians(
  variants: Record<string, () => void>,
  reps: number,
): Record<string, number> {
  const times: Record<string, number[]> = {};
  for (const [k, f] of Object.entries(variants)) {
    f();
    times[k] = [];
  }
  for (let r = 0; r < reps; r++)
    for (const [k, f] of Object.entries(variants)) {
      const t0 = performance.now();
      f();
      times[k]!.push(performance.now() - t0);
    }
  return Object.fromEntries(
    Object.entries(times).map(([k, v]) => [k, median(v)]),
  ) as Record<string, number>;
}

/** Product `s`'s row from its variants' median milliseconds `ms`. */
function productRow(s: Shape, ms: Record<string, number>, impl: string) {
  const gflop = (2 * s.m * s.n * s.k) / 1e9;
  return {
    product: s.name,
    fp32_ms: ms.fp32!,
    bf16_kernel_ms: ms.bf16_kernel!,
    bf16_training_ms: ms.bf16_training!,
    bf16_convert_both_ms: ms.bf16_convert_both!,
    convert_ms: ms.convert_activations!,
    fp32_gflops: gflop / (ms.fp32! / 1e3),
    bf16_kernel_gflops: gflop / (ms.bf16_kernel! / 1e3),
    speedup_kernel: ms.fp32! / ms.bf16_kernel!,
    speedup_training: ms.fp32! / ms.bf16_training!,
    speedup_convert_both: ms.fp32! / ms.bf16_convert_both!,
    impl,
  };
}

/** Each variant's median ms summed over the products (`rows`). */
function summaryOf(rows: Array<Record<string, number | string>>): Summary {
  const total = (k: string) => rows.reduce((t, r) => t + (r[k] as number), 0);
  return {
    fp32_ms: total('fp32_ms'),
    bf16_kernel_ms: total('bf16_kernel_ms'),
    bf16_training_ms: total('bf16_training_ms'),
    bf16_convert_both_ms: total('bf16_convert_both_ms'),
  };
}

/** bf16-matmul.md: the setting, one table row per product, and the totals. */
function bf16Markdown(
  o: Bf16MatmulBenchOptions,
  results: {
    threads: number;
    support: Bf16Support;
    rows: Array<Record<string, number | string>>;
    summary: Summary;
  },
): string {
  const { threads, support, rows, summary } = results;
  return [
    '# bf16-matmul benchmark\n',
    `The native addon's float32 product (oneDNN sgemm) against its bf16 product (oneDNN matmul primitive, bf16 operands, float32 accumulation and output), on charlm-small's products (${o.rows} rows); median of ${o.reps} alternating repetitions, ${threads} OpenMP threads. ${support.note}. "weight cached": the weight operand already bf16, the activation converted per product, as in training; "both converted": both operands converted per product.\n`,
    markdownTable({
      columns: [
        'product',
        'fp32 ms',
        'bf16 ms (kernel)',
        'bf16 ms (weight cached)',
        'bf16 ms (both converted)',
        'conversion ms',
        'speed-up kernel',
        'speed-up weight cached',
        'speed-up both converted',
        'oneDNN implementation',
      ],
      rows: rows.map((r) => [
        r.product!,
        (r.fp32_ms as number).toFixed(2),
        (r.bf16_kernel_ms as number).toFixed(2),
        (r.bf16_training_ms as number).toFixed(2),
        (r.bf16_convert_both_ms as number).toFixed(2),
        (r.convert_ms as number).toFixed(2),
        `${(r.speedup_kernel as number).toFixed(2)}x`,
        `${(r.speedup_training as number).toFixed(2)}x`,
        `${(r.speedup_convert_both as number).toFixed(2)}x`,
        r.impl!,
      ]),
    }),
    `\nAll products: fp32 ${summary.fp32_ms.toFixed(1)} ms; bf16 ${summary.bf16_kernel_ms.toFixed(1)} ms (kernel), ${summary.bf16_training_ms.toFixed(1)} ms (weight cached), ${summary.bf16_convert_both_ms.toFixed(1)} ms (both converted).\n`,
  ].join('\n');
}
