/**
 * The native captured step (pipeline/native-capture.ts): a single-device run, and each stage of
 * a K=2 pipeline (1F1B, GPipe, ZBV with its split backward) or of local parallelism (greedy, and
 * the last stage under --overlap 1), replays its step's actions once two
 * steps recorded the same addon calls and a trial replay reproduced a third, and trains bit for
 * bit as without it; a step whose kernels read a value computed in JS between the calls is never
 * replayed.
 */
import assert from 'node:assert/strict';
import { test } from 'node:test';
import { initBackend } from '../backend/index.js';
import { bf16Support } from '../backend/names.js';
import { nativeAddon, nativeUnavailable } from '../backend/native-addon.js';
import { tf } from '../backend/tfjs.js';
import { softmaxCrossEntropy } from '../model/layers.js';
import { maxParamDiff } from '../testing/assert-close.js';
import { assertPeaksAsRecorded, trainTinyLm } from '../testing/fixtures.js';
import type { StepIO } from './executor.js';
import {
  NATIVE_CAPTURE_ENV,
  NativeStepCapture,
  nativeReplays,
} from './native-capture.js';

const skip = nativeAddon()
  ? false
  : `native backend unavailable: ${nativeUnavailable()}`;

/** Runs `f` with LAYERWISE_NATIVE_CAPTURE set to `value` (the devices `f` starts copy it), then as it was. */
async function withCaptureEnv<T>(
  value: '0' | '1',
  f: () => Promise<T>,
): Promise<T> {
  const before = process.env[NATIVE_CAPTURE_ENV];
  process.env[NATIVE_CAPTURE_ENV] = value;
  try {
    return await f();
  } finally {
    if (before === undefined) delete process.env[NATIVE_CAPTURE_ENV];
    else process.env[NATIVE_CAPTURE_ENV] = before;
  }
}

for (const precision of ['fp32', 'bf16'] as const)
  test(`single on native (${precision}) with captured steps (the default) replays its forward and backward from its fourth or fifth step and trains bit for bit as without them`, {
    skip,
  }, async () => {
    const plain = await withCaptureEnv('0', () => runTiny(precision));
    const captured = await withCaptureEnv('1', () => runTiny(precision));
    assertReplayedFrom(captured.reports, 1);
    assert.deepEqual(
      captured.losses,
      plain.losses,
      'the same losses, bit for bit',
    );
    assert.equal(maxParamDiff(captured.params, plain.params), 0);
    assert.ok(
      plain.reports.every((r) => r.replayed === undefined),
      'none replayed with LAYERWISE_NATIVE_CAPTURE=0',
    );
    // a replayed step counts the bytes its recording held for its span: its peak is a recorded
    // step's (the batch's tokens and labels, 4 x 8 int32 each, aside)
    assertPeaksAsRecorded(captured.reports, 2 * 4 * 8 * 4);
  });

for (const [schedule, checkpoint, precision] of [
  ['1f1b', 'except_last', 'fp32'],
  ['zbv', 'never', 'fp32'],
  ['gpipe', 'always', 'fp32'],
  // bf16: the stages hand on block outputs held as bf16 values (backend/native.ts bf16Output)
  ['zbv', 'except_last', 'bf16'],
  // bf16 1F1B: stage 1's last action is a backward whose bf16 dx is sent after the step's claim
  ['1f1b', 'never', 'bf16'],
] as const)
  test(`gpipe K=2 M=2 on native (${precision}) with the ${schedule} schedule (re-materialization ${checkpoint}): each stage replays its step's actions from the fourth or fifth step, bit for bit as without captured steps`, {
    skip,
  }, async () => {
    const o = {
      strategy: 'gpipe',
      stages: 2,
      microBatches: 2,
      schedule,
      checkpoint,
    };
    const reports = await capturedAsPlain(precision, o);
    // every stage counts its replayed steps (zbv: 2 stages a device, 4 in all)
    assertReplayedFrom(reports, schedule === 'zbv' ? 4 : 2);
  });

