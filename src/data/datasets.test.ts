import assert from 'node:assert/strict';
import { existsSync } from 'node:fs';
import { test } from 'node:test';
import { LayerwiseError } from '../util/errors.js';
import {
  describeDataset,
  FASHION_MNIST_DIR,
  loadDataset,
  makeBatcher,
  validationBatches,
} from './index.js';

test('moby-dick loads with the expected size and vocabulary', async () => {
  const ds = await loadDataset('moby-dick');
  assert.equal(ds.kind, 'text');
  if (ds.kind !== 'text') return;
  const n = ds.train.length + ds.val.length;
  assert.ok(n > 1_200_000 && n < 1_230_000, `${n} characters`);
  assert.equal(ds.val.length, Math.floor(n * 0.1));
  assert.equal(ds.vocab.size, 89);
  assert.ok(
    ds.vocab.decode(ds.train.subarray(0, 60_000)).includes('Call me Ishmael.'),
  );
  assert.match(describeDataset(ds), /moby-dick: text/);
  const b = makeBatcher(ds, { batchSize: 32, context: 128, seed: 0 }).next();
  assert.deepEqual(b.xShape, [32, 128]);
  assert.ok(
    validationBatches(ds, { batchSize: 32, context: 128 }).length >= 29,
  );
});

test('mnist loads 9000 + 1000 28x28x1 images in [0, 1] with 10 classes', async () => {
  const ds = await loadDataset('mnist');
  assert.equal(ds.kind, 'image');
  if (ds.kind !== 'image') return;
  assert.deepEqual(ds.shape, [28, 28, 1]);
  assert.equal(ds.classes, 10);
  assert.equal(ds.train.y.length, 9000);
  assert.equal(ds.val.y.length, 1000);
  assert.equal(ds.train.x.length, 9000 * 784);
  let min = Infinity;
  let max = -Infinity;
  for (const v of ds.train.x) {
    if (v < min) min = v;
    if (v > max) max = v;
  }
  assert.equal(min, 0);
  assert.ok(max > 0.99 && max <= 1);
  const counts = new Array(10).fill(0);
  for (const y of ds.val.y) counts[y]++;
  assert.ok(
    counts.every((c) => c > 50),
    `validation mixes classes: ${counts}`,
  );
  // The split is fixed (independent of the training seed) and repeatable.
  const again = await loadDataset('mnist');
  assert.deepEqual(
    again.kind === 'image' && Array.from(again.val.y.subarray(0, 50)),
    Array.from(ds.val.y.subarray(0, 50)),
  );
});

test('fashion-mnist loads 60000 + 10000 images', {
  skip: !existsSync(FASHION_MNIST_DIR) && 'dataset-fashion-mnist not installed',
}, async () => {
  const ds = await loadDataset('fashion-mnist');
  assert.ok(ds.kind === 'image');
  assert.deepEqual(ds.shape, [28, 28, 1]);
  assert.equal(ds.classes, 10);
  assert.equal(ds.train.y.length, 60000);
  assert.equal(ds.val.y.length, 10000);
});

test('loadDataset explains unknown names and missing files', async () => {
  const is = (re: RegExp) => (e: unknown) =>
    e instanceof LayerwiseError && re.test(e.message);
  await assert.rejects(
    loadDataset('cifar10'),
    is(/Unknown data set "cifar10".*'moby-dick', 'mnist', 'fashion-mnist'/),
  );
  await assert.rejects(loadDataset(''), is(/No data set/));
  await assert.rejects(
    loadDataset('no/such/book.txt'),
    is(/no\/such\/book\.txt does not exist/),
  );
  await assert.rejects(
    loadDataset('no/such/file.md'),
    is(/neither a built-in name nor an existing file/),
  );
  await assert.rejects(
    loadDataset('idx:only-one'),
    is(/2 or 4 comma-separated IDX paths/),
  );
  await assert.rejects(
    loadDataset('idx:/nope/a,/nope/b'),
    is(/\/nope\/a does not exist/),
  );
  await assert.rejects(
    loadDataset('fashion-mnist', { fashionMnistDir: '/nope' }),
    is(/apt-get install dataset-fashion-mnist/),
  );
  await assert.rejects(
    loadDataset('mnist', { valFraction: 1.5 }),
    is(/Validation fraction 1.5/),
  );
});
