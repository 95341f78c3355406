/**
 * `npm run bench -- kernels`: where a training step's time goes, per TF.js kernel, on one
 * backend: single-device training of a preset in this thread (one plain-backprop Stage), every
 * kernel of the backend wrapped with a timer. Writes kernels-<backend>[-bf16].{json,md}: ms per
 * step and calls per kernel, the step's time, the time in kernels and outside them (the JS
 * between kernels: TF.js's dispatch, tape, tidy, the buffer pool), tokens/s. The timings include
 * each kernel's output allocation; with `--shapes` the rows are split by input shapes.
 *
 * With `--threads 1,2` (native only) the same stage trains at each OpenMP team size in turn,
 * one step at each count per round (so a busy machine slows every count alike), and the table
 * has each kernel's ms per step at each count and its speedup over the first count.
 */
import { availableParallelism, loadavg } from 'node:os';
import * as tf from '@tensorflow/tfjs-core';
import { initBackend, type Precision } from '../backend/index.js';
import {
  type AddonCall,
  nativeAddon,
  recordAddonCalls,
  replayAddonCalls,
} from '../backend/native-addon.js';
import { resolveConfig } from '../config/config.js';
import { type Model, modelParamCount } from '../model/model.js';
import { cpuTopology, describeTopology } from '../util/cpu.js';
import { check } from '../util/errors.js';
import {
  inThreadStage,
  markdownTable,
  reportBenchResults,
  warmUpSteps,
} from './report.js';

export interface KernelsBenchOptions {
  preset: string;
  batchSize: number;
  backend: string;
  /** Compute precision of the products (native only for bf16). */
  precision?: Precision;
  /** Measured steps at each thread count. */
  steps: number;
  /**
   * Untimed warm-up steps at each thread count first (default 1). V8 goes on optimizing the
   * step's JS on its background threads for tens of steps (charlm-small bf16: about 58 TurboFan
   * compiles from step 5 to 20, 56 more to step 80): at 1 thread they run on the idle core, at 2
   * they share the team's.
   */
  warmup?: number;
  /** Split rows by input shapes. */
  shapes: boolean;
  /** OpenMP team sizes to measure at, in this order (native only); undefined: the backend's default. */
  threads?: number[];
  /**
   * Also time each kernel on the team's CPU clocks (native only): two reads of every member's
   * clock around each call, a team wake-up each, which lengthen the step outside kernels.
   */
  cpu?: boolean;
  /**
   * Native only: time the measured steps' native addon calls too, then record one step's calls
   * and time them replayed alone at each thread count ({@link ReplayRun}): the step without
   * TF.js between its kernels, and whether the kernels run slower inside the TF.js step.
   */
  replay?: boolean;
  out: string;
}

/**
 * A recorded step's native addon calls replayed alone (no TF.js, no JS between them) at one
 * thread count, `o.steps` times in rounds alternating the counts after two untimed replays at
 * each: what the step's kernels take with the framework's work gone, the ceiling of a captured
 * step (as webgpu's, pipeline/captured-step.ts) on this machine.
 */
export interface ReplayRun {
  threads: number | null;
  /** Median ms of a replayed step. */
  step_median_ms: number;
  /** The TF.js step's median over the replay's (this count's run): the framework's share. */
  step_over_replay: number;
  /**
   * Median ms a measured TF.js step spent inside the same addon calls: above step_median_ms
   * where the kernels themselves run slower between TF.js's ops than back to back.
   */
  tfjs_addon_median_ms: number;
}

/** The wall ms of recorded addon calls, summed. */
function callsMs(calls: readonly AddonCall[]): number {
  return calls.reduce((a, c) => a + c.ms, 0);
}

/** A kernel's totals: wall ms, calls, and (with `--cpu`) CPU ms of this thread and of the other members together. */
interface KernelTotals {
  ms: number;
  /** Wall ms in each measured step (by round; a step without a call has none). */
  byStep: number[];
  calls: number;
  cpuSelf: number;
  cpuOthers: number;
}