for (const overlap of [0, 1])
  test(`local K=2 M=2 on native (${overlap ? 'overlap 1, deterministic' : 'greedy'}) with captured steps: each stage without an overlapped tail replays its local updates from the third step, bit for bit as without captured steps`, {
    skip,
  }, async () => {
    const o = {
      strategy: 'local',
      stages: 2,
      microBatches: 2,
      overlap,
      deterministic: overlap > 0,
    };
    const reports = await capturedAsPlain('fp32', o);
    // a local step is one update: 2 a step for each capturing stage (with overlap 1, stage 0's
    // tail is trained by stage 1's gradient, whenever it comes: only stage 1 captures); the
    // first update records, the second matches it, the third is tried, the fourth replays
    const each = overlap ? 2 : 4;
    const replays = reports.map((r) => r.replayed ?? 0);
    assert.deepEqual(
      replays,
      [0, each / 2, ...Array(replays.length - 2).fill(each)],
      'replayed local updates by step',
    );
  });

/**
 * Trains `o` (runTiny) on native without captured steps, then with them; asserts the same losses
 * and parameters, bit for bit, and returns the captured run's step reports.
 */
async function capturedAsPlain(
  precision: 'fp32' | 'bf16',
  o: Record<string, unknown>,
) {
  const plain = await withCaptureEnv('0', () => runTiny(precision, o));
  const captured = await withCaptureEnv('1', () => runTiny(precision, o));
  assert.deepEqual(captured.losses, plain.losses, 'the same losses');
  assert.equal(maxParamDiff(captured.params, plain.params), 0);
  return captured.reports;
}

/** charlm-like tiny run on native over 8 steps with `o`'s strategy. */
function runTiny(
  precision: 'fp32' | 'bf16',
  o: Record<string, unknown> = { strategy: 'single' },
) {
  return trainTinyLm(
    { backend: 'native', precision, clipNorm: 0.5, ...o },
    {
      shape: { layers: 2, dModel: 16, heads: 2, context: 8 },
      batchSize: 4,
      lrs: [3e-3, 2.5e-3, 2e-3, 1.5e-3, 1e-3, 8e-4, 6e-4, 4e-4],
    },
  );
}

/**
 * Two steps recorded alike (bf16's first also converts the parameters: not alike), the next
 * tried against TF.js, then every step replayed, by all `stages`.
 */
function assertReplayedFrom(
  reports: ReadonlyArray<{ replayed?: number }>,
  stages: number,
): void {
  const replays = reports.map((r) => r.replayed ?? 0);
  const first = replays.indexOf(stages);
  assert.ok(
    first >= 3 &&
      first <= 4 &&
      replays.slice(0, first).every((n) => n === 0) &&
      replays.slice(first).every((n) => n === stages),
    `replayed by ${stages} stage(s) from the fourth or fifth step on: ${replays}`,
  );
}

/**
 * One step of a small classifier on native: rows of a kept table E gathered by x, times W, the
 * softmax cross-entropy against labels, and W's gradient; with `stacked`, the gathered rows go
 * through tf.stack, which native copies in JS (a value the addon's calls do not make).
 */
function classifierStep(
  e: tf.Tensor,
  w: tf.Variable,
  x: tf.Tensor,
  labels: tf.Tensor,
  stacked: boolean,
): { loss: tf.Scalar; grad: tf.Tensor } {
  const { value, grads } = tf.variableGrads(() => {
    let rows = tf.gather(e, x);
    if (stacked) rows = tf.reshape(tf.stack([rows]), rows.shape);
    return softmaxCrossEntropy(tf.matMul(rows, w), labels);
  }, [w]);
  return { loss: value, grad: grads[w.name]! };
}

/** Step k's batch: 64 tokens of 16 and their labels of 5, different every step. */
function batchOf(k: number): { x: tf.Tensor; labels: tf.Tensor } {
  const x = Int32Array.from({ length: 64 }, (_, i) => (i * 7 + k * 3) % 16);
  const y = Int32Array.from({ length: 64 }, (_, i) => (i + k * 2) % 5);
  return { x: tf.tensor1d(x, 'int32'), labels: tf.tensor1d(y, 'int32') };
}

