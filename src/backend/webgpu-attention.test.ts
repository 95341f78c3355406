/**
 * The webgpu backend's WGSL flash attention (backend/webgpu-attention.ts) gives the cpu backend's
 * composed attention's context and gradient (dqkv) within 1e-4, and each query row's
 * log-sum-exp within 1e-4 of an f64 computation, on shapes with T not a multiple of the 64-row
 * block, several heads, batch > 1 and head widths 8 to 64; keeps nothing of size T x T (the
 * forward's outputs are B T D + B H T floats); runs one dispatch each way; and is what
 * model/layers.ts causalSelfAttention runs on webgpu. Skipped, saying why, where no WebGPU
 * adapter can be made.
 */

import assert from 'node:assert/strict';
import { test } from 'node:test';
import { causalSelfAttention } from '../model/layers.js';
import { Rng } from '../util/rng.js';
import { gpuQueue } from './gpu-queue.js';
import { initBackend } from './index.js';
import {
  CAUSAL_ATTENTION_GRAD_KERNEL,
  CAUSAL_ATTENTION_KERNEL,
  FLASH_ATTENTION_GRAD_KERNEL,
  FLASH_ATTENTION_KERNEL,
} from './kernel-names.js';
import { tf } from './tfjs.js';
import { installDawn } from './webgpu.js';

let why: string | false = false;
try {
  await installDawn();
} catch (e) {
  why = `no WebGPU adapter here: ${(e as Error).message}`;
}

type Shape = [b: number, t: number, h: number, dh: number];

/**
 * [B, T, H, dh]: T below, past and not a multiple of the 64-row block and of the key blocks; dh
 * a multiple of 4 (rows read as vec4s) and not (read as floats: wgsl-attention/forward.ts rowWidth).
 */
const SHAPES: Shape[] = [
  [2, 5, 2, 8],
  [1, 70, 2, 6],
  [1, 70, 3, 16],
  [2, 9, 2, 32],
  [1, 67, 1, 64],
  [1, 131, 2, 8],
];

interface Case {
  shape: Shape;
  qkv: Float32Array;
  dy: Float32Array;
}

function makeCase(shape: Shape): Case {
  const [b, t, h, dh] = shape;
  const rng = new Rng(b * 1000 + t * 10 + dh);
  const d = h * dh;
  const rand = (n: number) =>
    Float32Array.from({ length: n }, () => rng.normal());
  return { shape, qkv: rand(b * t * 3 * d), dy: rand(b * t * d) };
}

/** [ctx, dqkv] of the P pair (CAUSAL_ATTENTION_KERNEL) on the current backend. */
async function runP(c: Case): Promise<Float32Array[]> {
  const [b, t, h, dh] = c.shape;
  const qkv = tf.tensor(c.qkv, [b, t, 3 * h * dh]);
  const dy = tf.tensor(c.dy, [b, t, h * dh]);
  const engine = tf.engine();
  const [ctx, p] = engine.runKernel(
    CAUSAL_ATTENTION_KERNEL,
    { qkv },
    {
      heads: h,
    },
  ) as tf.Tensor[];
  const dqkv = engine.runKernel(
    CAUSAL_ATTENTION_GRAD_KERNEL,
    { dy, qkv, p: p! },
    { heads: h },
  ) as tf.Tensor;
  const out = [await ctx!.data(), await dqkv.data()] as Float32Array[];
  tf.dispose([qkv, dy, ctx!, p!, dqkv]);
  return out;
}

/** [ctx, lse, dqkv] of the flash pair on the current backend, and the forward's outputs' bytes. */
async function runFlash(
  c: Case,
): Promise<{ out: Float32Array[]; forwardBytes: number }> {
  const [b, t, h, dh] = c.shape;
  const qkv = tf.tensor(c.qkv, [b, t, 3 * h * dh]);
  const dy = tf.tensor(c.dy, [b, t, h * dh]);
  const engine = tf.engine();
  const before = tf.memory().numBytes;
  const [ctx, lse] = engine.runKernel(
    FLASH_ATTENTION_KERNEL,
    { qkv },
    {
      heads: h,
    },
  ) as tf.Tensor[];
  const forwardBytes = tf.memory().numBytes - before;
  const dqkv = engine.runKernel(
    FLASH_ATTENTION_GRAD_KERNEL,
    { dy, qkv, ctx: ctx!, lse: lse! },
    { heads: h },
  ) as tf.Tensor;
  const out = await Promise.all(
    [ctx!, lse!, dqkv].map((x) => x.data() as Promise<Float32Array>),
  );
  tf.dispose([qkv, dy, ctx!, lse!, dqkv]);
  return { out, forwardBytes };
}

/** Each query row's log-sum-exp of its scaled causal scores (f64), [B, H, T]. */
function lseOf({ shape: [b, t, h, dh], qkv }: Case): Float64Array {
  const at = (bi: number, ti: number, part: number, hi: number, d: number) =>
    qkv[(((bi * t + ti) * 3 + part) * h + hi) * dh + d]!;
  const out = new Float64Array(b * h * t);
  for (let bi = 0; bi < b; bi++)
    for (let hi = 0; hi < h; hi++)
      for (let i = 0; i < t; i++) {
        const s: number[] = [];
        for (let j = 0; j <= i; j++) {
          let dot = 0;
          for (let d = 0; d < dh; d++)
            dot += at(bi, i, 0, hi, d) * at(bi, j, 1, hi, d);
          s.push(dot / Math.sqrt(dh));
        }
        const top = Math.max(...s);
        const sum = s.reduce((a, v) => a + Math.exp(v - top), 0);
        out[(bi * h + hi) * t + i] = top + Math.log(sum);
      }
  return out;
}

