/**
 * What one training strategy is, in one place: each file under strategies/ (single.ts,
 * gpipe.ts, local.ts, l2l.ts) exports one {@link StrategySpec}, and everything that depends on
 * the strategy reads it from there: the trainer (partition and start), the device-memory check
 * before training (plan/budget.ts), `layerwise plan` (plan/plan.ts), the CLI's help and set-up
 * line, and the out-of-memory advice. The stage kind a strategy runs on its devices is named by
 * its runner (strategies/pipeline.ts, strategies/l2l.ts) as a module under pipeline/.
 */

import { availableParallelism } from 'node:os';
import type { TrainConfig } from '../config/config.js';
import type { StrategyFlags } from '../config/strategy-flags.js';
import type { ModelProfile } from '../cost/costs.js';
import type { PlanRequest, StrategyPlan } from '../cost/strategy-plan.js';
import type { HostParams } from '../model/init.js';
import type { Model } from '../model/model.js';
import type { StageRange } from '../partition/balance.js';
import { parseDevices } from '../runtime/devices.js';
import { LayerwiseError } from '../util/errors.js';
import type { Strategy } from './strategy.js';

/**
 * Cores left to the host's own threads when `--threads` is not given: the JS thread of each
 * device between its kernels, V8's garbage collector, the coordinator. 0 below 8 cores (each
 * kernel thread counts there), else one in 8 (2 of 16). Measured on the 16-core host of an
 * H200 machine (charlm-small single, bench/results/cores-16-threads-*.md): 14 kernel threads
 * ran fp32 30,445 and bf16 43,974 tokens/s where 16 ran 21,515 and 34,677 (OpenMP's spinning
 * workers and the JS thread's helpers fighting over the last cores); K=3 pipelines ran faster at
 * 4 threads a device than at 5, K=2 at 4 than at 8 (bench/results/cores.md).
 */
export function hostCores(cores: number): number {
  return cores >= 8 ? Math.ceil(cores / 8) : 0;
}

/**
 * Kernel threads of each of `devices` devices on one machine of `cores` cores (default: the
 * CPUs this process may use, os.availableParallelism): `--threads`, or the cores less
 * {@link hostCores} divided among the devices, at least 1 (so K devices on C cores get about
 * C/K each and do not contend; the native backend's OpenMP team of each device is that size).
 */
export function threadsPerDevice(
  cfg: Pick<TrainConfig, 'threads'>,
  devices: number,
  cores = availableParallelism(),
): number {
  return cfg.threads > 0
    ? cfg.threads
    : Math.max(
        1,
        Math.floor((cores - hostCores(cores)) / Math.max(1, devices)),
      );
}

/**
 * Splits `total` kernel threads among devices in proportion to `loads` (each device's share of
 * a step's work, e.g. its stages' FLOPs), at least one each: each device gets the whole part of
 * its share, and the threads left go to the largest remainders (ties: the lower device). All get
 * one where `total` is below the device count. E.g. 14 threads over a V-shape's K=3 devices of
 * loads [0.1, 2, 2] (the first holds the embedding and the head): [1, 7, 6].
 * @throws LayerwiseError for no loads, or a load that is negative or not finite.
 */
export function splitThreads(
  total: number,
  loads: readonly number[],
): number[] {
  if (loads.length === 0 || loads.some((l) => !(l >= 0 && Number.isFinite(l))))
    throw new LayerwiseError(
      `splitting threads: loads must be finite and non-negative, one per device, got [${loads.join(', ')}]`,
    );
  const n = loads.length;
  if (total <= n) return loads.map(() => 1);
  const sum = loads.reduce((a, b) => a + b, 0);
  const share = loads.map((l) => (sum > 0 ? (total * l) / sum : total / n));
  const out = share.map((x) => Math.max(1, Math.floor(x)));
  let left = total - out.reduce((a, b) => a + b, 0);
  const order = share
    .map((x, i) => ({ i, r: x - Math.floor(x) }))
    .sort((a, b) => b.r - a.r || a.i - b.i);
  for (let k = 0; left > 0; k = (k + 1) % n, left--) out[order[k]!.i]!++;
  // devices raised to 1 can overshoot: take back from the largest
  while (left < 0) {
    const big = out.indexOf(Math.max(...out));
    out[big]!--;
    left++;
  }
  return out;
}

