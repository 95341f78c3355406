import assert from 'node:assert/strict';
import { test } from 'node:test';
import { Worker } from 'node:worker_threads';
import * as tf from '@tensorflow/tfjs-core';
import { assertClose } from '../testing/assert-close.js';
import { LayerwiseError } from '../util/errors.js';
import { backendHeapBytes, initBackend } from './index.js';
import { deviceBytes } from './memory.js';

type Shape = number[];
const size = (s: Shape) => s.reduce((a, b) => a * b, 1);

/** Deterministic values in [-1, 1) (LCG), so failures reproduce. */
function values(shape: Shape, seed: number): Float32Array {
  let x = (seed * 2654435761) >>> 0;
  return Float32Array.from({ length: size(shape) }, () => {
    x = (Math.imul(x, 1664525) + 1013904223) >>> 0;
    return x / 2 ** 31 - 1;
  });
}

/** Run `f` on backend `name` and read its tensors back. */
async function on(
  name: string,
  f: () => tf.Tensor | tf.Tensor[],
): Promise<Float32Array[]> {
  await initBackend(name);
  return tf.tidy(() => {
    const r = f();
    return (Array.isArray(r) ? r : [r]).map((t) =>
      Float32Array.from(t.dataSync()),
    );
  });
}

const close = (
  x: ArrayLike<number>,
  y: ArrayLike<number>,
  what: string,
  tol = 1e-4,
) => assertClose(x, y, what, tol);

/** Naive float64 batched matmul with full broadcasting of batch dims: the reference. */
function refMatMul(
  a: Float32Array,
  sa: Shape,
  b: Float32Array,
  sb: Shape,
  tA: boolean,
  tB: boolean,
): Float64Array {
  const [a0, a1] = sa.slice(-2) as [number, number];
  const [b0, b1] = sb.slice(-2) as [number, number];
  const [m, k] = tA ? [a1, a0] : [a0, a1];
  const n = tB ? b0 : b1;
  const ba = sa.slice(0, -2);
  const bb = sb.slice(0, -2);
  const rank = Math.max(ba.length, bb.length);
  const pa = [...Array(rank - ba.length).fill(1), ...ba];
  const pb = [...Array(rank - bb.length).fill(1), ...bb];
  const bo = pa.map((d, i) => Math.max(d, pb[i]!));
  const out = new Float64Array(size(bo) * m * n);
  for (let t = 0; t < size(bo); t++) {
    let rest = t;
    let ia = 0;
    let ib = 0;
    let sA = 1;
    let sB = 1;
    for (let d = rank - 1; d >= 0; d--) {
      const c = rest % bo[d]!;
      rest = Math.floor(rest / bo[d]!);
      ia += (pa[d] === 1 ? 0 : c) * sA;
      ib += (pb[d] === 1 ? 0 : c) * sB;
      sA *= pa[d]!;
      sB *= pb[d]!;
    }
    for (let i = 0; i < m; i++) {
      for (let j = 0; j < n; j++) {
        let s = 0;
        for (let q = 0; q < k; q++) {
          const av = a[ia * m * k + (tA ? q * m + i : i * k + q)]!;
          const bv = b[ib * k * n + (tB ? j * k + q : q * n + j)]!;
          s += av * bv;
        }
        out[t * m * n + i * n + j] = s;
      }
    }
  }
  return out;
}

const MATMUL_CASES: [Shape, Shape, boolean, boolean][] = [
  [[5, 7], [7, 3], false, false],
  [[7, 5], [7, 3], true, false],
  [[5, 7], [3, 7], false, true],
  [[7, 5], [3, 7], true, true],
  [[2, 4, 5, 7], [7, 3], false, false],
  [[2, 4, 7, 5], [3, 7], true, true],
  [[2, 1, 5, 7], [3, 7, 6], false, false],
  [[4, 7, 5], [1, 3, 7], true, true],
  [[3, 6, 4], [3, 6, 5], true, false],
  [[6, 4], [3, 5, 4], false, true],
  [[40, 64], [3, 64], false, true],
  [[3, 64], [40, 64], false, true],
  [[2, 3, 16], [2, 20, 16], false, true],
  [[5, 0], [0, 3], false, false],
];

