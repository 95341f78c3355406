import assert from 'node:assert/strict';
import { mkdtemp, rm, writeFile } from 'node:fs/promises';
import { tmpdir } from 'node:os';
import { join } from 'node:path';
import { after, before, test } from 'node:test';
import { gzipSync } from 'node:zlib';
import { LayerwiseError } from '../util/errors.js';
import { encodeIdx, parseIdx, readIdxFile } from './idx.js';
import { loadIdxImages } from './images.js';

let dir = '';
before(async () => {
  dir = await mkdtemp(join(tmpdir(), 'layerwise-idx-'));
});
after(async () => {
  await rm(dir, { recursive: true, force: true });
});

/** 5 images 2x3, pixel value = 10*i + j; labels i % 3. */
const N = 5;
const pixels = Array.from(
  { length: N * 6 },
  (_, k) => 10 * Math.floor(k / 6) + (k % 6),
);
const labels = Array.from({ length: N }, (_, i) => i % 3);

function rejectsWith(p: Promise<unknown>, ...parts: RegExp[]) {
  return assert.rejects(p, (e: unknown) => {
    assert.ok(e instanceof LayerwiseError, `expected LayerwiseError, got ${e}`);
    for (const r of parts) assert.match(e.message, r);
    return true;
  });
}

test('hand-written header parses (big-endian sizes)', () => {
  const bytes = new Uint8Array([
    0, 0, 0x08, 2, 0, 0, 0, 2, 0, 0, 0, 3, 1, 2, 3, 4, 5, 6,
  ]);
  const a = parseIdx(bytes, 'x');
  assert.equal(a.dtype, 'uint8');
  assert.deepEqual(a.dims, [2, 3]);
  assert.deepEqual(Array.from(a.data), [1, 2, 3, 4, 5, 6]);
});

test('raw and gzipped files parse identically', async () => {
  const raw = encodeIdx('uint8', [N, 2, 3], pixels);
  await writeFile(join(dir, 'img-raw'), raw);
  await writeFile(join(dir, 'img.gz'), gzipSync(raw));
  const a = await readIdxFile(join(dir, 'img-raw'));
  const b = await readIdxFile(join(dir, 'img.gz'));
  for (const r of [a, b]) {
    assert.equal(r.dtype, 'uint8');
    assert.deepEqual(r.dims, [N, 2, 3]);
    assert.deepEqual(Array.from(r.data), pixels);
  }
  // "img" is missing but "img.gz" exists: the .gz is used.
  const c = await readIdxFile(join(dir, 'img'));
  assert.deepEqual(Array.from(c.data), pixels);
});

test('multi-byte dtypes round-trip', () => {
  const vals = [-3, 0, 7, 1000, -32768, 32767];
  for (const dtype of [
    'int8',
    'int16',
    'int32',
    'float32',
    'float64',
  ] as const) {
    const v =
      dtype === 'int8'
        ? vals.map((x) => Math.max(-128, Math.min(127, x)))
        : dtype.startsWith('float')
          ? vals.map((x) => x / 4)
          : vals;
    const r = parseIdx(encodeIdx(dtype, [2, 3], v), dtype);
    assert.equal(r.dtype, dtype);
    assert.deepEqual(Array.from(r.data), v, dtype);
  }
});

