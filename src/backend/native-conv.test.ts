/**
 * The native convolution and pooling kernels (backend/native-conv.ts) against the cpu backend's:
 * forward and gradient (which run Conv2DBackpropInput / Conv2DBackpropFilter, MaxPoolGrad and
 * AvgPoolGrad) equal within float32 tolerance on odd shapes: batch 1 and 3, sizes that are not
 * multiples of 8, stride 2, 'same', 'valid' and explicit pads, dilation 2, 1x1, 2x3 and 3x3
 * filters, pools on odd sizes and with ties; the cases they do not take (NCHW, other fused
 * activations) fall back to the cpu kernels; and a cnn-mnist training step on native really
 * runs them (the addon's functions are called). Skipped, saying why, where the addon is not built.
 */

import assert from 'node:assert/strict';
import { test } from 'node:test';
import { assertSameAsCpu as sameAsCpu } from '../testing/backend-compare.js';
import { presetSgdStep } from '../testing/fixtures.js';
import { initBackend } from './index.js';
import { nativeAddon, nativeKernelNames, nativeUnavailable } from './native.js';
import { NATIVE_CONV_KERNELS } from './native-conv.js';
import { tf } from './tfjs.js';

const skip = nativeAddon()
  ? false
  : `native backend unavailable: ${nativeUnavailable()}`;

/** Asserts that `f` on native gives the cpu backend's non-empty outputs (testing/backend-compare.ts). */
const assertSameAsCpu = (
  what: string,
  shapes: number[][],
  f: (...xs: tf.Tensor[]) => tf.Tensor[],
  tol = 1e-4,
) => sameAsCpu('native', what, shapes, f, { tol, nonEmpty: true });

type Pad = 'same' | 'valid' | number[][];
/** name, x [b, h, w, cin], filter [fh, fw, cin, cout], strides, pad, dilations */
const CONVS: Array<
  [string, number[], number[], number | [number, number], Pad, number]
> = [
  [
    '3x3 same, batch 3, 5 -> 3 channels',
    [3, 7, 5, 5],
    [3, 3, 5, 3],
    1,
    'same',
    1,
  ],
  ['3x3 valid, stride 2, batch 1', [1, 7, 5, 3], [3, 3, 3, 5], 2, 'valid', 1],
  ['3x3 same, stride 2', [3, 7, 5, 3], [3, 3, 3, 5], 2, 'same', 1],
  [
    '3x3 valid, stride 2, even size (last row and column unused)',
    [3, 8, 6, 3],
    [3, 3, 3, 4],
    2,
    'valid',
    1,
  ],
  ['2x3 same, stride 2 on 8x6', [3, 8, 6, 3], [2, 3, 3, 5], 2, 'same', 1],
  ['2x3 valid, strides [1, 2]', [1, 7, 5, 5], [2, 3, 5, 3], [1, 2], 'valid', 1],
  ['1x1', [3, 7, 5, 5], [1, 1, 5, 3], 1, 'valid', 1],
  ['1x1, stride 2, same', [3, 7, 5, 5], [1, 1, 5, 3], 2, 'same', 1],
  [
    'explicit pads',
    [1, 7, 5, 3],
    [3, 3, 3, 2],
    1,
    [
      [0, 0],
      [1, 2],
      [2, 0],
      [0, 0],
    ],
    1,
  ],
  [
    'cnn-mnist first layer (28x28x1 -> 16)',
    [2, 28, 28, 1],
    [3, 3, 1, 16],
    1,
    'same',
    1,
  ],
  ['3x3 same, dilation 2', [1, 7, 5, 3], [3, 3, 3, 5], 1, 'same', 2],
  ['2x3 valid, dilation 2, batch 3', [3, 9, 8, 3], [2, 3, 3, 5], 1, 'valid', 2],
];

