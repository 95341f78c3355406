/**
 * The native backend against the cpu backend: every native kernel and its gradient equal the
 * cpu backend's within float32 tolerance on odd shapes (transposed and batched operands, batch
 * broadcasting, batch 1, sizes that are not multiples of 8 or 16, empty products), the kernels
 * it does not provide fall back to the cpu backend's, and the native host optimizer equals the
 * JS one. Skipped, saying why, where the addon is not built.
 */

import assert from 'node:assert/strict';
import { execFileSync, spawnSync } from 'node:child_process';
import { dirname } from 'node:path';
import { test } from 'node:test';
import { fileURLToPath } from 'node:url';
import {
  causalSelfAttention,
  gelu,
  layerNorm,
  maskedSoftmax,
  softmaxCrossEntropy,
} from '../model/layers.js';
import {
  DeviceOptimizer,
  defaultOptimizerConfig,
  type OptimizerConfig,
} from '../optim/optimizer.js';
import { hostUpdate } from '../param-server/host-optimizer.js';
import {
  onBackend,
  randomArray,
  assertSameAsCpu as sameAsCpu,
} from '../testing/backend-compare.js';
import { withThreadsRestored } from '../testing/native-threads.js';
import { Rng } from '../util/rng.js';
import { initBackend } from './index.js';
import { ADAMW_MULTI_KERNEL } from './kernel-names.js';
import {
  ROUND_BF16_KERNEL,
  roundTensor,
  roundToBf16,
  widenBf16,
} from './low-precision.js';
import type { NativeBackend } from './native.js';
import { nativeAddon, nativeKernelNames, nativeUnavailable } from './native.js';
import { tf } from './tfjs.js';

const skip = nativeAddon()
  ? false
  : `native backend unavailable: ${nativeUnavailable()}`;

/** Asserts that `f` on native gives the cpu backend's outputs (testing/backend-compare.ts). */
const assertSameAsCpu = (
  what: string,
  shapes: number[][],
  f: (...xs: tf.Tensor[]) => tf.Tensor[],
  tol = 1e-4,
) => sameAsCpu('native', what, shapes, f, { tol });

const MATMULS: Array<[string, number[], number[], boolean, boolean]> = [
  ['2-D', [5, 7], [7, 3], false, false],
  ['2-D, a transposed', [7, 5], [7, 3], true, false],
  ['2-D, b transposed', [5, 7], [3, 7], false, true],
  ['2-D, both transposed', [7, 5], [3, 7], true, true],
  ['batch 1', [1, 9, 17], [1, 17, 33], false, false],
  ['batched, same batch', [4, 9, 17], [4, 17, 13], false, false],
  ['batched, both transposed', [4, 17, 9], [4, 13, 17], true, true],
  ['batched a, shared b', [3, 6, 10, 17], [17, 19], false, false],
  ['batched a transposed, shared b', [3, 17, 10], [17, 19], true, false],
  ['shared a, batched b', [10, 17], [6, 17, 19], false, false],
  ['many small (attention-like)', [2, 4, 24, 8], [2, 4, 8, 24], false, false],
  ['wide (not a multiple of 16)', [33, 257], [129, 257], false, true],
];

for (const [name, sa, sb, tA, tB] of MATMULS) {
  test(`native matMul equals cpu: ${name}`, { skip }, async () => {
    await assertSameAsCpu(`matMul ${name}`, [sa, sb], (a, b) => [
      tf.matMul(a!, b!, tA, tB),
    ]);
  });
}

test('native matMul gradients equal cpu, with broadcast batches', {
  skip,
}, async () => {
  for (const [name, sa, sb, tA, tB] of MATMULS) {
    await assertSameAsCpu(`d matMul ${name}`, [sa, sb], (a, b) =>
      tf.grads((x, y) => tf.sum(tf.square(tf.matMul(x!, y!, tA, tB))))([
        a!,
        b!,
      ]),
    );
  }
});

test('native matMul broadcasts batch axes in full ([2,1] with [3] gives [2,3]), as explicit tiling does', {
  skip,
}, async () => {
  // the stock cpu kernel does not broadcast this case, so the reference tiles the operands first
  const ref = await onBackend(
    'cpu',
    [
      [2, 1, 5, 7],
      [3, 7, 6],
    ],
    (a, b) => [
      tf.matMul(
        tf.broadcastTo(a!, [2, 3, 5, 7]),
        tf.broadcastTo(b!, [2, 3, 7, 6]),
      ),
    ],
  );
  const native = await onBackend(
    'native',
    [
      [2, 1, 5, 7],
      [3, 7, 6],
    ],
    (a, b) => [tf.matMul(a!, b!)],
  );
  assert.deepEqual(native[0]!.shape, [2, 3, 5, 6]);
  native[0]!.values.forEach((v, i) =>
    assert.ok(
      Math.abs(v - ref[0]!.values[i]!) <= 1e-4,
      `element ${i}: ${v} vs ${ref[0]!.values[i]}`,
    ),
  );
});

test('native fused matMul (bias, relu) equals cpu; empty products give empty or zero outputs', {
  skip,
}, async () => {
  await assertSameAsCpu(
    'fused matMul',
    [[6, 11], [11, 5], [5]],
    (a, b, bias) => [
      tf.fused.matMul({ a: a!, b: b!, bias, activation: 'relu' }),
    ],
  );
  await assertSameAsCpu(
    'fused matMul transposed, no bias',
    [
      [11, 6],
      [5, 11],
    ],
    (a, b) => [
      tf.fused.matMul({ a: a!, b: b!, transposeA: true, transposeB: true }),
    ],
  );
  await assertSameAsCpu(
    'k = 0',
    [
      [4, 0],
      [0, 3],
    ],
    (a, b) => [tf.matMul(a!, b!)],
  );
  await assertSameAsCpu(
    'm = 0',
    [
      [2, 0, 5],
      [2, 5, 3],
    ],
    (a, b) => [tf.matMul(a!, b!)],
  );
});

test('native element-wise kernels equal cpu: broadcasting binary ops, unary ops', {
  skip,
}, async () => {
  const pairs: Array<[string, number[], number[]]> = [
    ['same shape', [3, 5, 7], [3, 5, 7]],
    ['row vector', [4, 6, 17], [17]],
    ['column', [4, 6, 17], [4, 6, 1]],
    ['scalar right', [5, 9], []],
    ['scalar left', [], [5, 9]],
    ['both broadcast', [3, 1, 7], [1, 5, 1]],
    ['middle axis', [2, 1, 3, 4], [5, 1, 1]],
  ];
  for (const [name, sa, sb] of pairs) {
    await assertSameAsCpu(`binary ${name}`, [sa, sb], (a, b) => [
      tf.add(a!, b!),
      tf.sub(a!, b!),
      tf.mul(a!, b!),
      tf.div(a!, tf.add(tf.abs(b!), 0.5)),
      tf.maximum(a!, b!),
      tf.minimum(a!, b!),
      tf.squaredDifference(a!, b!),
    ]);
  }
  await assertSameAsCpu('unary', [[7, 33]], (x) => {
    const pos = tf.add(tf.abs(x!), 0.1);
    return [
      tf.exp(x!),
      tf.log(pos),
      tf.sqrt(pos),
      tf.rsqrt(pos),
      tf.square(x!),
      tf.neg(x!),
      tf.sigmoid(x!),
      tf.tanh(x!),
      tf.relu(x!),
      tf.abs(x!),
      tf.reciprocal(pos),
      tf.step(x!),
      tf.step(x!, 0.3),
    ];
  });
  // Step (ReLU's gradient mask) keeps NaN, as the cpu kernel does; alpha where x <= 0
  await initBackend('native');
  const st = tf.step(tf.tensor1d([NaN, -1, 0, 2]), 0.5);
  assert.deepEqual(Array.from(st.dataSync()), [NaN, 0.5, 0.5, 1]);
  st.dispose();
});

