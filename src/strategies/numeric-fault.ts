/**
 * Naming a numeric fault: from the non-finite values the stages found while diagnosing a step
 * (pipeline/executor.ts NumericFault), the one where the fault first appeared.
 *
 * Forward before backward: the lowest block whose output (or input, or the loss) is not finite,
 * its earliest micro-batch; else, as gradients flow from the last block down, the highest block
 * with a non-finite parameter gradient. When the diagnosis does not reproduce it, the stages
 * whose gradient sums of squares were not finite.
 */

import type { StageRange } from '../partition/balance.js';
import type { NumericFault } from '../pipeline/executor.js';
import { NumericFaultError } from '../util/errors.js';

const FORWARD_ORDER: Record<NumericFault['what'], number> = {
  input: 0,
  activation: 1,
  loss: 2,
  gradient: 3,
};

/** The first fault of `faults` in the order above, or undefined. */
export function firstFault(
  faults: readonly NumericFault[],
): NumericFault | undefined {
  const fwd = faults.filter((f) => f.what !== 'gradient');
  if (fwd.length) {
    return [...fwd].sort(
      (a, b) =>
        a.block - b.block ||
        FORWARD_ORDER[a.what] - FORWARD_ORDER[b.what] ||
        a.mb - b.mb,
    )[0];
  }
  return [...faults].sort((a, b) => b.block - a.block || a.mb - b.mb)[0];
}

/**
 * The error naming the first fault (see {@link firstFault}); `sums`: each device's gradient sum
 * of squares in the faulty step; `placement`: the device of each stage of `ranges` (default
 * stage s on device s).
 */
export function describeFaults(
  faults: readonly NumericFault[],
  sums: readonly number[],
  ranges: readonly StageRange[],
  placement: readonly number[] = ranges.map((_, s) => s),
): NumericFaultError {
  const f = firstFault(faults);
  if (!f) {
    const bad = sums
      .map((s, i) => [s, i] as const)
      .filter(([s]) => !Number.isFinite(s));
    const blocksOf = (s: number) =>
      `blocks ${ranges[s]!.from}-${ranges[s]!.to - 1}`;
    const several = placement.length > sums.length;
    const where = bad
      .map(([v, i]) => {
        if (!several) return `stage ${i} (${blocksOf(i)}): ${v}`;
        const own = placement.flatMap((d, s) => (d === i ? [s] : []));
        return `device ${i} (${own.map((s) => `stage ${s}, ${blocksOf(s)}`).join('; ')}): ${v}`;
      })
      .join(', ');
    return new NumericFaultError(
      `the gradient norm was not finite on ${where || 'some stage'} (the diagnosing re-run did not reproduce it)`,
    );
  }
  const block = `block ${f.block} (${f.blockName}) on stage ${f.stage}, micro-batch ${f.mb}`;
  switch (f.what) {
    case 'input':
      return new NumericFaultError(
        f.stage === 0
          ? `the input data of micro-batch ${f.mb} holds ${f.value}; clean the data set`
          : `the input of ${block} is ${f.value}`,
      );
    case 'activation':
      return new NumericFaultError(`the output of ${block} became ${f.value}`);
    case 'loss':
      return new NumericFaultError(
        `the loss became ${f.value} (after ${block})`,
      );
    case 'gradient':
      return new NumericFaultError(
        `the gradient of ${block} became ${f.value} (its forward was finite)`,
      );
  }
}
