/**
 * The webgpu backend's WGSL causal attention (backend/webgpu-attention.ts) gives the cpu
 * backend's composed kernel's outputs (ctx, P) and gradient (dqkv) within 1e-4, on shapes with T
 * not a multiple of the 64-row block, several heads, batch > 1 and head widths 8 to 64; and runs
 * fewer programs than the composed form on webgpu. Skipped, saying why, where no WebGPU adapter
 * can be made.
 */

import assert from 'node:assert/strict';
import { test } from 'node:test';
import { Rng } from '../util/rng.js';
import { initBackend } from './index.js';
import {
  CAUSAL_ATTENTION_GRAD_KERNEL,
  CAUSAL_ATTENTION_KERNEL,
} from './kernel-names.js';
import { tf } from './tfjs.js';
import { installDawn } from './webgpu.js';
import { registerWebGpuAttention } from './webgpu-attention.js';

let why: string | false = false;
try {
  await installDawn();
} catch (e) {
  why = `no WebGPU adapter here: ${(e as Error).message}`;
}

/** [B, T, H, dh] */
const SHAPES: Array<[number, number, number, number]> = [
  [2, 5, 2, 8],
  [1, 70, 3, 16],
  [2, 9, 2, 32],
  [1, 67, 1, 64],
];

interface Case {
  heads: number;
  qkv: Float32Array;
  dy: Float32Array;
  qkvShape: number[];
  dyShape: number[];
}

function makeCase([b, t, h, dh]: [number, number, number, number]): Case {
  const rng = new Rng(b * 1000 + t * 10 + dh);
  const d = h * dh;
  const rand = (n: number) =>
    Float32Array.from({ length: n }, () => rng.normal());
  return {
    heads: h,
    qkv: rand(b * t * 3 * d),
    dy: rand(b * t * d),
    qkvShape: [b, t, 3 * d],
    dyShape: [b, t, d],
  };
}

/** [ctx, p, dqkv] on the current backend; the gradient reads the given p (cpu's) when `p` is given. */
async function run(c: Case, p?: Float32Array): Promise<Float32Array[]> {
  const qkv = tf.tensor(c.qkv, c.qkvShape);
  const dy = tf.tensor(c.dy, c.dyShape);
  const [ctx, probs] = tf
    .engine()
    .runKernel(
      CAUSAL_ATTENTION_KERNEL,
      { qkv },
      { heads: c.heads },
    ) as tf.Tensor[];
  const pIn = p ? tf.tensor(p, probs!.shape) : probs!;
  const dqkv = tf
    .engine()
    .runKernel(
      CAUSAL_ATTENTION_GRAD_KERNEL,
      { dy, qkv, p: pIn },
      { heads: c.heads },
    ) as tf.Tensor;
  const out = [
    (await ctx!.data()) as Float32Array,
    (await probs!.data()) as Float32Array,
    (await dqkv.data()) as Float32Array,
  ];
  tf.dispose([qkv, dy, ctx!, probs!, pIn, dqkv]);
  return out;
}

function maxError(a: Float32Array, b: Float32Array): number {
  assert.equal(a.length, b.length);
  let m = 0;
  for (let i = 0; i < a.length; i++) m = Math.max(m, Math.abs(a[i]! - b[i]!));
  return m;
}

/** How many webgpu programs `f` runs. */
async function countPrograms(f: () => Promise<unknown>): Promise<number> {
  const backend = tf.backend() as unknown as {
    runWebGPUProgram: (...a: unknown[]) => unknown;
  };
  const original = backend.runWebGPUProgram;
  let n = 0;
  backend.runWebGPUProgram = function (...a: unknown[]) {
    n++;
    return original.apply(this, a);
  };
  try {
    await f();
  } finally {
    backend.runWebGPUProgram = original;
  }
  return n;
}

test('webgpu WGSL causal attention equals the cpu composed kernel', {
  skip: why,
}, async () => {
  const cases = SHAPES.map(makeCase);
  await initBackend('cpu');
  const want: Float32Array[][] = [];
  for (const c of cases) want.push(await run(c));
  await initBackend('webgpu');
  const composed = await countPrograms(() => run(cases[0]!));
  registerWebGpuAttention();
  const ours = await countPrograms(() => run(cases[0]!));
  console.log(
    `webgpu programs per forward + gradient: composed ${composed}, WGSL ${ours}`,
  );
  assert.equal(ours, 4);
  for (const [i, c] of cases.entries()) {
    const [ctx, p, dqkv] = await run(c);
    // the gradient of the same p as cpu's, so that it is compared alone
    const [, , dqkvSameP] = await run(c, want[i]![1]);
    const errs = [
      maxError(ctx!, want[i]![0]!),
      maxError(p!, want[i]![1]!),
      maxError(dqkv!, want[i]![2]!),
      maxError(dqkvSameP!, want[i]![2]!),
    ];
    console.log(
      `shape ${SHAPES[i]!.join('x')}: max |error| ctx, p, dqkv, dqkv(cpu p) = ${errs.map((e) => e.toExponential(2)).join(', ')}`,
    );
    for (const e of errs)
      assert.ok(e <= 1e-4, `error ${e} over 1e-4 on ${SHAPES[i]}`);
  }
});
