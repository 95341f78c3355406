import assert from 'node:assert/strict';
import { test } from 'node:test';
import { adamwMultiCount } from './kernel-names.js';

const t = (...shape: number[]) => ({ shape });

test('adamwMultiCount gives n for [p.., g.., m, v] laid out as the parameters, and names each mismatch', () => {
  assert.equal(
    adamwMultiCount([t(2, 3), t(4), t(2, 3), t(4), t(10), t(10)]),
    2,
  );
  assert.equal(adamwMultiCount([t(0), t(0)]), 0);
  assert.throws(
    () => adamwMultiCount([t(2), t(2), t(2)]),
    /takes 2n \+ 2 tensors/,
  );
  assert.throws(
    () => adamwMultiCount([t(2, 3), t(3, 3), t(6), t(6)]),
    /parameter 0 has 6 elements, its gradient 9/,
  );
  assert.throws(
    () => adamwMultiCount([t(2, 3), t(6), t(6), t(5)]),
    /the flat v has 5 elements, the parameters 6/,
  );
});