/** Each kernel's (or kernel and input shapes') totals, per thread count. */
interface KernelTimer {
  /** Where timed calls go now; null while not timing (the warm-up steps). */
  current: Map<string, KernelTotals> | null;
  /** The measured round now (index into KernelTotals.byStep). */
  round: number;
  /** Whether each call is also timed on the team's CPU clocks. */
  cpu: boolean;
  /** Kernel runs in progress: one inside another is timed as part of the outer one only. */
  depth: number;
}

/** One table row: a kernel's mean milliseconds and calls per measured step. */
interface KernelRow {
  kernel: string;
  ms_per_step: number;
  /**
   * Median over the measured steps of the kernel's ms in a step: unlike the mean, not moved by
   * one step that another process slowed (a rare kernel's few calls suffer most from that).
   */
  median_ms_per_step: number;
  calls_per_step: number;
  /** With `--cpu`: CPU ms per step of this thread and of each other member (their mean). */
  cpu_ms?: { this_thread: number; per_other_thread: number | null };
}

/** The measured steps at one thread count: means per step (ms) and the kernels' rows. */
export interface ThreadsRun {
  /** OpenMP team size (null: the backend's default, not set). */
  threads: number | null;
  step_ms: number;
  /** Median step time over the measured steps (ms). */
  step_median_ms: number;
  kernel_ms: number;
  /** step_ms - kernel_ms: the JS between kernels (dispatch, tape, tidy, buffer pool). */
  outside_ms: number;
  /**
   * CPU ms per step of this thread (member 0 of the OpenMP team: the JS, and every kernel's
   * serial part) and of each other team member (their mean), from the threads' own CPU clocks:
   * unlike step_ms, not lengthened by other processes (per_other_thread null at one thread).
   * null where the addon is not used.
   */
  cpu_ms: { this_thread: number; per_other_thread: number | null } | null;
  /**
   * The step's serial share from the CPU clocks (Amdahl's s): with a serial part s of the work
   * W on this thread and the rest split evenly, this thread runs s W + (1 - s) W / T and each
   * other member (1 - s) W / T. null at one thread or without the clocks.
   */
  serial_share: number | null;
  tokens_per_s: number;
  rows: KernelRow[];
}

/** What the measured steps took at each thread count, with the model and tokens per step. */
interface Steps {
  model: Model;
  runs: ThreadsRun[];
  tokens: number;
  /** With --replay: the addon calls in a recorded step, and each count's replay. */
  replay?: { calls: number; runs: ReplayRun[] };
}

/** Times every kernel of `o.backend` over `o.steps` training steps (at each of `o.threads`); writes kernels-<backend>[-bf16].{json,md}. */
export async function benchKernels(
  o: KernelsBenchOptions,
  log: (s: string) => void,
): Promise<void> {
  check(
    o.threads === undefined || o.backend === 'native',
    `--threads is for --backend native (its OpenMP team), got --backend ${o.backend}; leave --threads out`,
  );
  await initBackend(o.backend, { precision: o.precision ?? 'fp32' });
  check(
    !o.cpu || o.backend === 'native',
    `--cpu reads the native addon's OpenMP clocks, got --backend ${o.backend}; leave --cpu out`,
  );
  check(
    !o.replay || o.backend === 'native',
    `--replay replays the native addon's calls, got --backend ${o.backend}; leave --replay out`,
  );
  const timer = wrapKernels(o.backend, o.shapes, o.cpu === true);
  const { model, runs, tokens, replay } = await trainSteps(o, timer);
  for (const r of runs) {
    log(
      `${o.backend} ${o.precision ?? 'fp32'}${r.threads === null ? '' : ` threads ${r.threads}`}: ${r.step_ms.toFixed(1)} ms per step (${r.tokens_per_s.toFixed(0)} tokens/s), ${r.kernel_ms.toFixed(1)} ms in kernels, ${r.outside_ms.toFixed(1)} ms outside`,
    );
    for (const k of r.rows.slice(0, 12))
      log(
        `  ${k.kernel.padEnd(32)} ${k.ms_per_step.toFixed(2).padStart(8)} ms  ${k.calls_per_step} calls`,
      );
  }
  if (replay) log(replayLine(replay).trim());
  const first = runs[0]!;
  await reportBenchResults(
    o.out,
    `kernels-${o.backend}${o.precision === 'bf16' ? '-bf16' : ''}`,
    {
      bench: 'kernels',
      options: o,
      cpus: availableParallelism(),
      cpu_topology: cpuTopology() ?? null,
      load_average_1min: loadavg()[0],
      // libgomp's idle policy, which decides what the serial share below can see
      omp_wait_policy: process.env.OMP_WAIT_POLICY ?? null,
      gomp_spincount: process.env.GOMP_SPINCOUNT ?? null,
      step_ms: first.step_ms,
      kernel_ms: first.kernel_ms,
      tokens,
      rows: first.rows,
      runs,
      ...(replay ? { replay } : {}),
    },
    (runs.length > 1
      ? threadsMarkdown(o, model, runs)
      : kernelsMarkdown(o, model, first, tokens)) + replayLine(replay),
    log,
  );
}