/**
 * The devices a run has (all replicas): `replicas` for a one-device strategy (single), else
 * `--stages` (at least 1) times `replicas`.
 */
export function devicesOfRun(
  cfg: Pick<TrainConfig, 'stages' | 'replicas'>,
  oneDevice: boolean,
): number {
  return (oneDevice ? 1 : Math.max(1, cfg.stages)) * cfg.replicas;
}

/** The `--threads`-related fields of a run {@link deviceThreads} and {@link threadsLine} read. */
type ThreadsConfig = Pick<
  TrainConfig,
  'threads' | 'backend' | 'stages' | 'replicas' | 'devices'
>;

/**
 * Kernel threads of each device of a run, all replicas, before a device's own `threads=`:
 * `--threads`; else, given each device's load within a replica (`loads`: {@link
 * StrategySpec.deviceLoads}) that are not all equal, the cores less {@link hostCores} divided
 * among the replicas and split by load ({@link splitThreads}: a V-shape's first device, holding
 * the embedding and the head, gets few); else {@link threadsPerDevice} over {@link devicesOfRun}.
 */
export function runThreads(
  cfg: Pick<TrainConfig, 'threads' | 'stages' | 'replicas'>,
  oneDevice: boolean,
  loads?: readonly number[],
  cores = availableParallelism(),
): number[] {
  const n = devicesOfRun(cfg, oneDevice);
  const uniform = threadsPerDevice(cfg, n, cores);
  if (
    cfg.threads > 0 ||
    !loads ||
    loads.length * cfg.replicas !== n ||
    loads.every((l) => l === loads[0])
  )
    return Array.from({ length: n }, () => uniform);
  const each = splitThreads(
    Math.max(1, Math.floor((cores - hostCores(cores)) / cfg.replicas)),
    loads,
  );
  return Array.from({ length: n }, (_, i) => each[i % loads.length]!);
}

/**
 * Each device's backend and kernel threads: its own `backend=`/`threads=` in `--devices`, else
 * the run's backend and {@link runThreads}.
 */
function deviceKernels(
  cfg: ThreadsConfig,
  oneDevice: boolean,
  cores: number,
  loads?: readonly number[],
): Array<{ backend: string; threads: number }> {
  const n = devicesOfRun(cfg, oneDevice);
  const run = runThreads(cfg, oneDevice, loads, cores);
  const specs = parseDevices(cfg.devices, n / cfg.replicas, cfg.replicas);
  return specs.map((d, i) => ({
    backend: d.backend ?? cfg.backend,
    threads: d.threads ?? run[i]!,
  }));
}

/**
 * Kernel threads of each device of a run (summary.json `threads_per_device`): a device's own
 * `threads=` in `--devices`, else {@link threadsPerDevice} over {@link devicesOfRun}; 1 for a
 * device whose backend is not native (wasm and cpu run their kernels on one thread). One entry
 * per device, replica after replica.
 * @throws LayerwiseError for a malformed --devices (as parseDevices).
 */
export function deviceThreads(
  cfg: ThreadsConfig,
  oneDevice: boolean,
  cores = availableParallelism(),
  loads?: readonly number[],
): number[] {
  return deviceKernels(cfg, oneDevice, cores, loads).map((d) =>
    d.backend === 'native' ? d.threads : 1,
  );
}

/**
 * The CLI's set-up line on kernel threads, for a run with a native device: e.g. `kernel threads
 * per device: 7 (the 16 cores less 2 for the host's threads divided among 2 devices; --threads sets them)`; undefined without one.
 * @throws LayerwiseError for a malformed --devices (as parseDevices).
 */
