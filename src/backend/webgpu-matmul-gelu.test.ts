/**
 * The MLP's product + bias + GELU as one op (model/layers.ts denseGelu, kernel-names.ts
 * DENSE_GELU_KERNEL):
 *
 * - on cpu, wasm and native (fp32 and bf16, where its addon is built) it runs the kernels
 *   `dense` then `gelu` ran (composed-kernels.ts composedDenseGelu) and its registered gradient
 *   (matmul-grad.ts) the same gradient kernels on the same shapes: outputs and gradients equal
 *   theirs bit for bit;
 * - on webgpu it is one dispatch of ours (backend/webgpu-matmul-gelu.ts) writing y and h, and
 *   so is its gradient's DENSE_GELU_GRAD_KERNEL (dh and db); outputs and gradients equal the cpu
 *   backend's within 1e-4 of their scale, for sizes that are not multiples of the 64 x 64 tile
 *   and leading axes of any rank, and so in the 128 x 128 tiling (forced, on sizes past it);
 *   outputs of at least 256 large tiles take that tiling; its split backward
 *   (pipeline/split-backward.ts) equals tf.grads with one product in each part;
 * - under an f16 policy on webgpu, y, h, dh and db equal what the unfused kernels give under
 *   the same policy (f16 operands, GELU and its slope in f16 arithmetic) to f32 rounding, and
 *   differ from the f32 results (the rounding happened);
 * - mismatched shapes are refused with the mismatch named.
 * The webgpu parts are skipped, saying why, where no WebGPU adapter can be made.
 */
import assert from 'node:assert/strict';
import { test } from 'node:test';
import { dense, denseGelu, gelu } from '../model/layers.js';
import { backwardRecorded, recordForward } from '../pipeline/rematerialize.js';
import { backwardInput, backwardWeight } from '../pipeline/split-backward.js';
import { randomArray, scaledDifference } from '../testing/backend-compare.js';
import { noShaderF16 } from '../testing/webgpu.js';
import { gpuQueue } from './gpu-queue.js';
import { initBackend } from './index.js';
import {
  DENSE_GELU_GRAD_KERNEL,
  DENSE_GELU_KERNEL,
  GELU_GRAD_KERNEL,
  GELU_KERNEL,
} from './kernel-names.js';
import { nativeAddon, nativeUnavailable } from './native.js';
import { policyOf } from './precision.js';
import { tf } from './tfjs.js';
import { installDawn } from './webgpu.js';
import { forceProductTiling } from './webgpu-matmul.js';
import { denseGeluTiles } from './webgpu-matmul-gelu.js';

let why: string | false = false;
try {
  await installDawn();
} catch (e) {
  why = `no WebGPU adapter here: ${(e as Error).message}`;
}

/** x's shape, and w's [Din, Dout]. */
const CASES: Array<[x: number[], w: [number, number]]> = [
  [
    [5, 7],
    [7, 3],
  ],
  [
    [2, 70, 33],
    [33, 130],
  ],
  [
    [1, 2, 3, 20],
    [20, 65],
  ],
  [
    [130, 64],
    [64, 256],
  ],
];

/** Inputs of a case, the same values on every backend: x, w (scaled as a layer's), b, dy. */
function inputs([xs, [din, dout]]: (typeof CASES)[number]): tf.Tensor[] {
  const t = (shape: number[], seed: number, scale = 1) =>
    tf.tensor(
      randomArray(tf.util.sizeFromShape(shape), seed).map((v) => v * scale),
      shape,
    );
  const out = [...xs.slice(0, -1), dout];
  return [
    t(xs, 1),
    t([din, dout], 2, 2 / Math.sqrt(din)),
    t([dout], 3),
    t(out, 4),
  ];
}

/** y, then dx, dw, db for the seed dy, of `f` (tf.grads, the registered gradients). */
function run(f: (x: tf.Tensor, w: tf.Tensor, b: tf.Tensor) => tf.Tensor) {
  return (c: (typeof CASES)[number]): tf.Tensor[] =>
    tf.tidy(() => {
      const [x, w, b, dy] = inputs(c) as [
        tf.Tensor,
        tf.Tensor,
        tf.Tensor,
        tf.Tensor,
      ];
      const grads = tf.grads((x, w, b) => f(x, w, b))([x, w, b], dy);
      return [f(x, w, b), ...grads];
    });
}
const fused = run(denseGelu);
const unfused = run((x, w, b) => gelu(dense(x, w, b)));

