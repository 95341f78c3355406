/**
 * layerwise's WGSL kernels on webgpu (backend/webgpu-kernels.ts): each kernel and its gradient
 * give the cpu backend's (composed) results within 1e-4 of their scale on random inputs of a
 * few shapes (rows and element counts that are not multiples of a workgroup, rows longer than
 * one), each in at most three programs; the optimizer's fused AdamW and SGD updates give its
 * composed updates. Skipped, saying why, where no WebGPU adapter can be made. Results are read
 * with `await data()`, as webgpu in Node requires.
 */

import assert from 'node:assert/strict';
import { test } from 'node:test';
import { DeviceOptimizer, defaultOptimizerConfig } from '../optim/optimizer.js';
import { randomArray, scaledDifference } from '../testing/backend-compare.js';
import { gpuQueue } from './gpu-queue.js';
import { initBackend } from './index.js';
import {
  CAUSAL_SOFTMAX_GRAD_KERNEL,
  CAUSAL_SOFTMAX_KERNEL,
  GELU_GRAD_KERNEL,
  GELU_KERNEL,
  LAYER_NORM_GRAD_KERNEL,
  LAYER_NORM_KERNEL,
  SOFTMAX_CROSS_ENTROPY_GRAD_KERNEL,
  SOFTMAX_CROSS_ENTROPY_KERNEL,
  SUM_SQUARES_KERNEL,
} from './kernel-names.js';
import { tf } from './tfjs.js';
import { installDawn } from './webgpu.js';
import { chunksOf } from './webgpu-multi.js';

let why: string | false = false;
try {
  await installDawn();
} catch (e) {
  why = `no WebGPU adapter here: ${(e as Error).message}`;
}

const run = (name: string, inputs: tf.NamedTensorMap, attrs = {}) => {
  const out = tf.engine().runKernel(name, inputs, attrs);
  return Array.isArray(out) ? (out as tf.Tensor[]) : [out as tf.Tensor];
};

let seed = 1;
const rand = (shape: number[]) =>
  tf.tensor(randomArray(tf.util.sizeFromShape(shape), seed++), shape);

/** A case: builds its inputs from `seed` (the same on both backends) and runs kernels on them. */
interface Case {
  name: string;
  f: () => tf.Tensor[];
}

/** GELU then its gradient on [shape]. */
const gelu = (shape: number[]): Case => ({
  name: `gelu ${shape}`,
  f: () => {
    const x = tf.mul(rand(shape), 3);
    return [
      ...run(GELU_KERNEL, { x }),
      ...run(GELU_GRAD_KERNEL, { x, dy: rand(shape) }),
    ];
  },
});

/** Layer norm over the last axis of [shape], then its gradient from the forward's outputs. */
const layerNorm = (shape: number[]): Case => ({
  name: `layer norm ${shape}`,
  f: () => {
    const d = shape[shape.length - 1]!;
    const x = tf.add(tf.mul(rand(shape), 2), 0.5);
    const [y, xhat, rstd] = run(
      LAYER_NORM_KERNEL,
      { x, g: rand([d]), b: rand([d]) },
      { epsilon: 1e-5 },
    );
    const grads = run(LAYER_NORM_GRAD_KERNEL, {
      dy: rand(shape),
      xhat: xhat!,
      rstd: rstd!,
      g: rand([d]),
    });
    return [y!, xhat!, rstd!, ...grads];
  },
});

/** Softmax cross-entropy over logits [n, c], then its gradient. */
const crossEntropy = (n: number, c: number): Case => ({
  name: `softmax cross-entropy [${n}, ${c}]`,
  f: () => {
    const logits = tf.mul(rand([n, c]), 4);
    const labels = tf.tensor1d(
      Int32Array.from({ length: n }, (_, i) => (i * 7 + 3) % c),
      'int32',
    );
    const [loss, probs] = run(SOFTMAX_CROSS_ENTROPY_KERNEL, { logits, labels });
    const dy = tf.scalar(1.7);
    return [
      loss!,
      probs!,
      ...run(SOFTMAX_CROSS_ENTROPY_GRAD_KERNEL, { probs: probs!, labels, dy }),
    ];
  },
});

/** Causal softmax of scale * x over [shape] (last two axes T, T), then its gradient. */
const causalSoftmax = (shape: number[], scale: number): Case => ({
  name: `causal softmax ${shape} scale ${scale}`,
  f: () => {
    const x = tf.mul(rand(shape), 3);
    const [y] = run(CAUSAL_SOFTMAX_KERNEL, { x }, { scale });
    return [
      y!,
      ...run(CAUSAL_SOFTMAX_GRAD_KERNEL, { y: y!, dy: rand(shape) }, { scale }),
    ];
  },
});