/**
 * Registers every kernel of `backend` again wrapped with a timer: while `timer.current` is set,
 * each call adds its milliseconds (output allocation included) and one call to its row there,
 * keyed by the kernel's name (`byShapes`: and its inputs' shapes, e.g. `MatMul [32,64] [64,64]`).
 */
function wrapKernels(
  backend: string,
  byShapes: boolean,
  cpu: boolean,
): KernelTimer {
  const timer: KernelTimer = { current: null, round: 0, cpu, depth: 0 };
  for (const k of tf.getKernelsForBackend(backend)) {
    const f = k.kernelFunc;
    tf.unregisterKernel(k.kernelName, backend);
    tf.registerKernel({
      ...k,
      kernelFunc: (args) => {
        const times = timer.current;
        // a kernel run inside another (DENSE_KERNEL's product) is in the outer one's time
        if (!times || timer.depth > 0) return f(args);
        const c0 = timer.cpu ? teamCpu(backend) : [];
        const t0 = performance.now();
        timer.depth++;
        let r: ReturnType<typeof f>;
        try {
          r = f(args);
        } finally {
          timer.depth--;
        }
        const ms = performance.now() - t0;
        const c1 = timer.cpu ? teamCpu(backend) : [];
        const key = byShapes
          ? `${k.kernelName} ${Object.values(args.inputs)
              .map((t) => `[${(t as tf.TensorInfo | undefined)?.shape}]`)
              .join(' ')}`
          : k.kernelName;
        const e = times.get(key) ?? {
          ms: 0,
          byStep: [],
          calls: 0,
          cpuSelf: 0,
          cpuOthers: 0,
        };
        e.ms += ms;
        e.byStep[timer.round] = (e.byStep[timer.round] ?? 0) + ms;
        e.calls++;
        c1.forEach((s, m) => {
          if (m === 0) e.cpuSelf += 1000 * (s - c0[0]!);
          else e.cpuOthers += 1000 * (s - (c0[m] ?? 0));
        });
        times.set(key, e);
        return r;
      },
    });
  }
  return timer;
}

/** Sets the native addon's OpenMP team size on this thread (null: leaves it). */
function setTeam(threads: number | null): void {
  if (threads !== null) nativeAddon()!.setThreads(threads);
}

/**
 * Trains `o.preset` on one plain-backprop Stage in this thread: `o.warmup` (default 1) warm-up
 * rounds of one step with the timer off at each thread count, then `o.steps` rounds of one timed
 * step at each count (forward, backward, optimizer step at lr 1e-4). Returns the model, each
 * count's means per step and the tokens of one step. Disposes the stage.
 */
