/**
 * Partitioning: cutting a model's blocks into K contiguous stages. A balance is the number of
 * blocks per stage (torchgpipe's convention), e.g. [2, 3, 3] for 8 blocks on 3 stages.
 */
import { LayerwiseError } from '../util/errors.js';

/** Half-open block range [from, to) of one stage. */
export interface StageRange {
  from: number;
  to: number;
}

/**
 * Checks a balance against the model: one entry per stage, each >= 1, summing to the number
 * of blocks. Throws {@link LayerwiseError} saying which rule is broken and the valid range.
 */
export function validateBalance(
  balance: readonly number[],
  nBlocks: number,
  stages: number,
): void {
  if (balance.length !== stages) {
    throw new LayerwiseError(
      `balance ${balance.join(',')} has ${balance.length} entries but --stages is ${stages}; give one block count per stage`,
    );
  }
  if (balance.some((b) => !Number.isInteger(b) || b < 1)) {
    throw new LayerwiseError(
      `balance ${balance.join(',')} leaves a stage empty or is not whole numbers; every stage needs at least 1 block`,
    );
  }
  const sum = balance.reduce((a, b) => a + b, 0);
  if (sum !== nBlocks) {
    throw new LayerwiseError(
      `balance ${balance.join(',')} sums to ${sum}, but the model has ${nBlocks} blocks; the entries must sum to ${nBlocks}`,
    );
  }
}

/** Parses `--balance 2,3,3`. Throws {@link LayerwiseError} on anything but comma-separated integers. */
export function parseBalance(text: string): number[] {
  const parts = text.split(',').map((s) => s.trim());
  if (parts.some((p) => !/^\d+$/.test(p))) {
    throw new LayerwiseError(
      `--balance '${text}' must be comma-separated block counts, one per stage, e.g. 2,3,3, or one of flops, params, time, memory`,
    );
  }
  return parts.map(Number);
}

/**
 * Exact block partition: splits `costs` (one per block, any unit) into `k` contiguous non-empty
 * parts minimising the most expensive part (dynamic programme, O(k n^2)), as torchgpipe's
 * balance does with its block-partition algorithm. Among optimal partitions it returns one
 * found by the recurrence (not necessarily the one with the earliest cuts).
 * Throws {@link LayerwiseError} when k exceeds the number of blocks.
 */
export function balanceByCost(costs: readonly number[], k: number): number[] {
  const prefix = [0];
  for (const c of costs) prefix.push(prefix[prefix.length - 1] + c);
  return balanceByStageCost(
    costs.length,
    k,
    (_, from, to) => prefix[to] - prefix[from],
  );
}

/** Block ranges of each stage for a balance. */
export function stageRanges(balance: readonly number[]): StageRange[] {
  const out: StageRange[] = [];
  let from = 0;
  for (const b of balance) {
    out.push({ from, to: from + b });
    from += b;
  }
  return out;
}

/**
 * Exact min-max partition for costs that do not add up over blocks: splits `n` blocks into `k`
 * contiguous non-empty stages minimising the largest `stageCost(stage, from, to)` (stage index,
 * half-open block range), by the same dynamic programme as {@link balanceByCost} (O(k n^2)
 * calls). Used to minimise a stage's predicted peak memory, which depends on the stage's place
 * in the pipeline. Returns the balance (blocks per stage). Throws {@link LayerwiseError} when k
 * exceeds n.
 */
export function balanceByStageCost(
  n: number,
  k: number,
  stageCost: (stage: number, from: number, to: number) => number,
): number[] {
  if (!Number.isInteger(k) || k < 1)
    throw new LayerwiseError(`stages must be a positive integer, got ${k}`);
  if (k > n)
    throw new LayerwiseError(
      `cannot cut ${n} blocks into ${k} stages: use at most ${n} stages`,
    );
  const best = Array.from({ length: k + 1 }, () =>
    new Array<number>(n + 1).fill(Infinity),
  );
  const cut = Array.from({ length: k + 1 }, () =>
    new Array<number>(n + 1).fill(-1),
  );
  best[0][0] = 0;
  for (let j = 1; j <= k; j++) {
    for (let i = j; i <= n - (k - j); i++) {
      for (let p = j - 1; p < i; p++) {
        if (best[j - 1][p] === Infinity) continue;
        const v = Math.max(best[j - 1][p], stageCost(j - 1, p, i));
        if (v < best[j][i]) {
          best[j][i] = v;
          cut[j][i] = p;
        }
      }
    }
  }
  const sizes: number[] = [];
  let i = n;
  for (let j = k; j >= 1; j--) {
    const p = cut[j][i];
    sizes.unshift(i - p);
    i = p;
  }
  return sizes;
}