test('errors: bad magic, truncated, size mismatch, missing, corrupt gzip', async () => {
  const good = encodeIdx('uint8', [N, 2, 3], pixels);
  const badMagic = good.slice();
  badMagic[2] = 0x07;
  await writeFile(join(dir, 'bad-magic'), badMagic);
  await rejectsWith(
    readIdxFile(join(dir, 'bad-magic')),
    /bad-magic/,
    /bad magic number 0x00000703/,
  );
  await writeFile(join(dir, 'text-file'), 'hello world, not idx');
  await rejectsWith(
    readIdxFile(join(dir, 'text-file')),
    /text-file/,
    /bad magic/,
  );
  await writeFile(
    join(dir, 'trunc-data.gz'),
    gzipSync(good.subarray(0, good.length - 4)),
  );
  await rejectsWith(
    readIdxFile(join(dir, 'trunc-data.gz')),
    /trunc-data\.gz/,
    /truncated/,
    /46 bytes.*file has 42/,
  );
  await writeFile(join(dir, 'trunc-header'), good.subarray(0, 9));
  await rejectsWith(
    readIdxFile(join(dir, 'trunc-header')),
    /trunc-header/,
    /truncated/,
    /header/,
  );
  await writeFile(join(dir, 'trunc-tiny'), good.subarray(0, 2));
  await rejectsWith(
    readIdxFile(join(dir, 'trunc-tiny')),
    /trunc-tiny/,
    /truncated/,
  );
  await writeFile(
    join(dir, 'extra'),
    Buffer.concat([good, Buffer.from([1, 2, 3])]),
  );
  await rejectsWith(
    readIdxFile(join(dir, 'extra')),
    /extra/,
    /size mismatch/,
    /3 extra bytes/,
  );
  await rejectsWith(
    readIdxFile(join(dir, 'missing-file')),
    /missing-file does not exist/,
  );
  await rejectsWith(
    readIdxFile(join(dir, 'missing-file.gz')),
    /missing-file\.gz does not exist/,
  );
  await rejectsWith(readIdxFile(dir), /is a directory/);
  const gz = gzipSync(good);
  await writeFile(join(dir, 'corrupt.gz'), gz.subarray(0, gz.length - 10));
  await rejectsWith(
    readIdxFile(join(dir, 'corrupt.gz')),
    /corrupt\.gz/,
    /cannot be decompressed/,
  );
});

test('IDX image/label pairs load as an ImageDataset', async () => {
  const img = join(dir, 'pair-images.gz');
  const lab = join(dir, 'pair-labels');
  await writeFile(img, gzipSync(encodeIdx('uint8', [N, 2, 3], pixels)));
  await writeFile(lab, encodeIdx('uint8', [N], labels));
  const ds = await loadIdxImages(
    { images: img, labels: lab },
    { valFraction: 0.2 },
  );
  assert.equal(ds.kind, 'image');
  assert.deepEqual(ds.shape, [2, 3, 1]);
  assert.equal(ds.classes, 3);
  assert.equal(ds.train.y.length, 4);
  assert.equal(ds.val.y.length, 1);
  assert.equal(ds.train.x.length, 4 * 6);
  // Every example keeps its own pixels and label, scaled to [0, 1].
  for (const s of [ds.train, ds.val]) {
    for (let k = 0; k < s.y.length; k++) {
      const i = Math.round(s.x[k * 6] * 255) / 10;
      assert.equal(s.y[k], i % 3);
      assert.ok(Math.abs(s.x[k * 6 + 5] - (10 * i + 5) / 255) < 1e-7);
    }
  }
  // With separate validation files.
  const ds4 = await loadIdxImages({
    images: img,
    labels: lab,
    valImages: img,
    valLabels: lab,
  });
  assert.equal(ds4.train.y.length, N);
  assert.equal(ds4.val.y.length, N);
  // Mismatches.
  const lab4 = join(dir, 'labels-4');
  await writeFile(lab4, encodeIdx('uint8', [4], labels.slice(0, 4)));
  await rejectsWith(
    loadIdxImages({ images: img, labels: lab4 }),
    /size mismatch/i,
    /5 images/,
    /4 labels/,
  );
  await rejectsWith(loadIdxImages({ images: lab, labels: img }), /swap/);
  const small = join(dir, 'small-images');
  await writeFile(small, encodeIdx('uint8', [N, 3, 2], pixels));
  await rejectsWith(
    loadIdxImages({
      images: img,
      labels: lab,
      valImages: small,
      valLabels: lab,
    }),
    /3x2x1/,
    /2x3x1/,
  );
  const fimg = join(dir, 'float-images');
  await writeFile(fimg, encodeIdx('float32', [N, 2, 3], pixels));
  await rejectsWith(
    loadIdxImages({ images: fimg, labels: lab }),
    /outside \[0, 1\]/,
  );
});
