/**
 * layerwise's products on webgpu (backend/webgpu-matmul.ts): BatchMatMul and _FusedMatMul, and
 * the gradients of both (matmul-grad.ts: products again, and sums over broadcast axes), give
 * the cpu backend's results within 1e-4 of their scale for 2-D, batched and broadcast-batch
 * operands, both transposes, sizes that are not multiples of the tiles, every bias layout the
 * kernel takes and its fused activations, each product (and each column sum of a bias's or a
 * broadcast operand's gradient, backend/webgpu-matmul-bias.ts) in one program of ours, in every
 * tiling (wgsl/matmul.ts TILINGS, forced); products with at least 256 large tiles take the
 * 128 x 128 tiling, the others the 64 x 64 one (by program key); what they leave to TF.js's
 * stock kernels (prelu, other sums) still gives the cpu's results. Under an f16 policy the
 * products equal the cpu product of the f16-rounded operands, in both tilings.
 * Skipped, saying why, where no WebGPU adapter can be made.
 */

import assert from 'node:assert/strict';
import { test } from 'node:test';
import { randomArray, scaledDifference } from '../testing/backend-compare.js';
import { noShaderF16 } from '../testing/webgpu.js';
import { gpuQueue } from './gpu-queue.js';
import { initBackend } from './index.js';
import { policyOf } from './precision.js';
import { tf } from './tfjs.js';
import { installDawn } from './webgpu.js';
import {
  forceProductTiling,
  LARGE_TILE_MIN_WORKGROUPS,
  planProduct,
  productTiling,
  suffixBatches,
} from './webgpu-matmul.js';
import { columnSumPlan } from './webgpu-matmul-bias.js';
import { checkTiling, TILINGS } from './wgsl/matmul.js';

let why: string | false = false;
try {
  await installDawn();
} catch (e) {
  why = `no WebGPU adapter here: ${(e as Error).message}`;
}

let seed = 1;
const rand = (shape: number[]) =>
  tf.tensor(randomArray(tf.util.sizeFromShape(shape), seed++), shape);

/** A product case: operand shapes, transposes, the bias's shape and the activation (fused when either is given). */
interface Case {
  a: number[];
  b: number[];
  ta?: boolean;
  tb?: boolean;
  bias?: number[];
  activation?: string;
  /** prelu's weights' shape (activation 'prelu'; the forward only). */
  prelu?: number[];
  /** Column sums of ours the gradient runs (a bias [N], a broadcast operand's batch sum). */
  sums?: number;
  /** The forward only (no gradient). */
  forwardOnly?: boolean;
}

const name = (c: Case) =>
  `${c.a}${c.ta ? 'T' : ''} x ${c.b}${c.tb ? 'T' : ''}${c.bias ? ` + [${c.bias}]` : ''}${c.activation ? ` ${c.activation}` : ''}`;

/** The output, then each input's gradient for a random dy (the registered gradients' kernels). */
function outputs(c: Case): tf.Tensor[] {
  const a = rand(c.a);
  const b = rand(c.b);
  const bias = c.bias ? rand(c.bias) : undefined;
  const prelu = c.prelu ? rand(c.prelu) : undefined;
  const fused = bias !== undefined || c.activation !== undefined;
  const attrs = {
    transposeA: c.ta ?? false,
    transposeB: c.tb ?? false,
    activation: c.activation ?? 'linear',
    leakyreluAlpha: 0.3,
  };
  const f = (...xs: tf.Tensor[]) =>
    tf.engine().runKernel(
      fused ? '_FusedMatMul' : 'BatchMatMul',
      {
        a: xs[0]!,
        b: xs[1]!,
        ...(bias ? { bias: xs[2]! } : {}),
        ...(prelu ? { preluActivationWeights: prelu } : {}),
      },
      attrs,
    ) as tf.Tensor;
  const y = f(a, b, ...(bias ? [bias] : []));
  // the gradient takes linear only
  if ((c.activation ?? 'linear') !== 'linear' || c.forwardOnly) return [y];
  const dy = rand(y.shape);
  const grads = tf.grads((...xs: tf.Tensor[]) => tf.sum(tf.mul(f(...xs), dy)));
  return [y, ...grads(bias ? [a, b, bias] : [a, b])];
}

/**
 * Runs `f` counting what ran on webgpu (nothing elsewhere): programs of ours (TF.js programs
 * keyed 'lw_', and dispatches of ours outside TF.js's programs: those gpu-queue.ts counts beyond
 * the programs, such as the column sums) and every program's key.
 */