const CASES: Case[] = [
  gelu([130]),
  gelu([3, 5, 7]),
  layerNorm([67, 10]),
  layerNorm([3, 7, 70]),
  layerNorm([2, 130]),
  crossEntropy(67, 11),
  crossEntropy(5, 130),
  causalSoftmax([2, 3, 5, 5], 0.35),
  causalSoftmax([1, 1, 70, 70], 1),
  // more rows than a dispatch dimension holds (65,535): TF.js spreads the workgroups over two
  layerNorm([65600, 2]),
  crossEntropy(65600, 3),
];

/**
 * Calls `f`, counting layerwise's dispatches on webgpu: its TF.js programs (shader keys lw_*) and
 * the dispatches of its own pipelines (backend/webgpu-multi.ts: all that backend/gpu-queue.ts
 * counted beyond TF.js's programs).
 */
function counting<T>(f: () => T): { out: T; programs: number } {
  gpuQueue(); // made (and wrapping TF.js's programs) before the wrapper below
  const b = tf.backend() as unknown as {
    runWebGPUProgram?: (...a: unknown[]) => unknown;
  };
  const own = b.runWebGPUProgram;
  const hadOwn = Object.hasOwn(b, 'runWebGPUProgram'); // gpu-queue.ts's wrapper
  let programs = 0;
  let tfjs = 0;
  if (own)
    b.runWebGPUProgram = (...a: unknown[]) => {
      tfjs++;
      if ((a[0] as { shaderKey: string }).shaderKey.startsWith('lw_'))
        programs++;
      return own.apply(b, a);
    };
  const before = gpuQueue()?.counts().dispatches ?? 0;
  try {
    const out = f();
    const all = (gpuQueue()?.counts().dispatches ?? 0) - before;
    return { out, programs: programs + (gpuQueue() ? all - tfjs : 0) };
  } finally {
    if (hadOwn) b.runWebGPUProgram = own;
    else if (own) delete b.runWebGPUProgram;
  }
}

/** Runs `c` on the current backend: each output's shape and values, and the programs it ran. */
async function results(c: Case) {
  seed = 1;
  const { out: outs, programs } = counting(() => tf.tidy(c.f));
  const values = await Promise.all(outs.map((t) => t.data()));
  const shapes = outs.map((t) => t.shape);
  tf.dispose(outs);
  return { values, shapes, programs };
}

test('layerwise webgpu kernels equal the cpu composed forms, forward and gradient, in few programs', {
  skip: why,
}, async () => {
  for (const c of CASES) {
    await initBackend('cpu');
    const cpu = await results(c);
    await initBackend('webgpu');
    const gpu = await results(c);
    assert.deepEqual(gpu.shapes, cpu.shapes, `${c.name}: shapes`);
    const errors = gpu.values.map((v, i) => {
      const { worst, scale } = scaledDifference(
        v as Float32Array,
        cpu.values[i]!,
      );
      assert.ok(
        worst <= 1e-4,
        `${c.name}: output ${i} differs from cpu by ${worst} of ${scale}`,
      );
      return worst;
    });
    console.log(
      `${c.name}: max scaled error ${Math.max(...errors).toExponential(2)}, ${gpu.programs} layerwise programs`,
    );
    // layerwise's programs ran (not the composed form's stock ones): one to three a kernel
    assert.ok(
      gpu.programs >= 2 && gpu.programs <= 5,
      `${c.name}: ${gpu.programs} programs`,
    );
  }
  await initBackend('cpu');
});

/** The GPU dispatches `f` records on webgpu (backend/gpu-queue.ts's count; 0 elsewhere). */
function dispatching(f: () => void): number {
  const before = gpuQueue()?.counts().dispatches ?? 0;
  f();
  return (gpuQueue()?.counts().dispatches ?? 0) - before;
}

/**
 * Three optimizer steps over two matrices (decayed) and a vector, the vector between them (the
 * multi-tensor AdamW reorders them): parameters and state, the layerwise programs and all the
 * dispatches the updates ran.
 */