test('wasm matMul matches a float64 reference (transposes, batch broadcasting, empty)', async () => {
  for (const [sa, sb, tA, tB] of MATMUL_CASES) {
    const a = values(sa, 1);
    const b = values(sb, 2);
    const [got] = await on('wasm', () =>
      tf.matMul(tf.tensor(a, sa), tf.tensor(b, sb), tA, tB),
    );
    close(
      got!,
      refMatMul(a, sa, b, sb, tA, tB),
      `matMul ${sa} ${sb} ${tA} ${tB}`,
    );
  }
});

test('matMul gradient matches central differences on wasm and cpu (broadcast inputs summed)', async () => {
  for (const [sa, sb, tA, tB] of MATMUL_CASES.slice(0, 13)) {
    const a = values(sa, 3);
    const b = values(sb, 4);
    const ref = refMatMul(a, sa, b, sb, tA, tB);
    const r = values([ref.length], 5);
    // L = sum(C * R) is linear in each input, so central differences with step 1 are exact.
    const loss = (x: Float32Array, y: Float32Array) =>
      refMatMul(x, sa, y, sb, tA, tB).reduce((s, c, i) => s + c * r[i]!, 0);
    const fd = (which: 0 | 1) => {
      const base = which === 0 ? a : b;
      return Float64Array.from(base, (_, i) => {
        const up = Float32Array.from(base);
        const down = Float32Array.from(base);
        up[i]! += 1;
        down[i]! -= 1;
        return which === 0
          ? (loss(up, b) - loss(down, b)) / 2
          : (loss(a, up) - loss(a, down)) / 2;
      });
    };
    const cShape = tf.tidy(
      () => tf.matMul(tf.zeros(sa), tf.zeros(sb), tA, tB).shape,
    );
    const grads = () =>
      tf.grads((x: tf.Tensor, y: tf.Tensor) =>
        tf.sum(tf.mul(tf.matMul(x, y, tA, tB), tf.tensor(r, cShape))),
      )([tf.tensor(a, sa), tf.tensor(b, sb)]);
    for (const backend of ['wasm', 'cpu']) {
      if (
        backend === 'cpu' &&
        sa.length > 2 &&
        sb.length > 2 &&
        sa[0] !== sb[0]
      )
        continue; // stock cpu forward mis-broadcasts
      const [da, db] = await on(backend, grads);
      close(da!, fd(0), `${backend} dA ${sa} ${sb} ${tA} ${tB}`);
      close(db!, fd(1), `${backend} dB ${sa} ${sb} ${tA} ${tB}`);
    }
  }
});

test('wasm fused matMul (bias, activations, transposes, batch) matches cpu', async () => {
  const cases: [Shape, Shape, boolean, boolean, Shape | null, string][] = [
    [[5, 7], [7, 3], false, false, [3], 'relu'],
    [[7, 5], [3, 7], true, true, [3], 'relu'],
    [[2, 5, 7], [7, 3], false, false, [3], 'elu'],
    [[2, 5, 7], [2, 3, 7], false, true, [5, 3], 'sigmoid'],
    [[2, 7, 5], [7, 3], true, false, null, 'linear'],
  ];
  for (const [sa, sb, tA, tB, sBias, activation] of cases) {
    const f = () =>
      tf.fused.matMul({
        a: tf.tensor(values(sa, 6), sa),
        b: tf.tensor(values(sb, 7), sb),
        transposeA: tA,
        transposeB: tB,
        bias: sBias ? tf.tensor(values(sBias, 8), sBias) : undefined,
        activation: activation as 'relu',
      });
    const [want] = await on('cpu', f);
    const [got] = await on('wasm', f);
    close(got!, want!, `fused ${sa} ${sb} ${tA} ${tB} ${activation}`);
  }
});

test('wasm UnsortedSegmentSum and the gather gradient match cpu', async () => {
  const seg = () =>
    tf.unsortedSegmentSum(
      tf.tensor(values([6, 3], 9), [6, 3]),
      tf.tensor1d([2, 0, 2, 4, 0, 2], 'int32'),
      5,
    );
  close(
    (await on('wasm', seg))[0]!,
    (await on('cpu', seg))[0]!,
    'unsortedSegmentSum float32',
  );
  const segInt = () =>
    tf.unsortedSegmentSum(
      tf.tensor1d([1, 2, 3, 4], 'int32'),
      tf.tensor1d([1, 1, 0, 1], 'int32'),
      3,
    );
  assert.deepEqual([...(await on('wasm', segInt))[0]!], [3, 7, 0]);
  for (const [table, idx, axis] of [
    [[10, 4], [2, 3], 0],
    [[3, 8, 2], [5], 1],
  ] as [Shape, Shape, number][]) {
    const ids = Int32Array.from(values(idx, 10), (v) =>
      Math.floor(((v + 1) / 2) * table[axis]!),
    );
    const f = () =>
      tf.grad((t: tf.Tensor) =>
        tf.sum(tf.sin(tf.gather(t, tf.tensor(ids, idx, 'int32'), axis))),
      )(tf.tensor(values(table, 11), table));
    close(
      (await on('wasm', f))[0]!,
      (await on('cpu', f))[0]!,
      `gather grad ${table} ${idx} axis ${axis}`,
    );
  }
});