/** Losses and W's gradients of steps 0..n-1 through `capture` (null: TF.js alone), and how many it replayed. */
function runSteps(
  e: tf.Tensor,
  w: tf.Variable,
  n: number,
  stacked: boolean,
  capture: NativeStepCapture | null,
): { losses: number[]; grads: Float32Array[]; replayed: number } {
  const io = stepIO(1);
  const losses: number[] = [];
  const grads: Float32Array[] = [];
  const before = nativeReplays();
  for (let k = 0; k < n; k++) {
    const { x, labels } = batchOf(k);
    let out: { loss: tf.Tensor; grad: tf.Tensor };
    const act = { op: 'forward', mb: 0, keep: true };
    // the forward and backward as one action: the classifier step is one tape
    const r = capture?.replay(act, io, { x, labels });
    if (r) {
      capture!.endStep();
      out = { loss: r.loss!, grad: r.grads!.get('w')! };
    } else {
      capture?.begin(act, io, { x, labels });
      out = classifierStep(e, w, x, labels, stacked);
      capture?.end({ loss: out.loss }, new Map([['w', out.grad]]));
      capture?.endStep();
      x.dispose();
      labels.dispose();
    }
    losses.push(out.loss.dataSync()[0]!);
    // read through a copy: a read array leaves the pool for good, which would change the arrays
    // the next step is handed
    const copy = tf.mul(out.grad, 1);
    grads.push(copy.dataSync() as Float32Array);
    copy.dispose();
    out.loss.dispose();
    out.grad.dispose();
  }
  return { losses, grads, replayed: nativeReplays() - before };
}

test('a native capture replays only what its trial replay reproduced bit for bit: a step whose kernels read values copied in JS (tf.stack) is never replayed, and both give the results of TF.js', {
  skip,
}, async () => {
  await initBackend('native');
  const e = tf.randomNormal([16, 8], 0, 1, 'float32', 3);
  const w = weight([8, 5], 4, 'w');
  try {
    for (const stacked of [false, true]) {
      const captured = asTfjsGives({ w }, (capture) =>
        runSteps(e, w, 7, stacked, capture),
      );
      assert.equal(
        captured.replayed,
        stacked ? 0 : 4,
        stacked
          ? 'the stacked rows are copied in JS: the trial differs, never replayed'
          : 'steps 0-1 recorded, step 2 tried, steps 3-6 replayed',
      );
    }
  } finally {
    e.dispose();
    w.dispose();
  }
});

/** What the capture reads of a training step of `m` micro-batches: no block skipped, no diagnosis, loss seed 1. */
const stepIO = (m: number) =>
  ({
    m,
    dropped: new Set<number>(),
    diagnose: false,
    lossSeed: 1,
  }) as unknown as StepIO;

/** A trainable [rows, cols] float32 variable `name` of N(0, 0.5^2) values drawn with `seed`. */
const weight = (shape: [number, number], seed: number, name: string) =>
  tf.variable(tf.randomNormal(shape, 0, 0.5, 'float32', seed), true, name);

/**
 * Runs `steps` through TF.js alone (capture null), then through a new capture of `params`;
 * asserts the same losses and gradients, bit for bit, and returns the captured run's results.
 */
function asTfjsGives<R extends { losses: number[]; grads: Float32Array[] }>(
  params: Record<string, tf.Variable>,
  steps: (capture: NativeStepCapture | null) => R,
  what = '',
): R {
  const reference = steps(null);
  const capture = new NativeStepCapture({
    paramVars: new Map(Object.entries(params)),
  });
  const captured = steps(capture);
  capture.dispose();
  assert.deepEqual(captured.losses, reference.losses, what);
  captured.grads.forEach((g, k) =>
    assert.deepEqual(g, reference.grads[k], `${what} step ${k}'s gradient`),
  );
  return captured;
}

/**
 * Two actions a step: a product of a float32 input (its output handed on), then a classifier
 * whose input `x1` is held as bf16 values (`asBf16`) or as a float32 tensor of the same values
 * (bf16 values: exact either way); losses and W's gradients of steps 0..n-1, through `capture`
 * (null: TF.js alone), with `asBf16(k)` choosing step k's kind, and which steps were replayed.
 */