test("the native bf16 rounding kernel (roundTensor's one pass) equals the JS rounding and widening bit for bit, ties, NaN and infinities included", {
  skip,
}, async () => {
  await initBackend('native');
  assert.ok(
    tf.getKernel(ROUND_BF16_KERNEL, 'native'),
    'the native backend registers the kernel',
  );
  const special = [
    1,
    1.00390625,
    1.01171875,
    1.0078125,
    -2.5,
    Math.PI,
    3.4e38,
    3.40282e38,
    -0,
    0,
  ];
  special.push(Infinity, -Infinity, NaN, 1e-40, -1e-45);
  // a signalling NaN (quiet bit clear) and a NaN whose payload sits in the low half only
  const bits = new Uint32Array([0x7f800001, 0xff810000, 0x7fa00000]);
  const src = new Float32Array(70000 + special.length + bits.length); // over the parallel threshold
  src.set(randomArray(70000, 7).map((v) => v * 1000));
  src.set(special, 70000);
  src.set(new Float32Array(bits.buffer), 70000 + special.length);
  const bf = new Uint16Array(src.length);
  roundToBf16(src, bf);
  const want = new Float32Array(src.length);
  widenBf16(bf, want);
  const x = tf.tensor1d(src);
  const got = roundTensor(x);
  assert.deepEqual(
    new Uint32Array((got.dataSync() as Float32Array).slice().buffer),
    new Uint32Array(want.buffer),
  );
  tf.dispose([x, got]);
});

test('the fused native GELU, layer norm and causal softmax and their gradients equal the composed ones on cpu', {
  skip,
}, async () => {
  await assertSameAsCpu(
    'gelu',
    [
      [6, 41],
      [6, 41],
    ],
    (x, w) => [
      gelu(tf.mul(x!, 3)),
      tf.grad((v: tf.Tensor) => tf.sum(tf.mul(gelu(v), w!)))(tf.mul(x!, 3)),
    ],
  );
  await assertSameAsCpu(
    'layer norm and its gradient',
    [[2, 5, 37], [37], [37], [2, 5, 37]],
    (x, g, b, w) => [
      layerNorm(tf.mul(x!, 3), g!, b!),
      ...tf.grads((v: tf.Tensor, gv: tf.Tensor, bv: tf.Tensor) =>
        tf.sum(tf.mul(layerNorm(v, gv, bv), w!)),
      )([tf.mul(x!, 3), g!, b!]),
    ],
  );
  await assertSameAsCpu(
    'causal softmax and its gradient',
    [
      [3, 2, 9, 9],
      [3, 2, 9, 9],
    ],
    (x, w) => [
      maskedSoftmax(tf.mul(x!, 4), 0.35),
      tf.grad((v: tf.Tensor) => tf.sum(tf.mul(maskedSoftmax(v, 0.35), w!)))(
        tf.mul(x!, 4),
      ),
    ],
  );
  await initBackend('native');
  const k = tf.tidy(
    () =>
      tf.engine().runKernel('LayerwiseGelu', {
        x: tf.tensor1d([-1, 0, 2]),
      }) as tf.Tensor,
  );
  assert.equal(k.shape[0], 3, 'the fused kernel ran on native');
  k.dispose();
});

test('the fused native attention and softmax cross-entropy and their gradients equal the composed ones on cpu', {
  skip,
}, async () => {
  // (batch, time, width, heads): one pair per thread and pairs spread over the team; dh 4, 5, 1;
  // T past kCausalRows (64, native/src/kernels.h): the causal products by blocks of rows, the
  // last one partial, with pairs spread and not
  for (const [b, t, d, h] of [
    [1, 7, 12, 3],
    [3, 5, 10, 2],
    [2, 9, 3, 3],
    [2, 150, 8, 2],
    [1, 129, 4, 1],
  ] as const) {
    await assertSameAsCpu(
      `attention B=${b} T=${t} D=${d} H=${h}`,
      [[b, t, d], [d, 3 * d], [3 * d], [d, d], [d], [b, t, d]],
      (x, wqkv, bqkv, wo, bo, w) => {
        const loss = (
          xv: tf.Tensor,
          wq: tf.Tensor,
          bq: tf.Tensor,
          wov: tf.Tensor,
        ) => tf.sum(tf.mul(causalSelfAttention(xv, h, wq, bq, wov, bo!), w!));
        return [
          causalSelfAttention(x!, h, wqkv!, bqkv!, wo!, bo!),
          ...tf.grads(loss)([x!, tf.mul(wqkv!, 0.5), bqkv!, wo!]),
        ];
      },
    );
  }
  for (const [what, shape, classes] of [
    ['[N, C]', [7], 5],
    ['[B, T, V]', [2, 3], 11],
  ] as Array<[string, number[], number]>) {
    await assertSameAsCpu(
      `softmax cross-entropy ${what}`,
      [[...shape, classes]],
      (x) => {
        const n = tf.util.sizeFromShape(shape);
        // one label outside [0, C): its one-hot is all zeros, no loss, on both backends
        const labels = tf.tensor(
          Array.from({ length: n }, (_, i) =>
            i === 1 ? -1 : (i * 7) % classes,
          ),
          [...shape],
          'int32',
        );
        const f = (lg: tf.Tensor) =>
          tf.mul(softmaxCrossEntropy(lg, labels), 1.7);
        return [f(tf.mul(x!, 3)), tf.grad(f)(tf.mul(x!, 3))];
      },
    );
  }
  await initBackend('native');
  const { kernelNames } = await tf.profile(() =>
    tf.tidy(() => {
      const x = tf.ones([1, 4, 6]);
      return tf.grad((v: tf.Tensor) =>
        softmaxCrossEntropy(
          causalSelfAttention(
            v,
            2,
            tf.ones([6, 18]),
            tf.zeros([18]),
            tf.ones([6, 6]),
            tf.zeros([6]),
          ),
          tf.zeros([1, 4], 'int32'),
        ),
      )(x);
    }),
  );
  for (const k of [
    'LayerwiseCausalAttention',
    'LayerwiseCausalAttentionGrad',
    'LayerwiseSoftmaxCrossEntropy',
    'LayerwiseSoftmaxCrossEntropyGrad',
  ]) {
    assert.ok(
      kernelNames.includes(k),
      `${k} ran on native (kernels: ${kernelNames.join(', ')})`,
    );
  }
});