for (const [name, xs, ws, strides, pad, dil] of CONVS) {
  test(`native conv2d and its gradients equal cpu: ${name}`, {
    skip,
  }, async () => {
    const conv = (x: tf.Tensor, w: tf.Tensor) =>
      tf.conv2d(
        x as tf.Tensor4D,
        w as tf.Tensor4D,
        strides,
        pad as 'same',
        'NHWC',
        dil,
      );
    await assertSameAsCpu(`conv2d ${name}`, [xs, ws], (x, w) => [conv(x!, w!)]);
    // TF.js has no gradient for dilated convolutions
    if (dil === 1)
      await assertSameAsCpu(`d conv2d ${name}`, [xs, ws], (x, w) =>
        tf.grads((a, b) => tf.sum(tf.square(conv(a!, b!))))([x!, w!]),
      );
  });
}

test('native fused conv2d (bias, relu or linear) equals cpu, its gradients too; other activations fall back', {
  skip,
}, async () => {
  for (const [name, xs, ws, strides, pad] of CONVS.slice(0, 6)) {
    const cout = ws[3]!;
    const fused = (
      x: tf.Tensor,
      w: tf.Tensor,
      bias: tf.Tensor | undefined,
      activation: 'relu' | 'linear' | 'elu',
    ) =>
      tf.fused.conv2d({
        x: x as tf.Tensor4D,
        filter: w as tf.Tensor4D,
        strides,
        pad: pad as 'same',
        bias,
        activation,
      });
    await assertSameAsCpu(`fused relu ${name}`, [xs, ws, [cout]], (x, w, b) => [
      fused(x!, w!, b!, 'relu'),
    ]);
    await assertSameAsCpu(`fused linear, no bias ${name}`, [xs, ws], (x, w) => [
      fused(x!, w!, undefined, 'linear'),
    ]);
    await assertSameAsCpu(
      `fused elu (cpu) ${name}`,
      [xs, ws, [cout]],
      (x, w, b) => [fused(x!, w!, b!, 'elu')],
    );
    await assertSameAsCpu(
      `fused, bias [1, 1, 1, cout] ${name}`,
      [xs, ws, [1, 1, 1, cout]],
      (x, w, b) => [fused(x!, w!, b!, 'relu')],
    );
    await assertSameAsCpu(`d fused relu ${name}`, [xs, ws, [cout]], (x, w, b) =>
      tf.grads((p, q, r) => tf.sum(tf.square(fused(p!, q!, r!, 'relu'))))([
        x!,
        w!,
        b!,
      ]),
    );
  }
});

test('NCHW convolutions fall back to the cpu kernel and equal it', {
  skip,
}, async () => {
  await assertSameAsCpu(
    'conv2d NCHW',
    [
      [2, 3, 7, 5],
      [3, 3, 3, 4],
    ],
    (x, w) => [
      tf.conv2d(x as tf.Tensor4D, w as tf.Tensor4D, 1, 'same', 'NCHW'),
    ],
  );
});

/** name, x [b, h, w, c], filter size, strides, pad */
const POOLS: Array<
  [
    string,
    number[],
    number | [number, number],
    number | [number, number],
    'same' | 'valid',
  ]
> = [
  ['2x2 stride 2 same on 7x5, batch 3', [3, 7, 5, 5], 2, 2, 'same'],
  ['2x2 stride 2 valid on 7x5, batch 1', [1, 7, 5, 3], 2, 2, 'valid'],
  ['3x3 stride 1 same', [3, 7, 5, 3], 3, 1, 'same'],
  ['3x3 stride 1 valid', [1, 7, 5, 5], 3, 1, 'valid'],
  ['3x3 stride 2 same on 8x6', [3, 8, 6, 3], 3, 2, 'same'],
  ['2x3 strides [1, 2] same', [3, 7, 5, 3], [2, 3], [1, 2], 'same'],
  ['cnn-mnist first pool (28x28x16)', [2, 28, 28, 16], 2, 2, 'same'],
];