test('wasm conv2d and pooling gradients (filter, input, max/avg pool) match cpu', async () => {
  const cases: [
    Shape,
    Shape,
    number | [number, number],
    'same' | 'valid' | number,
  ][] = [
    [[2, 9, 9, 3], [3, 3, 3, 4], 1, 'same'],
    [[2, 9, 8, 3], [3, 2, 3, 4], 2, 'same'],
    [[1, 10, 10, 2], [4, 4, 2, 5], 3, 'valid'],
    [[3, 7, 7, 1], [2, 2, 1, 2], [2, 1], 'same'],
    [[2, 6, 7, 2], [3, 2, 2, 3], 2, 1],
    // Not [2, 1] strides with numeric pad: the stock wasm Conv2D forward corrupts the heap there.
  ];
  for (const [sx, sf, strides, pad] of cases) {
    const f = () =>
      tf.grads((x: tf.Tensor, w: tf.Tensor) =>
        tf.sum(
          tf.sin(tf.conv2d(x as tf.Tensor4D, w as tf.Tensor4D, strides, pad)),
        ),
      )([tf.tensor(values(sx, 12), sx), tf.tensor(values(sf, 13), sf)]);
    const [wx, ww] = await on('wasm', f);
    const [cx, cw] = await on('cpu', f);
    close(wx!, cx!, `conv2d dx ${sx} ${sf} ${strides} ${pad}`);
    close(ww!, cw!, `conv2d dW ${sx} ${sf} ${strides} ${pad}`);
  }
  // Shifted so some windows are all negative and some all zero (the stock wasm MaxPoolGrad bug).
  const x = values([2, 8, 8, 3], 14).map((v, i) => (i % 7 === 0 ? 0 : v - 0.3));
  for (const pool of [tf.maxPool, tf.avgPool]) {
    for (const [k, s, pad] of [
      [2, 2, 'valid'],
      [3, 2, 'same'],
      [3, 1, 'same'],
      [[2, 3], [1, 2], 'valid'],
    ] as const) {
      const f = () =>
        tf.grad((t: tf.Tensor) =>
          tf.sum(
            tf.sin(
              pool(
                t as tf.Tensor4D,
                k as [number, number],
                s as [number, number],
                pad,
              ),
            ),
          ),
        )(tf.tensor4d(x, [2, 8, 8, 3]));
      close(
        (await on('wasm', f))[0]!,
        (await on('cpu', f))[0]!,
        `${pool.name} grad ${k} ${s} ${pad}`,
      );
    }
  }
});

test('gradients of the ops layerwise trains with run on wasm and match cpu', async () => {
  const A = () => tf.tensor(values([4, 6], 15), [4, 6]);
  const P = () => tf.add(tf.abs(A()), 0.5); // positive, for log, sqrt, rsqrt, pow
  const ops: [string, (x: tf.Tensor) => tf.Tensor][] = [
    [
      'add/sub/mul/div broadcast',
      (x) =>
        tf.div(
          tf.sub(tf.mul(tf.add(x, tf.ones([6])), x), 0.3),
          tf.add(tf.square(x), 1),
        ),
    ],
    ['tanh exp', (x) => tf.add(tf.tanh(x), tf.exp(x))],
    [
      'log sqrt rsqrt',
      (x) => tf.add(tf.add(tf.log(x), tf.sqrt(x)), tf.rsqrt(x)),
    ],
    [
      'softmax logSoftmax',
      (x) => tf.add(tf.mul(tf.softmax(x), x), tf.logSoftmax(x)),
    ],
    [
      'mean sum max',
      (x) => tf.add(tf.add(tf.mean(x, 1), tf.sum(x, 1)), tf.max(x, 1)),
    ],
    [
      'reshape transpose slice concat',
      (x) =>
        tf.concat(
          [tf.slice(tf.transpose(tf.reshape(x, [6, 4])), [1, 0], [2, 6]), x],
          0,
        ),
    ],
    [
      'relu erf pow sigmoid',
      (x) =>
        tf.add(
          tf.add(tf.relu(x), tf.erf(x)),
          tf.add(tf.pow(tf.abs(x), 1.5), tf.sigmoid(x)),
        ),
    ],
    [
      'where greater oneHot',
      (x) =>
        tf.mul(
          tf.where(tf.greater(A(), 0.1), x, tf.neg(x)),
          tf.oneHot(tf.tensor1d([0, 5, 2, 1], 'int32'), 6),
        ),
    ],
    ['matMul', (x) => tf.matMul(x, x, true, false)],
  ];
  for (const [name, op] of ops) {
    const input = name.startsWith('log') ? P : A;
    const f = () => tf.grad((x: tf.Tensor) => tf.sum(tf.sin(op(x))))(input());
    close((await on('wasm', f))[0]!, (await on('cpu', f))[0]!, name);
  }
});