test('native reductions, transpose and softmax equal cpu on any axes', {
  skip,
}, async () => {
  await assertSameAsCpu('reductions', [[3, 4, 5, 6]], (x) => [
    tf.sum(x!),
    tf.sum(x!, -1),
    tf.sum(x!, 0),
    tf.sum(x!, [1, 3], true),
    tf.mean(x!, [0, 2]),
    tf.mean(x!, -1, true),
    tf.max(x!, 1),
    tf.max(x!, [2, 3]),
    tf.min(x!, 0),
    tf.min(x!, -1, true),
    // every axis into one element: the one-pass path (a loss's mean, a sum of squares)
    tf.mean(x!),
    tf.max(x!),
    tf.min(x!, [0, 1, 2, 3], true),
  ]);
  // above the size at which kernels split over the team
  await assertSameAsCpu('a whole large tensor', [[300, 257]], (x) => [
    tf.sum(tf.square(x!)),
    tf.mean(x!),
    tf.max(x!),
    // column sums by row blocks (a bias gradient), the last block partial
    tf.sum(x!, 0),
    tf.mean(x!, 0),
    tf.max(x!, 0),
  ]);
  await assertSameAsCpu('transposes', [[2, 3, 4, 5]], (x) => [
    tf.transpose(x!),
    tf.transpose(x!, [0, 1, 3, 2]),
    tf.transpose(x!, [0, 2, 1, 3]),
    tf.transpose(x!, [3, 1, 0, 2]),
    tf.transpose(tf.reshape(x!, [40, 3]), [1, 0]),
  ]);
  await assertSameAsCpu('softmax', [[4, 3, 37]], (x) => [
    tf.softmax(x!),
    tf.softmax(tf.reshape(x!, [444])),
  ]);
  await assertSameAsCpu(
    'stack',
    [
      [3, 4],
      [3, 4],
    ],
    (a, b) => [tf.stack([a!, b!, a!]), tf.stack([a!, b!], 1)],
  );
  await assertSameAsCpu('empty', [[0, 5]], (x) => [
    tf.add(x!, x!),
    tf.sum(x!, 1),
    tf.transpose(x!),
    tf.exp(x!),
  ]);
});

test('native gather and segment sum equal cpu (the embedding and its gradient)', {
  skip,
}, async () => {
  const runBoth = async (f: () => tf.Tensor[]) => [
    await onFixed('cpu', f),
    await onFixed('native', f),
  ];
  const table = () => tf.tensor(randomArray(7 * 5, 9), [7, 5]);
  const ids = () =>
    tf.tensor(
      [
        [3, 0, 6],
        [3, 3, 1],
      ],
      [2, 3],
      'int32',
    );
  const [cpu, native] = await runBoth(() => [
    tf.gather(table(), ids()),
    tf.gather(table(), tf.tensor1d([4, 0], 'int32'), 1),
    tf.unsortedSegmentSum(
      tf.reshape(tf.gather(table(), ids()), [6, 5]),
      tf.reshape(ids(), [6]),
      7,
    ),
  ]);
  cpu!.forEach((c, i) =>
    assert.deepEqual(
      {
        shape: native![i]!.shape,
        v: Array.from(native![i]!.values, (x) => x.toFixed(4)),
      },
      { shape: c.shape, v: Array.from(c.values, (x) => x.toFixed(4)) },
    ),
  );
  await initBackend('native');
  assert.throws(
    () => tf.tidy(() => tf.gather(table(), tf.tensor1d([7], 'int32'))),
    /GatherV2: the index value 7 is not in \[0, 6\]/,
  );
});

test("kernels the addon does not provide, and other dtypes, fall back to the cpu backend's", {
  skip,
}, async () => {
  assert.ok(
    nativeKernelNames().includes('BatchMatMul') &&
      nativeKernelNames().includes('Softmax'),
  );
  await initBackend('native');
  const i = tf.add(tf.tensor1d([1, 2], 'int32'), tf.tensor1d([3, 4], 'int32'));
  assert.equal(i.dtype, 'int32');
  assert.deepEqual(Array.from(i.dataSync()), [4, 6]);
  const c = tf.concat([tf.tensor1d([1]), tf.tensor1d([2, 3])]);
  assert.deepEqual(Array.from(c.dataSync()), [1, 2, 3]);
  // int32 and bool cast to float32 feed native kernels: a real float32 copy (the cpu kernel shares the int array)
  const mean = tf.tidy(() =>
    tf.mean(
      tf.cast(
        tf.equal(
          tf.tensor1d([1, 2, 3], 'int32'),
          tf.tensor1d([1, 0, 3], 'int32'),
        ),
        'float32',
      ),
    ),
  );
  assert.ok(Math.abs(mean.dataSync()[0]! - 2 / 3) < 1e-6);
  const e = tf.tidy(() =>
    tf.exp(tf.cast(tf.tensor1d([0, 1], 'int32'), 'float32')),
  );
  assert.deepEqual(
    Array.from(e.dataSync(), (v) => +v.toFixed(5)),
    [1, +Math.E.toFixed(5)],
  );
  tf.dispose([i, c, mean, e]);
});

/** Runs `f` (which makes its own tensors) on backend `name`. */
async function onFixed(
  name: string,
  f: () => tf.Tensor[],
): Promise<Array<{ shape: number[]; values: Float32Array }>> {
  await initBackend(name);
  return tf.tidy(() =>
    f().map((y) => ({ shape: y.shape, values: y.dataSync() as Float32Array })),
  );
}

test("a bf16 product built on one thread uses the whole team after setThreads(2) (each team member's CPU clock advances) and gives the same C; column sums are the same at 1 and 2 threads", {
  skip,
}, () => {
  const lib = nativeAddon()!;
  const [m, n, k] = [512, 256, 384];
  const a = randomArray(m * k, 1),
    b = randomArray(k * n, 2);
  const product = () => {
    const c = new Float32Array(m * n);
    lib.matmulBf16(a, b, c, 1, 0, 0, m, n, k, false, false);
    return c;
  };
  withThreadsRestored(lib, () => {
    lib.setThreads(1);
    const one = product(); // builds the product's primitive for one thread
    lib.setThreads(2);
    const cpu0 = lib.teamCpuSeconds();
    let two = product();
    for (let i = 0; i < 20; i++) two = product();
    const cpu1 = lib.teamCpuSeconds();
    assert.equal(cpu1.length, 2);
    assert.ok(
      cpu1[1]! > cpu0[1]!,
      `the second team member ran none of the product (${cpu0[1]} s then ${cpu1[1]} s)`,
    );
    for (let i = 0; i < one.length; i++)
      assert.ok(
        Math.abs(one[i]! - two[i]!) <= 1e-5 * (1 + Math.abs(one[i]!)),
        `C[${i}]: ${one[i]} at 1 thread, ${two[i]} at 2`,
      );
    // a bias gradient's column sums (by row blocks) do not depend on the team size
    const sums = (threads: number) => {
      lib.setThreads(threads);
      const out = new Float32Array(n);
      lib.reduceOuter(0, a, out, m * (k / n), n);
      return out;
    };
    assert.deepEqual(sums(2), sums(1));
  });
});

