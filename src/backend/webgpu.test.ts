/**
 * The webgpu backend in Node (Dawn's bindings; in CI a software GPU: Mesa through Dawn's OpenGL
 * backend): every block of every preset, and the loss, give the same outputs and gradients
 * (with respect to the parameters and the input) as the cpu backend, read asynchronously as
 * webgpu requires; a repeated step makes no bind group after its first steps (webgpu-host.ts).
 * Skipped, saying why, where no WebGPU adapter can be made.
 */

import assert from 'node:assert/strict';
import { test } from 'node:test';
import { paramKey } from '../model/block.js';
import { initParams } from '../model/init.js';
import { buildModel, type ModelConfig } from '../model/model.js';
import { scaledDifference } from '../testing/backend-compare.js';
import { assertPeaksAsRecorded, trainTinyLm } from '../testing/fixtures.js';
import { Rng } from '../util/rng.js';
import { initBackend } from './index.js';
import { tf } from './tfjs.js';
import { dawnFlags, installDawn } from './webgpu.js';
import { bindGroupCountsOf } from './webgpu-host.js';

let why: string | false = false;
try {
  const a = await installDawn();
  console.log(
    `webgpu adapter: ${a.description} (${a.featureLevel}${a.flags.length ? `, ${a.flags.join(' ')}` : ''})`,
  );
} catch (e) {
  why = `no WebGPU adapter here: ${(e as Error).message}`;
}

const MODELS: Array<[string, ModelConfig]> = [
  [
    'charlm',
    { arch: 'charlm', layers: 1, dModel: 16, heads: 2, context: 8, vocab: 11 },
  ],
  ['mlp', { arch: 'mlp', inputShape: [6, 6, 1], hidden: [12], classes: 5 }],
  [
    'cnn',
    {
      arch: 'cnn',
      inputShape: [7, 6, 1],
      channels: [4, 3],
      hidden: 9,
      classes: 5,
    },
  ],
];

/**
 * Forward and gradients of each block of `config` (and of the loss after the last one) on the
 * current backend: [output, d/d params..., d/d input (float inputs)] per block, as arrays.
 */
async function blockResults(config: ModelConfig): Promise<Float32Array[][]> {
  const model = buildModel(config);
  const host = initParams(model.blocks, 3);
  const rng = new Rng(9);
  const n = 3;
  const shape0 = model.inputShape(n);
  let x: tf.Tensor =
    model.inputDtype === 'int32'
      ? tf.tensor(
          Int32Array.from({ length: shape0.reduce((a, b) => a * b, 1) }, () =>
            rng.int((config as { vocab: number }).vocab),
          ),
          shape0,
          'int32',
        )
      : tf.tensor(
          Float32Array.from({ length: shape0.reduce((a, b) => a * b, 1) }, () =>
            rng.next(),
          ),
          shape0,
        );
  const out: Float32Array[][] = [];
  for (const [bi, block] of model.blocks.entries()) {
    if (block.params.length === 0 && x.dtype === 'float32') {
      // a pooling block after a ReLU sees windows of equal zeros: cpu and webgpu route the
      // gradient to different (equally valid) maxima there, so it gets an input without ties
      const shape = x.shape;
      x.dispose();
      x = tf.tensor(
        Float32Array.from({ length: shape.reduce((a, b) => a * b, 1) }, () =>
          rng.next(),
        ),
        shape,
      );
    }
    const names = block.params.map((p) => p.name);
    const ps = block.params.map((p) =>
      tf.tensor(host.get(paramKey(bi, p.name))!, p.shape),
    );
    const last = bi === model.blocks.length - 1;
    const labelsShape = model.blocks
      .reduce((s, b) => b.outputShape(s), shape0)
      .slice(0, -1);
    const labels = tf.tensor(
      Int32Array.from(
        { length: labelsShape.reduce((a, b) => a * b, 1) },
        (_, i) => i % 5,
      ),
      labelsShape,
      'int32',
    );
    const f = (...args: tf.Tensor[]) => {
      const p = Object.fromEntries(names.map((nm, i) => [nm, args[i]!]));
      const y = block.forward(p, args[names.length] ?? x);
      return last
        ? model.loss(y, labels)
        : tf.sum(tf.mul(y, tf.sin(tf.range(0, y.size).reshape(y.shape))));
    };
    const wantInput = x.dtype === 'float32';
    const xs = wantInput ? [...ps, x] : ps;
    const grads = tf.grads((...a: tf.Tensor[]) => f(...a))(xs);
    const y = block.forward(
      Object.fromEntries(names.map((nm, i) => [nm, ps[i]!])),
      x,
    );
    const values = [
      await y.data(),
      ...(await Promise.all(grads.map((g) => g.data()))),
    ] as Float32Array[];
    if (last) values.push((await f(...ps, x).data()) as Float32Array);
    out.push(values);
    x = y;
  }
  return out;
}