const values = (ts: tf.Tensor[]) => Promise.all(ts.map((t) => t.data()));

/** Whether two runs' outputs are the same floats, bit for bit. */
async function assertBitEqual(
  got: tf.Tensor[],
  want: tf.Tensor[],
  what: string,
) {
  const [g, w] = [await values(got), await values(want)];
  g.forEach((v, i) => {
    assert.deepEqual(got[i]!.shape, want[i]!.shape, `${what}: shape ${i}`);
    const a = new Uint32Array(new Float32Array(v).buffer);
    const b = new Uint32Array(new Float32Array(w[i]!).buffer);
    const at = a.findIndex((bits, j) => bits !== b[j]);
    assert.equal(
      at,
      -1,
      `${what}: output ${i} differs at ${at}: ${v[at]} vs ${w[i]![at]}`,
    );
  });
}

for (const [backend, precision] of [
  ['cpu', 'fp32'],
  ['wasm', 'fp32'],
  ['native', 'fp32'],
  ['native', 'bf16'],
] as const) {
  const skip =
    backend === 'native' && !nativeAddon()
      ? `native backend unavailable: ${nativeUnavailable()}`
      : false;
  test(`${backend} ${precision}: denseGelu gives dense then gelu's output and gradients bit for bit`, {
    skip,
  }, async () => {
    await initBackend(backend, { precision });
    try {
      for (const c of CASES) {
        const [got, want] = [fused(c), unfused(c)];
        await assertBitEqual(got, want, `${backend} ${c[0]} x ${c[1]}`);
        tf.dispose([...got, ...want]);
      }
    } finally {
      await initBackend(backend); // fp32 again for the other tests
    }
  });
}

let whyF16: string | false = false;
if (!why) whyF16 = await noShaderF16();

test('webgpu f16: denseGelu and its gradient kernel equal the unfused kernels under the same f16 policy, not the f32 results', {
  skip: why || whyF16,
}, async () => {
  const c = CASES[1]!;
  // y, h, their unfused pair; dh, db, their unfused pair (on an h of the same values under
  // both policies, so that only the slope's arithmetic differs between them)
  const outputs = () =>
    tf.tidy(() => {
      const [x, w, b, dy] = inputs(c) as [
        tf.Tensor,
        tf.Tensor,
        tf.Tensor,
        tf.Tensor,
      ];
      const run = (name: string, ins: tf.NamedTensorMap) =>
        tf.engine().runKernel(name, ins) as tf.Tensor[];
      const [y, h] = run(DENSE_GELU_KERNEL, { x, w, b });
      const h32 = tf.tensor(
        randomArray(dy.size, 5).map((v) => 2 * v),
        dy.shape,
      );
      const [dh, db] = run(DENSE_GELU_GRAD_KERNEL, { h: h32, dy });
      const dhRef = tf.engine().runKernel(GELU_GRAD_KERNEL, {
        x: h32,
        dy,
      }) as tf.Tensor;
      return [
        [y!, gelu(dense(x, w, b))],
        [h!, h!],
        [dh!, dhRef],
        [db!, tf.sum(dhRef, [0, 1])],
      ];
    });
  // the first webgpu test of the file: the device is made with shader-f16 (f16 arithmetic)
  await initBackend('webgpu', { precision: 'f16' });
  const { setProductOperands } = await import('./webgpu-matmul.js');
  const { f16Arithmetic, useF16Arithmetic } = await import(
    './webgpu-kernels.js'
  );
  try {
    assert.ok(f16Arithmetic(tf.backend()), 'the device has shader-f16');
    const f16 = await Promise.all(outputs().map(values));
    setProductOperands('float32');
    useF16Arithmetic(false);
    const f32 = await Promise.all(outputs().map(values));
    const names = ['y', 'h', 'dh', 'db'];
    f16.forEach(([got, want], i) => {
      // the same f16 operations, in the same order (db's sums in another order: 1e-5)
      const d = scaledDifference(got!, want!).worst;
      assert.ok(d <= 1e-5, `f16 ${names[i]} vs the unfused f16 kernels: ${d}`);
      // and not the f32 results: the f16 rounding happened
      const e = scaledDifference(got!, f32[i]![0]!).worst;
      assert.ok(e > 1e-5, `f16 ${names[i]} equals the f32 one (${e})`);
    });
  } finally {
    setProductOperands(policyOf('fp32').compute);
    useF16Arithmetic(false);
  }
});