async function trainSteps(
  o: KernelsBenchOptions,
  timer: KernelTimer,
): Promise<Steps> {
  const cfg = resolveConfig({
    preset: o.preset,
    batchSize: o.batchSize,
    backend: o.backend,
  });
  const { model, step: trainStep, dispose } = await inThreadStage(cfg);
  const counts = o.threads ?? [null];
  const times = counts.map(() => new Map<string, KernelTotals>());
  const stepMs = counts.map(() => [] as number[]);
  const cpu = counts.map(() => [] as number[]);
  let tokens = 0;
  const step = () => {
    tokens = trainStep().tokens;
  };
  let replayed: { calls: number; ms: number[] } | undefined;
  // with --replay: ms a measured step spent inside addon calls, per count
  const addonMs = counts.map(() => [] as number[]);
  try {
    for (let w = 0; w < (o.warmup ?? 1); w++)
      for (const t of counts) {
        setTeam(t);
        step();
      }
    for (let s = 0; s < o.steps; s++)
      counts.forEach((t, i) => {
        setTeam(t);
        timer.current = times[i]!;
        timer.round = s;
        const c0 = teamCpu(o.backend);
        const t0 = performance.now();
        if (o.replay) addonMs[i]!.push(callsMs(recordAddonCalls(step)));
        else step();
        stepMs[i]!.push(performance.now() - t0);
        timer.current = null;
        addCpu(cpu[i]!, c0, teamCpu(o.backend));
      });
    // last: the replays write into the stage's buffers (its parameters too)
    if (o.replay) replayed = replaySteps(o.steps, counts, step);
  } finally {
    timer.current = null;
    dispose();
  }
  const runs = counts.map((t, i) =>
    threadsRun(
      t,
      times[i]!,
      stepMs[i]!,
      cpu[i]!,
      o.steps,
      tokens,
      o.cpu === true,
    ),
  );
  const replay = replayed && {
    calls: replayed.calls,
    runs: counts.map((t, i) => ({
      threads: t,
      step_median_ms: replayed.ms[i]!,
      step_over_replay: runs[i]!.step_median_ms / replayed.ms[i]!,
      tfjs_addon_median_ms: median(addonMs[i]!, addonMs[i]!.length),
    })),
  };
  return { model, runs, tokens, ...(replay ? { replay } : {}) };
}

/**
 * Records one training step's native addon calls (at the last of `counts`) and times them
 * replayed alone at each count: two untimed replays at each, then `steps` rounds of one at each
 * count in turn. Returns the calls in the step and each count's median ms ({@link ReplayRun}).
 */
function replaySteps(
  steps: number,
  counts: readonly (number | null)[],
  step: () => void,
): { calls: number; ms: number[] } {
  setTeam(counts[counts.length - 1]!);
  const calls: AddonCall[] = recordAddonCalls(step);
  for (const t of counts) {
    setTeam(t);
    replayAddonCalls(calls);
    replayAddonCalls(calls);
  }
  const times = counts.map(() => [] as number[]);
  for (let s = 0; s < steps; s++)
    counts.forEach((t, i) => {
      setTeam(t);
      const t0 = performance.now();
      replayAddonCalls(calls);
      times[i]!.push(performance.now() - t0);
    });
  return { calls: calls.length, ms: times.map((x) => median(x, x.length)) };
}

/** The markdown line of a replayed step (--replay), or '' without one. */
function replayLine(replay: Steps['replay']): string {
  if (!replay) return '';
  const at = replay.runs
    .map(
      (r) =>
        `${r.step_median_ms.toFixed(1)} ms${r.threads === null ? '' : ` at ${r.threads}`} (the step through TF.js ${r.step_over_replay.toFixed(2)}x that, ${r.tfjs_addon_median_ms.toFixed(1)} ms of it inside the same calls)`,
    )
    .join(', ');
  const [a, b] = replay.runs;
  const speedup =
    a && b
      ? `; speedup ${(a.step_median_ms / b.step_median_ms).toFixed(2)}x`
      : '';
  return `Replayed step (--replay: one step's ${replay.calls} native addon calls recorded, then run again alone, no TF.js or other JS between them, the ceiling of a captured step; medians): ${at}${speedup}.\n`;
}

