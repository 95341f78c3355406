import assert from 'node:assert/strict';
import { mkdir, mkdtemp, rm, writeFile } from 'node:fs/promises';
import { tmpdir } from 'node:os';
import { join } from 'node:path';
import { after, before, test } from 'node:test';
import { LayerwiseError } from '../util/errors.js';
import { Rng } from '../util/rng.js';
import {
  type BatcherState,
  makeBatcher,
  validationBatches,
} from './batcher.js';
import { type ImageDataset, splitExamples } from './images.js';
import { describeDataset, loadDataset } from './index.js';
import { parseNpy } from './npy.js';
import {
  loadJsonlDataset,
  loadNpyDataset,
  type TensorDataset,
  tensorDatasetFromJsonl,
  tensorSplitSize,
} from './tensors.js';

let dir = '';
before(async () => {
  dir = await mkdtemp(join(tmpdir(), 'layerwise-tensors-'));
});
after(async () => {
  await rm(dir, { recursive: true, force: true });
});

/** Write `content` to a file named `name` in the test folder; returns its path. */
async function put(
  name: string,
  content: string | Uint8Array,
): Promise<string> {
  const p = join(dir, name);
  await writeFile(p, content);
  return p;
}

const jsonl = (rows: unknown[]) =>
  `${rows.map((r) => JSON.stringify(r)).join('\n')}\n`;

/** The raw (little-endian, this host's order) bytes of a typed array. */
const raw = (a: ArrayBufferView) =>
  new Uint8Array(a.buffer, a.byteOffset, a.byteLength);

/** A .npy file as numpy.save writes it (header padded to a multiple of 64 bytes), with knobs to break it. */
function npy(
  descr: string,
  shape: number[],
  data: ArrayBufferView,
  o: {
    version?: 1 | 2 | 3;
    fortran?: string;
    header?: string;
    extra?: number;
    cut?: number;
  } = {},
): Uint8Array {
  const version = o.version ?? 1;
  const tuple = `(${shape.join(', ')}${shape.length === 1 ? ',' : ''})`;
  let header =
    o.header ??
    `{'descr': '${descr}', 'fortran_order': ${o.fortran ?? 'False'}, 'shape': ${tuple}, }`;
  const pre = version === 1 ? 10 : 12;
  header += `${' '.repeat((64 - ((pre + header.length + 1) % 64)) % 64)}\n`;
  const h = new TextEncoder().encode(header);
  const body = raw(data);
  const out = new Uint8Array(pre + h.length + body.length + (o.extra ?? 0));
  out.set([0x93, 0x4e, 0x55, 0x4d, 0x50, 0x59, version, 0]);
  const dv = new DataView(out.buffer);
  if (version === 1) dv.setUint16(8, h.length, true);
  else dv.setUint32(8, h.length, true);
  out.set(h, pre);
  out.set(body, pre + h.length);
  return o.cut ? out.subarray(0, out.length - o.cut) : out;
}

/** Every example of a tensor set as a `x|y` string, train then val, to compare contents across splits. */
function rows(ds: TensorDataset): string[] {
  const xPer = ds.xShape.reduce((a, b) => a * b, 1);
  const yPer =
    ds.target.kind === 'classes'
      ? 1
      : ds.target.shape.reduce((a, b) => a * b, 1);
  const out: string[] = [];
  for (const s of [ds.train, ds.val]) {
    for (let i = 0; i < s.y.length / yPer; i++) {
      out.push(
        `${Array.from(s.x.subarray(i * xPer, (i + 1) * xPer)).join(',')}|${Array.from(s.y.subarray(i * yPer, (i + 1) * yPer)).join(',')}`,
      );
    }
  }
  return out;
}

// 20 examples, x a 2x2 matrix [[i, -i], [i/4, 1]], y = i % 3
const classRows = Array.from({ length: 20 }, (_, i) => ({
  x: [
    [i, -i],
    [i / 4, 1],
  ],
  y: i % 3,
}));
const classRowStrings = classRows.map((r) => `${r.x.flat().join(',')}|${r.y}`);