test('webgpu: denseGelu is one dispatch and equals the cpu backend, forward and gradient', {
  skip: why,
}, async () => {
  for (const c of CASES) {
    await initBackend('cpu');
    const cpu = fused(c);
    const want = await values(cpu);
    tf.dispose(cpu);
    await initBackend('webgpu');
    const gpu = fused(c);
    (await values(gpu)).forEach((v, i) => {
      const { worst } = scaledDifference(v, want[i]!);
      assert.ok(
        worst <= 1e-4,
        `${c[0]} x ${c[1]}: output ${i} differs by ${worst}`,
      );
    });
    tf.dispose(gpu);
    // the forward alone: one dispatch, no program of TF.js's
    const [x, w, b] = inputs(c);
    await values([x!, w!, b!]);
    const before = gpuQueue()!.counts().dispatches;
    const [y, h] = tf.engine().runKernel(DENSE_GELU_KERNEL, {
      x: x!,
      w: w!,
      b: b!,
    }) as tf.Tensor[];
    assert.equal(gpuQueue()!.counts().dispatches - before, 1, 'one dispatch');
    // h is the product + bias, y its GELU (the element-wise kernel's numbers)
    const ref = tf.engine().runKernel(GELU_KERNEL, { x: h! }) as tf.Tensor;
    const { worst } = scaledDifference(await y!.data(), await ref.data());
    assert.ok(worst <= 1e-6, `y = GELU(h) to ${worst}`);
    // the gradient's first kernel: dh and db in one dispatch, GELU's gradient and dh's column sums
    const dy = inputs(c)[3]!;
    await dy.data();
    const mark = gpuQueue()!.counts().dispatches;
    const [dh, db] = tf
      .engine()
      .runKernel(DENSE_GELU_GRAD_KERNEL, { h: h!, dy }) as tf.Tensor[];
    assert.equal(gpuQueue()!.counts().dispatches - mark, 1, 'one dispatch');
    const dhRef = tf.engine().runKernel(GELU_GRAD_KERNEL, {
      x: h!,
      dy,
    }) as tf.Tensor;
    const dbRef = tf.sum(tf.reshape(dhRef, [-1, c[1][1]]), 0);
    for (const [got, want, what] of [
      [dh!, dhRef, 'dh'],
      [db!, dbRef, 'db'],
    ] as const) {
      assert.deepEqual(got.shape, want.shape, what);
      const d = scaledDifference(await got.data(), await want.data()).worst;
      assert.ok(d <= 1e-5, `${what} to ${d}`);
    }
    tf.dispose([x!, w!, b!, y!, h!, ref, dy, dh!, db!, dhRef, dbRef]);
  }
});

test('webgpu: denseGelu in the 128 x 128 tiling (forced) equals the cpu backend, forward and gradient; large outputs take that tiling', {
  skip: why,
}, async () => {
  const cases: typeof CASES = [
    ...CASES,
    [
      [2, 150, 33],
      [33, 260],
    ],
  ];
  try {
    for (const c of cases) {
      await initBackend('cpu');
      const cpu = fused(c);
      const want = await values(cpu);
      tf.dispose(cpu);
      await initBackend('webgpu');
      forceProductTiling('t128');
      const gpu = fused(c);
      (await values(gpu)).forEach((v, i) => {
        const { worst } = scaledDifference(v, want[i]!);
        assert.ok(
          worst <= 1e-4,
          `${c[0]} x ${c[1]}: output ${i} differs by ${worst}`,
        );
      });
      tf.dispose(gpu);
      const rows = tf.util.sizeFromShape(c[0].slice(0, -1));
      const { tiling, tiles } = denseGeluTiles(rows, c[1][1]);
      assert.equal(tiling.name, 't128');
      assert.equal(tiles, Math.ceil(rows / 128) * Math.ceil(c[1][1] / 128));
      forceProductTiling(undefined);
    }
  } finally {
    forceProductTiling(undefined);
  }
  // chosen by size: the 8 x d1024 model's MLP (8,192 rows, 4,096 columns), and a small one
  assert.deepEqual(
    [denseGeluTiles(8192, 4096).tiling.name, denseGeluTiles(8192, 4096).tiles],
    ['t128', 2048],
  );
  assert.deepEqual(
    [denseGeluTiles(1024, 1024).tiling.name, denseGeluTiles(1024, 1024).tiles],
    ['t64', 256],
  );
});

