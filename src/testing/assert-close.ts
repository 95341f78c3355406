import assert from 'node:assert/strict';
import type { HostParams } from '../model/init.js';

/**
 * Test helper: asserts max |x - y| <= tol * (1 + max |y|) elementwise (a relative tolerance
 * that stays meaningful near zero). Throws an AssertionError naming `what`.
 */
export function assertClose(
  x: ArrayLike<number>,
  y: ArrayLike<number>,
  what: string,
  tol = 1e-4,
): void {
  assert.equal(x.length, y.length, `${what}: lengths`);
  let diff = 0;
  let scale = 0;
  for (let i = 0; i < x.length; i++) {
    diff = Math.max(diff, Math.abs(x[i]! - y[i]!));
    scale = Math.max(scale, Math.abs(y[i]!));
  }
  assert.ok(
    diff <= tol * (1 + scale),
    `${what}: max abs diff ${diff} (scale ${scale})`,
  );
}

/**
 * Test helper: the largest |a - b| over every element of every parameter of two host
 * parameter sets. Asserts first that both have the same keys and each key the same length.
 */
export function maxParamDiff(a: HostParams, b: HostParams): number {
  assert.deepEqual(
    [...a.keys()].sort(),
    [...b.keys()].sort(),
    'same parameter keys',
  );
  let max = 0;
  for (const [k, v] of a) {
    const w = b.get(k)!;
    assert.equal(w.length, v.length, k);
    for (let i = 0; i < v.length; i++)
      max = Math.max(max, Math.abs(v[i] - w[i]));
  }
  return max;
}