function twoActionSteps(
  w0: tf.Variable,
  w: tf.Variable,
  n: number,
  asBf16: (k: number) => boolean,
  capture: NativeStepCapture | null,
): { losses: number[]; grads: Float32Array[]; replayed: boolean[] } {
  const io = stepIO(2);
  const backend = tf.backend() as unknown as {
    shadowBuffer(length: number): Uint16Array;
    bf16Output(bf: Uint16Array, shape: number[]): tf.TensorInfo;
  };
  const losses: number[] = [];
  const grads: Float32Array[] = [];
  const replayed: boolean[] = [];
  for (let k = 0; k < n; k++) {
    const before = nativeReplays();
    const x0 = tf.tensor2d(randomValues(64 * 8, 10 + k), [64, 8]);
    const x1values = randomValues(64 * 8, 50 + k);
    let x1: tf.Tensor;
    if (asBf16(k)) {
      // as a kernel's bf16 output (a block boundary): a free buffer of the backend's, held as is
      const bf = backend.shadowBuffer(64 * 8);
      nativeAddon()!.toBf16(x1values, bf);
      x1 = tf
        .engine()
        .makeTensorFromTensorInfo(backend.bf16Output(bf, [64, 8]));
    } else {
      const bf = new Uint16Array(64 * 8);
      nativeAddon()!.toBf16(x1values, bf);
      x1 = tf.tensor2d(widened(bf), [64, 8]);
    }
    const labels = tf.tensor1d(
      Int32Array.from({ length: 64 }, (_, i) => (i + k) % 5),
      'int32',
    );
    const first = { op: 'forward', mb: 0, keep: true };
    const second = { op: 'forward', mb: 1, keep: true };
    let loss: tf.Tensor;
    let grad: tf.Tensor;
    const r0 = capture?.replay(first, io, { x: x0 });
    if (r0) {
      r0.y!.dispose();
      const r1 = capture!.replay(second, io, { x: x1, labels })!;
      capture!.endStep();
      loss = r1.loss!;
      grad = r1.grads!.get('w')!;
    } else {
      capture?.begin(first, io, { x: x0 });
      const y0 = tf.matMul(x0, w0);
      capture?.end({ y: y0 }, new Map());
      y0.dispose();
      capture?.begin(second, io, { x: x1, labels });
      const { value, grads: g } = tf.variableGrads(
        () => softmaxCrossEntropy(tf.matMul(x1, w), labels),
        [w],
      );
      capture?.end({ loss: value }, new Map([['w', g.w!]]));
      capture?.endStep();
      loss = value;
      grad = g.w!;
      tf.dispose([x0, x1, labels]);
    }
    losses.push(loss.dataSync()[0]!);
    const copy = tf.mul(grad, 1); // read through a copy (a read array leaves the pool)
    grads.push(copy.dataSync() as Float32Array);
    tf.dispose([copy, loss, grad]);
    replayed.push(nativeReplays() > before);
  }
  return { losses, grads, replayed };
}

/** n deterministic values in [-1, 1) from `seed`. */
const randomValues = (n: number, seed: number) =>
  Float32Array.from({ length: n }, (_, i) => Math.sin(seed * 97.3 + i * 1.7));

/** bf16 values widened to float32 (exact). */
function widened(bf: Uint16Array): Float32Array {
  const out = new Float32Array(bf.length);
  nativeAddon()!.fromBf16(bf, out);
  return out;
}

test('bf16: a replayed later action whose input comes as float32 where the recording had it as bf16 values (or back) converts it exactly: the losses and gradients of TF.js, bit for bit', {
  skip:
    skip ||
    (!bf16Support().nativeBf16 &&
      `this CPU has no avx512_bf16 or AMX (${bf16Support().note})`),
}, async () => {
  await initBackend('native', { precision: 'bf16' });
  const w0 = weight([8, 6], 5, 'w0');
  const w = weight([8, 5], 6, 'w');
  try {
    for (const recordedAsBf16 of [true, false]) {
      // steps 0-7 record, try and replay the capture with one kind, steps 8-11 replay with the other
      const asBf16 = (k: number) => k < 8 === recordedAsBf16;
      const what = recordedAsBf16 ? 'bf16 -> float32' : 'float32 -> bf16';
      const captured = asTfjsGives(
        { w0, w },
        (capture) => twoActionSteps(w0, w, 12, asBf16, capture),
        what,
      );
      assert.deepEqual(
        captured.replayed.slice(7),
        [true, true, true, true, true],
        `${what}: replayed before the change of kind and after it`,
      );
    }
  } finally {
    w0.dispose();
    w.dispose();
  }
});