test("the causal softmax's gradient reads no masked column of dy (NaN there leaves dx as with 0 there) and writes 0 in them, at 1 and 2 threads", {
  skip,
}, () => {
  // the fused attention gradients (native/src/attention.cc, bf16.cc) leave dP's masked columns
  // unwritten scratch and rely on this; T 150 past one team member's rows at 2 threads
  const lib = nativeAddon()!;
  const [batch, t, scale] = [3, 150, 0.37];
  const n = batch * t * t;
  const y = new Float32Array(n);
  lib.causalSoftmax(randomArray(n, 5), y, batch, t, scale);
  const dy = randomArray(n, 6);
  const dyZero = dy.slice(),
    dyNaN = dy.slice();
  for (let r = 0; r < batch * t; r++)
    for (let j = (r % t) + 1; j < t; j++) {
      dyZero[r * t + j] = 0;
      dyNaN[r * t + j] = Number.NaN;
    }
  const grad = (d: Float32Array, threads: number) => {
    lib.setThreads(threads);
    const dx = new Float32Array(n).fill(7); // no stale value may survive
    lib.causalSoftmaxGrad(y, d, dx, batch, t, scale);
    return dx;
  };
  withThreadsRestored(lib, () => {
    const reference = grad(dyZero, 1);
    for (const threads of [1, 2]) {
      const dx = grad(dyNaN, threads);
      assert.deepEqual(dx, reference, `at ${threads} thread(s)`);
    }
    for (let r = 0; r < batch * t; r++)
      for (let j = (r % t) + 1; j < t; j++)
        assert.equal(reference[r * t + j], 0, `row ${r} column ${j} is masked`);
    // and the unmasked entries are the softmax gradient scale y (dy - sum(dy y)) of each row
    for (const r of [0, t - 1, t + 70, batch * t - 1]) {
      const i = r % t;
      let dot = 0;
      for (let j = 0; j <= i; j++) dot += dy[r * t + j]! * y[r * t + j]!;
      for (let j = 0; j <= i; j++) {
        const want = scale * y[r * t + j]! * (dy[r * t + j]! - dot);
        assert.ok(
          Math.abs(reference[r * t + j]! - want) <= 1e-5 * (1 + Math.abs(want)),
          `row ${r} column ${j}: ${reference[r * t + j]} against ${want}`,
        );
      }
    }
  });
});

test('a weight gradient A^T B with a small output and a long k (split over k at 2 or more threads) equals the float64 product, fp32 and bf16, at 1, 2 and 4 threads', {
  skip,
}, () => {
  // k not a multiple of the slices' 64-row blocks, n not a multiple of 16; outputs below and
  // above 2^16 elements (the split's bound before it was raised to 2^20)
  for (const [m, n, k] of [
    [256, 89, 4133],
    [160, 520, 2100],
  ] as const)
    checkSplitReduction(m, n, k);
});

/** {@link matmul} and matmulBf16 of A^T B, A [k, m], B [k, n], at 1, 2 and 4 threads against the float64 product. */
function checkSplitReduction(m: number, n: number, k: number): void {
  const lib = nativeAddon()!;
  const a = randomArray(k * m, 3), // A stored [k, m]
    b = randomArray(k * n, 4);
  const [ab, bb] = [new Uint16Array(k * m), new Uint16Array(k * n)];
  lib.toBf16(a, ab);
  lib.toBf16(b, bb);
  const reference = (x: Float32Array, y: Float32Array) => {
    const c = new Float64Array(m * n);
    for (let r = 0; r < k; r++)
      for (let i = 0; i < m; i++) {
        const xi = x[r * m + i]!;
        for (let j = 0; j < n; j++) c[i * n + j] += xi * y[r * n + j]!;
      }
    return c;
  };
  const [af, bf] = [new Float32Array(k * m), new Float32Array(k * n)];
  lib.fromBf16(ab, af);
  lib.fromBf16(bb, bf);
  const exact = { fp32: reference(a, b), bf16: reference(af, bf) };
  withThreadsRestored(lib, () => {
    for (const threads of [1, 2, 4]) {
      lib.setThreads(threads);
      const cpu0 = lib.teamCpuSeconds();
      const c32 = new Float32Array(m * n),
        c16 = new Float32Array(m * n);
      let impl = '';
      for (let i = 0; i < 5; i++) {
        lib.matmul(a, b, c32, 1, 0, 0, m, n, k, true, false);
        impl = lib.matmulBf16(ab, bb, c16, 1, 0, 0, m, n, k, true, false);
      }
      const cpu1 = lib.teamCpuSeconds();
      if (threads === 2)
        assert.ok(
          cpu1[1]! > cpu0[1]!,
          'the second team member computed no slice',
        );
      // bf16 names the path it took (fp32's takes the same test, splitsReduction)
      if (threads > 1 && !impl.startsWith('emulated'))
        assert.match(impl, /^split over k/, `[${m}, ${n}] at ${threads}`);
      for (const [what, c] of [
        ['fp32', c32],
        ['bf16', c16],
      ] as const)
        for (let i = 0; i < m * n; i++) {
          const want = exact[what][i]!;
          // float32 sums of k products of normal values (|C| about sqrt(k) = 64): a lost or doubled slice is off by tens
          assert.ok(
            Math.abs(c[i]! - want) <= 2e-6 * k,
            `${what} C[${i}] at ${threads} threads: ${c[i]}, float64 product ${want}`,
          );
        }
    }
  });
}

test('a long product (split over rows at 2 or more threads) equals the float64 product, fp32 and bf16, with op(B) as stored or transposed and a bf16 output with its bias, at 1, 2, 3 and 4 threads', {
  skip,
}, () => {
  // rows not a multiple of the 64-row blocks; fp32 n <= k (B transposed first) and n > k
  for (const [m, n, k] of [
    [1100, 200, 300],
    [1100, 330, 70],
  ] as const)
    for (const transB of [false, true]) checkSplitRows(m, n, k, transB);
});