for (const [name, xs, size, strides, pad] of POOLS) {
  test(`native max and average pooling and their gradients equal cpu: ${name}`, {
    skip,
  }, async () => {
    const max = (x: tf.Tensor) =>
      tf.maxPool(x as tf.Tensor4D, size, strides, pad);
    const avg = (x: tf.Tensor) =>
      tf.avgPool(x as tf.Tensor4D, size, strides, pad);
    await assertSameAsCpu(`pools ${name}`, [xs], (x) => [max(x!), avg(x!)]);
    // dy varies by position (a random weighting), so a misrouted gradient shows
    const dyShape = tf.tidy(() => max(tf.zeros(xs)).shape);
    await assertSameAsCpu(`d max pool ${name}`, [xs, dyShape], (x, r) =>
      tf.grads((a) => tf.sum(tf.mul(max(a!), r!)))([x!]),
    );
    await assertSameAsCpu(`d avg pool ${name}`, [xs, dyShape], (x, r) =>
      tf.grads((a) => tf.sum(tf.mul(avg(a!), r!)))([x!]),
    );
    // ties: few distinct values, so windows have several maxima; the first one gets dy, as on cpu
    await assertSameAsCpu(
      `d max pool with ties ${name}`,
      [xs, dyShape],
      (x, r) => {
        const ties = tf.floor(tf.relu(x!));
        return tf.grads((a) => tf.sum(tf.mul(max(a!), r!)))([ties]);
      },
      1e-6,
    ); // a misrouted dy would differ by O(1); overlapping windows sum in another order
  });
}

test('the native backend registers its convolution and pooling kernels', {
  skip,
}, async () => {
  await initBackend('native');
  for (const name of [
    'Conv2D',
    'Conv2DBackpropInput',
    'Conv2DBackpropFilter',
    'FusedConv2D',
    'MaxPool',
    'MaxPoolGrad',
    'AvgPool',
    'AvgPoolGrad',
  ]) {
    assert.ok(nativeKernelNames().includes(name), `${name} is native`);
    assert.equal(
      tf.getKernel(name, 'native')?.kernelFunc,
      NATIVE_CONV_KERNELS[name],
      `${name} registered on 'native'`,
    );
  }
});

test('a cnn-mnist training step on native runs the native convolution and pooling kernels', {
  skip,
}, async () => {
  await initBackend('native');
  // count the addon's calls: native-conv.ts looks its functions up at each call
  const lib = nativeAddon() as unknown as Record<
    string,
    (...a: unknown[]) => unknown
  >;
  const names = [
    'conv2d',
    'conv2dBackpropInput',
    'conv2dBackpropFilter',
    'maxPool',
    'maxPoolGrad',
  ];
  const calls = new Map(names.map((n) => [n, 0]));
  const originals = new Map(names.map((n) => [n, lib[n]!]));
  for (const n of names)
    lib[n] = (...a: unknown[]) => {
      calls.set(n, calls.get(n)! + 1);
      return originals.get(n)!(...a);
    };
  try {
    const { loss0, loss1 } = await presetSgdStep('cnn-mnist', 4);
    assert.ok(
      Number.isFinite(loss0) && loss1 < loss0,
      `loss ${loss0} -> ${loss1}`,
    );
  } finally {
    for (const n of names) lib[n] = originals.get(n)!;
  }
  // two conv blocks: forward twice per pass (3 passes' worth of forwards), the first block's input needs no gradient
  assert.ok(calls.get('conv2d')! >= 4, `conv2d calls: ${calls.get('conv2d')}`);
  assert.ok(
    calls.get('maxPool')! >= 4,
    `maxPool calls: ${calls.get('maxPool')}`,
  );
  assert.ok(
    calls.get('conv2dBackpropFilter')! >= 2,
    `conv2dBackpropFilter calls: ${calls.get('conv2dBackpropFilter')}`,
  );
  assert.ok(
    calls.get('conv2dBackpropInput')! >= 1,
    `conv2dBackpropInput calls: ${calls.get('conv2dBackpropInput')}`,
  );
  assert.ok(
    calls.get('maxPoolGrad')! >= 2,
    `maxPoolGrad calls: ${calls.get('maxPoolGrad')}`,
  );
});
