/**
 * The median of `xs` (the mean of the two middle values for an even count); NaN when empty.
 * Timings use it rather than the mean: this machine's speed drifts, and a mean carries outliers.
 */
export function median(xs: readonly number[]): number {
  if (xs.length === 0) return NaN;
  const s = [...xs].sort((a, b) => a - b);
  const h = s.length >> 1;
  return s.length % 2 ? s[h] : (s[h - 1] + s[h]) / 2;
}

/**
 * The largest |got - want| relative to want's scale (max(1, max |want|)); NaN-safe: a NaN
 * difference makes it NaN, which no tolerance accepts.
 */
export function scaledDifference(
  got: ArrayLike<number>,
  want: ArrayLike<number>,
): { worst: number; scale: number } {
  // a loop, not Math.max(...want): arrays of millions overflow the call stack when spread
  let scale = 1;
  for (let j = 0; j < want.length; j++)
    scale = Math.max(scale, Math.abs(want[j]!));
  let worst = 0;
  for (let j = 0; j < got.length; j++) {
    const d = Math.abs(got[j]! - want[j]!) / scale;
    if (!(d <= worst)) worst = d;
  }
  return { worst, scale };
}