/** CPU seconds of each member of the native addon's team on this thread (empty on another backend). */
function teamCpu(backend: string): number[] {
  return backend === 'native' ? nativeAddon()!.teamCpuSeconds() : [];
}

/** Adds each member's CPU seconds between `before` and `after` to `total` (in ms, grown as needed). */
function addCpu(total: number[], before: number[], after: number[]): void {
  after.forEach((s, m) => {
    total[m] = (total[m] ?? 0) + 1000 * (s - (before[m] ?? 0));
  });
}

/**
 * CPU ms per step of this thread and of each other member (their mean), and the serial share s
 * that solves this = s W + (1 - s) W / T, other = (1 - s) W / T, W = this + (T - 1) other.
 */
function cpuSplit(
  cpuMs: number[],
  steps: number,
): Pick<ThreadsRun, 'cpu_ms' | 'serial_share'> {
  if (cpuMs.length === 0) return { cpu_ms: null, serial_share: null };
  const self = cpuMs[0]! / steps;
  const others = cpuMs.slice(1);
  const other =
    others.length > 0
      ? others.reduce((a, v) => a + v, 0) / others.length / steps
      : 0;
  const work = self + others.length * other;
  return {
    cpu_ms: {
      this_thread: self,
      per_other_thread: others.length > 0 ? other : null,
    },
    serial_share: others.length > 0 && work > 0 ? (self - other) / work : null,
  };
}

/**
 * What the serial share can see under libgomp's idle policy in `env`: where an idle team member
 * spins before it sleeps (GOMP_SPINCOUNT above 0; without it, OMP_WAIT_POLICY other than passive), its spinning is on
 * its CPU clock as if it were work, so the share reads low (0.3% for a bf16 step at 2 threads on
 * 2 cores whose other member, sampled by perf, waited in libgomp 13-15% of the time); with
 * GOMP_SPINCOUNT=0 idle members sleep and the clocks count work only. '' where they sleep.
 */
export function spinNote(env: Record<string, string | undefined>): string {
  // libgomp (env.c): GOMP_SPINCOUNT, where set, decides; else active spins for minutes,
  // passive not at all, and no policy 300,000 rounds
  const policy = env.OMP_WAIT_POLICY?.toLowerCase();
  const count = env.GOMP_SPINCOUNT;
  const sleeps =
    count !== undefined ? Number(count) === 0 : policy === 'passive';
  if (sleeps) return '';
  const how =
    count !== undefined
      ? `GOMP_SPINCOUNT=${count}`
      : policy === 'active'
        ? 'OMP_WAIT_POLICY=active'
        : "libgomp's default spin";
  return ` A lower bound: an idle member spins before it sleeps (${how}), and its spinning counts on its clock as work; run with GOMP_SPINCOUNT=0 (idle members sleep; the step is then slower, every kernel waking them) to read the serial share itself.`;
}

/** The median of `values` (the mean of the middle two for an even count), a step without a value counted as 0 ms. */
function median(values: number[], count: number): number {
  const v = Array.from({ length: count }, (_, i) => values[i] ?? 0).sort(
    (a, b) => a - b,
  );
  const h = Math.floor(count / 2);
  return count % 2 === 1 ? v[h]! : (v[h - 1]! + v[h]!) / 2;
}

