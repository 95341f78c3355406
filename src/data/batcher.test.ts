import assert from 'node:assert/strict';
import { test } from 'node:test';
import { LayerwiseError } from '../util/errors.js';
import { Rng } from '../util/rng.js';
import {
  type Batch,
  type BatcherOptions,
  makeBatcher,
  validationBatches,
  windowCount,
} from './batcher.js';
import type { ImageDataset } from './images.js';
import { textDatasetFromString } from './text.js';

const rng = new Rng(123);
const text = Array.from({ length: 1000 }, () =>
  String.fromCharCode(97 + rng.int(26)),
).join(''); // no repeated 16-grams
const tds = textDatasetFromString('synthetic', text); // 900 train, 100 val tokens

function imageDataset(n: number, nVal: number): ImageDataset {
  const [h, w, c] = [3, 2, 2];
  const mk = (m: number, off: number) => {
    const x = new Float32Array(m * h * w * c);
    const y = new Int32Array(m);
    for (let i = 0; i < m; i++) {
      x.fill((i + off) / (n + nVal), i * 12, (i + 1) * 12);
      y[i] = (i + off) % 4;
    }
    return { x, y };
  };
  return {
    kind: 'image',
    name: 'synthetic-images',
    shape: [h, w, c],
    classes: 4,
    train: mk(n, 0),
    val: mk(nVal, n),
  };
}
const ids = imageDataset(50, 10);

function take(
  ds: Parameters<typeof makeBatcher>[0],
  opts: BatcherOptions,
  k: number,
) {
  const b = makeBatcher(ds, opts);
  return Array.from({ length: k }, () => b.next());
}

function sameBatch(a: Batch, b: Batch): boolean {
  return (
    JSON.stringify([
      Array.from(a.x),
      a.xShape,
      Array.from(a.y),
      a.yShape,
      a.examples,
      a.tokens,
    ]) ===
    JSON.stringify([
      Array.from(b.x),
      b.xShape,
      Array.from(b.y),
      b.yShape,
      b.examples,
      b.tokens,
    ])
  );
}

test('text batches: shapes, targets shifted by one, windows from the stream', () => {
  const B = 4;
  const T = 16;
  const b = makeBatcher(tds, { batchSize: B, context: T, seed: 1 });
  assert.equal(b.items, windowCount(900, T));
  assert.equal(b.items, 56);
  assert.equal(b.batchesPerEpoch, 14);
  const batch = b.next();
  assert.ok(batch.x instanceof Int32Array);
  assert.deepEqual(batch.xShape, [B, T]);
  assert.deepEqual(batch.yShape, [B, T]);
  assert.equal(batch.x.length, B * T);
  assert.equal(batch.y.length, B * T);
  assert.equal(batch.examples, B);
  assert.equal(batch.tokens, B * T);
  const train = `,${Array.from(tds.train).join(',')},`;
  const bx = batch.x as Int32Array;
  for (let r = 0; r < B; r++) {
    const x = Array.from(bx.subarray(r * T, (r + 1) * T));
    const y = Array.from(batch.y.subarray(r * T, (r + 1) * T));
    assert.deepEqual(
      y.slice(0, T - 1),
      x.slice(1),
      'targets are inputs shifted by one',
    );
    assert.ok(
      train.includes(`,${[...x, y[T - 1]].join(',')},`),
      'a window of the training stream',
    );
  }
});

test('an epoch visits every window once (remainder dropped) and epochs differ', () => {
  const B = 5;
  const T = 16;
  const b = makeBatcher(tds, { batchSize: B, context: T, seed: 3 });
  assert.equal(b.items, 56);
  const starts = (batch: Batch) =>
    Array.from({ length: B }, (_, r) => batch.x[r * T]);
  const epoch0: number[][] = [];
  for (let i = 0; i < b.batchesPerEpoch; i++)
    epoch0.push(Array.from(b.next().x));
  assert.equal(b.epoch, 1);
  assert.deepEqual(b.state().cursor, 0);
  // All windows distinct (by content, since the synthetic text never repeats a 16-gram).
  const windows = new Set<string>();
  for (const x of epoch0)
    for (let r = 0; r < B; r++)
      windows.add(x.slice(r * T, (r + 1) * T).join(','));
  assert.equal(windows.size, 55);
  const first1 = b.next();
  assert.notDeepEqual(
    starts(first1),
    epoch0[0].filter((_, i) => i % T === 0),
    'next epoch is reshuffled',
  );
});

test('same seed -> same batches; different seed -> different batches', () => {
  for (const [ds, opts] of [
    [tds, { batchSize: 4, context: 16 }],
    [ids, { batchSize: 8 }],
  ] as const) {
    const a = take(ds, { ...opts, seed: 7 }, 30);
    const b = take(ds, { ...opts, seed: 7 }, 30);
    const c = take(ds, { ...opts, seed: 8 }, 30);
    assert.ok(a.every((x, i) => sameBatch(x, b[i])));
    assert.ok(!a.every((x, i) => sameBatch(x, c[i])));
    assert.ok(!sameBatch(a[0], c[0]));
  }
});

