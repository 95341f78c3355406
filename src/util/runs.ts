/**
 * Cutting a list of sized items into runs of consecutive items, for kernels that take many
 * tensors at once but have a limit per call (optim/optimizer.ts: the native multi-tensor AdamW's
 * elements per call; backend/webgpu-multi.ts: one storage binding's elements).
 */

/**
 * Cuts items of `sizes` (elements each, in order) into runs of consecutive items of at most
 * `max` elements together; an item over `max` is a run of its own. Returns [first, end) index
 * pairs covering every item in order ([] for no items).
 */
export function consecutiveRuns(
  sizes: readonly number[],
  max: number,
): Array<[number, number]> {
  const out: Array<[number, number]> = [];
  let first = 0;
  let total = 0;
  sizes.forEach((n, i) => {
    if (i > first && total + n > max) {
      out.push([first, i]);
      first = i;
      total = 0;
    }
    total += n;
  });
  if (first < sizes.length) out.push([first, sizes.length]);
  return out;
}
