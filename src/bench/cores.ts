/**
 * `npm run bench -- cores`: tokens/s against kernel threads on one many-core machine (issue 37,
 * item 4): native single (fp32, bf16), the pipeline schedules (1f1b, zb-h1, zbv, dualpipev)
 * and local parallelism at K = 2, 3, 4 devices where the model has the blocks, each with
 * `--threads` 1, 2, 4, 8, 16 per device where K x threads fits the cores (and each K's
 * default, strategies/spec.ts threadsPerDevice: the cores less the host's, divided among K), the
 * schedules at each of `--micro-batches` (4 and 8), and PyTorch's CPU training of the same model
 * (bench/pytorch/charlm.py) where `python3 -c 'import torch'` works. Writes cores.json and
 * cores.md naming the CPU and its physical cores (util/cpu.ts).
 *
 * Every configuration runs in this process as the other benches do (createStrategy: its devices
 * are worker threads or, with `devices: 'process'`, pinned device processes), `warmup` warm-up
 * steps (default 1), then the median of `steps` timed steps. A time budget keeps the default under
 * 5 minutes on a 16-core machine: configurations run in order of importance (the whole machine's
 * single and PyTorch rows and zbv K=3 first, then every kind at its default threads, then the
 * rest, more threads first), and those not started once the budget is spent are listed as skipped.
 */
import { spawnSync } from 'node:child_process';
import { existsSync } from 'node:fs';
import { availableParallelism, cpus } from 'node:os';
import { fileURLToPath } from 'node:url';
import { nativeAddon, nativeUnavailable } from '../backend/native.js';
import { resolveConfig, type TrainConfig } from '../config/config.js';
import { makeBatcher } from '../data/batcher.js';
import { modelParamCount } from '../model/model.js';
import { createStrategy, resolveStages, specOf } from '../strategies/index.js';
import { deviceThreads, threadsPerDevice } from '../strategies/spec.js';
import { cpuTopology, describeTopology } from '../util/cpu.js';
import { check, LayerwiseError } from '../util/errors.js';
import { median } from '../util/stats.js';
import {
  type BenchRun,
  loadBenchModel,
  markdownTable,
  reportBenchResults,
  timeTrainSteps,
  warmUpSteps,
  writeBenchResults,
} from './report.js';

/** What `--kinds` can name: single at each precision, the schedules on K devices, local parallelism. */
export const CORE_KINDS = [
  'single',
  'single-bf16',
  '1f1b',
  'zb-h1',
  'zbv',
  'dualpipev',
  'local',
] as const;
export type CoreKind = (typeof CORE_KINDS)[number];

/** Options of {@link benchCores} (the command's flags). */
export interface CoresBenchOptions {
  preset: string;
  batchSize: number;
  /** Timed steps per configuration. */
  steps: number;
  /**
   * Untimed warm-up steps per configuration first (default 1; each configuration's devices are
   * new, their JS not yet optimized by V8: see bench/kernels.ts `warmup`).
   */
  warmup?: number;
  /** Kernel threads per device to try (each K also gets its default, strategies/spec.ts threadsPerDevice). */
  threads: number[];
  /** Devices K of the pipelines and local parallelism. */
  stages: number[];
  kinds: CoreKind[];
  /**
   * Micro-batch counts M of the pipeline schedules, each a row (dualpipev needs at least 2K):
   * fewer and larger micro-batches keep the kernels efficient (on 2 cores zbv K=2 ran 8,881
   * tokens/s at M=4 against 7,756 at M=8), more shrink the bubble.
   */
  microBatches: number[];
  /** Local updates per mini-batch of local parallelism. */
  localMicroBatches: number;
  /** Where the devices run: worker threads of this process, or device processes (pinned, runtime/pinning.ts). */
  devices: 'thread' | 'process';
  /**
   * Times each configuration is measured (default 1), in rounds over the grid in a rotated order
   * ({@link measureRounds}): on a shared machine whose speed drifts by a fifth within minutes,
   * a speedup between two rows measured minutes apart is the drift's as much as the threads'.
   */
  rounds?: number;
  /** Seconds after which no further configuration starts. */
  budgetS: number;
  /** The Python that runs bench/pytorch/charlm.py; '' skips PyTorch. */
  python: string;
  /** charlm.py's path, where it is not beside this package (a device bundle holds only dist/); default {@link CHARLM_PY}. */
  pytorchScript?: string;
  /** A line for cores.md about the run (e.g. that the machine was shared). */
  note?: string;
  out: string;
  name: string;
}