test('webgpu: the split backward (input part, then weight part) of denseGelu equals tf.grads, running no product twice', {
  skip: why,
}, async () => {
  await initBackend('webgpu');
  const c = CASES[1]!;
  const [x, w, b, dy] = inputs(c) as [
    tf.Tensor,
    tf.Tensor,
    tf.Tensor,
    tf.Tensor,
  ];
  const want = tf.grads((w, b, x) => denseGelu(x, w, b))([w, b, x], dy);
  const n0 = tf.memory().numTensors;
  const products = (f: () => tf.Tensor[]) =>
    tf
      .profile(f)
      .then((p) => p.kernels.filter((k) => k.name === 'BatchMatMul').length);
  let pending!: ReturnType<typeof backwardInput>['pending'];
  let dx: tf.Tensor | null = null;
  const inI = await products(() => {
    const rec = recordForward(() => denseGelu(x, w, b));
    const r = backwardInput(rec, x, [w, b], dy, true);
    pending = r.pending;
    dx = r.dx;
    return [dx!];
  });
  let got: tf.Tensor[] = [];
  const inW = await products(() => (got = backwardWeight(pending, [w, b])));
  assert.equal(inI, 1, 'I: dx = dh w^T only');
  assert.equal(inW, 1, 'W: dw = x^T dh only');
  for (const [i, g] of [...got, dx!].entries()) {
    const d = scaledDifference(await g.data(), await want[i]!.data()).worst;
    assert.ok(d <= 1e-5, `gradient ${i} differs by ${d}`);
  }
  tf.dispose([...got, dx!]);
  assert.equal(tf.memory().numTensors, n0, 'I + W leave no tensors');
  tf.dispose([...want, x, w, b, dy]);
});

test('denseGelu refuses mismatched shapes, naming them', async () => {
  await initBackend('cpu');
  const [x, w, b] = [tf.zeros([2, 3]), tf.zeros([3, 4]), tf.zeros([4])];
  assert.throws(() => denseGelu(x, tf.zeros([4, 4]), b), /must end in Din = 4/);
  assert.throws(() => denseGelu(x, w, tf.zeros([3])), /b must be \[4\]/);
  assert.throws(
    () => denseGelu(x, tf.zeros([1, 3, 4]), b),
    /w must be \[Din, Dout\]/,
  );
  tf.dispose([x, w, b]);
});

test('webgpu: the backward of denseGelu (full and split) makes no zeros of h on the host for the gradient it never reads', {
  skip: why,
}, async () => {
  await initBackend('webgpu');
  const c = CASES[1]!;
  const [x, w, b, dy] = inputs(c) as [
    tf.Tensor,
    tf.Tensor,
    tf.Tensor,
    tf.Tensor,
  ];
  const hSize = tf.util.sizeFromShape([...c[0].slice(0, -1), c[1][1]]);
  // tfjs-core's tape node makes the zeros of an unreached output with engine.makeTensor
  const engine = tf.engine() as unknown as {
    makeTensor: (v: unknown, shape: number[], ...rest: unknown[]) => tf.Tensor;
  };
  const make = engine.makeTensor;
  const made: number[] = [];
  engine.makeTensor = function (v, shape, ...rest) {
    made.push(tf.util.sizeFromShape(shape));
    return make.call(this, v, shape, ...rest);
  };
  const n0 = tf.memory().numTensors;
  try {
    const full = recordForward(() => denseGelu(x, w, b));
    const g = backwardRecorded(full, [x, w, b], dy);
    const split = recordForward(() => denseGelu(x, w, b));
    const r = backwardInput(split, x, [w, b], dy, true);
    const gw = backwardWeight(r.pending, [w, b]);
    const want = tf.grads((x, w, b) => denseGelu(x, w, b))([x, w, b], dy);
    for (const [i, got] of [...g, r.dx!, ...gw].entries()) {
      const ref = want[[0, 1, 2, 0, 1, 2][i]!]!;
      const d = scaledDifference(await got.data(), await ref.data()).worst;
      assert.ok(d <= 1e-6, `gradient ${i} differs from tf.grads by ${d}`);
    }
    tf.dispose([...g, r.dx!, ...gw, ...want]);
  } finally {
    engine.makeTensor = make;
  }
  // tf.grads makes them (the engine's own walk); the tape's two walks before it do not
  const zeros = made.filter((n) => n === hSize).length;
  assert.equal(zeros, 1, `tensors of h's size made from host data: ${zeros}`);
  assert.equal(tf.memory().numTensors, n0, 'no tensor left behind');
  tf.dispose([x, w, b, dy]);
});