for (const [name, config] of MODELS) {
  test(`webgpu: every ${name} block and the loss equal cpu, forward and gradients`, {
    skip: why,
  }, async () => {
    await initBackend('cpu');
    const cpu = await blockResults(config);
    await initBackend('webgpu');
    const gpu = await blockResults(config);
    assert.equal(gpu.length, cpu.length);
    gpu.forEach((arrays, b) =>
      arrays.forEach((v, i) => {
        const ref = cpu[b]![i]!;
        assert.equal(v.length, ref.length, `block ${b} output ${i} size`);
        const { worst, scale } = scaledDifference(v, ref);
        assert.ok(
          worst <= 1e-4,
          `${name} block ${b} result ${i} (0: output, then gradients, last: loss) differs from cpu by ${worst} of ${scale}`,
        );
      }),
    );
    await initBackend('cpu');
  });
}

/** Three training steps of `strategy` on `backend`: losses and parameters. */
const train3 = (backend: string, o: Record<string, unknown>) =>
  trainTinyLm(
    { backend, ...o },
    {
      shape: { layers: 2, dModel: 16, heads: 2, context: 8 },
      batchSize: 4,
      lrs: [3e-3, 2e-3, 1e-3],
    },
  );

test("LAYERWISE_DAWN_FLAGS: comma-separated key=value flags, a word without '=' continuing the flag before it (Dawn's toggle lists)", () => {
  assert.deepEqual(dawnFlags('backend=vulkan'), ['backend=vulkan']);
  assert.deepEqual(
    dawnFlags('backend=vulkan,enable-dawn-features=a,b,,adapter=x'),
    ['backend=vulkan', 'enable-dawn-features=a,b', 'adapter=x'],
  );
  assert.deepEqual(dawnFlags(''), []);
  assert.throws(
    () => dawnFlags('a,backend=vulkan'),
    /'a' is not a key=value flag/,
  );
});

test('on webgpu, single, gpipe K=2, local K=2 and l2l train as on cpu (3 steps, float32 tolerance)', {
  skip: why,
}, async () => {
  const { maxParamDiff } = await import('../testing/assert-close.js');
  const runs: Array<[string, Record<string, unknown>]> = [
    ['single', { strategy: 'single' }],
    ['gpipe K=2', { strategy: 'gpipe', stages: 2, microBatches: 2 }],
    [
      'local K=2',
      { strategy: 'local', stages: 2, microBatches: 2, deterministic: true },
    ],
    ['l2l', { strategy: 'l2l', microBatches: 2 }],
  ];
  for (const [name, o] of runs) {
    const cpu = await train3('cpu', o);
    const gpu = await train3('webgpu', o);
    gpu.losses.forEach((l, i) =>
      assert.ok(
        Math.abs(l - cpu.losses[i]!) <= 1e-4,
        `${name} step ${i}: webgpu ${l} vs cpu ${cpu.losses[i]}`,
      ),
    );
    const d = maxParamDiff(gpu.params, cpu.params);
    assert.ok(
      d <= 1e-4,
      `${name}: parameters on webgpu differ from cpu by ${d}`,
    );
  }
});