/**
 * The command's flags (strings from commander) as {@link CoresBenchOptions}.
 * @throws LayerwiseError naming a list entry that is not a positive integer or a known kind,
 * a --devices that is not thread or process, or a non-positive --steps or --budget-s.
 */
export function parseCoresOptions(
  raw: Record<string, unknown>,
): CoresBenchOptions {
  const ints = (flag: string, v: unknown) =>
    String(v)
      .split(',')
      .map((x) => {
        check(
          /^[1-9]\d*$/.test(x.trim()),
          `--${flag}: '${x}' is not a positive integer (e.g. --${flag} 1,2,4)`,
        );
        return Number(x);
      });
  const kinds = String(raw.kinds)
    .split(',')
    .map((k) => {
      check(
        (CORE_KINDS as readonly string[]).includes(k),
        `--kinds: unknown '${k}' (valid: ${CORE_KINDS.join(', ')})`,
      );
      return k as CoreKind;
    });
  check(
    raw.devices === 'thread' || raw.devices === 'process',
    `--devices: '${raw.devices}' is neither thread nor process`,
  );
  for (const f of ['steps', 'budgetS', 'batchSize'] as const)
    check(
      Number(raw[f]) > 0,
      `--${f === 'budgetS' ? 'budget-s' : f === 'batchSize' ? 'batch-size' : f} must be positive, got ${raw[f]}`,
    );
  check(
    raw.rounds === undefined || /^[1-9]\d*$/.test(String(raw.rounds)),
    `--rounds: '${raw.rounds}' is not a positive integer (e.g. --rounds 5)`,
  );
  return {
    ...(raw as Omit<
      CoresBenchOptions,
      'threads' | 'stages' | 'kinds' | 'microBatches'
    >),
    threads: ints('threads', raw.threads),
    stages: ints('stages', raw.stages),
    microBatches: ints('micro-batches', raw.microBatches),
    kinds,
    ...(raw.rounds === undefined ? {} : { rounds: Number(raw.rounds) }),
  };
}

/** One configuration: a kind on `devices` devices with `threads` kernel threads each (a pipeline schedule: over `microBatches` micro-batches). */
export interface CoreConfig {
  kind: CoreKind | 'pytorch' | 'pytorch-bf16';
  devices: number;
  threads: number;
  microBatches?: number;
}

/** A configuration not run, and why. */
export interface Skipped {
  kind: string;
  devices: number;
  threads: number | '-';
  microBatches?: number;
  reason: string;
}

/** One measured configuration. */
export interface Row {
  kind: string;
  engine: 'layerwise' | 'pytorch';
  precision: 'fp32' | 'bf16';
  devices: number;
  stages: number;
  threads_per_device: number;
  /** Kernel threads of each device where the run split them unevenly (by load, at K's default threads). */
  threads_split?: number[];
  threads_total: number;
  /** A pipeline schedule's micro-batches M; null for single, local and PyTorch. */
  micro_batches: number | null;
  tokens_per_s: number;
  step_s: number;
  /** With --rounds above 1: each round's tokens/s, in round order (the row is the median round's). */
  rounds_tokens_per_s?: number[];
  /** tokens/s over single's (same precision) with all the cores; PyTorch rows: undefined. */
  vs_single?: number;
  /**
   * One-device rows above one thread: tokens/s over the same kind's at one thread (issue 37's
   * 2-core bar), from the rounds where both ran (see {@link overOneThread}).
   */
  vs_one_thread?: number;
  /** single rows: tokens/s over PyTorch's at the same threads and precision. */
  vs_pytorch?: number;
  /** single rows: tokens/s over PyTorch's of the same precision on all the cores (issue 37's bar, at layerwise's default threads). */
  vs_pytorch_all?: number;
}

const V_SHAPED: ReadonlySet<string> = new Set(['zbv', 'dualpipev']);
/** The kinds that are pipeline schedules over micro-batches (one row per `--micro-batches` entry). */
const SCHEDULED: ReadonlySet<string> = new Set([
  '1f1b',
  'zb-h1',
  'zbv',
  'dualpipev',
]);
const isSingle = (k: CoreConfig['kind']) => k.startsWith('single');
const isPyTorch = (k: CoreConfig['kind']) => k.startsWith('pytorch');