test('JSONL classes: shapes inferred, labels int32, a fixed seeded 10% held out', async () => {
  const p = await put('classes.jsonl', jsonl(classRows));
  const ds = await loadJsonlDataset(p);
  assert.equal(ds.kind, 'tensor');
  assert.equal(ds.name, 'classes.jsonl');
  assert.deepEqual(ds.xShape, [2, 2]);
  assert.deepEqual(ds.target, { kind: 'classes', classes: 3 });
  assert.ok(ds.train.y instanceof Int32Array && ds.val.y instanceof Int32Array);
  assert.equal(tensorSplitSize(ds, 'train'), 18);
  assert.equal(tensorSplitSize(ds, 'val'), 2);
  assert.equal(ds.train.x.length, 18 * 4);
  // every example appears once, with its own label, across the two splits
  assert.deepEqual(rows(ds).sort(), [...classRowStrings].sort());
  assert.notDeepEqual(
    rows(ds),
    classRowStrings,
    'examples are permuted before the split',
  );
  // deterministic for a seed, different for another
  const again = await loadJsonlDataset(p);
  assert.deepEqual(rows(again), rows(ds));
  const other = await loadJsonlDataset(p, { splitSeed: 5 });
  assert.notDeepEqual(rows(other), rows(ds));
  assert.deepEqual(rows(other).sort(), rows(ds).sort());
  // the split is exactly the image loaders' permutation
  const ref = splitExamples(
    {
      x: new Float32Array(classRows.flatMap((r) => r.x.flat())),
      y: new Int32Array(classRows.map((r) => r.y)),
    },
    4,
    0.1,
    0,
  );
  assert.deepEqual(Array.from(ds.val.y), Array.from(ref.val.y));
  assert.deepEqual(Array.from(ds.val.x), Array.from(ref.val.x));
  // valFraction 0: nothing held out; classes option
  const all = await loadJsonlDataset(p, { valFraction: 0, classes: 7 });
  assert.equal(tensorSplitSize(all, 'val'), 0);
  assert.deepEqual(all.target, { kind: 'classes', classes: 7 });
  assert.match(
    describeDataset(ds),
    /^classes\.jsonl: tensors \[2, 2\], 3 classes, 18 train, 2 val$/,
  );
});

test('JSONL regression: float targets of a shape, scalar x is one feature, scalar y has shape []', () => {
  const text = jsonl(
    Array.from({ length: 10 }, (_, i) => ({
      x: [i, i * 0.5, 1],
      y: [i + 0.25, -i - 1],
    })),
  );
  const ds = tensorDatasetFromJsonl('reg.jsonl', text, { valFraction: 0.2 });
  assert.deepEqual(ds.xShape, [3]);
  assert.deepEqual(ds.target, { kind: 'values', shape: [2] });
  assert.ok(
    ds.train.y instanceof Float32Array && ds.val.y instanceof Float32Array,
  );
  assert.equal(tensorSplitSize(ds, 'train'), 8);
  assert.equal(ds.val.y.length, 2 * 2);
  for (const r of rows(ds)) {
    const [x, y] = r.split('|').map((s) => s.split(',').map(Number));
    assert.deepEqual(
      y,
      [x[0] + 0.25, -x[0] - 1],
      'targets stay with their features',
    );
  }
  assert.match(describeDataset(ds), /regression targets \[2\], 8 train, 2 val/);

  const scalar = tensorDatasetFromJsonl(
    's.jsonl',
    '{"x": 1.5, "y": 0.5}\n{"x": 2, "y": -1}\n',
    { valFraction: 0 },
  );
  assert.deepEqual(scalar.xShape, [1]);
  assert.deepEqual(scalar.target, { kind: 'values', shape: [] });
  assert.deepEqual(
    Array.from(scalar.train.y).sort(),
    [-1, 0.5],
    'kept (in the fixed permuted order)',
  );

  // integers are class labels unless written as one-element arrays
  const ints = tensorDatasetFromJsonl(
    'i.jsonl',
    '{"x": [1], "y": [3]}\n{"x": [2], "y": [5]}\n',
    { valFraction: 0 },
  );
  assert.deepEqual(ints.target, { kind: 'values', shape: [1] });
  // a negative or fractional scalar makes every y a regression target
  const mixed = tensorDatasetFromJsonl(
    'm.jsonl',
    '{"x": [1], "y": 2}\n{"x": [2], "y": 0.5}\n',
    { valFraction: 0 },
  );
  assert.deepEqual(mixed.target, { kind: 'values', shape: [] });
  assert.deepEqual(Array.from(mixed.train.y).sort(), [0.5, 2]);
});