test('initBackend rejects unknown names and missing optional packages with clear messages', async () => {
  await assert.rejects(
    initBackend('gpu'),
    (err: unknown) =>
      err instanceof LayerwiseError &&
      /unknown backend 'gpu'.*wasm, cpu, native, tensorflow, webgpu/.test(
        err.message,
      ),
  );
  await assert.rejects(
    initBackend('tensorflow'),
    (err: unknown) =>
      err instanceof LayerwiseError &&
      err.message.includes('npm install @tensorflow/tfjs-node'),
  );
  // webgpu ships with layerwise now: it initialises where Dawn finds an adapter, else says what to install
  const wg = await initBackend('webgpu').then(
    () => 'ok',
    (err: unknown) => err,
  );
  assert.ok(
    wg === 'ok' ||
      (wg instanceof LayerwiseError &&
        /found no GPU adapter.*apt-get install libegl1/.test(wg.message)),
    `webgpu: ${String(wg)}`,
  );
  await assert.rejects(initBackend('wasm', { threads: 0 }), LayerwiseError);
});

test('deviceBytes counts live tensor bytes; backendHeapBytes is the wasm heap', async () => {
  await initBackend('wasm');
  const before = deviceBytes();
  const t = tf.zeros([1000]);
  assert.equal(deviceBytes() - before, 4000);
  t.dispose();
  assert.equal(deviceBytes(), before);
  assert.ok((backendHeapBytes() ?? 0) >= 16 * 2 ** 20);
  await initBackend('cpu');
  assert.equal(backendHeapBytes(), undefined);
});

test('wasm initialises and trains an embedding inside a worker_thread', async () => {
  const moduleUrl = new URL('./index.js', import.meta.url).href;
  const source = `
    import { parentPort } from 'node:worker_threads';
    import * as tf from '@tensorflow/tfjs-core';
    import { initBackend } from ${JSON.stringify(moduleUrl)};
    await initBackend('wasm');
    const g = tf.grad((t) => tf.sum(tf.matMul(tf.gather(t, tf.tensor1d([0, 2, 2], 'int32')), t, false, true)))(
      tf.tensor2d([[1, 2], [3, 4], [5, 6]]));
    parentPort.postMessage({ backend: tf.getBackend(), grad: Array.from(g.dataSync()) });`;
  // Resolve bare specifiers from this package: write the worker next to the compiled tests.
  const { writeFile, rm } = await import('node:fs/promises');
  const file = new URL('./worker-probe.tmp.mjs', import.meta.url);
  await writeFile(file, source);
  try {
    const msg = await new Promise<{ backend: string; grad: number[] }>(
      (resolve, reject) => {
        const worker = new Worker(file);
        worker.once('message', (m) => {
          resolve(m);
          void worker.terminate();
        });
        worker.once('error', reject);
      },
    );
    assert.equal(msg.backend, 'wasm');
    // L = sum_i sum_j g_i . t_j with g = rows [0,2,2]: dL/dt_j = sum_i g_i + (count of j in idx) * sum_j t_j.
    const rowSum = [1 + 5 + 5, 2 + 6 + 6];
    const total = [9, 12];
    const count = [1, 0, 2];
    const want = count.flatMap((c) => [
      rowSum[0]! + c * total[0]!,
      rowSum[1]! + c * total[1]!,
    ]);
    assert.deepEqual(msg.grad, want);
  } finally {
    await rm(file, { force: true });
  }
});