/** K devices' default threads on `cores` cores (strategies/spec.ts threadsPerDevice: the cores less the host's, over K). */
const autoThreads = (devices: number, cores: number) =>
  threadsPerDevice({ threads: 0 }, devices, cores);

/** Threads per device for K devices on `cores` cores: the listed ones that fit, and the default ({@link autoThreads}). */
export function threadsForDevices(
  listed: readonly number[],
  devices: number,
  cores: number,
): number[] {
  const fit = listed.filter((t) => devices * t <= cores);
  const auto = autoThreads(devices, cores);
  return [...new Set([...fit, auto])].sort((a, b) => a - b);
}

/**
 * The configurations of a run, in the order they run, and those skipped because they do not
 * fit (pure): K x threads over `cores`, or more stages (K, or 2K for the V-shaped schedules)
 * than the model's `blocks`. Order: rank 0 is single, single-bf16 and PyTorch with all the
 * cores, and zbv K=3 at its default threads; rank 1 every other configuration at its K's
 * default threads; rank 2 the rest, more threads in all first. `pytorchMissing`: why PyTorch
 * does not run (its rows are then listed as skipped with it), undefined where it runs.
 */
export function coresGrid(
  o: Pick<CoresBenchOptions, 'threads' | 'stages' | 'kinds' | 'microBatches'>,
  cores: number,
  blocks: number,
  pytorchMissing?: string,
): { configs: CoreConfig[]; skipped: Skipped[] } {
  const configs: CoreConfig[] = [];
  const skipped: Skipped[] = [];
  const add = (kind: CoreConfig['kind'], k: number) => {
    if (isPyTorch(kind) && pytorchMissing !== undefined) {
      for (const t of threadsForDevices(o.threads, k, cores))
        skipped.push({ kind, devices: k, threads: t, reason: pytorchMissing });
      return;
    }
    for (const t of o.threads.filter((x) => k * x > cores))
      skipped.push({
        kind,
        devices: k,
        threads: t,
        reason: `${k} x ${t} threads > ${cores} cores`,
      });
    // a pipeline schedule at each M; single, local and PyTorch once
    const ms = SCHEDULED.has(kind) ? o.microBatches : [undefined];
    for (const t of threadsForDevices(o.threads, k, cores))
      for (const m of ms)
        configs.push({
          kind,
          devices: k,
          threads: t,
          ...(m === undefined ? {} : { microBatches: m }),
        });
  };
  for (const kind of o.kinds) {
    if (isSingle(kind)) {
      add(kind, 1);
      add(kind === 'single' ? 'pytorch' : 'pytorch-bf16', 1);
      continue;
    }
    for (const k of o.stages) {
      const stages = k * (V_SHAPED.has(kind) ? 2 : 1);
      if (stages > blocks)
        skipped.push({
          kind,
          devices: k,
          threads: '-',
          reason: `needs ${stages} stages, the model has ${blocks} blocks`,
        });
      else add(kind, k);
    }
  }
  const rank = (c: CoreConfig) => {
    // PyTorch with all the cores: the bar's reference
    if (isPyTorch(c.kind)) return c.threads === cores ? 0 : 2;
    const auto = c.threads === autoThreads(c.devices, cores);
    if (auto && (c.devices === 1 || (c.kind === 'zbv' && c.devices === 3)))
      return 0;
    return auto ? 1 : 2;
  };
  const order = configs.map((c, i) => ({ c, i, r: rank(c) }));
  order.sort(
    (a, b) =>
      a.r - b.r ||
      (a.r === 2 ? b.c.devices * b.c.threads - a.c.devices * a.c.threads : 0) ||
      a.i - b.i,
  );
  return { configs: order.map((x) => x.c), skipped };
}

/** The bench's shared run: its options, configuration, model, cores and log. */
type CoresRun = BenchRun<CoresBenchOptions>;

/**
 * Runs the grid ({@link coresGrid}) within the time budget and writes `<name>.json` and
 * `<name>.md` under `o.out`. Throws LayerwiseError when the native addon does not load (the
 * bench measures its threads).
 */