test('JSONL "split": "val" lines form the validation split, in file order; blank lines and CRLF are fine', () => {
  const lines = [
    '{"x": [1, 1], "y": 0}',
    '',
    '{"x": [2, 2], "y": 1, "split": "val"}\r',
    '   ',
    '{"x": [3, 3], "y": 1, "split": "train", "id": "ignored"}',
    '{"x": [4, 4], "y": 2, "split": "val"}',
    '{"x": [5, 5], "y": 0}',
  ];
  const ds = tensorDatasetFromJsonl('split.jsonl', lines.join('\n'), {
    valFraction: 0.5,
  });
  assert.deepEqual(Array.from(ds.train.x), [1, 1, 3, 3, 5, 5]);
  assert.deepEqual(Array.from(ds.train.y), [0, 1, 0]);
  assert.deepEqual(Array.from(ds.val.x), [2, 2, 4, 4]);
  assert.deepEqual(Array.from(ds.val.y), [1, 2]);
  assert.deepEqual(ds.target, { kind: 'classes', classes: 3 });
  // only "train" fields: nothing held out
  const onlyTrain = tensorDatasetFromJsonl(
    't.jsonl',
    '{"x": 1, "y": 0, "split": "train"}\n{"x": 2, "y": 1}\n',
  );
  assert.equal(tensorSplitSize(onlyTrain, 'val'), 0);
});

test('loadDataset reads .jsonl, .ndjson and npy: specs', async () => {
  const a = await put('a.ndjson', jsonl(classRows));
  const b = await put('b.JSONL', jsonl(classRows));
  const dsA = await loadDataset(a);
  const dsB = await loadDataset(b, {
    valFraction: 0.25,
    splitSeed: 2,
    classes: 4,
  });
  assert.equal(dsA.kind, 'tensor');
  assert.ok(dsB.kind === 'tensor');
  assert.equal(tensorSplitSize(dsB, 'val'), 5);
  assert.deepEqual(dsB.target, { kind: 'classes', classes: 4 });
  const x = await put(
    'lx.npy',
    npy('<f4', [4, 3], new Float32Array(12).fill(0.5)),
  );
  const y = await put(
    'ly.npy',
    npy('<i8', [4], new BigInt64Array([0n, 1n, 0n, 1n])),
  );
  const ds = await loadDataset(`npy:${x},${y}`, { valFraction: 0.25 });
  assert.ok(ds.kind === 'tensor');
  assert.equal(ds.name, `npy:${x},${y}`);
  assert.deepEqual(ds.xShape, [3]);
  assert.equal(tensorSplitSize(ds, 'val'), 1);
  const is = (re: RegExp) => (e: unknown) =>
    e instanceof LayerwiseError && re.test(e.message);
  await assert.rejects(
    loadDataset('npy:only.npy'),
    is(/2 or 4 comma-separated \.npy paths/),
  );
  await assert.rejects(
    loadDataset(join(dir, 'missing.jsonl')),
    is(/missing\.jsonl does not exist/),
  );
  await assert.rejects(
    loadDataset('cifar10'),
    is(/\.jsonl\/\.ndjson file.*'npy:X\.npy,Y\.npy'/),
  );
});

test('npy: float32, float64 and uint8 features with int64 labels; values kept unchanged', async () => {
  const n = 10;
  const f32 = new Float32Array(n * 6).map((_, i) => i / 8 - 2);
  const labels = new BigInt64Array(n).map((_, i) => BigInt(i % 4));
  const yPath = await put('y.npy', npy('<i8', [n], labels));
  for (const [descr, data] of [
    ['<f4', f32],
    ['<f8', Float64Array.from(f32)],
    ['|u1', new Uint8Array(n * 6).map((_, i) => (i * 7) % 256)],
  ] as const) {
    const xPath = await put(
      `x${descr.slice(1)}.npy`,
      npy(descr, [n, 2, 3], data),
    );
    const ds = await loadNpyDataset(
      { x: xPath, y: yPath },
      { valFraction: 0.2 },
    );
    assert.deepEqual(ds.xShape, [2, 3], descr);
    assert.deepEqual(ds.target, { kind: 'classes', classes: 4 });
    assert.ok(ds.train.y instanceof Int32Array);
    assert.equal(tensorSplitSize(ds, 'train'), 8);
    const expected = Array.from(
      { length: n },
      (_, i) =>
        `${Array.from(data.subarray(i * 6, (i + 1) * 6), Number).join(',')}|${i % 4}`,
    );
    assert.deepEqual(
      rows(ds).sort(),
      expected.sort(),
      `${descr} values and labels survive the split`,
    );
  }
  // separate validation files, float regression targets, rank-1 X, other dtypes and versions
  const x = await put(
    'rx.npy',
    npy('<i4', [4], new Int32Array([1, -2, 3, -4]), { version: 2 }),
  );
  const y = await put(
    'ry.npy',
    npy('<f4', [4, 1], new Float32Array([0.5, 1.5, 2.5, 3.5])),
  );
  const vx = await put(
    'rvx.npy',
    npy('<i2', [2], new Int16Array([7, 8]), { version: 3 }),
  );
  const vy = await put(
    'rvy.npy',
    npy('<f8', [2, 1], new Float64Array([9.25, 10])),
  );
  const ds = await loadNpyDataset({ x, y, valX: vx, valY: vy });
  assert.deepEqual(ds.xShape, [1]);
  assert.deepEqual(ds.target, { kind: 'values', shape: [1] });
  assert.deepEqual(Array.from(ds.train.x), [1, -2, 3, -4]);
  assert.deepEqual(Array.from(ds.train.y), [0.5, 1.5, 2.5, 3.5]);
  assert.deepEqual(Array.from(ds.val.x), [7, 8]);
  assert.ok(ds.val.y instanceof Float32Array);
  assert.deepEqual(Array.from(ds.val.y), [9.25, 10]);
});

