import assert from 'node:assert/strict';
import { test } from 'node:test';
import { spinNote } from './kernels.js';

test("spinNote: the serial share from the CPU clocks is called a lower bound wherever libgomp's idle members spin, and nothing is said where they sleep", () => {
  // layerwise's own setting (backend/native-addon.ts configureOpenMP): spin, then sleep
  const ours = spinNote({
    OMP_WAIT_POLICY: 'passive',
    GOMP_SPINCOUNT: '100000',
  });
  assert.match(ours, /lower bound/);
  assert.match(ours, /GOMP_SPINCOUNT=100000/);
  assert.match(
    spinNote({ OMP_WAIT_POLICY: 'ACTIVE' }),
    /OMP_WAIT_POLICY=active/,
  );
  assert.match(spinNote({}), /libgomp's default/);
  // idle members sleep: the clocks count work only
  assert.equal(spinNote({ GOMP_SPINCOUNT: '0' }), '');
  assert.equal(spinNote({ OMP_WAIT_POLICY: 'passive' }), '');
  // GOMP_SPINCOUNT, where set, decides over the policy (libgomp env.c)
  assert.equal(
    spinNote({ OMP_WAIT_POLICY: 'active', GOMP_SPINCOUNT: '0' }),
    '',
  );
});
