/**
 * Placing the kernel threads of the devices on this host on cores of their own, so that K
 * pipeline devices on one machine do not contend for the same cores (issue 37, item 3).
 *
 * A device runs its kernels on an OpenMP team (the native backend's oneDNN with libgomp) of
 * `threads` members (`--threads`, by default the cores divided among the devices:
 * strategies/spec.ts threadsPerDevice). Device i of the local devices (worker threads and
 * processes of this host, in device order) owns the next `threads_i` CPUs of the ones this
 * process may use (Linux: `Cpus_allowed_list` of /proc/self/status, SMT siblings side by side so
 * a device gets whole cores) ({@link devicePlacement}). How a device is bound to them:
 * - a device process (`--devices process`): its environment gets `OMP_PLACES` (one place per
 *   CPU it owns: `{4},{5},{6},{7}`) and `OMP_PROC_BIND=close` (OpenMP 4.0 affinity, read by
 *   libgomp and LLVM's libomp when the library loads): the thread that loads the addon (the
 *   device's stage thread) is bound to the first place and each team thread to the next
 *   ({@link processPinning});
 * - a thread device (`--devices thread`, the default): worker threads share one process and one
 *   environment, whose places would put every device's team on the same first CPUs, so the
 *   device's stage thread binds each member of its team itself with sched_setaffinity, member i
 *   to the i-th CPU it owns (native addon's pinTeam, native/src/affinity.cc; runtime/stage-host.ts
 *   after the backend starts) ({@link threadPinning}).
 *
 * Nothing is pinned when:
 * - this host runs one device only: there is no other device to keep it apart from, and a team
 *   bound to fixed CPUs cannot move away from other processes' threads (on 2 shared cores,
 *   charlm-small single at --threads 2 bound used 3.5% more CPU and was slower in 4 of 5
 *   alternated runs than unbound);
 * - the run has a browser device (its tab's threads are not ours to place);
 * - the devices' threads add up to more CPUs than this process may use (they would share);
 * - the environment already sets an affinity (`OMP_PLACES`, `OMP_PROC_BIND`,
 *   `GOMP_CPU_AFFINITY`, `KMP_AFFINITY`), on the coordinator or in a device's `--devices`
 *   entry: the user's choice stands;
 * - `LAYERWISE_PIN=0`; or the OS does not say which CPUs are allowed (not Linux).
 * The coordinator's main thread and Node's own threads (V8's GC and compiler, libuv) are not
 * pinned: they run wherever the OS finds room.
 */
import { readFileSync } from 'node:fs';
import { cpuSiblings, parseCpuList } from '../util/cpu.js';
import { check } from '../util/errors.js';

/** Environment variables that set OpenMP thread affinity; any of them set means no pinning of ours. */
export const AFFINITY_VARIABLES = [
  'OMP_PLACES',
  'OMP_PROC_BIND',
  'GOMP_CPU_AFFINITY',
  'KMP_AFFINITY',
] as const;

/**
 * The CPUs this process may run on: Linux's `Cpus_allowed_list` of /proc/self/status (which
 * honours taskset, cgroup cpusets and containers), SMT siblings side by side ({@link bySiblings});
 * undefined where the OS does not say.
 */
export function allowedCpus(): number[] | undefined {
  let status: string;
  try {
    status = readFileSync('/proc/self/status', 'utf8');
  } catch {
    return undefined;
  }
  const m = /^Cpus_allowed_list:\s*(\S+)/m.exec(status);
  return m ? bySiblings(parseCpuList(m[1]!), (c) => cpuSiblings(c)) : undefined;
}

/**
 * Orders `cpus` so that hardware threads of one physical core (SMT siblings) are adjacent, in
 * the order of their lowest CPU: with siblings (0, 8), (1, 9), ... the order is 0, 8, 1, 9, ...
 * So a device given consecutive CPUs gets whole cores, their L1/L2 caches its own, rather than
 * halves of cores shared with another device. `siblingsOf(c)`: c's siblings, itself included
 * (Linux: topology/thread_siblings_list); CPUs not in `cpus` are left out.
 */
export function bySiblings(
  cpus: readonly number[],
  siblingsOf: (cpu: number) => readonly number[],
): number[] {
  const allowed = new Set(cpus);
  const seen = new Set<number>();
  const out: number[] = [];
  for (const c of [...cpus].sort((a, b) => a - b)) {
    if (seen.has(c)) continue;
    const group = [c, ...siblingsOf(c)].filter(
      (x) => allowed.has(x) && !seen.has(x),
    );
    for (const x of [...new Set(group)].sort((a, b) => a - b)) {
      seen.add(x);
      out.push(x);
    }
  }
  return out;
}