test('npy files written by NumPy itself parse (v1 and v3 headers)', () => {
  const b64 = (s: string) => new Uint8Array(Buffer.from(s, 'base64'));
  // np.save(f, np.array([[0.5, -1.25], [2, 3], [4, 5.5]], dtype='<f4'))
  const x = parseNpy(
    b64(
      'k05VTVBZAQB2AHsnZGVzY3InOiAnPGY0JywgJ2ZvcnRyYW5fb3JkZXInOiBGYWxzZSwgJ3NoYXBlJzogKDMsIDIpLCB9ICAgICAgICAgICAgICAgICAgICAgICAgICAgICAgICAgICAgICAgICAgICAgICAgICAgICAgICAgIAoAAAA/AACgvwAAAEAAAEBAAACAQAAAsEA=',
    ),
  );
  assert.equal(x.dtype, 'float32');
  assert.deepEqual(x.shape, [3, 2]);
  assert.deepEqual(
    Array.from(x.data as Float32Array),
    [0.5, -1.25, 2, 3, 4, 5.5],
  );
  // np.save(f, np.array([2, 0, 1], dtype='<i8'))
  const y = parseNpy(
    b64(
      'k05VTVBZAQB2AHsnZGVzY3InOiAnPGk4JywgJ2ZvcnRyYW5fb3JkZXInOiBGYWxzZSwgJ3NoYXBlJzogKDMsKSwgfSAgICAgICAgICAgICAgICAgICAgICAgICAgICAgICAgICAgICAgICAgICAgICAgICAgICAgICAgICAgIAoCAAAAAAAAAAAAAAAAAAAAAQAAAAAAAAA=',
    ),
  );
  assert.equal(y.dtype, 'int64');
  assert.deepEqual(y.shape, [3]);
  assert.deepEqual(Array.from(y.data as BigInt64Array), [2n, 0n, 1n]);
  // np.lib.format.write_array(f, np.arange(3, dtype='<u2'), version=(3, 0))
  const u = parseNpy(
    b64(
      'k05VTVBZAwB0AAAAeydkZXNjcic6ICc8dTInLCAnZm9ydHJhbl9vcmRlcic6IEZhbHNlLCAnc2hhcGUnOiAoMywpLCB9ICAgICAgICAgICAgICAgICAgICAgICAgICAgICAgICAgICAgICAgICAgICAgICAgICAgICAgICAgIAoAAAEAAgA=',
    ),
  );
  assert.equal(u.dtype, 'uint16');
  assert.deepEqual(Array.from(u.data as Uint16Array), [0, 1, 2]);
  // np.save(f, np.asfortranarray(np.array([[1, 2], [3, 4]], dtype='<f4')))
  assert.throws(
    () =>
      parseNpy(
        b64(
          'k05VTVBZAQB2AHsnZGVzY3InOiAnPGY0JywgJ2ZvcnRyYW5fb3JkZXInOiBUcnVlLCAnc2hhcGUnOiAoMiwgMiksIH0gICAgICAgICAgICAgICAgICAgICAgICAgICAgICAgICAgICAgICAgICAgICAgICAgICAgICAgICAgIAoAAIA/AABAQAAAAEAAAIBA',
        ),
        'f.npy',
      ),
    (e: unknown) =>
      e instanceof LayerwiseError &&
      /f\.npy is in Fortran \(column-major\) order \(header field 'fortran_order' is True\).*np\.ascontiguousarray/.test(
        e.message,
      ),
  );
  // np.save(f, np.array([1, 2], dtype='>f8'))
  assert.throws(
    () =>
      parseNpy(
        b64(
          'k05VTVBZAQB2AHsnZGVzY3InOiAnPmY4JywgJ2ZvcnRyYW5fb3JkZXInOiBGYWxzZSwgJ3NoYXBlJzogKDIsKSwgfSAgICAgICAgICAgICAgICAgICAgICAgICAgICAgICAgICAgICAgICAgICAgICAgICAgICAgICAgICAgIAo/8AAAAAAAAEAAAAAAAAAA',
        ),
        'b.npy',
      ),
    (e: unknown) =>
      e instanceof LayerwiseError &&
      /b\.npy is big-endian \(header field 'descr' is '>f8'\).*astype\('<f8'\)/.test(
        e.message,
      ),
  );
});

