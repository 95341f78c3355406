import assert from 'node:assert/strict';

/**
 * Test helper: asserts max |x - y| <= tol * (1 + max |y|) elementwise (a relative tolerance
 * that stays meaningful near zero). Throws an AssertionError naming `what`.
 */
export function assertClose(x: ArrayLike<number>, y: ArrayLike<number>, what: string, tol = 1e-4): void {
  assert.equal(x.length, y.length, `${what}: lengths`);
  let diff = 0;
  let scale = 0;
  for (let i = 0; i < x.length; i++) {
    diff = Math.max(diff, Math.abs(x[i]! - y[i]!));
    scale = Math.max(scale, Math.abs(y[i]!));
  }
  assert.ok(diff <= tol * (1 + scale), `${what}: max abs diff ${diff} (scale ${scale})`);
}
