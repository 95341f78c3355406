import assert from 'node:assert/strict';
import { mkdtemp, rm, writeFile } from 'node:fs/promises';
import { tmpdir } from 'node:os';
import { join } from 'node:path';
import { test } from 'node:test';
import { LayerwiseError } from '../util/errors.js';
import { loadTextFile, textDatasetFromString } from './text.js';
import { Vocab } from './vocab.js';

test('split keeps the last valFraction of the text for validation', () => {
  const text = 'abcdefghij'.repeat(10); // 100 chars
  const ds = textDatasetFromString('t', text);
  assert.equal(ds.kind, 'text');
  assert.equal(ds.train.length, 90);
  assert.equal(ds.val.length, 10);
  assert.equal(ds.vocab.decode(ds.val), text.slice(90));
  assert.equal(ds.vocab.decode(ds.train) + ds.vocab.decode(ds.val), text);
  const none = textDatasetFromString('t', text, { valFraction: 0 });
  assert.equal(none.val.length, 0);
  assert.throws(
    () => textDatasetFromString('t', text, { valFraction: 1 }),
    LayerwiseError,
  );
  assert.throws(
    () => textDatasetFromString('t', text, { valFraction: NaN }),
    LayerwiseError,
  );
  assert.throws(() => textDatasetFromString('t', ''), LayerwiseError);
  assert.throws(
    () => textDatasetFromString('t', 'xyz', { vocab: Vocab.fromText('ab') }),
    /not in the 2-character vocabulary/,
  );
});

test('loadTextFile reads UTF-8, drops a BOM, and reports bad files', async () => {
  const dir = await mkdtemp(join(tmpdir(), 'layerwise-text-'));
  try {
    const p = join(dir, 'book.txt');
    await writeFile(p, `\uFEFF${'whale ηο 🐳\n'.repeat(20)}`);
    const ds = await loadTextFile(p, { valFraction: 0.25 });
    assert.equal(ds.name, 'book.txt');
    assert.equal(
      ds.train.length + ds.val.length,
      20 * Array.from('whale ηο 🐳\n').length,
    );
    assert.ok(!ds.vocab.chars.includes('\uFEFF'));
    const bad = join(dir, 'latin1.txt');
    await writeFile(bad, Buffer.from([0x63, 0x61, 0x66, 0xe9]));
    await assert.rejects(loadTextFile(bad), /not valid UTF-8/);
    const empty = join(dir, 'empty.txt');
    await writeFile(empty, '');
    await assert.rejects(loadTextFile(empty), /is empty/);
    await assert.rejects(
      loadTextFile(join(dir, 'nope.txt')),
      (e: unknown) =>
        e instanceof LayerwiseError &&
        /nope\.txt does not exist/.test(e.message),
    );
    await assert.rejects(loadTextFile(dir), /not a regular file/);
  } finally {
    await rm(dir, { recursive: true, force: true });
  }
});