test('tensor batches: shapes, dtypes and values; validation batches; tokens = examples', async () => {
  const p = await put('batch.jsonl', jsonl(classRows));
  const ds = await loadJsonlDataset(p, { valFraction: 0.25 });
  const known = new Set(classRowStrings);
  const b = makeBatcher(ds, { batchSize: 4, seed: 1 });
  assert.equal(b.items, 15);
  assert.equal(b.batchesPerEpoch, 3);
  const batch = b.next();
  assert.ok(batch.x instanceof Float32Array);
  assert.ok(batch.y instanceof Int32Array);
  assert.deepEqual(batch.xShape, [4, 2, 2]);
  assert.deepEqual(batch.yShape, [4]);
  assert.equal(batch.x.length, 16);
  assert.equal(batch.examples, 4);
  assert.equal(batch.tokens, 4);
  for (let r = 0; r < 4; r++) {
    assert.ok(
      known.has(
        `${Array.from(batch.x.subarray(r * 4, (r + 1) * 4)).join(',')}|${batch.y[r]}`,
      ),
      'a row of the data with its label',
    );
  }
  const vb = validationBatches(ds, { batchSize: 2, partial: true });
  assert.deepEqual(
    vb.map((v) => v.examples),
    [2, 2, 1],
  );
  assert.deepEqual(
    Array.from(vb[0].x),
    Array.from(ds.val.x.subarray(0, 8)),
    'validation in data order',
  );
  assert.deepEqual(Array.from(vb[2].y), [ds.val.y[4]]);

  const reg = tensorDatasetFromJsonl(
    'r.jsonl',
    jsonl(
      Array.from({ length: 12 }, (_, i) => ({
        x: [i, 2 * i],
        y: [[i], [i + 0.5], [-i - 1]],
      })),
    ),
    { valFraction: 0.25 },
  );
  const rb = makeBatcher(reg, { batchSize: 3, seed: 0 }).next();
  assert.ok(rb.x instanceof Float32Array);
  assert.ok(rb.y instanceof Float32Array, 'regression targets are float32');
  assert.deepEqual(rb.xShape, [3, 2]);
  assert.deepEqual(rb.yShape, [3, 3, 1]);
  assert.equal(rb.tokens, 3);
  for (let r = 0; r < 3; r++) {
    const i: number = rb.x[r * 2];
    assert.equal(rb.x[r * 2 + 1], 2 * i);
    assert.deepEqual(Array.from(rb.y.subarray(r * 3, r * 3 + 3)), [
      i,
      i + 0.5,
      -i - 1,
    ]);
  }
  const rv = validationBatches(reg, { batchSize: 3 });
  assert.equal(rv.length, 1);
  assert.ok(rv[0].y instanceof Float32Array);
  assert.deepEqual(rv[0].yShape, [3, 3, 1]);
  assert.throws(
    () => makeBatcher(reg, { batchSize: 10, seed: 0 }),
    /has 9 examples, fewer than batch size 10/,
  );
});

test('tensor batchers resume exactly from their state, and refuse another kind of state', async () => {
  const ds = tensorDatasetFromJsonl('res.jsonl', jsonl(classRows), {
    valFraction: 0,
  });
  const a = makeBatcher(ds, { batchSize: 3, seed: 9 });
  for (let i = 0; i < 8; i++) a.next(); // into the second epoch (6 batches per epoch)
  const state = JSON.parse(JSON.stringify(a.state())) as BatcherState;
  assert.equal(state.kind, 'tensor');
  assert.equal(state.context, 0);
  assert.equal(state.items, 20);
  const b = makeBatcher(ds, { batchSize: 3 }, state);
  for (let i = 0; i < 7; i++) {
    const x = a.next();
    const y = b.next();
    assert.deepEqual(
      [Array.from(x.x), Array.from(x.y)],
      [Array.from(y.x), Array.from(y.y)],
    );
  }
  const img: ImageDataset = {
    kind: 'image',
    name: 'img',
    shape: [2, 2, 1],
    classes: 3,
    train: { x: new Float32Array(80), y: new Int32Array(20) },
    val: { x: new Float32Array(0), y: new Int32Array(0) },
  };
  const imgState = makeBatcher(img, { batchSize: 3, seed: 9 }).state();
  assert.throws(
    () => makeBatcher(ds, { batchSize: 3 }, imgState),
    /batcher state is for a image data set but this one is tensor/,
  );
});