/** matmul, matmulBf16 and matmulBf16To (with a bias) of op(A) op(B), A [m, k], at 1 to 4 threads against the float64 product. */
function checkSplitRows(
  m: number,
  n: number,
  k: number,
  transB: boolean,
): void {
  const lib = nativeAddon()!;
  const a = randomArray(m * k, 5),
    b = randomArray(k * n, 6), // [k, n], or [n, k] when transB
    bias = randomArray(n, 7);
  const [ab, bb] = [new Uint16Array(m * k), new Uint16Array(k * n)];
  lib.toBf16(a, ab);
  lib.toBf16(b, bb);
  const [af, bf] = [new Float32Array(m * k), new Float32Array(k * n)];
  lib.fromBf16(ab, af);
  lib.fromBf16(bb, bf);
  const reference = (x: Float32Array, y: Float32Array) => {
    const c = new Float64Array(m * n);
    for (let i = 0; i < m; i++)
      for (let r = 0; r < k; r++) {
        const xi = x[i * k + r]!;
        for (let j = 0; j < n; j++)
          c[i * n + j] += xi * y[transB ? j * k + r : r * n + j]!;
      }
    return c;
  };
  const exact = { fp32: reference(a, b), bf16: reference(af, bf) };
  const where = `[${m}, ${k}] x [${k}, ${n}]${transB ? ' (B stored transposed)' : ''}`;
  withThreadsRestored(lib, () => {
    for (const threads of [1, 2, 3, 4]) {
      lib.setThreads(threads);
      const c32 = new Float32Array(m * n),
        c16 = new Float32Array(m * n),
        cTo = new Uint16Array(m * n);
      lib.matmul(a, b, c32, 1, 0, 0, m, n, k, false, transB);
      const impl = lib.matmulBf16(ab, bb, c16, 1, 0, 0, m, n, k, false, transB);
      lib.matmulBf16To(ab, bb, cTo, bias, 1, 0, 0, m, n, k, false, transB);
      if (threads > 1 && !impl.startsWith('emulated'))
        assert.match(impl, /^split over rows/, `${where} at ${threads}`);
      const cToF = new Float32Array(m * n);
      lib.fromBf16(cTo, cToF);
      for (let i = 0; i < m * n; i++) {
        // float32 sums of k products of values in [-1, 1): a lost, doubled or shifted block of rows is off by far more
        const tol = 2e-6 * k;
        const at = `C[${Math.floor(i / n)}, ${i % n}] of ${where} at ${threads} threads`;
        assert.ok(
          Math.abs(c32[i]! - exact.fp32[i]!) <= tol,
          `fp32 ${at}: ${c32[i]}, float64 ${exact.fp32[i]}`,
        );
        assert.ok(
          Math.abs(c16[i]! - exact.bf16[i]!) <= tol,
          `bf16 ${at}: ${c16[i]}, float64 ${exact.bf16[i]}`,
        );
        const want = exact.bf16[i]! + bias[i % n]!;
        // rounded once to bf16: within half of its last place (2^-8 relative), plus the sums' error
        assert.ok(
          Math.abs(cToF[i]! - want) <= Math.abs(want) / 256 + tol,
          `bf16 output with bias ${at}: ${cToF[i]}, float64 ${want}`,
        );
      }
    }
  });
}

/**
 * The path matmulBf16 names for op(A) B of A [m, k] (stored [k, m] when transA) and B [k, n] at 2
 * threads, in a fresh process (the addon reads its variables once) with `variable` set to
 * `value`; and that process's stderr.
 */
function bf16PathWith(
  variable: string,
  value: string,
  [m, n, k]: readonly [number, number, number],
  transA: boolean,
): { impl: string; stderr: string } {
  const script = `
    const { nativeAddon } = await import('./native-addon.js');
    const lib = nativeAddon();
    lib.setThreads(2);
    const impl = lib.matmulBf16(new Uint16Array(${k * m}).fill(0x3f80), new Uint16Array(${k * n}).fill(0x3f80),
      new Float32Array(${m * n}), 1, 0, 0, ${m}, ${n}, ${k}, ${transA}, false);
    console.log(JSON.stringify({ impl }));`;
  const r = spawnSync(process.execPath, ['--input-type=module', '-e', script], {
    cwd: dirname(fileURLToPath(import.meta.url)),
    encoding: 'utf8',
    env: { ...process.env, [variable]: value },
  });
  assert.equal(r.status, 0, r.stderr);
  const { impl } = JSON.parse(r.stdout.trim().split('\n').at(-1)!) as {
    impl: string;
  };
  return { impl, stderr: r.stderr };
}

test('LAYERWISE_SPLIT_REDUCTION_MAX moves the bound of the split over k (0: never), and a malformed value is reported and the default kept', {
  skip,
}, (t) => {
  const run = (value: string) =>
    bf16PathWith(
      'LAYERWISE_SPLIT_REDUCTION_MAX',
      value,
      [160, 520, 2100],
      true,
    );
  const split = run('');
  if (split.impl.startsWith('emulated')) {
    t.skip('no bf16 products on this CPU: no name tells the paths apart');
    return;
  }
  assert.match(split.impl, /^split over k/, 'the default bound (2^20)');
  assert.doesNotMatch(run('0').impl, /^split over k/, 'bound 0: never split');
  assert.doesNotMatch(
    run(String(160 * 520 - 1)).impl,
    /^split over k/,
    'an output one element above the bound',
  );
  const bad = run('lots');
  assert.match(bad.impl, /^split over k/, 'the default kept');
  assert.match(
    bad.stderr,
    /LAYERWISE_SPLIT_REDUCTION_MAX=lots is not a non-negative integer/,
  );
});

test('LAYERWISE_SPLIT_ROWS_MIN moves the rows a team member needs for the split over rows (0: never), and a malformed value is reported and the default kept', {
  skip,
}, (t) => {
  const run = (value: string) =>
    bf16PathWith('LAYERWISE_SPLIT_ROWS_MIN', value, [600, 100, 50], false);
  const split = run('');
  if (split.impl.startsWith('emulated')) {
    t.skip('no bf16 products on this CPU: no name tells the paths apart');
    return;
  }
  assert.match(
    split.impl,
    /^split over rows/,
    'the default: 256 rows a member',
  );
  assert.doesNotMatch(run('0').impl, /^split over rows/, '0: never split');
  assert.doesNotMatch(
    run('301').impl,
    /^split over rows/,
    '300 rows a member, one short',
  );
  assert.match(run('300').impl, /^split over rows/, '300 rows a member');
  const bad = run('-3');
  assert.match(bad.impl, /^split over rows/, 'the default kept');
  assert.match(
    bad.stderr,
    /LAYERWISE_SPLIT_ROWS_MIN=-3 is not a non-negative integer/,
  );
});

test("a dense layer's input gradient dy W^T (a long product, W a shared [n, k] weight with n <= k, which matmul.cc transposes first) gives the product on W^T transposed by hand bit for bit, and the float64 product, alone and over a broadcast batch, at 1 and 2 threads", {
  skip,
}, () => {
  const lib = nativeAddon()!;
  // m past the 512 rows, n k = 256 x 300 past the 2^16 floats, none a multiple of 16 but n
  const [m, n, k, batch] = [517, 256, 300, 2];
  const a = randomArray(batch * m * k, 5),
    w = randomArray(n * k, 6); // W stored [n, k]
  const wt = new Float32Array(k * n);
  for (let j = 0; j < n; j++)
    for (let r = 0; r < k; r++) wt[r * n + j] = w[j * k + r]!;
  withThreadsRestored(lib, () => {
    for (const threads of [1, 2]) {
      lib.setThreads(threads);
      for (const [b, aStride] of [
        [1, 0],
        [batch, m * k],
      ] as const) {
        const viaT = new Float32Array(b * m * n),
          byHand = new Float32Array(b * m * n);
        lib.matmul(a, w, viaT, b, aStride, 0, m, n, k, false, true);
        lib.matmul(a, wt, byHand, b, aStride, 0, m, n, k, false, false);
        assert.deepEqual(viaT, byHand, `batch ${b} at ${threads} threads`);
        for (const i of [0, 1, m * n - 1, b * m * n - 1]) {
          const [p, row, col] = [
            Math.floor(i / (m * n)),
            Math.floor(i / n) % m,
            i % n,
          ];
          let want = 0;
          for (let r = 0; r < k; r++)
            want += a[p * aStride + row * k + r]! * w[col * k + r]!;
          assert.ok(
            Math.abs(viaT[i]! - want) <= 2e-6 * k,
            `C[${i}] batch ${b} at ${threads} threads: ${viaT[i]}, float64 product ${want}`,
          );
        }
      }
    }
  });
});