async function counting<T>(
  f: () => Promise<T>,
): Promise<{ result: T; ours: number; keys: string[] }> {
  const b = tf.backend() as unknown as {
    runWebGPUProgram?: (...a: unknown[]) => unknown;
  };
  const q = gpuQueue(); // hooks the backend first, so the hook below sees its programs
  const own = b.runWebGPUProgram;
  let ours = 0;
  const keys: string[] = [];
  if (own)
    b.runWebGPUProgram = (...args: unknown[]) => {
      const key = (args[0] as { shaderKey: string }).shaderKey;
      if (key.startsWith('lw_')) ours++;
      keys.push(key);
      return own.apply(b, args);
    };
  const before = q?.counts().dispatches ?? 0;
  try {
    const result = await f();
    const raw = (q?.counts().dispatches ?? 0) - before - keys.length;
    return { result, ours: ours + raw, keys };
  } finally {
    if (own) b.runWebGPUProgram = own;
  }
}

/** Runs `c` on the current backend: outputs' shapes and values, how many programs of ours ran and their keys. */
async function results(c: Case) {
  seed = 1;
  const { result, ours, keys } = await counting(async () => {
    const outs = tf.tidy(() => outputs(c));
    const values = await Promise.all(outs.map((t) => t.data()));
    const shapes = outs.map((t) => t.shape);
    tf.dispose(outs);
    return { values, shapes };
  });
  return { ...result, ours, keys };
}

/** Covered cases: each product (forward, dA, dB) is one program of ours. */
const COVERED: Case[] = [
  { a: [5, 7], b: [7, 3] },
  { a: [70, 33], b: [33, 130] },
  { a: [33, 70], b: [33, 65], ta: true },
  { a: [70, 33], b: [65, 33], tb: true },
  { a: [17, 70], b: [65, 17], ta: true, tb: true },
  { a: [3, 67, 19], b: [3, 19, 66] },
  { a: [2, 3, 67, 19], b: [19, 66] }, // b broadcast over both batch axes
  { a: [1, 67, 19], b: [4, 19, 66], sums: 1 }, // a broadcast
  { a: [3, 19, 67], b: [2, 3, 66, 19], ta: true, tb: true, sums: 1 }, // a's batch a suffix of the output's
  { a: [1, 130, 20], b: [1, 20, 70], bias: [70], sums: 1 },
  { a: [2, 65, 20], b: [20, 70], bias: [65, 1] },
  { a: [2, 65, 20], b: [2, 70, 20], tb: true, bias: [2, 65, 70] },
  { a: [65, 20], b: [20, 70], bias: [1] },
  { a: [2, 33, 20], b: [20, 70], bias: [70], activation: 'relu' },
  { a: [33, 20], b: [20, 70], activation: 'relu6' },
  { a: [33, 20], b: [20, 70], bias: [70], activation: 'elu' },
  { a: [33, 20], b: [20, 70], bias: [70], activation: 'leakyrelu' },
  { a: [33, 20], b: [20, 70], bias: [70], activation: 'sigmoid' },
];

/** Programs of ours per case: the forward, plus where the gradient runs (linear) tf.grads's forward, dA, dB and the column sums. */
const programsOf = (c: Case) =>
  (c.activation ?? 'linear') !== 'linear' ? 1 : 4 + (c.sums ?? 0);

async function compare(c: Case, expectOurs?: number) {
  await initBackend('cpu');
  const cpu = await results(c);
  await initBackend('webgpu');
  const gpu = await results(c);
  assert.deepEqual(gpu.shapes, cpu.shapes, `${name(c)}: shapes`);
  gpu.values.forEach((v, i) => {
    const { worst } = scaledDifference(v, cpu.values[i]!);
    assert.ok(worst <= 1e-4, `${name(c)}: output ${i} differs by ${worst}`);
  });
  if (expectOurs !== undefined)
    assert.equal(gpu.ours, expectOurs, `${name(c)}: programs of ours`);
  return gpu.keys;
}