test('splitExamples keeps its image behaviour: the Rng(seed) permutation, last floor(N*f) are validation', () => {
  const n = 17;
  const all = {
    x: new Float32Array(n * 2).map((_, i) => i),
    y: new Int32Array(n).map((_, i) => i),
  };
  const { train, val } = splitExamples(all, 2, 0.3, 4);
  const perm = new Rng(4).shuffle(Int32Array.from({ length: n }, (_, i) => i));
  assert.ok(train.y instanceof Int32Array);
  assert.deepEqual(Array.from(train.y), Array.from(perm.subarray(0, 12)));
  assert.deepEqual(Array.from(val.y), Array.from(perm.subarray(12)));
  assert.deepEqual(Array.from(val.x.subarray(0, 2)), [
    2 * perm[12],
    2 * perm[12] + 1,
  ]);
});

/** Malformed JSONL files: content, options, and what the message must say (besides the file name). */
const BAD_JSONL: [string, string, { classes?: number }, RegExp][] = [
  ['empty file', '', {}, /has no examples \(it is empty or only blank lines\)/],
  ['only blank lines', '\n  \n\r\n', {}, /has no examples/],
  [
    'invalid JSON',
    '{"x": [1], "y": 0}\n{"x": [1], "y": 0\n',
    {},
    /line 2 is not valid JSON/,
  ],
  [
    'not an object',
    '[1, 2]\n',
    {},
    /line 1 is an array of length 2, not a JSON object/,
  ],
  [
    'missing y',
    '{"x": [1, 2], "label": 0}\n',
    {},
    /line 1 has no "y" field \(fields: "x", "label"\)/,
  ],
  [
    'string value',
    '{"x": [1, "2"], "y": 0}\n',
    {},
    /line 1: x\[1\] is "2" \(a string\), not a number \(write numbers without quotes\)/,
  ],
  [
    'null value',
    '{"x": [[1, 2], [null, 4]], "y": 0}\n',
    {},
    /line 1: x\[1\]\[0\] is null, not a number.*NaN/,
  ],
  [
    'boolean label',
    '{"x": [1], "y": true}\n',
    {},
    /line 1: y is true \(a boolean\), not a number/,
  ],
  [
    'NaN literal',
    '{"x": [1], "y": 0}\n{"x": [NaN], "y": 0}\n',
    {},
    /line 2 contains NaN, which is not a number in JSON/,
  ],
  [
    'Infinity literal',
    '{"x": [-Infinity], "y": 0}\n',
    {},
    /line 1 contains -Infinity/,
  ],
  [
    'overflowing number',
    '{"x": [1e999], "y": 0}\n',
    {},
    /line 1: x\[0\] is Infinity \(out of range\), not a finite number/,
  ],
  [
    'beyond float32',
    '{"x": [1], "y": 0}\n{"x": [1e39], "y": 0}\n',
    {},
    /line 2: x has value 1e\+39, beyond float32 range/,
  ],
  [
    'ragged rows',
    '{"x": [[1, 2], [3]], "y": 0}\n',
    {},
    /line 1: x\[1\] has 1 elements but x\[0\] has 2: ragged/,
  ],
  [
    'ragged depth',
    '{"x": [[1, 2], 3], "y": 0}\n',
    {},
    /line 1: x\[1\] is a number where x\[0\] is an array of length 2: ragged/,
  ],
  [
    'empty x',
    '{"x": [], "y": 0}\n',
    {},
    /line 1: x has an empty array \(shape \[0\]\)/,
  ],
  [
    'x shape differs',
    '{"x": [1, 2], "y": 0}\n\n{"x": [1, 2, 3], "y": 1}\n',
    {},
    /line 3: x has shape \[3\] but line 1's x has shape \[2\]/,
  ],
  [
    'mixed label kinds',
    '{"x": [1], "y": 1}\n{"x": [2], "y": [0.5, 1]}\n',
    {},
    /line 2: y is an array of shape \[2\] but line 1's y is a number; mixed label kinds/,
  ],
  [
    'target shape differs',
    '{"x": [1], "y": [1, 2]}\n{"x": [2], "y": [1, 2, 3]}\n',
    {},
    /line 2: y has shape \[3\] but line 1's y has shape \[2\]/,
  ],
  [
    'bad split value',
    '{"x": [1], "y": 0, "split": "validation"}\n',
    {},
    /line 1 has "split": "validation"; use "train" or "val"/,
  ],
  [
    'all validation',
    '{"x": [1], "y": 0, "split": "val"}\n',
    {},
    /"split": "val" on all 1 examples, leaving none for training/,
  ],
  [
    'label beyond classes',
    '{"x": [1], "y": 7}\n{"x": [1], "y": 2}\n',
    { classes: 5 },
    /has class label 7, but 5 classes were asked for/,
  ],
  [
    'classes for regression',
    '{"x": [1], "y": 0.5}\n',
    { classes: 5 },
    /line 1: y is 0\.5, not a class label, but 5 classes were asked for/,
  ],
];