export function threadsLine(
  cfg: ThreadsConfig,
  oneDevice: boolean,
  cores = availableParallelism(),
  loads?: readonly number[],
): string | undefined {
  const native = deviceKernels(cfg, oneDevice, cores, loads).filter(
    (d) => d.backend === 'native',
  );
  if (native.length === 0) return undefined;
  const each = native.map((d) => d.threads);
  const n = devicesOfRun(cfg, oneDevice);
  const list = new Set(each).size === 1 ? String(each[0]) : each.join(', ');
  const host = hostCores(cores);
  const ownThreads = cfg.devices?.includes('threads=') ?? false;
  const why =
    cfg.threads > 0
      ? '--threads'
      : `the ${cores} cores${host ? ` less ${host} for the host's threads` : ''} divided among ${n} device${n > 1 ? 's' : ''}${new Set(each).size > 1 && !ownThreads ? " by each device's share of the model's FLOPs" : ''}; --threads sets them`;
  const own = ownThreads ? "a device's threads= in --devices, else " : '';
  return `kernel threads per device: ${list} (${own}${why})`;
}

/**
 * One strategy. Its answers to the configuration's shared checks (the default, --replicas, loss
 * scaling, --overlap, several stages per device) are the {@link StrategyFlags} it extends, which
 * strategies/index.ts registers with config/.
 */
export interface StrategySpec extends StrategyFlags {
  /** One line for help texts: what it does. */
  readonly help: string;
  /** Whether its updates equal single-device backprop's on the same seed and data (false: local parallelism). */
  readonly exact: boolean;
  /** Whether it runs on exactly one device (single); else on `--stages` devices (K >= 2 to plan, unless {@link anyStages}). */
  readonly oneDevice: boolean;
  /** Whether it also runs on one device, `--stages 1` (l2l: the relay alone; K: the pipelined relay). */
  readonly anyStages?: boolean;
  /** Whether every stage has a loss of its own (local parallelism): the metrics record each stage's, and a non-finite one is named by its stage. */
  readonly stageLosses?: boolean;
  /** Whether it skips the blocks --layer-drop draws (its submit honours `dropped`). */
  readonly layerDrop?: boolean;
  /**
   * Checks the resolved configuration's strategy-specific flags before anything is loaded.
   * Throws {@link LayerwiseError} naming the flag and the fix.
   */
  validate?(cfg: TrainConfig): void;
  /**
   * Stages its partition cuts the model into, for a strategy on several devices (default:
   * config's stageCount, the devices times the schedule's stages per device; gpipe: a schedule
   * file's own count). Throws {@link LayerwiseError} for a bad schedule file.
   */
  partitionStages?(cfg: TrainConfig): number;
  /** Starts the strategy on `ranges` (from strategies/index.ts resolveStages) with these initial parameters. */
  create(
    cfg: TrainConfig,
    model: Model,
    params: HostParams,
    ranges: StageRange[],
  ): Promise<Strategy>;
  /**
   * The device-memory prediction of a run: peak bytes per device (stage) for `cfg` on
   * `ranges`, from a profile at {@link microBatch} examples (plan/budget.ts profiles it).
   */
  readonly memory: {
    /** Examples per micro-batch of the run. */
    microBatch(cfg: TrainConfig): number;
    /** Whether the prediction needs `profile.auxHeads` at every stage's end but the last (local parallelism). */
    auxHeads?: boolean;
    predictPeakBytes(
      profile: ModelProfile,
      cfg: TrainConfig,
      ranges: readonly StageRange[],
    ): number[];
  };
  /** `layerwise plan`: the best settings of this strategy for the request (peak, step time, bubble). */
  plan(profile: ModelProfile, req: PlanRequest): StrategyPlan;
  /** The `layerwise train` flags that realise a plan of this strategy, e.g. `--strategy l2l --micro-batches 4 --stash host`. */
  flags(p: StrategyPlan): string;
  /** A note `layerwise plan` prints under its table when this strategy was planned (how to read its row). */
  readonly planNote?: string;
  /** What to try when a run of it does not fit its device-memory budget. */
  outOfMemoryAdvice(cfg: Pick<TrainConfig, 'stash'>): string;
  /** The CLI's line describing the run's set-up after the stage list, if any (`bytes`: the model's fp32 parameter bytes). */
  describeRun?(cfg: TrainConfig, bytes: number): string;
  /**
   * Each device's share of a step's work within one replica (its stages' FLOPs, partition/stages.ts
   * blockFlops), where the devices' loads differ by design (a V-shape's first device holds the
   * embedding and the head): {@link runThreads} splits the kernel threads by it. Absent: an
   * equal split.
   */
  deviceLoads?(cfg: TrainConfig, model: Model, ranges: StageRange[]): number[];
}