test('single on webgpu with captured steps (the default; LAYERWISE_WEBGPU_CAPTURE=0 turns them off) replays its forward and backward once two steps matched, and trains bit for bit as without them (clipping, a changing learning rate); gpipe K=2 with one micro-batch captures nothing', {
  skip: why,
}, async () => {
  const { maxParamDiff } = await import('../testing/assert-close.js');
  const { withCapture } = await import('../bench/webgpu-replay.js');
  const run = (o: Record<string, unknown> = { strategy: 'single' }) =>
    trainTinyLm(
      { backend: 'webgpu', clipNorm: 0.5, ...o },
      {
        shape: { layers: 2, dModel: 16, heads: 2, context: 8 },
        batchSize: 4,
        lrs: [3e-3, 2.5e-3, 2e-3, 1.5e-3, 1e-3, 8e-4, 6e-4, 4e-4],
      },
    );
  // a pipeline's stages with one micro-batch: none holds the whole model, none captures
  const pipeline = { strategy: 'gpipe', stages: 2, microBatches: 1 };
  const plain = await withCapture(false, () => run());
  const plainPipeline = await withCapture(false, () => run(pipeline));
  const captured = await withCapture(true, () => run());
  const capturedPipeline = await withCapture(true, () => run(pipeline));
  assert.ok(
    capturedPipeline.reports.every((r) => (r.gpu?.replays ?? 0) === 0),
    'no stage of gpipe K=2 replayed',
  );
  assert.deepEqual(capturedPipeline.losses, plainPipeline.losses);
  const replays = captured.reports.map((r) => r.gpu?.replays ?? 0);
  assert.deepEqual(
    replays.slice(0, 3),
    [0, 0, 0],
    'the first steps run through TF.js (recorded, compared)',
  );
  assert.ok(
    replays.slice(3).every((n) => n === 1),
    `every later step replayed: ${replays}`,
  );
  assert.deepEqual(
    captured.losses,
    plain.losses,
    'the same losses, bit for bit',
  );
  assert.equal(maxParamDiff(captured.params, plain.params), 0);
  // a replayed step counts the bytes its recording held (activations, gradients) for its span:
  // its peak is a recorded step's, less the batch's tokens and labels (4 x 8 int32 each), which a
  // replay takes as host values. Without the count it read half (88,424 against 177,212 B).
  assertPeaksAsRecorded(captured.reports, 2 * 4 * 8 * 4);
  assert.ok(
    plain.reports.every((r) => (r.gpu?.replays ?? 0) === 0),
    'none replayed without the variable',
  );
});

test("the main job's command trains on webgpu from the CLI and its loss falls", {
  skip: why,
}, async () => {
  const { spawnSync } = await import('node:child_process');
  const { mkdtempSync, readFileSync, rmSync } = await import('node:fs');
  const { tmpdir } = await import('node:os');
  const { join } = await import('node:path');
  const { fileURLToPath } = await import('node:url');
  const out = mkdtempSync(join(tmpdir(), 'layerwise-webgpu-'));
  try {
    // the main job (charlm-tiny, gpipe K=2, Moby-Dick), smaller and shorter: a software GPU is slow
    const r = spawnSync(
      process.execPath,
      [
        fileURLToPath(new URL('../cli/main.js', import.meta.url)),
        'train',
        '--preset',
        'charlm-tiny',
        '--data',
        'moby-dick',
        '--layers',
        '1',
        '--d-model',
        '32',
        '--heads',
        '2',
        '--context',
        '32',
        '--batch-size',
        '16',
        '--strategy',
        'gpipe',
        '--stages',
        '2',
        '--micro-batches',
        '4',
        '--steps',
        '30',
        '--lr',
        '0.01',
        '--eval-every',
        '0',
        '--eval-batches',
        '1',
        '--backend',
        'webgpu',
        '--out',
        join(out, 'run'),
      ],
      { encoding: 'utf8', timeout: 300_000 },
    );
    const said = (r.stderr ?? '')
      .split('\n')
      .filter((l) => !/^Warning|^\s+at |^$/.test(l))
      .slice(-8)
      .join('\n');
    assert.equal(r.status, 0, `exit ${r.status} signal ${r.signal}: ${said}`);
    const s = JSON.parse(
      readFileSync(join(out, 'run', 'summary.json'), 'utf8'),
    );
    assert.equal(s.backend, 'webgpu');
    assert.ok(
      s.final_loss < s.initial_loss - 0.5,
      `loss ${s.initial_loss} -> ${s.final_loss}`,
    );
  } finally {
    rmSync(out, { recursive: true, force: true });
  }
});

/** `steps` steps of gradient descent on a two-layer perceptron on the current backend: the bind groups each step made, and the final weights. */
async function descend(
  steps: number,
): Promise<{ made: number[]; weights: Float32Array[] }> {
  const device = (tf.backend() as unknown as { device?: object }).device;
  const x = tf.tensor2d(
    Array.from({ length: 8 * 16 }, (_, i) => Math.sin(i)),
    [8, 16],
  );
  const y = tf.tensor2d(
    Array.from({ length: 8 * 4 }, (_, i) => Math.cos(i)),
    [8, 4],
  );
  let w: tf.Tensor[] = [
    tf.tensor2d(
      Array.from({ length: 16 * 32 }, (_, i) => 0.1 * Math.sin(3 * i)),
      [16, 32],
    ),
    tf.tensor2d(
      Array.from({ length: 32 * 4 }, (_, i) => 0.1 * Math.cos(5 * i)),
      [32, 4],
    ),
  ];
  const loss = (w1: tf.Tensor, w2: tf.Tensor) =>
    tf.mean(tf.square(tf.sub(tf.matMul(tf.relu(tf.matMul(x, w1)), w2), y)));
  const made: number[] = [];
  for (let s = 0; s < steps; s++) {
    const before = device ? bindGroupCountsOf(device).made : 0;
    const next = tf.tidy(() => {
      const g = tf.grads(loss)(w);
      return w.map((p, i) => tf.sub(p, tf.mul(g[i]!, 0.05)));
    });
    await next[0]!.data(); // a step's read, as training's loss
    for (const p of w) p.dispose();
    w = next;
    made.push(device ? bindGroupCountsOf(device).made - before : 0);
  }
  const weights = (await Promise.all(w.map((p) => p.data()))) as Float32Array[];
  tf.dispose([x, y, ...w]);
  return { made, weights };
}