test('malformed JSONL files are rejected with the file, the line and the problem', async () => {
  for (const [what, content, opts, re] of BAD_JSONL) {
    const p = await put(`bad-${what.replace(/\W+/g, '-')}.jsonl`, content);
    await assert.rejects(loadJsonlDataset(p, opts), (e: unknown) => {
      assert.ok(e instanceof LayerwiseError, `${what}: ${String(e)}`);
      assert.match(e.message, re, what);
      assert.ok(
        e.message.includes(p),
        `${what}: the message names the file: ${e.message}`,
      );
      return true;
    });
  }
});

/** Malformed .npy pairs: X file, Y file (and validation files), what the message must say. */
const f32 = (n: number) => new Float32Array(n).fill(0.5);
const labels = (n: number) => new BigInt64Array(n);
const BAD_NPY: [string, () => Uint8Array[], RegExp][] = [
  [
    'bad magic',
    () => [
      new TextEncoder().encode('PK\x03\x04 zip file'),
      npy('<i8', [2], labels(2)),
    ],
    /does not start with the magic string \\x93NUMPY.*\.npz/,
  ],
  [
    'truncated preamble',
    () => [npy('<f4', [2], f32(2)).subarray(0, 8), npy('<i8', [2], labels(2))],
    /is truncated: 8 bytes, shorter than its preamble/,
  ],
  [
    'unknown version',
    () => {
      const b = npy('<f4', [2], f32(2));
      b[6] = 4;
      return [b, npy('<i8', [2], labels(2))];
    },
    /format version 4\.0; versions 1\.0, 2\.0 and 3\.0/,
  ],
  [
    'fortran order',
    () => [
      npy('<f4', [2, 2], f32(4), { fortran: 'True' }),
      npy('<i8', [2], labels(2)),
    ],
    /Fortran \(column-major\) order \(header field 'fortran_order' is True\)/,
  ],
  [
    'big-endian',
    () => [npy('>f4', [2], f32(2)), npy('<i8', [2], labels(2))],
    /big-endian \(header field 'descr' is '>f4'\)/,
  ],
  [
    'float16',
    () => [npy('<f2', [2], new Uint16Array(2)), npy('<i8', [2], labels(2))],
    /unsupported dtype \(header field 'descr' is '<f2'\); supported are/,
  ],
  [
    'object array',
    () => [npy('|O', [2], new Uint8Array(16)), npy('<i8', [2], labels(2))],
    /unsupported dtype \(header field 'descr' is '\|O'\)/,
  ],
  [
    'structured dtype',
    () => [
      npy('', [2], f32(2), {
        header:
          "{'descr': [('a', '<f4')], 'fortran_order': False, 'shape': (2,), }",
      }),
      npy('<i8', [2], labels(2)),
    ],
    /structured dtype \(header field 'descr' is \[\('a', '<f4'\)\]\)/,
  ],
  [
    'missing shape',
    () => [
      npy('', [2], f32(2), {
        header: "{'descr': '<f4', 'fortran_order': False, }",
      }),
      npy('<i8', [2], labels(2)),
    ],
    /has no 'shape' in its header/,
  ],
  [
    'bad shape',
    () => [
      npy('', [2], f32(2), {
        header: "{'descr': '<f4', 'fortran_order': False, 'shape': (2, -1), }",
      }),
      npy('<i8', [2], labels(2)),
    ],
    /header field 'shape' = \(2, -1\), not a tuple of non-negative integers/,
  ],
  [
    'extra header key',
    () => [
      npy('', [2], f32(2), {
        header:
          "{'descr': '<f4', 'fortran_order': False, 'shape': (2,), 'extra': 1}",
      }),
      npy('<i8', [2], labels(2)),
    ],
    /unexpected header field\(s\) 'extra'/,
  ],
  [
    'malformed header',
    () => [
      npy('', [2], f32(2), {
        header: "{'descr': '<f4', 'fortran_order': False 'shape': (2,)}",
      }),
      npy('<i8', [2], labels(2)),
    ],
    /malformed header .*expected ',' or '}'/,
  ],
  [
    'truncated data',
    () => [npy('<f4', [3, 2], f32(6), { cut: 5 }), npy('<i8', [3], labels(3))],
    /is truncated: header says float32 \(3, 2\) = 24 data bytes, but the file has 19/,
  ],
  [
    'extra data',
    () => [npy('<f4', [3], f32(3), { extra: 4 }), npy('<i8', [3], labels(3))],
    /has 4 extra bytes after the float32 \(3,\) data/,
  ],
  [
    'N mismatch',
    () => [npy('<f4', [4, 2], f32(8)), npy('<i8', [3], labels(3))],
    /Size mismatch: .*x\.npy has 4 examples \(shape \(4, 2\)\) but .*y\.npy has 3/,
  ],
  [
    'no examples',
    () => [npy('<f4', [0, 3], f32(0)), npy('<i8', [0], labels(0))],
    /has no examples \(header field 'shape' is \(0, 3\)\)/,
  ],
  [
    'NaN feature',
    () => [
      npy('<f8', [2, 2], new Float64Array([0, 1, NaN, 3])),
      npy('<i8', [2], labels(2)),
    ],
    /x\.npy: example 1 \(flat index 2\) has a NaN value/,
  ],
  [
    'infinite target',
    () => [
      npy('<f4', [2], f32(2)),
      npy('<f4', [2], new Float32Array([1, -Infinity])),
    ],
    /y\.npy: example 1 \(flat index 1\) has value -Infinity, which is not finite/,
  ],
  [
    'negative label',
    () => [npy('<f4', [2], f32(2)), npy('<i4', [2], new Int32Array([0, -1]))],
    /y\.npy: example 1 is class label -1; labels must be class numbers/,
  ],
  [
    'one-hot labels',
    () => [npy('<f4', [2], f32(2)), npy('|u1', [2, 3], new Uint8Array(6))],
    /integer dtype uint8 and shape \(2, 3\).*y\.argmax\(1\)/,
  ],
  [
    'validation feature shape',
    () => [
      npy('<f4', [2, 3], f32(6)),
      npy('<i8', [2], labels(2)),
      npy('<f4', [2, 4], f32(8)),
      npy('<i8', [2], labels(2)),
    ],
    /Validation features .*vx\.npy have shape \[4\] per example but training features .*x\.npy have \[3\]/,
  ],
  [
    'validation target kind',
    () => [
      npy('<f4', [2], f32(2)),
      npy('<i8', [2], labels(2)),
      npy('<f4', [2], f32(2)),
      npy('<f4', [2], f32(2)),
    ],
    /Validation targets .*vy\.npy are float targets of shape \[\] but training targets .*y\.npy are integer class labels/,
  ],
];

test('malformed .npy files are rejected with the file, the header field or example, and the problem', async () => {
  let k = 0;
  for (const [what, make, re] of BAD_NPY) {
    const files = make();
    const sub = join(dir, `npy-bad-${k++}`);
    await mkdir(sub);
    const names = ['x.npy', 'y.npy', 'vx.npy', 'vy.npy']
      .slice(0, files.length)
      .map((n) => join(sub, n));
    await Promise.all(files.map((f, i) => writeFile(names[i], f)));
    const [x, y, valX, valY] = names;
    await assert.rejects(loadNpyDataset({ x, y, valX, valY }), (e: unknown) => {
      assert.ok(e instanceof LayerwiseError, `${what}: ${String(e)}`);
      assert.match(e.message, re, what);
      assert.ok(
        e.message.includes(sub),
        `${what}: the message names the file: ${e.message}`,
      );
      return true;
    });
  }
  await assert.rejects(
    loadNpyDataset({ x: join(dir, 'nope-x.npy'), y: join(dir, 'nope-y.npy') }),
    /nope-x\.npy does not exist/,
  );
});