test('native kernels split over a team of 4 (more members than this machine may have cores) give their 1-thread results: layer norm gradient, column and row sums, segment sums, broadcast binary ops, GELU gradient', {
  skip,
}, () => {
  const lib = nativeAddon()!;
  // sizes that are not multiples of 4 threads, 16 floats or 64-row blocks
  const [rows, cols] = [1003, 100];
  const dy = randomArray(rows * cols, 11),
    xhat = randomArray(rows * cols, 12),
    g = randomArray(cols, 13);
  const rstd = Float32Array.from(randomArray(rows, 14), (v) => 1 + Math.abs(v));
  const [dyBf, xhatBf] = [
    new Uint16Array(rows * cols),
    new Uint16Array(rows * cols),
  ];
  lib.toBf16(dy, dyBf);
  lib.toBf16(xhat, xhatBf);
  const wide = randomArray(2 * 50_001, 15),
    row = randomArray(50_001, 16);
  const ids = Int32Array.from(
    { length: 5000 },
    (_, i) => ((i * 7919) % 40) - 1,
  ); // -1 and 38: outside [0, 37), skipped
  const segData = randomArray(5000 * cols, 17);
  const run = () => {
    const out: Record<string, Float32Array> = {};
    for (const [what, d, x] of [
      ['f32', dy, xhat],
      ['bf16', dyBf, xhatBf],
    ] as const) {
      const [dx, dg, db] = [
        new Float32Array(rows * cols),
        new Float32Array(cols),
        new Float32Array(cols),
      ];
      lib.layerNormGradAny(d, x, rstd, g, dx, dg, db, rows, cols);
      Object.assign(out, {
        [`layerNormGrad ${what} dx`]: dx,
        [`layerNormGrad ${what} dg`]: dg,
        [`layerNormGrad ${what} db`]: db,
      });
    }
    const colSums = (
      op: number,
      x: Float32Array | Uint16Array,
      outer: number,
      inner: number,
    ) => {
      const o = new Float32Array(inner);
      lib.reduceOuter(op, x, o, outer, inner);
      return o;
    };
    out['column sums by row blocks'] = colSums(0, dy, rows, cols);
    out['column sums by row blocks, bf16'] = colSums(0, dyBf, rows, cols);
    out['column sums of 100 rows (columns split)'] = colSums(0, dy, 100, 1003);
    out['column max of 100 rows (columns split)'] = colSums(2, dy, 100, 1003);
    const rowOps = (op: number, outer: number) => {
      const o = new Float32Array(outer);
      lib.reduce(op, wide, o, outer, wide.length / outer);
      return o;
    };
    out['sum of one long row'] = rowOps(0, 1);
    out['means of 2 long rows'] = rowOps(1, 2);
    out['max of 2 long rows'] = rowOps(2, 2);
    out['min of one long row'] = rowOps(3, 1);
    for (const segments of [37, 4000]) {
      // 37: rows split over the team into partial outputs; 4000: columns split
      const o = new Float32Array(segments * cols);
      lib.segmentSum(
        segData,
        ids.map((s) => (segments === 37 ? s : s * 100 + 7)),
        o,
        5000,
        cols,
        segments,
      );
      out[`segment sums into ${segments}`] = o;
    }
    const sum = new Float32Array(wide.length);
    lib.binary(0, wide, [2, 50_001], row, [50_001], sum, [2, 50_001]);
    out['[2, 50001] + [50001]'] = sum;
    const big = randomArray(70_001, 18);
    const gg = new Float32Array(big.length);
    lib.geluGrad(big, wide.subarray(0, big.length), gg);
    out['GELU gradient'] = gg;
    return out;
  };
  withThreadsRestored(lib, () => {
    lib.setThreads(1);
    const one = run();
    lib.setThreads(4);
    const four = run();
    const again = run();
    // the same reference the 1-thread kernels are tested against elsewhere: [2, 50001] + [50001] by hand
    for (let i = 0; i < wide.length; i++)
      assert.equal(
        one['[2, 50001] + [50001]']![i],
        Math.fround(wide[i]! + row[i % 50_001]!),
        `sum[${i}]`,
      );
    for (const [what, want] of Object.entries(one)) {
      const got = four[what]!;
      assert.deepEqual(
        again[what],
        got,
        `${what}: two runs at 4 threads differ`,
      );
      // sums in another order (member partials, pieces of a row) round differently; the rest is exact
      const reordered = / dg| db|sum of one|means|segment sums into 37/.test(
        what,
      );
      for (let i = 0; i < want.length; i++)
        if (reordered)
          assert.ok(
            Math.abs(got[i]! - want[i]!) <= 1e-5 * (1 + Math.abs(want[i]!)),
            `${what}[${i}]: ${got[i]} at 4 threads, ${want[i]} at 1`,
          );
        else assert.equal(got[i], want[i], `${what}[${i}] at 4 threads`);
    }
    // segment sums against float64: a lost or doubled member partial is off by whole rows
    const seg = one['segment sums into 37']!;
    const exact = new Float64Array(37 * cols);
    ids.forEach((s, r) => {
      if (s >= 0 && s < 37)
        for (let c = 0; c < cols; c++)
          exact[s * cols + c] += segData[r * cols + c]!;
    });
    for (const o of [seg, four['segment sums into 37']!])
      for (let i = 0; i < exact.length; i++)
        assert.ok(
          Math.abs(o[i]! - exact[i]!) <= 1e-4 * (1 + Math.abs(exact[i]!)),
          `segment sum ${i}`,
        );
  });
});

test('native host AdamW and SGD equal the JS host optimizer within 1e-6', {
  skip,
}, () => {
  const lib = nativeAddon()!;
  const n = 100_003; // above the threading threshold, not a multiple of the vector width
  for (const step of [1, 2, 7]) {
    const adam = { ...defaultOptimizerConfig('adamw'), weightDecay: 0.1 };
    const p = randomArray(n, 1),
      g = randomArray(n, 2),
      m = randomArray(n, 3).map(Math.abs),
      v = randomArray(n, 4).map(Math.abs);
    const [p2, m2, v2] = [p.slice(), m.slice(), v.slice()];
    hostUpdate(adam, 2, p, g, { m, v }, 1e-2, 0.5, step);
    lib.adamw(
      p2,
      g,
      m2,
      v2,
      1e-2,
      adam.beta1,
      adam.beta2,
      adam.epsilon,
      adam.weightDecay,
      step,
      0.5,
    );
    for (const [js, nat, what] of [
      [p, p2, 'p'],
      [m, m2, 'm'],
      [v, v2, 'v'],
    ] as const) {
      let worst = 0;
      for (let i = 0; i < n; i++)
        worst = Math.max(
          worst,
          Math.abs(js[i]! - nat[i]!) / Math.max(1, Math.abs(js[i]!)),
        );
      assert.ok(
        worst <= 1e-6,
        `AdamW step ${step}: ${what} differs by ${worst}`,
      );
    }
  }
  const sgd = { ...defaultOptimizerConfig('sgd'), weightDecay: 0.01 };
  const p = randomArray(n, 5),
    g = randomArray(n, 6),
    vel = randomArray(n, 7);
  const [p2, vel2] = [p.slice(), vel.slice()];
  hostUpdate(sgd, 2, p, g, { velocity: vel }, 0.1, 1, 1);
  lib.sgd(p2, g, vel2, 0.1, sgd.momentum, sgd.weightDecay, 1);
  for (let i = 0; i < n; i++)
    assert.ok(
      Math.abs(p[i]! - p2[i]!) <= 1e-6 * Math.max(1, Math.abs(p[i]!)),
      `SGD p[${i}]`,
    );
  assert.throws(
    () =>
      lib.adamw(p2, g.subarray(1), vel2, vel2, 0.1, 0.9, 0.99, 1e-8, 0, 1, 1),
    /length/,
  );
});