test('resume: a batcher restored from state() after k batches yields batches k+1.. identically', () => {
  for (const [ds, opts] of [
    [tds, { batchSize: 4, context: 16, seed: 11 }],
    [ids, { batchSize: 8, seed: 11 }],
  ] as const) {
    const ref = take(ds, opts, 40); // crosses several epoch boundaries (14 and 6 batches per epoch)
    for (const k of [0, 1, 5, 6, 13, 14, 15, 29]) {
      const b = makeBatcher(ds, opts);
      for (let i = 0; i < k; i++) b.next();
      const saved = JSON.parse(JSON.stringify(b.state()));
      const r = makeBatcher(
        ds,
        {
          batchSize: opts.batchSize,
          context: 'context' in opts ? opts.context : undefined,
        },
        saved,
      );
      for (let i = k; i < 40; i++)
        assert.ok(sameBatch(r.next(), ref[i]), `${ds.kind} k=${k} batch ${i}`);
    }
  }
});

test('image batches: shapes and pixels follow their labels', () => {
  const b = makeBatcher(ids, { batchSize: 8, seed: 0 });
  assert.equal(b.batchesPerEpoch, 6);
  const batch = b.next();
  assert.ok(batch.x instanceof Float32Array);
  assert.deepEqual(batch.xShape, [8, 3, 2, 2]);
  assert.deepEqual(batch.yShape, [8]);
  assert.equal(batch.examples, 8);
  assert.equal(batch.tokens, 8);
  for (let r = 0; r < 8; r++) {
    const i = Math.round(batch.x[r * 12] * 60);
    assert.equal(batch.y[r], i % 4);
    assert.ok(i < 50, 'from the training split');
  }
});

test('bad options and foreign states are LayerwiseErrors', () => {
  assert.throws(
    () => makeBatcher(tds, { batchSize: 0, context: 8, seed: 1 }),
    LayerwiseError,
  );
  assert.throws(() => makeBatcher(tds, { batchSize: 2, seed: 1 }), /Context/);
  assert.throws(() => makeBatcher(tds, { batchSize: 2, context: 8 }), /seed/);
  assert.throws(
    () => makeBatcher(tds, { batchSize: 2, context: 8, seed: 1.5 }),
    /integer seed/,
  );
  assert.throws(
    () => makeBatcher(tds, { batchSize: 100, context: 16, seed: 1 }),
    /fewer than batch size 100/,
  );
  assert.throws(
    () => makeBatcher(ids, { batchSize: 51, seed: 1 }),
    /fewer than batch size 51/,
  );
  const s = makeBatcher(tds, { batchSize: 4, context: 16, seed: 1 }).state();
  assert.throws(
    () => makeBatcher(tds, { batchSize: 8, context: 16 }, s),
    /batch size 4/,
  );
  assert.throws(
    () => makeBatcher(tds, { batchSize: 4, context: 8 }, s),
    /context 16/,
  );
  assert.throws(
    () => makeBatcher(tds, { batchSize: 4, context: 16, seed: 2 }, s),
    /seed 1/,
  );
  assert.throws(() => makeBatcher(ids, { batchSize: 4 }, s), /text data set/);
  assert.throws(
    () => makeBatcher(tds, { batchSize: 4, context: 16 }, { ...s, cursor: -1 }),
    /cursor/,
  );
  assert.throws(
    () => makeBatcher(tds, { batchSize: 4, context: 16 }, { ...s, items: 3 }),
    /data changed/,
  );
  assert.throws(
    () => makeBatcher(tds, { batchSize: 4, context: 16 }, null as never),
    LayerwiseError,
  );
  assert.doesNotThrow(() =>
    makeBatcher(tds, { batchSize: 4, context: 16, seed: 1 }, s),
  );
});

test('validationBatches: fixed, in order, full batches unless partial', () => {
  const T = 16;
  const v = validationBatches(tds, { batchSize: 2, context: T });
  assert.equal(windowCount(100, T), 6);
  assert.equal(v.length, 3);
  assert.deepEqual(v[0].xShape, [2, T]);
  assert.deepEqual(
    Array.from(v[0].x.subarray(0, T)),
    Array.from(tds.val.subarray(0, T)),
  );
  assert.deepEqual(
    Array.from(v[0].y.subarray(0, T)),
    Array.from(tds.val.subarray(1, T + 1)),
  );
  assert.deepEqual(
    Array.from(v[0].x.subarray(T, 2 * T)),
    Array.from(tds.val.subarray(T, 2 * T)),
  );
  const again = validationBatches(tds, { batchSize: 2, context: T });
  assert.ok(v.every((b, i) => sameBatch(b, again[i])));
  assert.equal(
    validationBatches(tds, { batchSize: 2, context: T, maxBatches: 2 }).length,
    2,
  );
  assert.equal(validationBatches(tds, { batchSize: 4, context: T }).length, 1);
  const p = validationBatches(tds, { batchSize: 4, context: T, partial: true });
  assert.deepEqual(
    p.map((b) => b.examples),
    [4, 2],
  );
  assert.deepEqual(p[1].yShape, [2, T]);
  const im = validationBatches(ids, { batchSize: 4 });
  assert.deepEqual(
    im.map((b) => b.xShape),
    [
      [4, 3, 2, 2],
      [4, 3, 2, 2],
    ],
  );
  assert.deepEqual(Array.from(im[0].y), [50 % 4, 51 % 4, 52 % 4, 53 % 4]);
  assert.deepEqual(
    validationBatches(
      textDatasetFromString('t', 'abcdefgh', { valFraction: 0 }),
      { batchSize: 1, context: 2 },
    ),
    [],
  );
});
