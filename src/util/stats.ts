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