test('on webgpu a repeated step makes no bind group after its first steps, and trains as on cpu', {
  skip: why,
}, async () => {
  await initBackend('cpu');
  const cpu = await descend(6);
  await initBackend('webgpu');
  const gpu = await descend(6);
  await initBackend('cpu');
  assert.ok(
    gpu.made[0]! > 0,
    `the first step makes its bind groups (${gpu.made})`,
  );
  assert.deepEqual(
    gpu.made.slice(3),
    [0, 0, 0],
    `bind groups made per step: ${gpu.made}`,
  );
  gpu.weights.forEach((w, i) => {
    const worst = Math.max(
      ...w.map((v, k) => Math.abs(v - cpu.weights[i]![k]!)),
    );
    assert.ok(worst <= 1e-5, `weight ${i} differs from cpu by ${worst}`);
  });
});

test("a step's recorded GPU commands replay without TF.js as valid commands, every dispatch of the step in them", {
  skip: why,
}, async () => {
  const { recordCommands, replayCommands } = await import(
    './webgpu-commands.js'
  );
  const { gpuQueue } = await import('./gpu-queue.js');
  await initBackend('webgpu');
  const q = gpuQueue()!;
  const device = (tf.backend() as unknown as { device: GPUDevice }).device;
  const x = tf.tensor2d(
    Array.from({ length: 8 * 16 }, (_, i) => Math.sin(i)),
    [8, 16],
  );
  let w: tf.Tensor = tf.tensor2d(
    Array.from({ length: 16 * 4 }, (_, i) => Math.cos(i)),
    [16, 4],
  );
  const step = () => {
    const next = tf.tidy(() => {
      const [g] = tf.grads((v: tf.Tensor) =>
        tf.mean(tf.square(tf.matMul(x, v))),
      )([w]);
      return tf.sub(w, tf.mul(g!, 0.1));
    });
    w.dispose();
    w = next;
  };
  step();
  await w.data();
  const before = q.counts();
  const ops = recordCommands(device, () => {
    step();
    q.flush();
  });
  const dispatches = q.counts().dispatches - before.dispatches;
  await w.data();
  assert.ok(dispatches > 0);
  assert.equal(
    ops.filter((o) => o.op === 'dispatch').length,
    dispatches,
    'every dispatch recorded',
  );
  assert.ok(
    ops.some((o) => o.op === 'submit'),
    'the submit recorded',
  );
  device.pushErrorScope('validation');
  replayCommands(device, ops);
  replayCommands(device, ops);
  const error = await device.popErrorScope();
  assert.equal(error, null, `Dawn's validation: ${error?.message}`);
  tf.dispose([x, w]);
  await initBackend('cpu');
});

/**
 * This thread's webgpu device and queue, and a d16 charlm-small Stage trained in this thread
 * (bench/report.ts inThreadStage): for the tests that record a step's commands.
 */
async function tinyStage() {
  const { inThreadStage } = await import('../bench/report.js');
  await import('../strategies/index.js');
  const { resolveConfig } = await import('../config/config.js');
  const { gpuQueue } = await import('./gpu-queue.js');
  await initBackend('webgpu');
  const cfg = resolveConfig({
    preset: 'charlm-small',
    backend: 'webgpu',
    batchSize: 1,
    dModel: 16,
    heads: 2,
    context: 8,
  });
  return {
    cfg,
    q: gpuQueue()!,
    device: (tf.backend() as unknown as { device: GPUDevice }).device,
    stage: () => inThreadStage(cfg),
  };
}