function maxError(a: ArrayLike<number>, b: ArrayLike<number>): number {
  assert.equal(a.length, b.length);
  let m = 0;
  for (let i = 0; i < a.length; i++) {
    const e = Math.abs(a[i]! - b[i]!);
    m = Number.isNaN(e) ? Number.POSITIVE_INFINITY : Math.max(m, e);
  }
  return m;
}

test('webgpu WGSL flash attention equals the cpu composed attention, keeps nothing T x T, and runs one dispatch each way', {
  skip: why,
}, async () => {
  const cases = SHAPES.map(makeCase);
  await initBackend('cpu');
  assert.equal(tf.getKernel(FLASH_ATTENTION_KERNEL, 'cpu'), undefined);
  const want: Float32Array[][] = [];
  for (const c of cases) want.push(await runP(c));
  await initBackend('webgpu');
  // bad input: a clear error naming what qkv must be
  const odd = tf.zeros([1, 4, 10]);
  assert.throws(
    () =>
      tf.engine().runKernel(FLASH_ATTENTION_KERNEL, { qkv: odd }, { heads: 2 }),
    /qkv must be float32 \[B, T, 3 \* heads \* dh\], got float32 \[1,4,10\] with heads 2/,
  );
  odd.dispose();
  const queue = gpuQueue()!;
  for (const [i, c] of cases.entries()) {
    const [b, t, h, dh] = c.shape;
    const before = queue.counts().dispatches;
    const { out, forwardBytes } = await runFlash(c);
    const dispatches = queue.counts().dispatches - before;
    const [ctx, lse, dqkv] = out as [Float32Array, Float32Array, Float32Array];
    const errs = [
      maxError(ctx, want[i]![0]!),
      maxError(lse, lseOf(c)),
      maxError(dqkv, want[i]![1]!),
    ];
    console.log(
      `shape ${c.shape.join('x')}: max |error| ctx, lse, dqkv = ${errs.map((e) => e.toExponential(2)).join(', ')}; ${dispatches} dispatches, forward outputs ${forwardBytes} bytes`,
    );
    for (const e of errs)
      assert.ok(e <= 1e-4, `error ${e} over 1e-4 on ${c.shape}`);
    assert.equal(dispatches, 2, 'one dispatch forward, one gradient');
    // what the gradient keeps from the forward: ctx [B, T, D] and lse [B, H, T], float32; the
    // P form's P alone is B H T T
    assert.equal(forwardBytes, 4 * (b * t * h * dh + b * h * t));
    if (t > dh + 1) assert.ok(forwardBytes < 4 * b * h * t * t);
  }
});

test('causalSelfAttention runs the flash pair on webgpu (none of the P pair) and its gradients equal cpu within 1e-4', {
  skip: why,
}, async () => {
  const [b, t, h, dh] = [2, 70, 2, 16];
  const d = h * dh;
  const rng = new Rng(7);
  const rand = (...shape: number[]) =>
    Float32Array.from(
      { length: shape.reduce((a, v) => a * v, 1) },
      () => 0.3 * rng.normal(),
    );
  const values = [
    rand(b, t, d),
    rand(d, 3 * d),
    rand(3 * d),
    rand(d, d),
    rand(d),
  ];
  const shapes = [[b, t, d], [d, 3 * d], [3 * d], [d, d], [d]];
  const gradsOn = async (backend: string) => {
    await initBackend(backend);
    const ran: string[] = [];
    const original = tf.engine().runKernel.bind(tf.engine());
    tf.engine().runKernel = ((name: string, ...rest: unknown[]) => {
      ran.push(name);
      return (original as (...a: unknown[]) => unknown)(name, ...rest);
    }) as typeof original;
    try {
      const xs = values.map((v, i) => tf.tensor(v, shapes[i]!));
      const f = (...a: tf.Tensor[]) =>
        tf.sum(
          tf.square(causalSelfAttention(a[0]!, h, a[1]!, a[2]!, a[3]!, a[4]!)),
        );
      const grads = tf.grads(f)(xs);
      const out = await Promise.all(
        grads.map((g) => g.data() as Promise<Float32Array>),
      );
      tf.dispose([...xs, ...grads]);
      return { out, ran };
    } finally {
      tf.engine().runKernel = original;
    }
  };
  const cpu = await gradsOn('cpu');
  const gpu = await gradsOn('webgpu');
  assert.ok(cpu.ran.includes(CAUSAL_ATTENTION_GRAD_KERNEL), 'cpu: the P pair');
  assert.ok(gpu.ran.includes(FLASH_ATTENTION_KERNEL), 'webgpu: flash');
  assert.ok(
    gpu.ran.includes(FLASH_ATTENTION_GRAD_KERNEL),
    'webgpu: flash grad',
  );
  assert.ok(!gpu.ran.includes(CAUSAL_ATTENTION_KERNEL), 'webgpu: no P');
  for (const [i, g] of gpu.out.entries()) {
    const e = maxError(g, cpu.out[i]!);
    const scale = Math.max(1, ...cpu.out[i]!.map(Math.abs));
    assert.ok(e <= 1e-4 * scale, `gradient ${i}: ${e} (scale ${scale})`);
  }
});