export async function benchCores(
  o: CoresBenchOptions,
  log: (s: string) => void,
): Promise<void> {
  if (!nativeAddon())
    throw new LayerwiseError(
      `bench cores measures the native backend's threads, which does not load here (${nativeUnavailable()}); build it with npm ci after installing libdnnl-dev`,
    );
  const base = resolveConfig({
    preset: o.preset,
    batchSize: o.batchSize,
    backend: 'native',
  });
  const bench = await loadBenchModel(base);
  const run: CoresRun = { o, base, bench, cores: availableParallelism(), log };
  const torch = pytorchVersion(o.python, o.pytorchScript ?? CHARLM_PY);
  const grid = coresGrid(
    o,
    run.cores,
    bench.model.blocks.length,
    torch.ok ? undefined : `PyTorch ${torch.why}`,
  );
  const { rows, skipped } = await measureRounds(
    run,
    grid.configs,
    grid.skipped,
    async (rows, skipped) => {
      await writeBenchResults(
        o.out,
        o.name,
        ...coresResults(run, torch, rows, skipped),
      );
    },
    (c) => measureOrSkip(run, c),
  );
  for (const s of skipped) log(`skipped ${label(s)}: ${s.reason}`);
  await reportBenchResults(
    o.out,
    o.name,
    ...coresResults(run, torch, rows, skipped),
    log,
  );
}

/**
 * Measures each of `configs` `run.o.rounds` times (default 1): round r runs them from the r-th
 * on, wrapping round (round 0 in the grid's order of importance), so that a drift of the
 * machine's speed spreads over all of them; a configuration that fails is not run again. After
 * each measurement `save` gets the rows so far and the skipped ones (those not yet run listed as
 * such), so that what is measured stays on disk if the run is cut short (a device session's
 * limit). Once `o.budgetS` is spent no measurement starts. Each row is the one of its median
 * round (by tokens/s; the lower middle one of an even count), with every round's tokens/s.
 * `measure` runs one configuration (benchCores: {@link measureOrSkip}; tests: a fake).
 */
export async function measureRounds(
  run: Pick<CoresRun, 'o'>,
  configs: readonly CoreConfig[],
  gridSkipped: readonly Skipped[],
  save: (rows: Row[], skipped: Skipped[]) => Promise<void>,
  measure: (c: CoreConfig) => Promise<Row | Skipped>,
): Promise<{ rows: Row[]; skipped: Skipped[] }> {
  const { o } = run;
  const rounds = o.rounds ?? 1;
  const measured: Row[][] = configs.map(() => []);
  const failed = new Map<number, Skipped>();
  const t0 = performance.now();
  const results = (pending: (i: number) => string | undefined) => {
    const skipped: Skipped[] = [...gridSkipped];
    const rows: Row[] = [];
    configs.forEach((c, i) => {
      const f = failed.get(i);
      const why = pending(i);
      if (measured[i]!.length > 0) rows.push(medianRound(measured[i]!));
      else if (f) skipped.push(f);
      else if (why) skipped.push({ ...c, reason: why });
    });
    return { rows, skipped };
  };
  for (let round = 0; round < rounds; round++)
    for (let j = 0; j < configs.length; j++) {
      const i = (j + round) % configs.length;
      if (failed.has(i) || (performance.now() - t0) / 1000 > o.budgetS)
        continue;
      const r = await measure(configs[i]!);
      if ('reason' in r) failed.set(i, r);
      else measured[i]!.push(r);
      const so = results((k) =>
        measured[k]!.length === 0
          ? 'not run: the bench stopped before it'
          : undefined,
      );
      await save(so.rows, so.skipped);
    }
  return results(() => `time budget of ${o.budgetS} s spent`);
}

/** The row of the median round by tokens/s (the lower middle one of an even count), with each round's tokens/s where there are several. */
function medianRound(rounds: Row[]): Row {
  const sorted = [...rounds].sort((a, b) => a.tokens_per_s - b.tokens_per_s);
  const mid = sorted[Math.floor((sorted.length - 1) / 2)]!;
  return rounds.length === 1
    ? mid
    : { ...mid, rounds_tokens_per_s: rounds.map((r) => r.tokens_per_s) };
}

/** cores.json's object and cores.md's text for the rows so far (their ratios filled in). */
function coresResults(
  run: CoresRun,
  torch: { ok: boolean; version?: string; why?: string },
  rows: Row[],
  skipped: Skipped[],
): [unknown, string] {
  withRatios(rows, run.cores);
  const machine = machineOf(run.cores);
  return [
    {
      bench: 'cores',
      options: run.o,
      machine,
      pytorch: torch.ok ? torch.version : torch.why,
      params: modelParamCount(run.bench.model),
      rows,
      skipped,
    },
    coresMarkdown(run, machine, torch, rows, skipped),
  ];
}

