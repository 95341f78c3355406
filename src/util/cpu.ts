/**
 * The machine's CPU topology from Linux's sysfs: how many logical CPUs share each physical core
 * (simultaneous multithreading, "hyper-threads"). A bench that compares thread counts names it,
 * since 16 logical CPUs on 8 cores and on 16 cores scale differently past 8 threads.
 */
import { readdirSync, readFileSync } from 'node:fs';
import { join } from 'node:path';

/** Physical cores and the logical CPUs on them, as the kernel lists them. */
export interface CpuTopology {
  /** Logical CPUs the kernel lists (online or not; os.availableParallelism may be fewer). */
  logical: number;
  /** Distinct (package, core) pairs: physical cores. */
  physicalCores: number;
  /** logical / physicalCores, rounded: 2 with SMT on, 1 without. */
  threadsPerCore: number;
}

/**
 * Reads `topology/physical_package_id` and `topology/core_id` of every `cpuN` under `root`
 * (default /sys/devices/system/cpu). Returns undefined where they cannot be read (not Linux, a
 * container without sysfs), never throws.
 */
export function cpuTopology(
  root = '/sys/devices/system/cpu',
): CpuTopology | undefined {
  let names: string[];
  try {
    names = readdirSync(root).filter((n) => /^cpu\d+$/.test(n));
  } catch {
    return undefined;
  }
  const cores = new Set<string>();
  let logical = 0;
  for (const n of names) {
    try {
      const read = (f: string) =>
        readFileSync(join(root, n, 'topology', f), 'utf8').trim();
      cores.add(`${read('physical_package_id')}:${read('core_id')}`);
      logical++;
    } catch {
      // an offline CPU without topology files: not counted
    }
  }
  if (logical === 0) return undefined;
  return {
    logical,
    physicalCores: cores.size,
    threadsPerCore: Math.round(logical / cores.size),
  };
}

/** `8 physical cores, 2 threads each` (or `topology unknown`). */
export function describeTopology(t: CpuTopology | undefined): string {
  if (t === undefined) return 'topology unknown';
  return `${t.physicalCores} physical core${t.physicalCores === 1 ? '' : 's'}, ${t.threadsPerCore} thread${t.threadsPerCore === 1 ? '' : 's'} each`;
}