async function optimizerRun(kind: 'adamw' | 'sgd', momentum: number) {
  const opt = new DeviceOptimizer({
    ...defaultOptimizerConfig(kind),
    momentum,
    weightDecay: 0.01,
  });
  const params = new Map([
    ['w', tf.variable(tf.tensor(randomArray(63, 1), [7, 9]))],
    ['b', tf.variable(tf.tensor(randomArray(70, 2), [70]))],
    ['w2', tf.variable(tf.tensor(randomArray(15, 3), [3, 5]))],
  ]);
  tf.tidy(() => tf.add(tf.square(params.get('w')!), 1)); // the queue exists before the count
  let programs = 0;
  let dispatches = 0;
  for (let step = 0; step < 3; step++) {
    const grads = new Map(
      [...params].map(
        ([k, p], i) =>
          [
            k,
            tf.tensor(randomArray(p.size, 10 + 2 * step + i), p.shape),
          ] as const,
      ),
    );
    dispatches += dispatching(() => {
      programs += counting(() =>
        opt.apply(params, grads, 0.05 / (step + 1), step === 1 ? 0.5 : 1),
      ).programs;
    });
    tf.dispose([...grads.values()]);
  }
  const state = await opt.getState();
  const out = [
    ...(await Promise.all([...params.values()].map((p) => p.data()))),
  ] as Float32Array[];
  for (const slots of Object.values(state.slots))
    out.push(...Object.values(slots));
  tf.dispose([...params.values()]);
  return { out, programs, dispatches };
}

test('the fused AdamW and SGD updates on webgpu equal the composed updates on cpu', {
  skip: why,
}, async () => {
  for (const [kind, momentum] of [
    ['adamw', 0],
    ['sgd', 0.9],
    ['sgd', 0],
  ] as const) {
    await initBackend('cpu');
    const { out: cpu } = await optimizerRun(kind, momentum);
    await initBackend('webgpu');
    const {
      out: gpu,
      programs,
      dispatches,
    } = await optimizerRun(kind, momentum);
    assert.equal(gpu.length, cpu.length);
    if (kind === 'adamw') {
      // one multi-tensor dispatch a step over all 3 parameters (and the slots' first zeros)
      assert.equal(programs, 3, 'adamw: one layerwise dispatch a step');
      assert.ok(
        dispatches >= 3 && dispatches <= 3 + 6,
        `adamw: ${dispatches} dispatches`,
      );
    } else {
      // one program per output and parameter, 3 parameters, 3 steps
      const outputs = momentum > 0 ? 2 : 1;
      assert.equal(programs, outputs * 3 * 3, `${kind}: fused programs`);
    }
    const errors = gpu.map((v, i) => {
      const { worst } = scaledDifference(v, cpu[i]!);
      assert.ok(
        worst <= 1e-4,
        `${kind} momentum ${momentum}: array ${i} differs from cpu by ${worst}`,
      );
      return worst;
    });
    console.log(
      `${kind} momentum ${momentum}: max scaled error ${Math.max(...errors).toExponential(2)}`,
    );
  }
  await initBackend('cpu');
});

test('the per-tensor sums of squares on webgpu equal the cpu composed form, in one dispatch', {
  skip: why,
}, async () => {
  // element counts around a workgroup (256) and a round of eight loads a thread (2,048), one
  // long tensor, odd shapes
  const shapes = [
    [1],
    [255],
    [257],
    [3, 7],
    [70000],
    [64, 33],
    [2, 2, 2],
    [2047],
    [2049],
  ];
  const sums = async () => {
    seed = 1;
    const xs = shapes.map((s) => tf.mul(rand(s), 3));
    let out: tf.Tensor | undefined;
    const dispatches = dispatching(() => {
      out = tf
        .engine()
        .runKernel(
          SUM_SQUARES_KERNEL,
          xs as unknown as tf.NamedTensorMap,
        ) as tf.Tensor;
    });
    const values = await out!.data();
    assert.deepEqual(out!.shape, [shapes.length]);
    tf.dispose([...xs, out!]);
    return { values, dispatches };
  };
  await initBackend('cpu');
  const cpu = await sums();
  await initBackend('webgpu');
  tf.tidy(() => tf.add(tf.scalar(1), 1)); // the queue exists before the count
  const gpu = await sums();
  await initBackend('cpu');
  assert.equal(gpu.dispatches, 1, 'one dispatch for all the tensors');
  shapes.forEach((s, i) => {
    const rel = Math.abs(gpu.values[i]! - cpu.values[i]!) / cpu.values[i]!;
    assert.ok(
      rel <= 1e-4,
      `tensor ${s}: ${gpu.values[i]} vs cpu ${cpu.values[i]}`,
    );
  });
});

test('the multi-tensor kernels cut their tensors into runs that fit one binding', () => {
  assert.deepEqual(chunksOf([3, 4, 2, 5, 1], 7), [
    [0, 2],
    [2, 4],
    [4, 5],
  ]);
  assert.deepEqual(chunksOf([7, 0, 7], 7), [
    [0, 2],
    [2, 3],
  ]);
  assert.deepEqual(chunksOf([], 7), []);
  assert.throws(() => chunksOf([2, 8], 7), /tensor 1 has 8 elements/);
});