/** Cases past the 128 x 128 tile: several tiles along M and N, edges in M, N and K (not multiples of 8 or 16). */
const LARGE_EDGES: Case[] = [
  { a: [200, 37], b: [37, 300] },
  { a: [37, 200], b: [300, 37], ta: true, tb: true },
  { a: [37, 129], b: [37, 257], ta: true },
  { a: [2, 130, 19], b: [19, 259], bias: [259], activation: 'relu' },
  { a: [1, 129, 9], b: [3, 9, 140], sums: 1 },
  { a: [2, 140, 24], b: [2, 131, 24], tb: true, bias: [2, 140, 131] },
  { a: [150, 40], b: [40, 133], bias: [150, 1], activation: 'leakyrelu' },
];

test('every tiling, forced, equals the cpu backend on every covered case and edges past its tile, forward and gradient', {
  skip: why,
}, async () => {
  try {
    for (const [tiling, t] of Object.entries(TILINGS)) {
      checkTiling(t);
      forceProductTiling(tiling);
      for (const c of [...COVERED, ...LARGE_EDGES]) {
        const keys = await compare(c, programsOf(c));
        const products = keys.filter((k) => k.startsWith('lw_matmul_'));
        assert.ok(
          products.length > 0 &&
            products.every((k) => k.startsWith(`lw_matmul_${tiling}_`)),
          `${name(c)}: programs ${products} are not all ${tiling}'s`,
        );
      }
    }
  } finally {
    forceProductTiling(undefined);
  }
});

test(`products of at least ${LARGE_TILE_MIN_WORKGROUPS} 128 x 128 tiles take the large tiling (by program key), smaller ones the 64 x 64 one`, {
  skip: why,
}, async () => {
  // the 8 x d1024 model's products (batch 32 x context 256 = 8,192 rows)
  assert.equal(productTiling(8192, 4096, 1).name, 't128');
  assert.equal(productTiling(8192, 1024, 1).name, 't128');
  assert.equal(productTiling(1024, 4096, 1).name, 't128'); // 256 tiles
  assert.equal(productTiling(1024, 1024, 1).name, 't64'); // 64 tiles
  assert.equal(productTiling(1024, 1000, 1).name, 't64');
  assert.equal(productTiling(129, 129, 64).name, 't128'); // 2 x 2 x 64
  assert.equal(productTiling(128, 128, 255).name, 't64');
  // run: 2 x 2 tiles of 128 a batch, 64 batches (256 workgroups) vs 63 (252)
  for (const [batch, want] of [
    [64, 't128'],
    [63, 't64'],
  ] as const) {
    const c: Case = {
      a: [batch, 130, 8],
      b: [batch, 8, 129],
      forwardOnly: true,
    };
    const keys = await compare(c, 1);
    const product = keys.find((k) => k.startsWith('lw_matmul_'));
    assert.ok(
      product?.startsWith(`lw_matmul_${want}_`),
      `${name(c)}: ${product}, not ${want}`,
    );
  }
  assert.throws(() => forceProductTiling('t256'), /t64, t128/);
  forceProductTiling('auto');
  assert.equal(productTiling(1024, 1024, 1).name, 't64');
});

test('webgpu products equal the cpu backend, forward and gradient, one program of ours each', {
  skip: why,
}, async () => {
  for (const c of COVERED) await compare(c, programsOf(c));
});

test('webgpu products leave what they do not cover to the stock kernel, with the cpu backend results', {
  skip: why,
}, async () => {
  // batches [3, 1] x [1, 4]: no suffix of [3, 4] (TF.js's stock kernel throws on them too)
  assert.equal(
    planProduct(
      { dataId: {}, shape: [3, 1, 5, 6], dtype: 'float32' },
      { dataId: {}, shape: [1, 4, 6, 7], dtype: 'float32' },
      false,
      false,
    ),
    undefined,
  );
  // more output tiles along M than a dispatch dimension holds (65,535 x 64 rows)
  assert.equal(
    planProduct(
      { dataId: {}, shape: [65535 * 64 + 1, 2], dtype: 'float32' },
      { dataId: {}, shape: [2, 3], dtype: 'float32' },
      false,
      false,
    ),
    undefined,
  );
  assert.equal(
    planProduct(
      { dataId: {}, shape: [65535 * 64, 2], dtype: 'float32' },
      { dataId: {}, shape: [2, 3], dtype: 'float32' },
      false,
      false,
    )?.m,
    65535 * 64,
  );
  // prelu's weights: the stock kernel runs it
  await compare(
    { a: [33, 20], b: [20, 70], bias: [70], activation: 'prelu', prelu: [70] },
    0,
  );
});

