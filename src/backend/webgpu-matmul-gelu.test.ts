/**
 * The MLP's product + bias + GELU as one op (model/layers.ts denseGelu, kernel-names.ts
 * DENSE_GELU_KERNEL):
 *
 * - on cpu, wasm and native (fp32 and bf16, where its addon is built) it runs the kernels `dense` then `gelu` ran
 *   (composed-kernels.ts composedDenseGelu) and its registered gradient (matmul-grad.ts) the
 *   same gradient kernels on the same shapes: outputs and gradients equal theirs bit for bit;
 * - on webgpu it is one dispatch of ours (backend/webgpu-matmul-gelu.ts) writing y and h, and
 *   its outputs and gradients equal the cpu backend's within 1e-4 of their scale, for sizes that
 *   are not multiples of the 64 x 64 tile and leading axes of any rank;
 * - under an f16 policy on webgpu, y and h equal what `_FusedMatMul` then LayerwiseGelu give
 *   under the same policy (f16 operands, f16 GELU factor) to f32 rounding, and differ from the
 *   f32 results (the rounding happened);
 * - mismatched shapes are refused with the mismatch named.
 * The webgpu parts are skipped, saying why, where no WebGPU adapter can be made.
 */
import assert from 'node:assert/strict';
import { test } from 'node:test';
import { dense, denseGelu, gelu } from '../model/layers.js';
import { randomArray, scaledDifference } from '../testing/backend-compare.js';
import { noShaderF16 } from '../testing/webgpu.js';
import { gpuQueue } from './gpu-queue.js';
import { initBackend } from './index.js';
import { DENSE_GELU_KERNEL, GELU_KERNEL } from './kernel-names.js';
import { nativeAddon, nativeUnavailable } from './native.js';
import { policyOf } from './precision.js';
import { tf } from './tfjs.js';
import { installDawn } from './webgpu.js';

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
    tf.dispose([x!, w!, b!, y!, h!, ref]);
  }
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

let whyF16: string | false = false;
if (!why) whyF16 = await noShaderF16();

test('webgpu f16: denseGelu equals _FusedMatMul then GELU under the same f16 policy, not the f32 results', {
  skip: why || whyF16,
}, async () => {
  const c = CASES[1]!;
  const forward = () =>
    tf.tidy(() => {
      const [x, w, b] = inputs(c) as [tf.Tensor, tf.Tensor, tf.Tensor];
      const [y, h] = tf
        .engine()
        .runKernel(DENSE_GELU_KERNEL, { x, w, b }) as tf.Tensor[];
      return [y!, h!, gelu(dense(x, w, b))];
    });
  await initBackend('webgpu');
  const f32 = await values(forward());
  await initBackend('webgpu', { precision: 'f16' });
  const { setProductOperands } = await import('./webgpu-matmul.js');
  const { useF16Arithmetic } = await import('./webgpu-kernels.js');
  try {
    const [y, h, ref] = await values(forward());
    // h: the same f16-rounded operands in the same f32 sums as _FusedMatMul's
    assert.ok(scaledDifference(h!, f32[1]!).worst > 1e-5, 'operands rounded');
    const { worst } = scaledDifference(y!, ref!);
    assert.ok(worst <= 1e-6, `f16 denseGelu vs the two f16 kernels: ${worst}`);
    assert.ok(
      scaledDifference(y!, f32[0]!).worst > 1e-5,
      'f16 differs from f32',
    );
  } finally {
    setProductOperands(policyOf('fp32').compute);
    useF16Arithmetic(false);
  }
});
