/**
 * The machine's CPUs as Linux describes them: CPU lists (`0-3,8`) and which logical CPUs are
 * hardware threads of one physical core (simultaneous multithreading, "hyper-threads"), from
 * sysfs. runtime/pinning.ts places devices on whole cores with them; a bench that compares
 * thread counts names the topology, since 16 logical CPUs on 8 cores and on 16 cores scale
 * differently past 8 threads.
 */
import { readdirSync, readFileSync } from 'node:fs';
import { join } from 'node:path';
import { check } from './errors.js';

/** Linux's per-CPU sysfs folder. */
const SYS_CPU = '/sys/devices/system/cpu';

/**
 * Parses a Linux CPU list (`0-3,8,10-11`, as in /proc/self/status Cpus_allowed_list, cpuset
 * files or topology/thread_siblings_list) into ascending CPU numbers.
 * @throws LayerwiseError naming the part that is not `N` or `N-M` (N <= M).
 */
export function parseCpuList(text: string): number[] {
  const cpus = new Set<number>();
  for (const part of text.trim().split(',')) {
    const m = /^(\d+)(?:-(\d+))?$/.exec(part.trim());
    check(
      m !== null && (m[2] === undefined || Number(m[2]) >= Number(m[1])),
      `CPU list '${text.trim()}': '${part}' is not N or N-M with N <= M`,
    );
    const from = Number(m![1]);
    const to = m![2] === undefined ? from : Number(m![2]);
    for (let c = from; c <= to; c++) cpus.add(c);
  }
  return [...cpus].sort((a, b) => a - b);
}

/**
 * `<root>/<cpu>/topology/thread_siblings_list` parsed (`cpu` a folder name such as `cpu3`).
 * @throws where the file is missing or unreadable (an offline CPU has none), or not a CPU list.
 */
function readSiblings(root: string, cpu: string): number[] {
  return parseCpuList(
    readFileSync(join(root, cpu, 'topology', 'thread_siblings_list'), 'utf8'),
  );
}

/**
 * CPU `cpu`'s SMT siblings, itself included (`topology/thread_siblings_list` under `root`,
 * default /sys/devices/system/cpu); itself alone where the file is missing or unreadable.
 */
export function cpuSiblings(cpu: number, root = SYS_CPU): number[] {
  try {
    return readSiblings(root, `cpu${cpu}`);
  } catch {
    return [cpu];
  }
}

/** Physical cores and the logical CPUs on them, as the kernel lists them. */
export interface CpuTopology {
  /** Logical CPUs with a topology (online ones; os.availableParallelism may be fewer). */
  logical: number;
  /** Physical cores: distinct sibling groups. */
  physicalCores: number;
  /** logical / physicalCores, rounded: 2 with SMT on, 1 without. */
  threadsPerCore: number;
}

/**
 * Groups every `cpuN` under `root` (default /sys/devices/system/cpu) with a
 * `topology/thread_siblings_list` by its siblings. Returns undefined where none can be read
 * (not Linux, a container without sysfs); never throws.
 */
export function cpuTopology(root = SYS_CPU): CpuTopology | undefined {
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
      cores.add(readSiblings(root, n).join(','));
      logical++;
    } catch {
      // an offline CPU has no topology files: not counted
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