test('suffixBatches: an operand batch shape broadcasts by modulo when it is a suffix of the output', () => {
  assert.equal(suffixBatches([], [2, 3]), 1);
  assert.equal(suffixBatches([1, 1], [2, 3]), 1);
  assert.equal(suffixBatches([3], [2, 3]), 3);
  assert.equal(suffixBatches([1, 3], [2, 3]), 3);
  assert.equal(suffixBatches([2, 1], [2, 3]), undefined);
  assert.equal(suffixBatches([2], [2, 3]), undefined);
  assert.equal(suffixBatches([2, 3], [2, 3]), 6);
});

test('webgpu Sum over leading axes is one column-sum dispatch of ours and equals the cpu backend; other sums are stock', {
  skip: why,
}, async () => {
  const cases: Array<[number[], number[], boolean, number]> = [
    [[3, 70, 65], [0, 1], false, 1],
    [[3, 70, 65], [1, 0], true, 1],
    [[130, 5], [0], false, 1],
    // rows past the four-row rounds of each of the 32 row phases, columns past a workgroup's 8
    [[3, 133, 19], [0, 1], false, 1],
    [[1, 97], [0], false, 1],
    [[5000, 3], [0], false, 0], // few long columns: stock
    [[3, 70, 65], [2], false, 0],
    [[3, 70, 65], [0, 2], true, 0],
    [[3, 70], [0, 1], false, 0],
  ];
  for (const [shape, axis, keepDims, ours] of cases) {
    const sum = () => {
      seed = 1;
      return tf.sum(rand(shape), axis, keepDims);
    };
    await initBackend('cpu');
    const want = sum();
    const wantValues = await want.data();
    await initBackend('webgpu');
    const { result: got, ours: n } = await counting(async () => sum());
    assert.deepEqual(got.shape, want.shape, `sum ${shape} over ${axis}`);
    const { worst } = scaledDifference(await got.data(), wantValues);
    assert.ok(worst <= 1e-5, `sum ${shape} over ${axis}: ${worst}`);
    assert.equal(n, ours, `sum ${shape} over ${axis}: programs of ours`);
  }
  assert.equal(columnSumPlan([4, 5], 0, false)?.cols, 5);
});

let whyF16: string | false = false;
if (!why) whyF16 = await noShaderF16();

test('webgpu products under an f16 policy equal the cpu product of f16-rounded operands, in one program, in both tilings', {
  skip: why || whyF16,
}, async () => {
  const c: Case = { a: [2, 150, 33], b: [33, 135], bias: [135] };
  await initBackend('webgpu', { precision: 'f16' });
  const { roundF16 } = await import('./webgpu-f16.js');
  const { setProductOperands } = await import('./webgpu-matmul.js');
  try {
    for (const tiling of ['t64', 't128']) {
      await initBackend('webgpu', { precision: 'f16' });
      forceProductTiling(tiling);
      const gpu = await results(c);
      assert.equal(
        gpu.ours,
        5,
        'forward (twice: tf.grads runs it), dA, dB and the bias sum: one program each',
      );
      assert.ok(
        gpu.keys.some((k) => k.startsWith(`lw_matmul_${tiling}_`)),
        `${tiling}: ${gpu.keys}`,
      );
      seed = 1;
      const [a, b, bias] = [rand(c.a), rand(c.b), rand(c.bias!)];
      const [a16, b16] = await Promise.all([
        roundF16(a).data(),
        roundF16(b).data(),
      ]);
      const [av, bv, biasv] = await Promise.all([
        a.data(),
        b.data(),
        bias.data(),
      ]);
      await initBackend('cpu');
      const want = await tf
        .add(
          tf.matMul(tf.tensor(a16, c.a), tf.tensor(b16, c.b)),
          tf.tensor(biasv, c.bias),
        )
        .data();
      const { worst } = scaledDifference(gpu.values[0]!, want);
      assert.ok(worst <= 1e-5, `${tiling}: f16 product differs by ${worst}`);
      // and it is not the float32 product: the rounding happened
      const f32 = await tf
        .add(
          tf.matMul(tf.tensor(av, c.a), tf.tensor(bv, c.b)),
          tf.tensor(biasv, c.bias),
        )
        .data();
      assert.ok(scaledDifference(gpu.values[0]!, f32).worst > 1e-5);
    }
  } finally {
    forceProductTiling(undefined);
    setProductOperands(policyOf('fp32').compute);
  }
});