/**
 * Gives each device its own consecutive CPUs: device i gets `threads[i]` CPUs of `cpus`, after
 * those of devices 0..i-1. Returns one CPU list per device, or undefined when the threads add
 * up to more than `cpus.length` (then devices would share CPUs: better not to pin at all).
 * @throws LayerwiseError for a thread count that is not a positive integer.
 */
export function placeDevices(
  threads: readonly number[],
  cpus: readonly number[],
): number[][] | undefined {
  for (const t of threads)
    check(
      Number.isInteger(t) && t >= 1,
      `placing devices on CPUs: threads per device must be positive integers, got ${t}`,
    );
  if (threads.reduce((a, b) => a + b, 0) > cpus.length) return undefined;
  let next = 0;
  return threads.map((t) => {
    const own = cpus.slice(next, next + t);
    next += t;
    return own;
  });
}

/** OpenMP environment binding a team to `cpus`, one thread per CPU in order: `OMP_PLACES={0},{1}`, `OMP_PROC_BIND=close`. */
export function ompPinning(cpus: readonly number[]): Record<string, string> {
  check(cpus.length > 0, 'OpenMP pinning needs at least one CPU');
  return {
    OMP_PLACES: cpus.map((c) => `{${c}}`).join(','),
    OMP_PROC_BIND: 'close',
  };
}

/** What {@link devicePlacement} decides from: the devices, the environments and the CPUs. */
export interface PinningInput {
  /** Per device of the run: its kind, its own environment (processes) and kernel threads. */
  devices: ReadonlyArray<{
    kind: string;
    env?: Readonly<Record<string, string>>;
    threads: number;
  }>;
  /** The coordinator's environment (process.env). */
  env: Readonly<Record<string, string | undefined>>;
  /** CPUs this process may use ({@link allowedCpus}); undefined: unknown, no pinning. */
  cpus: readonly number[] | undefined;
}

/** Device kinds whose kernels run on this host's CPUs (placed); 'host' and 'browser' are not. */
const LOCAL_KINDS = new Set(['thread', 'process']);

/**
 * The CPUs each device of the run owns on this host (pure): one entry per device, undefined for
 * devices that are not local (a HOST:PORT device) or when nothing is pinned (see the module's
 * list of cases). Local devices (threads and processes) are placed in device order by
 * {@link placeDevices}, `threads` CPUs each.
 * @throws LayerwiseError when LAYERWISE_PIN is set to anything but 0 or 1.
 */
export function devicePlacement(
  input: PinningInput,
): Array<number[] | undefined> {
  const { devices, env, cpus } = input;
  const none = devices.map(() => undefined);
  const pin = env.LAYERWISE_PIN;
  check(
    pin === undefined || pin === '0' || pin === '1',
    `LAYERWISE_PIN=${pin}: use 1 (pin each device's kernel threads on cores of their own, the default) or 0 (do not pin)`,
  );
  const userSet = (e: Readonly<Record<string, string | undefined>>) =>
    AFFINITY_VARIABLES.some((v) => e[v] !== undefined);
  if (
    pin === '0' ||
    cpus === undefined ||
    userSet(env) ||
    devices.some((d) => d.kind === 'browser')
  )
    return none;
  const local = devices.flatMap((d, i) => (LOCAL_KINDS.has(d.kind) ? [i] : []));
  if (local.length < 2 || local.some((i) => userSet(devices[i]!.env ?? {})))
    return none;
  const places = placeDevices(
    local.map((i) => devices[i]!.threads),
    cpus,
  );
  if (!places) return none;
  const out: Array<number[] | undefined> = none;
  local.forEach((i, j) => {
    out[i] = places[j]!;
  });
  return out;
}

/**
 * The affinity environment of each device process on this host (pure): one entry per device,
 * {@link ompPinning} of its CPUs ({@link devicePlacement}) for a local process, `{}` for other
 * devices or when nothing is pinned.
 * @throws LayerwiseError when LAYERWISE_PIN is set to anything but 0 or 1.
 */
export function processPinning(
  input: PinningInput,
): Array<Record<string, string>> {
  const places = devicePlacement(input);
  return input.devices.map((d, i) =>
    d.kind === 'process' && places[i] ? ompPinning(places[i]) : {},
  );
}

/**
 * The CPUs of each thread device (pure): one entry per device, its CPUs ({@link devicePlacement})
 * for a worker-thread device, which binds its team to them (native addon's pinTeam), undefined
 * for other devices or when nothing is pinned.
 * @throws LayerwiseError when LAYERWISE_PIN is set to anything but 0 or 1.
 */
export function threadPinning(
  input: PinningInput,
): Array<number[] | undefined> {
  const places = devicePlacement(input);
  return input.devices.map((d, i) =>
    d.kind === 'thread' ? places[i] : undefined,
  );
}