/** `single-bf16 K=1 x 16 thread(s)`, `zbv K=3 x 4 thread(s) M=4`. */
function label(c: {
  kind: string;
  devices: number;
  threads: number | '-';
  microBatches?: number;
}) {
  return `${c.kind} K=${c.devices} x ${c.threads} thread(s)${c.microBatches === undefined ? '' : ` M=${c.microBatches}`}`;
}

/** The CPU's model name, the cores this process may use, and the physical cores under them (util/cpu.ts). */
function machineOf(cores: number): Machine {
  const t = cpuTopology();
  return {
    cpu: cpus()[0]?.model.trim() ?? 'unknown',
    cores,
    physical_cores: t?.physicalCores ?? null,
    threads_per_core: t?.threadsPerCore ?? null,
    topology: describeTopology(t),
  };
}

/** cores.json's `machine`: the CPU, the cores this process may use, and sysfs's topology (null where unknown). */
interface Machine {
  cpu: string;
  cores: number;
  physical_cores: number | null;
  threads_per_core: number | null;
  topology: string;
}

/** Measures `c`; a configuration that fails (bad flags, a device that dies) becomes a skipped entry naming why. */
async function measureOrSkip(
  run: CoresRun,
  c: CoreConfig,
): Promise<Row | Skipped> {
  try {
    const row = isPyTorch(c.kind)
      ? measurePyTorch(run, c)
      : await measureLayerwise(run, c);
    run.log(
      `${label(c)}: ${row.tokens_per_s.toFixed(0)} tokens/s, ${row.step_s.toFixed(3)} s/step`,
    );
    return row;
  } catch (e) {
    const why = (e as Error).message.split('\n')[0]!;
    run.log(`${label(c)}: failed: ${why}`);
    return { ...c, reason: `failed: ${why}` };
  }
}

/** The train configuration of a layerwise kind on `c.devices` devices with `c.threads` threads each. */
function configOf(run: CoresRun, c: CoreConfig): TrainConfig {
  const { o, base } = run;
  const kind = c.kind as CoreKind;
  const strategy = isSingle(kind)
    ? 'single'
    : kind === 'local'
      ? 'local'
      : 'gpipe';
  return resolveConfig({
    ...base,
    balance: undefined,
    strategy,
    stages: strategy === 'single' ? 1 : c.devices,
    microBatches:
      strategy === 'single'
        ? 1
        : strategy === 'local'
          ? o.localMicroBatches
          : c.microBatches,
    remat: 'never',
    ...(strategy === 'gpipe'
      ? { schedule: kind as TrainConfig['schedule'] }
      : {}),
    precision: kind === 'single-bf16' ? 'bf16' : 'fp32',
    // K devices at their default: threads 0, so that the run splits them as it would by default
    // (by each device's share of the FLOPs where the loads differ: strategies/spec.ts runThreads)
    threads:
      c.devices > 1 && c.threads === autoThreads(c.devices, run.cores)
        ? 0
        : c.threads,
    ...(o.devices === 'process' ? { devices: 'process' } : {}),
  } as Parameters<typeof resolveConfig>[0]);
}

/** `o.warmup` (default 1) warm-up steps, then `o.steps` timed steps of the configuration; closes its devices. */
async function measureLayerwise(run: CoresRun, c: CoreConfig): Promise<Row> {
  const { o, bench } = run;
  const cfg = configOf(run, c);
  const ranges = await resolveStages(cfg, bench.model);
  const s = await createStrategy(cfg, bench.model, bench.params, ranges);
  try {
    const batcher = makeBatcher(bench.ds, {
      batchSize: o.batchSize,
      context: bench.context,
      seed: 1,
    });
    let tokens = 0;
    const times = await timeTrainSteps(
      s,
      () => batcher.next(),
      o.steps,
      (_r, b) => {
        tokens = b.tokens;
      },
      o.warmup ?? 1,
    );
    const secs = median(times);
    const split = deviceThreads(
      cfg,
      cfg.strategy === 'single',
      run.cores,
      specOf(cfg.strategy).deviceLoads?.(cfg, bench.model, ranges),
    );
    const uneven = new Set(split).size > 1;
    return {
      kind: c.kind,
      engine: 'layerwise',
      precision: cfg.precision === 'bf16' ? 'bf16' : 'fp32',
      devices: c.devices,
      stages: c.devices * (V_SHAPED.has(c.kind) ? 2 : 1),
      threads_per_device: c.threads,
      ...(uneven ? { threads_split: split } : {}),
      threads_total: uneven
        ? split.reduce((a, b) => a + b, 0)
        : c.devices * c.threads,
      micro_batches: c.microBatches ?? null,
      tokens_per_s: tokens / secs,
      step_s: secs,
    };
  } finally {
    await s.close();
  }
}