/** One count's totals over `steps` steps as means (and medians) per step, kernels slowest first. */
function threadsRun(
  threads: number | null,
  times: Map<string, KernelTotals>,
  stepMs: number[],
  cpuMs: number[],
  steps: number,
  tokens: number,
  cpu: boolean,
): ThreadsRun {
  const others = cpuMs.length - 1; // team members besides this thread
  const rows = [...times]
    .map(([kernel, e]) => ({
      kernel,
      ms_per_step: e.ms / steps,
      median_ms_per_step: median(e.byStep, steps),
      calls_per_step: e.calls / steps,
      ...(cpu
        ? {
            cpu_ms: {
              this_thread: e.cpuSelf / steps,
              per_other_thread:
                others > 0 ? e.cpuOthers / others / steps : null,
            },
          }
        : {}),
    }))
    .sort((a, b) => b.ms_per_step - a.ms_per_step);
  const step_ms = stepMs.reduce((a, v) => a + v, 0) / steps;
  const kernel_ms = rows.reduce((a, r) => a + r.ms_per_step, 0);
  return {
    threads,
    step_ms,
    step_median_ms: median(stepMs, steps),
    kernel_ms,
    outside_ms: step_ms - kernel_ms,
    ...cpuSplit(cpuMs, steps),
    tokens_per_s: (tokens / step_ms) * 1000,
    rows,
  };
}

/** The setting line both tables start with. */
function settingLine(o: KernelsBenchOptions, model: Model): string {
  const cpus = availableParallelism();
  const load = loadavg()[0]!;
  return `Model ${o.preset} (${modelParamCount(model).toLocaleString('en-US')} parameters), mini-batch ${o.batchSize}, backend ${o.backend}, precision ${o.precision ?? 'fp32'}, single-device training in one thread, on ${cpus} CPUs (${describeTopology(cpuTopology())}) whose 1-minute load average was ${load.toFixed(1)} at the end${load > cpus ? ' (above the CPU count, other processes shared them and wall times are longer than on idle CPUs)' : ''}`;
}

/** kernels.md at one thread count: the setting and step time (ms per step, in kernels), then one row per kernel. */
function kernelsMarkdown(
  o: KernelsBenchOptions,
  model: Model,
  run: ThreadsRun,
  tokens: number,
): string {
  const perStep = run.step_ms;
  return [
    `# kernels benchmark\n`,
    `${settingLine(o, model)}, mean of ${o.steps} steps after ${warmUpSteps(o.warmup ?? 1)}: ${perStep.toFixed(0)} ms per step (median ${run.step_median_ms.toFixed(0)}) (${((tokens / perStep) * 1000).toFixed(0)} tokens/s), ${run.kernel_ms.toFixed(0)} ms of it in kernels (each kernel's time includes allocating its output), ${run.outside_ms.toFixed(0)} ms outside them.\n`,
    markdownTable({
      columns: [
        'kernel',
        'ms per step',
        'median ms per step',
        'share of the step',
        'calls per step',
      ],
      rows: run.rows.map((r) => [
        r.kernel,
        r.ms_per_step.toFixed(1),
        r.median_ms_per_step.toFixed(1),
        `${((100 * r.ms_per_step) / perStep).toFixed(1)}%`,
        r.calls_per_step,
      ]),
    }),
  ].join('\n');
}

/** With `--cpu`: kernel `name`'s CPU speedup on this thread at each count after the first ('-' where not timed). */
function cpuSpeedups(runs: ThreadsRun[], name: string): string[] {
  const at = (r: ThreadsRun) =>
    r.rows.find((k) => k.kernel === name)?.cpu_ms?.this_thread;
  const base = at(runs[0]!);
  return runs.slice(1).map((r) => {
    const v = at(r);
    return base && v ? `${(base / v).toFixed(2)}x` : '-';
  });
}

/**
 * kernels.md at several thread counts: the step, the kernels' and the outside time per step at
 * each count, then each kernel's ms per step at each count and its speedup over the first
 * count (kernels by their time at the first count, slowest first); with `--cpu` also each
 * kernel's speedup on this thread's CPU clock.
 */