test('native AdamW over many parameters in one call (adamwMulti) equals adamw on each bit for bit at 1 and 2 threads and any alignment of its outputs, its bf16 copies of the new p toBf16 of them; sumSquaresMulti equals Square then Sum', {
  skip,
}, async () => {
  const lib = nativeAddon()!;
  // pieces that straddle the threads' even split, sizes below and above the vector width
  const sizes = [70, 40_001, 1, 30_001, 5, 65_536, 17];
  await withThreadsRestored(lib, async () => {
    for (const threads of [1, 2, 4]) {
      lib.setThreads(threads);
      for (const step of [1, 5]) {
        // the first 3 parameters decayed, then all (where p's decay factor is not 1, fused and
        // unfused products differ, so a path that computes otherwise shows)
        const decayed = step === 1 ? 3 : sizes.length;
        const ins = sizes.map((n, j) => [
          randomArray(n, 10 * j + 1),
          randomArray(n, 10 * j + 2),
          randomArray(n, 10 * j + 3),
          randomArray(n, 10 * j + 4).map(Math.abs),
        ]);
        const hyper = [1e-2, 0.9, 0.95, 1e-8] as const;
        const expected = ins.map(([p, g, m, v], j) => {
          const out = [p!.slice(), m!.slice(), v!.slice()];
          lib.adamw(
            p!,
            g!,
            m!,
            v!,
            ...hyper,
            j < decayed ? 0.1 : 0,
            step,
            0.5,
            out[0],
            out[1],
            out[2],
          );
          return out;
        });
        // outputs at every offset in a 32-byte line, each of p, m, v at its own: the kernel
        // streams an output from the registers where it is aligned once p is, through an L1
        // buffer where not, and computes a few elements alone to align them; the bits are the same
        const outs = [0, 1, 2].map((k) =>
          sizes.map((n, j) => {
            const at = (j + 3 * k) % 8;
            return new Float32Array(n + 8).subarray(at, at + n);
          }),
        );
        const col = (k: number) => ins.map((q) => q[k]!);
        // the new p's bf16 rounding for every other parameter
        const bf16s = sizes.map((n, j) =>
          j % 2 === 0 ? new Uint16Array(n) : null,
        );
        lib.adamwMulti(
          col(0),
          col(1),
          col(2),
          col(3),
          outs[0]!,
          outs[1]!,
          outs[2]!,
          ...hyper,
          0.1,
          decayed,
          step,
          0.5,
          bf16s,
        );
        bf16s.forEach((bf, j) => {
          if (bf === null) return;
          const want = new Uint16Array(bf.length);
          lib.toBf16(expected[j]![0]!, want);
          assert.deepEqual(bf, want, `${threads} threads: bf16 copy of p ${j}`);
        });
        sizes.forEach((_, j) =>
          ['p', 'm', 'v'].forEach((what, k) =>
            assert.deepEqual(
              outs[k]![j],
              expected[j]![k],
              `${threads} threads, step ${step}: ${what} of parameter ${j}`,
            ),
          ),
        );
      }
      const xs = sizes.map((n, j) => randomArray(n, 100 + j));
      const sums = new Float32Array(sizes.length);
      lib.sumSquaresMulti(xs, sums);
      await initBackend('native');
      const composed = tf.tidy(() =>
        xs.map((x) => tf.sum(tf.square(tf.tensor(x))).dataSync()[0]!),
      );
      composed.forEach((c, j) =>
        assert.ok(
          Math.abs(sums[j]! - c) <= 1e-7 * c,
          `${threads} threads: sum of squares ${j}: ${sums[j]} vs ${c}`,
        ),
      );
    }
  });
  const one = [new Float32Array(4)];
  assert.throws(
    () =>
      lib.adamwMulti(
        one,
        [new Float32Array(3)],
        one,
        one,
        one,
        one,
        one,
        0.1,
        0.9,
        0.99,
        1e-8,
        0,
        0,
        1,
        1,
      ),
    /g must have as many arrays as p, each of its parameter's length/,
  );
  assert.throws(
    () => lib.sumSquaresMulti(one, new Float32Array(2)),
    /one element per array/,
  );
});

test('native output buffers are reused across steps, never while a tensor view or a caller can still see them', {
  skip,
}, async () => {
  await initBackend('native');
  const pool = (tf.backend() as NativeBackend).pool;
  const a = tf.tensor(randomArray(64 * 1024, 1), [256, 256]);
  const other = tf.tensor(randomArray(64 * 1024, 2), [256, 256]);
  // same shapes as the products below, other values: a reused buffer would be overwritten with them
  const step = () =>
    tf.tidy(() => tf.sum(tf.relu(tf.matMul(other, a))).dataSync()[0]!);
  const first = step();
  const reused = pool.stats.reused;
  assert.equal(step(), first);
  assert.ok(
    pool.stats.reused > reused,
    "the second step reuses the first step's buffers",
  );
  // a caller's dataSync array keeps its values after the tensor is disposed and kernels run again
  const y = tf.matMul(a, a);
  const seen = y.dataSync() as Float32Array;
  const copy = seen.slice();
  y.dispose();
  for (let i = 0; i < 3; i++) step();
  assert.deepEqual(seen, copy);
  // a slice (the cpu kernel returns a view of its input's buffer) outlives its input intact
  const z = tf.matMul(a, a);
  const part = tf.slice(z, [0, 0], [128, 256]);
  const expected = tf.tidy(() =>
    (tf.matMul(a, a).dataSync() as Float32Array).slice(0, 128 * 256),
  ); // not z.dataSync(): that would disown z's buffer
  z.dispose();
  for (let i = 0; i < 3; i++) step();
  assert.deepEqual(part.dataSync(), expected);
  tf.dispose([a, other, part]);
});