/** bench/pytorch/charlm.py beside this module's package (dist/bench -> the project's root). */
export const CHARLM_PY = fileURLToPath(
  new URL('../../bench/pytorch/charlm.py', import.meta.url),
);

/** Whether `python` imports torch and `script` (charlm.py) is there: torch's version, or why not. */
function pytorchVersion(
  python: string,
  script: string,
): {
  ok: boolean;
  version?: string;
  why?: string;
} {
  if (python === '') return { ok: false, why: 'not run (--python "")' };
  if (!existsSync(script))
    return {
      ok: false,
      why: `not run: ${script} not found; give --pytorch-script bench/pytorch/charlm.py`,
    };
  const r = spawnSync(
    python,
    ['-c', 'import torch; print(torch.__version__)'],
    {
      encoding: 'utf8',
      timeout: 60_000,
    },
  );
  if (r.status === 0) return { ok: true, version: r.stdout.trim() };
  const why = r.error
    ? r.error.message
    : (r.stderr.trim().split('\n').at(-1) ?? `exit ${r.status}`);
  return { ok: false, why: `not importable (${why})` };
}

/** PyTorch's CPU training of the same charlm (charlm.py, SDPA attention) on `c.threads` threads. */
function measurePyTorch(run: CoresRun, c: CoreConfig): Row {
  const m = run.bench.model.config;
  if (m.arch !== 'charlm')
    throw new LayerwiseError(
      `the PyTorch reference trains charlm presets only, not ${m.arch}`,
    );
  const args = [
    run.o.pytorchScript ?? CHARLM_PY,
    ...['--layers', m.layers, '--d-model', m.dModel, '--heads', m.heads],
    ...['--context', m.context, '--vocab', m.vocab],
    ...['--batch-size', run.o.batchSize, '--steps', run.o.steps],
    ...['--device', 'cpu', '--threads', c.threads, '--sdpa'],
    ...(c.kind === 'pytorch-bf16' ? ['--bf16'] : []),
  ].map(String);
  const r = spawnSync(run.o.python, args, {
    encoding: 'utf8',
    timeout: 300_000,
  });
  if (r.status !== 0)
    throw new Error(
      `charlm.py: ${r.error?.message ?? r.stderr.trim().split('\n').at(-1)}`,
    );
  const out = JSON.parse(r.stdout.trim().split('\n').at(-1)!) as {
    tokens_per_s: number;
    step_s: number[];
  };
  return {
    kind: c.kind,
    engine: 'pytorch',
    precision: c.kind === 'pytorch-bf16' ? 'bf16' : 'fp32',
    devices: 1,
    stages: 1,
    threads_per_device: c.threads,
    threads_total: c.threads,
    micro_batches: null,
    tokens_per_s: out.tokens_per_s,
    step_s: median(out.step_s),
  };
}

/**
 * Fills vs_single (over layerwise single of the same precision at its default threads,
 * {@link autoThreads}) and, on single rows, vs_pytorch (over PyTorch at the same threads and
 * precision) and vs_pytorch_all (over PyTorch of the same precision on all `cores`), where measured.
 */
function withRatios(rows: Row[], cores: number): void {
  const find = (kind: string, threads: number) =>
    rows.find((r) => r.kind === kind && r.threads_per_device === threads);
  for (const r of rows) {
    const one = find(r.kind, 1);
    if (r.devices === 1 && r.threads_per_device > 1 && one)
      r.vs_one_thread = overOneThread(r, one);
    if (r.engine === 'pytorch') continue;
    const single = find(
      r.precision === 'bf16' ? 'single-bf16' : 'single',
      autoThreads(1, cores),
    );
    if (single) r.vs_single = r.tokens_per_s / single.tokens_per_s;
    if (r.devices === 1) {
      const torchKind = r.precision === 'bf16' ? 'pytorch-bf16' : 'pytorch';
      const torch = find(torchKind, r.threads_per_device);
      if (torch) r.vs_pytorch = r.tokens_per_s / torch.tokens_per_s;
      const all = find(torchKind, cores);
      if (all) r.vs_pytorch_all = r.tokens_per_s / all.tokens_per_s;
    }
  }
}