test("a training step's GPU commands repeat those of the step before: the same pipelines, bind groups, dispatches and copies, only the batch's uploads coming from new staging buffers", {
  skip: why,
}, async () => {
  const { isUpload, recordCommands, sameCommand } = await import(
    './webgpu-commands.js'
  );
  const { q, device, stage: make } = await tinyStage();
  const stage = await make();
  try {
    const recorded = async () => {
      const ops = recordCommands(device, () => {
        stage.step();
        q.flush();
      });
      await q.caughtUp();
      return ops;
    };
    for (let i = 0; i < 2; i++) await recorded(); // the pool and the caches filled
    const [a, b] = [await recorded(), await recorded()];
    assert.equal(b.length, a.length, 'as many commands');
    assert.ok(a.filter((o) => o.op === 'dispatch').length > 50);
    const differing = a.flatMap((o, i) =>
      sameCommand(o, b[i]!) ? [] : [[o, b[i]!] as const],
    );
    // the batch's tokens, labels and the loss seed: each written into a new mapped staging buffer
    // and copied from it into the same tensor buffer as the step before
    assert.ok(
      differing.length > 0 && differing.length <= 4,
      `${differing.length} commands differ`,
    );
    for (const [o, p] of differing) {
      assert.ok(o.op === 'copy' && p.op === 'copy', `a ${o.op} differs`);
      const [, srcOffset, dst, dstOffset, size] = o.args;
      const q2 = p.args;
      assert.ok(isUpload(o) && isUpload(p), 'an upload');
      assert.deepEqual(
        [srcOffset, dst, dstOffset, size],
        [q2[1], q2[2], q2[3], q2[4]],
      );
    }
  } finally {
    stage.dispose();
    await initBackend('cpu');
  }
});

test("a training step's recorded GPU commands, replayed with the next batches' uploads and AdamW's next step counts, train as TF.js's steps do", {
  skip: why,
}, async () => {
  const { recordCommands, replayCommands } = await import(
    './webgpu-commands.js'
  );
  const { optimizerConfigOf } = await import('../config/config.js');
  const { cfg, q, device, stage: make } = await tinyStage();
  const STEPS = 6;
  const RECORDED = 3; // steps 0-2 through TF.js, 3 recorded, 4 and 5 replayed
  // through TF.js: every step's batch and the parameters after the last
  const a = await make();
  const batches = Array.from({ length: STEPS }, () => a.step());
  const want = await a.stage.getParams();
  a.dispose();
  const b = await make();
  try {
    for (let i = 0; i < RECORDED; i++) b.step();
    const ops = recordCommands(device, () => {
      b.step();
      q.flush();
    });
    // which upload is the tokens and which the labels: by the recorded batch's bytes
    const bytesOf = (v: ArrayLike<number>, dtype: string) =>
      new Uint8Array(
        (dtype === 'int32' ? Int32Array.from(v) : Float32Array.from(v)).buffer,
      );
    const recorded = batches[RECORDED]!;
    const uploads = ops.flatMap((o) =>
      o.op === 'copy' && o.data ? [o.data] : [],
    );
    const sameBytes = (x: Uint8Array, y: Uint8Array) =>
      x.byteLength === y.byteLength && x.every((v, k) => v === y[k]);
    const role = uploads.map((d) =>
      sameBytes(d, bytesOf(recorded.x, b.model.inputDtype))
        ? 'x'
        : sameBytes(d, bytesOf(recorded.y, 'int32'))
          ? 'y'
          : 'other',
    );
    assert.deepEqual(
      role.filter((r) => r !== 'other').sort(),
      ['x', 'y'],
      `the batch's tokens and labels among the uploads (${role})`,
    );
    const writes = ops.filter((o) => o.op === 'write');
    assert.equal(writes.length, 1, "one writeBuffer a step: AdamW's uniforms");
    const { beta1, beta2 } = optimizerConfigOf(cfg);
    for (let k = RECORDED + 1; k < STEPS; k++)
      replayCommands(device, ops, {
        inputs: {
          upload: (i, bytes) =>
            role[i] === 'x'
              ? bytesOf(batches[k]!.x, b.model.inputDtype)
              : role[i] === 'y'
                ? bytesOf(batches[k]!.y, 'int32')
                : bytes,
          // wgsl/multi.ts ADAMW_MULTI_WGSL's uniforms: bc1, bc2 (1 - beta^t) at bytes 44 and 48
          write: (_, bytes) => {
            const u = bytes.slice();
            new Float32Array(u.buffer, 44, 2).set([
              1 - beta1 ** (k + 1),
              1 - beta2 ** (k + 1),
            ]);
            return u;
          },
        },
      });
    const got = await b.stage.getParams();
    assert.deepEqual([...got.keys()], [...want.keys()]);
    for (const [name, w] of want) {
      const { worst } = scaledDifference(got.get(name)!, w);
      assert.ok(
        worst <= 1e-6,
        `${name} differs from TF.js's steps by ${worst}`,
      );
    }
  } finally {
    b.dispose();
    await initBackend('cpu');
  }
});