function threadsMarkdown(
  o: KernelsBenchOptions,
  model: Model,
  runs: ThreadsRun[],
): string {
  const base = runs[0]!;
  const ms = (v: number | null | undefined) => (v == null ? '-' : v.toFixed(2));
  const speedup = (
    a: number | null | undefined,
    b: number | null | undefined,
  ) =>
    a == null || b == null || a <= 0 || b <= 0 ? '-' : `${(a / b).toFixed(2)}x`;
  type Pick = (r: ThreadsRun) => number | null | undefined;
  // mean and median ms at each count, and their speedups over the first count
  const line = (name: string, pick: Pick, pickMedian: Pick = () => null) => [
    name,
    ...runs.map((r) => ms(pick(r))),
    ...runs.slice(1).map((r) => speedup(pick(base), pick(r))),
    ...runs.map((r) => ms(pickMedian(r))),
    ...runs.slice(1).map((r) => speedup(pickMedian(base), pickMedian(r))),
  ];
  const byName = runs.map((r) => new Map(r.rows.map((k) => [k.kernel, k])));
  const calls = new Map(base.rows.map((k) => [k.kernel, k.calls_per_step]));
  const cpuColumns = o.cpu
    ? runs.slice(1).map((r) => `CPU speedup at ${r.threads}`)
    : [];
  const pad = cpuColumns.map(() => '');
  const names = [
    ...new Set(
      [...base.rows, ...runs.flatMap((r) => r.rows)].map((k) => k.kernel),
    ),
  ];
  return [
    `# kernels benchmark at ${runs.map((r) => r.threads).join(', ')} threads\n`,
    `${settingLine(o, model)}, the OpenMP team set to each count in turn, ${o.steps} rounds of one step at each count after ${warmUpSteps(o.warmup ?? 1)} at each; means per step in ms, and medians over the steps (of the step's time and of each kernel's in a step: unlike means, not moved by a few steps that another process slowed) (each kernel's time includes allocating its output; outside kernels: TF.js's dispatch, tape, tidy and the buffer pool). Speedup: the time at the first count (${base.threads}) over the time at the count. CPU: ms per step on the threads' own CPU clocks (not lengthened by other processes on a shared machine); this thread runs the JS and every serial part, so its CPU speedup is what the step's would be on otherwise idle cores, or less (time this thread waits for the others is not on its clock).\n`,
    `Serial share of the step from the CPU clocks (Amdahl's s; this thread runs s W + (1 - s) W / T, each other thread (1 - s) W / T): ${runs.map((r) => `${r.serial_share === null ? '-' : `${(100 * r.serial_share).toFixed(1)}%`} at ${r.threads}`).join(', ')}.${spinNote(process.env)}\n`,
    markdownTable({
      columns: [
        'kernel',
        ...runs.map((r) => `ms at ${r.threads}`),
        ...runs.slice(1).map((r) => `speedup at ${r.threads}`),
        ...runs.map((r) => `median at ${r.threads}`),
        ...runs.slice(1).map((r) => `median speedup at ${r.threads}`),
        ...cpuColumns,
        'calls per step',
      ],
      rows: [
        [
          ...line(
            '**step**',
            (r) => r.step_ms,
            (r) => r.step_median_ms,
          ),
          ...pad,
          '',
        ],
        [...line('**in kernels**', (r) => r.kernel_ms), ...pad, ''],
        [...line('**outside kernels**', (r) => r.outside_ms), ...pad, ''],
        [
          ...line('**CPU, this thread**', (r) => r.cpu_ms?.this_thread),
          ...pad,
          '',
        ],
        [
          ...line(
            '**CPU, each other thread**',
            (r) => r.cpu_ms?.per_other_thread,
          ),
          ...pad,
          '',
        ],
        ...names.map((n) => [
          ...line(
            n,
            (r) => byName[runs.indexOf(r)]!.get(n)?.ms_per_step,
            (r) => byName[runs.indexOf(r)]!.get(n)?.median_ms_per_step,
          ),
          ...(o.cpu ? cpuSpeedups(runs, n) : []),
          calls.get(n) ?? '-',
        ]),
      ],
    }),
  ].join('\n');
}