test("the fused device AdamW and SGD updates on native equal the composed ones on cpu within 1e-6 (AdamW in several calls of at most the kernel's elementsPerCall, decayed parameters in two of them)", {
  skip,
}, async () => {
  await initBackend('native');
  const per = (
    tf.getKernel(ADAMW_MULTI_KERNEL, 'native') as { elementsPerCall?: number }
  ).elementsPerCall!;
  assert.ok(per > 0, 'native registers AdamW with elementsPerCall');
  const rows = Math.ceil(per / 1000) + 100; // w2 alone over one call's elements
  const configs: OptimizerConfig[] = [
    { ...defaultOptimizerConfig('adamw'), weightDecay: 0.1 },
    { ...defaultOptimizerConfig('sgd'), weightDecay: 0.01 },
    { ...defaultOptimizerConfig('sgd'), momentum: 0 },
  ];
  for (const config of configs) {
    const run = async (backend: string) => {
      await initBackend(backend);
      const params = new Map([
        ['w', tf.variable(tf.tensor(randomArray(300 * 70, 1), [300, 70]))],
        ['b', tf.variable(tf.tensor(randomArray(70, 2)))],
        // over elementsPerCall elements: native's AdamW runs [w], [w2], [b] as three calls
        [
          'w2',
          tf.variable(tf.tensor(randomArray(rows * 1000, 3), [rows, 1000])),
        ],
      ]);
      const opt = new DeviceOptimizer(config);
      for (let s = 0; s < 3; s++) {
        const grads = new Map(
          [...params].map(
            ([k, p], i) =>
              [k, tf.tensor(randomArray(p.size, 10 * s + i), p.shape)] as const,
          ),
        );
        opt.apply(params, grads, 0.01, s === 1 ? 0.5 : 1);
        tf.dispose([...grads.values()]);
      }
      const out = [...params.values()].map((p) => p.dataSync() as Float32Array);
      opt.dispose();
      tf.dispose([...params.values()]);
      return out;
    };
    const cpu = await run('cpu');
    const native = await run('native');
    cpu.forEach((c, i) =>
      c.forEach((v, j) =>
        assert.ok(
          Math.abs(v - native[i]![j]!) <= 1e-6 * Math.max(1, Math.abs(v)),
          `${config.kind} momentum ${config.momentum}: parameter ${i}[${j}] ${native[i]![j]} vs cpu ${v}`,
        ),
      ),
    );
  }
});

test('300 training steps on native leak no tensor and keep the resident set flat', {
  skip,
}, async () => {
  const { buildModel } = await import('../model/model.js');
  const { getPreset } = await import('../model/presets.js');
  const { initParams } = await import('../model/init.js');
  const { Stage } = await import('../pipeline/stage.js');
  await initBackend('native');
  const model = buildModel(
    getPreset('charlm-tiny').make(
      { vocab: 40 },
      { layers: 1, dModel: 32, heads: 2, context: 16 },
    ),
  );
  const stage = new Stage(
    model,
    { from: 0, to: model.blocks.length },
    initParams(model.blocks, 3),
    { ...defaultOptimizerConfig('adamw'), clipNorm: 1 },
  );
  const rng = new Rng(4);
  const batch = () =>
    tf.tensor(
      Int32Array.from({ length: 8 * 16 }, () => rng.int(40)),
      [8, 16],
      'int32',
    );
  const tensors: number[] = [];
  const rss: number[] = [];
  try {
    for (let step = 1; step <= 300; step++) {
      stage.forward(0, batch(), { keep: true, grad: true, labels: batch() });
      stage.backward(0, null, 1);
      stage.step(1e-3, 1);
      await stage.flush();
      if (step === 50 || step === 300) {
        tensors.push(tf.memory().numTensors);
        rss.push(process.memoryUsage().rss);
      }
    }
  } finally {
    stage.dispose();
  }
  assert.equal(
    tensors[1],
    tensors[0],
    `tensors held after step 50 and 300: ${tensors}`,
  );
  const growth = (rss[1]! - rss[0]!) / 2 ** 20;
  assert.ok(
    growth < 64,
    `the resident set grew by ${growth.toFixed(1)} MiB from step 50 to step 300`,
  );
});

test('native products and convolutions survive signals: 1500 of each under the V8 CPU profiler (SIGPROF to the JS thread) exit cleanly', {
  skip,
}, async () => {
  // oneDNN's JIT GEMM kernels point rsp at the heap; a signal during one corrupted the heap
  // (native/src/signals.h): this run aborted with "corrupted size vs. prev_size" 3 of 3 times
  const { spawnSync } = await import('node:child_process');
  const { mkdtempSync, readdirSync, rmSync } = await import('node:fs');
  const { tmpdir } = await import('node:os');
  const { join } = await import('node:path');
  const dir = mkdtempSync(join(tmpdir(), 'layerwise-sig-'));
  try {
    const script = `
      const { initBackend } = await import(${JSON.stringify(new URL('./index.js', import.meta.url).href)});
      const { tf } = await import(${JSON.stringify(new URL('./tfjs.js', import.meta.url).href)});
      await initBackend('native');
      const a = tf.randomNormal([64, 256]), b = tf.randomNormal([256, 256]);
      const x = tf.randomNormal([8, 28, 28, 4]), w = tf.randomNormal([3, 3, 4, 16]);
      for (let i = 0; i < 1500; i++) tf.tidy(() => [tf.matMul(a, b), tf.conv2d(x, w, 1, 'same')]);
      console.log('finished');`;
    const r = spawnSync(
      process.execPath,
      [
        '--cpu-prof',
        '--cpu-prof-dir',
        dir,
        '--input-type=module',
        '-e',
        script,
      ],
      { encoding: 'utf8', timeout: 120_000 },
    );
    assert.equal(
      r.signal,
      null,
      `killed by ${r.signal}: ${r.stderr.slice(-500)}`,
    );
    assert.equal(r.status, 0, r.stderr.slice(-500));
    assert.match(r.stdout, /finished/);
    assert.equal(
      readdirSync(dir).filter((f) => f.endsWith('.cpuprofile')).length,
      1,
      'the profiler ran',
    );
  } finally {
    rmSync(dir, { recursive: true, force: true });
  }
});

test('loading the addon starts no OpenMP team; initBackend starts the thread its team needs (idle teams throttle libgomp spin-waits)', {
  skip: skip || (process.platform !== 'linux' && 'reads /proc/self/task'),
}, () => {
  // a fresh process: this runner has loaded the addon already. Threads counted after the load
  // and after initBackend('native', {threads: 2}), whose team of 2 is this thread and 1 worker;
  // a team started at load (as the addon once did, machine-wide) would already hold it
  const script = `
    import { readdirSync } from 'node:fs';
    const count = () => readdirSync('/proc/self/task').length;
    const { nativeAddon } = await import('./native-addon.js');
    nativeAddon();
    const loaded = count();
    const { initBackend } = await import('./index.js');
    await initBackend('native', { threads: 2 });
    console.log(JSON.stringify({ loaded, team: count() }));`;
  const out = execFileSync(
    process.execPath,
    ['--input-type=module', '-e', script],
    { cwd: dirname(fileURLToPath(import.meta.url)), encoding: 'utf8' },
  );
  const { loaded, team } = JSON.parse(out.trim().split('\n').at(-1)!);
  assert.equal(
    team - loaded,
    1,
    `threads after load ${loaded}, with the team ${team}`,
  );
});