/**
 * A one-device row's tokens/s over the same kind's at one thread (`one`): with rounds, the median
 * of each round's ratio (round i of both, run minutes apart in the same pass over the grid, so
 * that the machine's drift between passes, 16% here, cancels; a row cut short by the budget
 * pairs its first rounds), else the rows' ratio.
 */
export function overOneThread(
  r: Pick<Row, 'tokens_per_s' | 'rounds_tokens_per_s'>,
  one: Pick<Row, 'tokens_per_s' | 'rounds_tokens_per_s'>,
): number {
  const a = r.rounds_tokens_per_s;
  const b = one.rounds_tokens_per_s;
  if (!a || !b) return r.tokens_per_s / one.tokens_per_s;
  const n = Math.min(a.length, b.length);
  return median(a.slice(0, n).map((t, i) => t / b[i]!));
}

/** cores.md: the machine and setting, the rows (fastest kinds first as run), then what was skipped. */
function coresMarkdown(
  run: CoresRun,
  machine: Machine,
  torch: { ok: boolean; version?: string; why?: string },
  rows: Row[],
  skipped: Skipped[],
): string {
  const { o, bench } = run;
  const rounds = o.rounds ?? 1;
  const x = (v: number | undefined) =>
    v === undefined ? '-' : `${v.toFixed(2)}x`;
  const sorted = [...rows].sort(
    (a, b) =>
      a.devices - b.devices ||
      a.kind.localeCompare(b.kind) ||
      a.threads_per_device - b.threads_per_device ||
      (a.micro_batches ?? 0) - (b.micro_batches ?? 0),
  );
  return [
    `# cores benchmark\n`,
    `${machine.cpu}, ${machine.cores} cores (${machine.topology}), Node ${process.versions.node}; PyTorch ${torch.ok ? torch.version : torch.why}.${o.note ? ` ${o.note}` : ''}\n`,
    `Model ${o.preset} (${bench.model.blocks.length} blocks, ${modelParamCount(bench.model).toLocaleString('en-US')} parameters), mini-batch ${o.batchSize}, native backend, devices: ${o.devices}${o.devices === 'process' ? ' (pinned where they fit)' : ''}; pipelines without re-materialization at M = ${o.microBatches.join(', ')} micro-batches (column M), local ${o.localMicroBatches} updates per mini-batch; median of ${o.steps} timed steps after ${warmUpSteps(o.warmup ?? 1)}${rounds > 1 ? `; each configuration measured in ${rounds} rounds over the grid, each round in a rotated order (a drift of the machine's speed spreads over all of them), the row the round with the median tokens/s (by round: each round's)` : ''}. vs single: over layerwise single of the same precision at its default ${autoThreads(1, machine.cores)} threads (the ${machine.cores} cores less the host's); vs 1 thread: over the same kind at one thread${rounds > 1 ? " (the median of the rounds' ratios)" : ''}; vs PyTorch: over PyTorch (charlm.py, SDPA) at the same threads and precision; vs PyTorch all: over PyTorch of the same precision on all ${machine.cores} cores.\n`,
    markdownTable({
      columns: [
        'kind',
        'K',
        'stages',
        'threads per device',
        'threads in all',
        'M',
        'tokens/s',
        's/step',
        'vs single',
        'vs 1 thread',
        'vs PyTorch',
        'vs PyTorch all',
        ...(rounds > 1 ? ['tokens/s by round'] : []),
      ],
      rows: sorted.map((r) => [
        r.kind,
        r.devices,
        r.stages,
        r.threads_split?.join('/') ?? r.threads_per_device,
        r.threads_total,
        r.micro_batches ?? '-',
        r.tokens_per_s.toFixed(0),
        r.step_s.toFixed(3),
        r.engine === 'pytorch' ? '-' : x(r.vs_single),
        x(r.vs_one_thread),
        x(r.vs_pytorch),
        x(r.vs_pytorch_all),
        ...(rounds > 1
          ? [r.rounds_tokens_per_s?.map((t) => t.toFixed(0)).join(', ') ?? '-']
          : []),
      ]),
    }),
    skipped.length
      ? `Skipped:\n\n${skipped.map((s) => `- ${label(s)}: ${s.reason}`).join('\n')}\n`
      : '',
  ].join('\n');
}
