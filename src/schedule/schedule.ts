/**
 * Pipeline schedules as plain data, in the spirit of PyTorch pipelining
 * (torch/distributed/pipelining/schedules.py): a schedule is, for each stage, the ordered list
 * of actions it performs in one training step. One executor ({@link ../pipeline/executor.ts})
 * interprets any schedule; a new schedule is only a new list.
 *
 * Actions print compactly as `<stage><kind><micro-batch>` (e.g. `1F3` = stage 1, forward of
 * micro-batch 3), which makes schedules easy to test, to compare and to show in a trace.
 */
import { LayerwiseError } from '../util/errors.js';
import { type CoreOp, declarationOf, OPS, type OpSpec } from './ops.js';

/** Re-materialization (activation checkpointing) modes, as in torchgpipe. */
export type RematMode = 'always' | 'except_last' | 'never';
export const REMAT_MODES: readonly RematMode[] = [
  'always',
  'except_last',
  'never',
];

/** Schedules this executor understands. */
export type ScheduleKind =
  | 'gpipe'
  | '1f1b'
  | 'zb-h1'
  | 'interleaved-1f1b'
  | 'zbv'
  | 'dualpipev';
export const SCHEDULE_KINDS: readonly ScheduleKind[] = [
  'gpipe',
  '1f1b',
  'zb-h1',
  'interleaved-1f1b',
  'zbv',
  'dualpipev',
];

/** The `--schedule` a run gets when it names none: GPipe's fill-drain (Huang et al., 2019). */
export const DEFAULT_SCHEDULE: ScheduleKind = 'gpipe';

/**
 * What a schedule kind declares, once, for everything that asks about it (the executor's
 * placement, the config's checks, the cost model): a new schedule is one generator and one
 * entry of {@link SCHEDULES}.
 */
export interface ScheduleSpec {
  /** Stages per device (`v`: --virtual-stages, for the kinds that take it). */
  stagesPerDevice(v: number): number;
  /** Whether it takes `--virtual-stages` v (at least 2) as its stages per device (interleaved 1F1B). */
  takesVirtualStages?: boolean;
  /** The device of each of the k * stagesPerDevice(v) stages on k devices. */
  placement(k: number, v: number): number[];
  /** The compute-only training schedule of m micro-batches on k devices. */
  compute(m: number, k: number, mode: RematMode, v: number): ComputeSchedule;
  /**
   * Micro-batches whose stage input a stage holds at once at most, of m, on a pipeline of
   * `stages` stages (the cost model's activation count).
   */
  inFlight(stages: number, m: number): number;
  /** The paper or code it follows. */
  source: string;
}

/** 1F1B's bound: a stage holds at most K micro-batches (PipeDream-Flush). */
const boundedByStages = (stages: number, m: number) => Math.min(stages, m);

/** The V-shape's placement: stages s and 2k - 1 - s on device s (Qi et al., 2024). */
const vShape = (k: number) =>
  Array.from({ length: 2 * k }, (_, s) => (s < k ? s : 2 * k - 1 - s));

/** Every schedule kind this executor runs, by its --schedule name. */
export const SCHEDULES: Readonly<Record<ScheduleKind, ScheduleSpec>> = {
  gpipe: {
    stagesPerDevice: () => 1,
    placement: (k) => chainPlacement(k),
    compute: (m, k, mode) => gpipeCompute(m, k, mode),
    inFlight: (_stages, m) => m, // all forwards before any backward
    source: 'Huang et al. 2019 (GPipe); torchgpipe',
  },
  '1f1b': {
    stagesPerDevice: () => 1,
    placement: (k) => chainPlacement(k),
    compute: (m, k, mode) => oneFOneBCompute(m, k, mode),
    inFlight: boundedByStages,
    source: 'PipeDream-Flush, Narayanan et al. 2021',
  },
  'zb-h1': {
    stagesPerDevice: () => 1,
    placement: (k) => chainPlacement(k),
    compute: (m, k, mode) => zbH1Compute(m, k, mode),
    inFlight: boundedByStages,
    source: 'Qi et al., "Zero Bubble Pipeline Parallelism", ICLR 2024',
  },
  'interleaved-1f1b': {
    stagesPerDevice: (v) => v,
    takesVirtualStages: true,
    placement: (k, v) => Array.from({ length: k * v }, (_, s) => s % k),
    compute: (m, k, mode, v) => interleaved1F1BCompute(m, k, v, mode),
    inFlight: boundedByStages,
    source: "Narayanan et al. SC'21; PyTorch's ScheduleInterleaved1F1B",
  },
  zbv: {
    stagesPerDevice: () => 2,
    placement: vShape,
    compute: (m, k, mode) => zbvCompute(m, k, mode),
    inFlight: boundedByStages,
    source: "Qi et al. 2024 section 6; PyTorch's ScheduleZBVZeroBubble",
  },
  dualpipev: {
    stagesPerDevice: () => 2,
    placement: vShape,
    compute: (m, k, mode) => dualpipevCompute(m, k, mode),
    inFlight: boundedByStages,
    source: "DeepSeek-V3's DualPipe cut in half; PyTorch's ScheduleDualPipeV",
  },
};

/** The spec of a schedule kind. @throws LayerwiseError for an unknown kind, naming the valid ones. */
export function scheduleSpec(kind: ScheduleKind): ScheduleSpec {
  const spec = (SCHEDULES as Record<string, ScheduleSpec | undefined>)[kind];
  if (!spec)
    throw new LayerwiseError(
      `unknown schedule '${kind as string}'; valid: ${SCHEDULE_KINDS.join(', ')}`,
    );
  return spec;
}

/**
 * Stages per device of a schedule kind: `v` (--virtual-stages, at least 2) for interleaved
 * 1F1B, 2 for the V-shape (zbv, dualpipev), 1 for the others. A run of k devices has k times
 * that many (virtual) stages.
 */
export function stagesPerDevice(kind: ScheduleKind, v = 2): number {
  return scheduleSpec(kind).stagesPerDevice(v);
}

/**
 * The device of each (virtual) stage of a kind on k devices: stage s on device s (one stage
 * per device); interleaved, s mod k (Narayanan et al., 2021: device d runs stages d, d + k,
 * d + 2k...); the V-shape, stages s and 2k - 1 - s on device s (Qi et al., 2024: device 0 runs
 * the first and the last stage).
 */
export function placementOf(kind: ScheduleKind, k: number, v = 2): number[] {
  return scheduleSpec(kind).placement(k, v);
}

/** What one action does; {@link Action} adds the stage it belongs to. `mb` is the micro-batch index in [0, M). */
export type ActionBody =
  /** Wait for micro-batch mb's activation from the previous stage. */
  | { op: 'recv_act'; mb: number }
  /**
   * Forward pass of micro-batch mb. `keep`: keep the forward activations for backward
   * (no re-materialization); otherwise only the input is kept and backward recomputes.
   * `grad: false` (evaluation) keeps nothing.
   */
  | { op: 'forward'; mb: number; keep: boolean; grad: boolean }
  /** Send micro-batch mb's output activation to the next stage. */
  | { op: 'send_act'; mb: number }
  /** Wait for the gradient of micro-batch mb's output from the next stage. */
  | { op: 'recv_grad'; mb: number }
  /** Backward pass of micro-batch mb, accumulating parameter gradients. */
  | { op: 'backward'; mb: number }
  /**
   * Zero-bubble split backward, first part (I): the gradient of micro-batch mb's stage input
   * (what the previous stage waits for); the weight-gradient work is kept for its W.
   */
  | { op: 'backward_input'; mb: number }
  /** Zero-bubble split backward, second part (W): micro-batch mb's parameter gradients from what its I kept, accumulated. */
  | { op: 'backward_weight'; mb: number }
  /** Send the gradient of micro-batch mb's input to the previous stage. */
  | { op: 'send_grad'; mb: number }
  /** Contribute this stage's squared gradient norm and receive the global clipping scale. */
  | { op: 'reduce_grad_norm' }
  /**
   * Data parallelism: sum the accumulated gradients of the device's stages across the
   * replicas (a ring all-reduce), so every replica steps on the whole mini-batch's gradient.
   */
  | { op: 'all_reduce_grads' }
  /** One optimizer step on the accumulated gradients; gradients are reset. */
  | { op: 'optimizer_step' }
  /** Local parallelism: forward, local loss and backward of micro-batch mb within this stage. */
  | { op: 'local_update'; mb: number }
  /** Local parallelism, overlap: backprop the next stage's input gradient of mb through this stage's tail. */
  | { op: 'overlap_backward'; mb: number }
  /** Local parallelism, free-running overlap: apply every overlap gradient that has arrived, without waiting. */
  | { op: 'poll_grads' }
  /** Local parallelism, overlap: wait for every overlap gradient still outstanding and apply it (a flush). */
  | { op: 'drain_grads' }
  /** Local parallelism: optimizer step clipped by this stage's own gradient norm. */
  | { op: 'local_step' }
  /**
   * L2L: wait until the parameter server has applied every earlier update of `layer`, then
   * upload the layer's parameters to the device (nothing to do if a prefetch already did).
   */
  | { op: 'load_layer'; layer: number }
  /**
   * L2L: upload `layer`'s parameters now if the parameter server has them ready, without
   * waiting, so the transfer overlaps the current layer's compute on asynchronous backends.
   */
  | { op: 'prefetch_layer'; layer: number }
  /**
   * L2L: forward of micro-batch mb through `layer` alone. Its output is stashed as the next
   * layer's input; on the last layer (evaluation only) the micro-batch loss is recorded. A
   * layer the step drops (a pipelined relay's stage with no layer left) passes its input on.
   */
  | { op: 'layer_forward'; layer: number; mb: number; grad: boolean }
  /**
   * L2L: re-computation of `layer` for micro-batch mb from its stashed input, then backward
   * from the incoming gradient; accumulates the layer's gradient and keeps the input gradient
   * for the layer below. On the last layer the loss is computed here (seeded with 1/M). A
   * layer the step drops passes the gradient on.
   */
  | { op: 'layer_backward'; layer: number; mb: number }
  /** L2L: download the layer's accumulated gradient and hand it to the parameter server. */
  | { op: 'push_grads'; layer: number }
  /** L2L: free the layer's parameters on the device. */
  | { op: 'release_layer'; layer: number };

/**
 * One action of a schedule: what it does and the (virtual) stage it belongs to, as PyTorch
 * pipelining's `_Action(stage_index, computation_type, microbatch_index)`. A device may run
 * several stages; a stage runs on one device.
 */
export type Action = ActionBody & {
  /** The (virtual) stage in [0, S): the model's stage of blocks the action works on. */
  stage: number;
};

/**
 * A lowered schedule: per device, the ordered list of its actions for one mini-batch, with
 * communication (receives, sends, the gradient-norm all-reduce) in place. What the executor
 * runs. Made from a {@link ComputeSchedule} by {@link lower}.
 */
export type Schedule = Action[][];

/** An action of compute: run by a stage kind's handler, not by the executor's core. */
export type ComputeAction = Exclude<Action, { op: CoreOp }>;
/** The ops of compute. */
export type ComputeOp = ComputeAction['op'];

/**
 * A compute-only schedule (the first level): per device, the order of its compute actions
 * (forward, backward, local updates, relay layers...), each naming its stage, and no
 * communication. A schedule generator returns one; {@link lower} adds the communication.
 */
export type ComputeSchedule = ComputeAction[][];

/**
 * Compact text form of an action: `1F3` (stage 1, forward of micro-batch 3), `0B0`, `2STEP`.
 * Forwards that recompute nothing print `F`, kept ones `Fk`; relay actions name their layer
 * (`0L3F1`).
 */
export function formatAction(a: Action): string {
  // an undeclared op prints as itself, so an error about it can show the schedule
  const short = Object.hasOwn(OPS, a.op) ? OPS[a.op].short : String(a.op);
  if ('layer' in a)
    return `${a.stage}L${a.layer}${short}${'mb' in a ? a.mb : ''}`;
  const kind = a.op === 'forward' && a.keep && a.grad ? 'Fk' : short;
  return 'mb' in a ? `${a.stage}${kind}${a.mb}` : `${a.stage}${kind}`;
}

/** One line per device, actions separated by spaces. */
export function formatSchedule(s: readonly (readonly Action[])[]): string {
  return s.map((acts) => acts.map(formatAction).join(' ')).join('\n');
}

/**
 * A device's actions, one per line, with the action at `index` marked `<-- ERROR HERE` (as PyTorch
 * pipelining shows a failing schedule); at most `context` actions on each side, the rest counted.
 */
export function formatScheduleError(
  device: number,
  actions: readonly Action[],
  index: number,
  context = 6,
): string {
  const from = Math.max(0, index - context);
  const to = Math.min(actions.length, index + context + 1);
  const lines = [
    `schedule of device ${device}, action ${index + 1} of ${actions.length}:`,
  ];
  if (from > 0) lines.push(`  ... ${from} earlier`);
  for (let i = from; i < to; i++)
    lines.push(
      `  ${formatAction(actions[i])}${i === index ? '  <-- ERROR HERE' : ''}`,
    );
  if (to < actions.length) lines.push(`  ... ${actions.length - to} later`);
  return lines.join('\n');
}

function checkArgs(m: number, k: number): void {
  if (!Number.isInteger(m) || m < 1)
    throw new LayerwiseError(
      `micro-batches must be a positive integer, got ${m}`,
    );
  if (!Number.isInteger(k) || k < 1)
    throw new LayerwiseError(`stages must be a positive integer, got ${k}`);
}

/** Whether micro-batch mb keeps its forward activations under a re-materialization mode. */
export function keepsActivations(
  mode: RematMode,
  mb: number,
  m: number,
): boolean {
  return mode === 'never' || (mode === 'except_last' && mb === m - 1);
}

/**
 * GPipe's clock cycles (Huang et al., 2019; torchgpipe's `clock_cycles`): at tick t, every
 * (micro-batch i, stage j) with i + j = t runs. For m = 4 micro-batches and n = 3 stages:
 *
 *     tick  stage0  stage1  stage2
 *      0     F0
 *      1     F1      F0
 *      2     F2      F1      F0
 *      3     F3      F2      F1
 *      4             F3      F2
 *      5                     F3
 *
 * Backward runs the same table mirrored (last micro-batch first, from the last stage).
 * Yields, per tick, the list of [micro-batch, stage] pairs.
 */
export function* clockCycles(
  m: number,
  n: number,
): Generator<Array<[number, number]>> {
  for (let t = 0; t < m + n - 1; t++) {
    const pairs: Array<[number, number]> = [];
    for (let j = Math.max(0, t - m + 1); j < Math.min(n, t + 1); j++)
      pairs.push([t - j, j]);
    yield pairs;
  }
}

/** Stage s of k on device s: the placement of every schedule with one stage per device. */
export function chainPlacement(k: number): number[] {
  return Array.from({ length: k }, (_, s) => s);
}

/**
 * Which of device `from`'s links (of `devices` in a row) reaches device `to`: 'next' for
 * from + 1, 'prev' for from - 1, and the ring's wrap link between the last device and the first
 * (interleaved schedules on more than 2 devices: 'next' from the last, 'prev' from the first).
 * Devices are linked to their neighbours only (runtime/links.ts), so any other pair throws
 * {@link LayerwiseError} naming `what`.
 */
export function linkSide(
  from: number,
  to: number,
  devices: number,
  what = `device ${from} and device ${to}`,
): 'next' | 'prev' {
  if (to === from + 1) return 'next';
  if (to === from - 1) return 'prev';
  if (devices > 2 && from === devices - 1 && to === 0) return 'next';
  if (devices > 2 && from === 0 && to === devices - 1) return 'prev';
  throw new LayerwiseError(
    `${what}: devices are linked to their neighbours (and the last to the first) only, so neighbouring stages must be on the same device or on neighbouring ones`,
  );
}

/** Whether a placement needs the ring's wrap link between the last device and the first (see {@link linkSide}). */
export function needsWrapLink(placement: readonly number[]): boolean {
  const devices = Math.max(0, ...placement) + 1;
  if (devices <= 2) return false;
  return placement.some((d, s) => {
    const e = placement[s + 1];
    return (
      e !== undefined &&
      ((d === devices - 1 && e === 0) || (d === 0 && e === devices - 1))
    );
  });
}

/** What {@link lower} adds besides sends and receives. */
export interface LowerOptions {
  /**
   * 'all-reduce': each device ends with the gradient-norm all-reduce (one `reduce_grad_norm`,
   * named by the device's first stage) and one `optimizer_step` per stage it runs, in stage
   * order (synchronous pipelines). 'none' (default): the compute list has its own steps, or
   * none (evaluation, local parallelism, the relay).
   */
  step?: 'all-reduce' | 'none';
  /** Local parallelism's overlap: input gradients go back, applied at fixed points or polled. */
  overlap?: { deterministic: boolean };
}

/**
 * Lowers a compute-only schedule to the schedule the executor runs (the second level), as
 * PyTorch pipelining's `_add_send_recv`: around each compute action, the receives and sends its
 * op declares (schedule/ops.ts `lower`) where the neighbouring stage runs on another device
 * (stages on the same device hand tensors over directly); then the step (see
 * {@link LowerOptions}). A receive comes right before the compute that needs it and a send right
 * after the compute that produced it, so the lowered order is the compute order. `placement[s]`
 * is the device of stage s.
 *
 * Throws {@link LayerwiseError} when an action's stage is not placed on the device whose list it
 * is in, when a stage is out of range, or when neighbouring stages are on devices with no link
 * between them ({@link linkSide}).
 */
export function lower(
  compute: ComputeSchedule,
  placement: readonly number[],
  opts: LowerOptions = {},
): Schedule {
  const stages = placement.length;
  const devices = Math.max(0, ...placement) + 1;
  for (let s = 0; s + 1 < stages; s++) {
    const a = placement[s]!;
    const b = placement[s + 1]!;
    if (a !== b)
      linkSide(
        a,
        b,
        devices,
        `stage ${s} on device ${a} and stage ${s + 1} on device ${b}`,
      );
  }
  return compute.map((acts, device) => {
    const out: Action[] = [];
    for (const a of acts) {
      if (!Number.isInteger(a.stage) || a.stage < 0 || a.stage >= stages)
        throw new LayerwiseError(
          `action ${formatAction(a)} on device ${device}: stage ${a.stage} is not one of the ${stages} stages`,
        );
      if (placement[a.stage] !== device)
        throw new LayerwiseError(
          `action ${formatAction(a)} in device ${device}'s list, but stage ${a.stage} is placed on device ${placement[a.stage]}`,
        );
      const spec = declarationOf(a.op) as OpSpec<typeof a.op>;
      if (spec.core)
        throw new LayerwiseError(
          `action ${formatAction(a)}: a compute-only schedule has no communication (lowering adds it)`,
        );
      const around = spec.lower?.(a, {
        remotePrev: a.stage > 0 && placement[a.stage - 1] !== device,
        remoteNext: a.stage < stages - 1 && placement[a.stage + 1] !== device,
        overlap: opts.overlap,
      });
      out.push(...(around?.before ?? []), a, ...(around?.after ?? []));
    }
    if (opts.step === 'all-reduce') {
      const own = placement
        .map((d, s) => (d === device ? s : -1))
        .filter((s) => s >= 0);
      if (own.length > 0) {
        out.push({ op: 'reduce_grad_norm', stage: own[0] });
        for (const s of own) out.push({ op: 'optimizer_step', stage: s });
      }
    }
    return out;
  });
}

/**
 * GPipe fill-drain, compute only: every stage runs all forwards in order, then all backwards
 * in reverse order (see {@link clockCycles}); stage s on device s. Forwards keep their
 * activations by `mode` ({@link keepsActivations}). Throws {@link LayerwiseError} for m < 1 or
 * k < 1.
 */
export function gpipeCompute(
  m: number,
  k: number,
  mode: RematMode,
): ComputeSchedule {
  checkArgs(m, k);
  return Array.from({ length: k }, (_, s) => {
    const acts: ComputeAction[] = [];
    for (let i = 0; i < m; i++) acts.push(forward(s, i, mode, m));
    for (let i = m - 1; i >= 0; i--)
      acts.push({ op: 'backward', stage: s, mb: i });
    return acts;
  });
}

function forward(
  stage: number,
  mb: number,
  mode: RematMode,
  m: number,
): ComputeAction {
  return {
    op: 'forward',
    stage,
    mb,
    keep: keepsActivations(mode, mb, m),
    grad: true,
  };
}

/**
 * 1F1B (PipeDream-Flush, Narayanan et al., 2021), compute only: stage s runs
 * min(k - s - 1, m) warm-up forwards, then alternates one forward and one backward, then
 * drains the remaining backwards. Same bubble as GPipe, but at most k - s micro-batches are in
 * flight on stage s. For m = 4, k = 2 (`1F0` = stage 1, forward of micro-batch 0):
 *
 *     device 0:  0F0 0F1 0B0 0F2 0B1 0F3 0B2 0B3
 *     device 1:  1F0 1B0 1F1 1B1 1F2 1B2 1F3 1B3
 */
export function oneFOneBCompute(
  m: number,
  k: number,
  mode: RematMode,
): ComputeSchedule {
  checkArgs(m, k);
  return Array.from({ length: k }, (_, s) => {
    const acts: ComputeAction[] = [];
    const warm = Math.min(k - s - 1, m);
    let f = 0;
    for (; f < warm; f++) acts.push(forward(s, f, mode, m));
    for (let b = 0; b < m; b++) {
      if (f < m) acts.push(forward(s, f++, mode, m));
      acts.push({ op: 'backward', stage: s, mb: b });
    }
    return acts;
  });
}

/**
 * ZB-H1 (Qi et al., "Zero Bubble Pipeline Parallelism", ICLR 2024, section 3.1; the
 * handcrafted schedule of their Megatron-DeepSpeed `ZeroBubbleH1Pipeline`), compute only: 1F1B
 * with each backward split into its input part I (what the previous stage waits for) and its
 * weight part W. Stage s runs 1F1B's min(k - s - 1, m) warm-up forwards, then for each
 * micro-batch j a forward (while any is left) and I(j), followed by W(j - s) once j >= s: the
 * last s weight parts are deferred to the end, where they fill the drain's bubble. In-flight
 * micro-batches stay 1F1B's (at most k - s), so the peak activation memory is 1F1B's, and with
 * F = I = W the bubble is about a third of 1F1B's: (k - 1) / (3m + k - 1) of the step against
 * (k - 1) / (m + k - 1). Stage 0 runs full backwards (B): nothing waits for its input
 * gradient, so splitting it gains nothing. For m = 4, k = 2:
 *
 *     device 0:  0F0 0F1 0B0 0F2 0B1 0F3 0B2 0B3
 *     device 1:  1F0 1I0 1F1 1I1 1W0 1F2 1I2 1W1 1F3 1I3 1W2 1W3
 *
 * Throws {@link LayerwiseError} for m < 1 or k < 1.
 */
export function zbH1Compute(
  m: number,
  k: number,
  mode: RematMode,
): ComputeSchedule {
  // 1F1B's lists, each backward of a stage s > 0 split in place: I(j), then W(j - s)
  return oneFOneBCompute(m, k, mode).map((acts, s) => {
    if (s === 0) return acts;
    const out: ComputeAction[] = [];
    for (const a of acts) {
      if (a.op !== 'backward') {
        out.push(a);
        continue;
      }
      out.push({ op: 'backward_input', stage: s, mb: a.mb });
      if (a.mb >= s)
        out.push({ op: 'backward_weight', stage: s, mb: a.mb - s });
    }
    for (let w = Math.max(0, m - s); w < m; w++)
      out.push({ op: 'backward_weight', stage: s, mb: w });
    return out;
  });
}

/** Per-key micro-batch counters (a stage's next forward, backward...): take(key) gives 0, 1, 2... */
function microBatchCounters(): (key: string) => number {
  const next = new Map<string, number>();
  return (key) => {
    const mb = next.get(key) ?? 0;
    next.set(key, mb + 1);
    return mb;
  };
}

/**
 * Interleaved 1F1B (Narayanan et al., "Efficient Large-Scale Language Model Training on GPU
 * Clusters Using Megatron-LM", SC'21; PyTorch pipelining's `ScheduleInterleaved1F1B`), compute
 * only: v stages per device, stage s on device s mod k ({@link placementOf}). Micro-batches go in
 * rounds of r = m / max(1, floor(m / k)); device d runs min((v - 1) r + 2 (k - 1 - d), v m)
 * warm-up forwards, then one forward and one backward at a time, then the remaining backwards.
 * Its j-th forward works on its local stage floor(j / r) mod v (depth first: a round goes
 * through every local stage before the next round starts), its j-th backward (counted from the
 * end of the warm-up) on local stage v - 1 - floor(j / r) mod v. The bubble is (k - 1) / (v m)
 * of the ideal step instead of 1F1B's (k - 1) / m; in flight: up to v times 1F1B's micro-batches
 * per device, each of a stage v times smaller. Throws {@link LayerwiseError} for m < 1, k < 1,
 * v < 2, or m not a multiple of its number of rounds.
 */
export function interleaved1F1BCompute(
  m: number,
  k: number,
  v: number,
  mode: RematMode,
): ComputeSchedule {
  checkArgs(m, k);
  if (!Number.isInteger(v) || v < 2)
    throw new LayerwiseError(
      `interleaved-1f1b needs --virtual-stages of at least 2 (stages per device), got ${v}`,
    );
  const rounds = Math.max(1, Math.floor(m / k));
  if (m % rounds !== 0)
    throw new LayerwiseError(
      `interleaved-1f1b runs micro-batches in ${rounds} rounds of equal size: --micro-batches ${m} is not a multiple of ${rounds}; use ${rounds * Math.ceil(m / rounds)}`,
    );
  const r = m / rounds;
  return Array.from({ length: k }, (_, d) => {
    const warm = Math.min((v - 1) * r + 2 * (k - 1 - d), v * m);
    const stageOf = (local: number) => local * k + d;
    const fwdStage = (j: number) => stageOf(Math.floor(j / r) % v);
    const bwdStage = (j: number) =>
      stageOf(v - 1 - (Math.floor((j - warm) / r) % v));
    const take = microBatchCounters();
    const acts: ComputeAction[] = [];
    const f = (j: number) => {
      const stage = fwdStage(j);
      acts.push(forward(stage, take(`F${stage}`), mode, m));
    };
    const b = (j: number) => {
      const stage = bwdStage(j);
      acts.push({ op: 'backward', stage, mb: take(`B${stage}`) });
    };
    const total = v * m;
    for (let j = 0; j < warm; j++) f(j);
    for (let j = warm; j < total; j++) {
      f(j);
      b(j);
    }
    for (let j = total; j < total + warm; j++) b(j);
    return acts;
  });
}

/**
 * ZBV, the V-shape zero-bubble schedule (Qi et al., "Zero Bubble Pipeline Parallelism", ICLR
 * 2024, section 6; PyTorch pipelining's `ScheduleZBVZeroBubble`), compute only: two stages per
 * device, stages d and 2k - 1 - d on device d ({@link placementOf}), so the micro-batch goes down
 * the devices and back up, and device 0 computes the loss. With c0 = d and c1 = 2k - 1 - d,
 * device d runs 2 (k - d) - 1 forwards of c0; d pairs (c1 forward, c0 forward); k - d triples
 * (c1 forward, I, W); then, while forwards remain, (c0 forward, c0 I, c0 W, c1 forward, c1 I,
 * c1 W); then d pairs (c0 I, c1 I), k - d pairs (c0 I, c0 W), and the weight parts left, c1's
 * first. With F = I = W the bubble is near zero at 1F1B's peak activation memory. Micro-batch
 * indices past m - 1 are dropped (the generator runs at least 2k - 1). Throws
 * {@link LayerwiseError} for m < 1 or k < 1.
 */
export function zbvCompute(
  m: number,
  k: number,
  mode: RematMode,
): ComputeSchedule {
  checkArgs(m, k);
  const n = Math.max(2 * k - 1, m);
  return Array.from({ length: k }, (_, d) => {
    const c0 = d;
    const c1 = 2 * k - 1 - d;
    const acts: ComputeAction[] = [];
    let f0 = 0;
    let f1 = 0;
    let b0 = 0;
    let b1 = 0;
    const push = (a: ComputeAction) => {
      if ((a as { mb: number }).mb < m) acts.push(a);
    };
    const F = (stage: number, mb: number) => push(forward(stage, mb, mode, m));
    const I = (stage: number, mb: number) =>
      push({ op: 'backward_input', stage, mb });
    const W = (stage: number, mb: number) =>
      push({ op: 'backward_weight', stage, mb });
    for (let i = 0; i < 2 * (k - d) - 1; i++) F(c0, f0++);
    for (let i = 0; i < d; i++) {
      F(c1, f1++);
      F(c0, f0++);
    }
    for (let i = 0; i < k - d; i++) {
      F(c1, f1++);
      I(c1, b1);
      W(c1, b1++);
    }
    while (f1 < f0 || f0 < n) {
      if (f0 < n) F(c0, f0++);
      I(c0, b0);
      W(c0, b0++);
      F(c1, f1++);
      I(c1, b1);
      W(c1, b1++);
    }
    let w0 = b0;
    let w1 = b1;
    for (let i = 0; i < d; i++) {
      I(c0, b0++);
      I(c1, b1++);
    }
    for (let i = 0; i < k - d; i++) {
      I(c0, b0++);
      W(c0, w0++);
    }
    while (w1 < b1) W(c1, w1++);
    while (w0 < b0) W(c0, w0++);
    return acts;
  });
}

/**
 * DualPipeV (DeepSeek-V3's DualPipe, Liu et al. 2024, cut in half; PyTorch pipelining's
 * `ScheduleDualPipeV`, after deepseek-ai/DualPipe), compute only: the V-shape placement of zbv
 * (stages d and 2k - 1 - d on device d). Device d runs 2 (k - d - 1) forwards of its first
 * stage c0; d + 1 pairs (c0 forward, c1 forward); k - d - 1 triples (c1 I, a pending W, c1
 * forward); then m - 2k + d + 1 rounds of the main step, a c0 forward with a c1 full backward
 * and a c1 forward with a c0 full backward (DualPipe overlaps each pair's communication with
 * the other's compute; here the pair runs one after the other); k - d - 1 rounds of (c1
 * backward, c1 forward, c0 backward); d + 1 pairs (c1, c0) of backwards, the second half split
 * into I with its W deferred; k - d - 1 rounds of (a pending W, c0 backward); and the W left. A
 * split backward's W runs in the order its I ran. Needs m >= 2k. Throws
 * {@link LayerwiseError} for m < 2k or k < 1.
 */
export function dualpipevCompute(
  m: number,
  k: number,
  mode: RematMode,
): ComputeSchedule {
  checkArgs(m, k);
  if (m < 2 * k)
    throw new LayerwiseError(
      `dualpipev needs at least as many micro-batches as stages (2 per device: ${2 * k}), got --micro-batches ${m}`,
    );
  return Array.from({ length: k }, (_, d) => {
    const c0 = d;
    const c1 = 2 * k - 1 - d;
    const acts: ComputeAction[] = [];
    const take = microBatchCounters();
    const weights: Array<{ stage: number; mb: number }> = [];
    const F = (stage: number) =>
      acts.push(forward(stage, take(`F${stage}`), mode, m));
    // a full backward takes the next input-gradient index (PyTorch counts B and I together)
    const B = (stage: number) =>
      acts.push({ op: 'backward', stage, mb: take(`I${stage}`) });
    const I = (stage: number) => {
      const mb = take(`I${stage}`);
      acts.push({ op: 'backward_input', stage, mb });
      weights.push({ stage, mb });
    };
    const W = () => {
      const w = weights.shift();
      if (w) acts.push({ op: 'backward_weight', stage: w.stage, mb: w.mb });
    };
    for (let i = 0; i < 2 * (k - d - 1); i++) F(c0);
    for (let i = 0; i < d + 1; i++) {
      F(c0);
      F(c1);
    }
    for (let i = 0; i < k - d - 1; i++) {
      I(c1);
      W();
      F(c1);
    }
    for (let i = 0; i < m - 2 * k + d + 1; i++) {
      F(c0);
      B(c1);
      F(c1);
      B(c0);
    }
    for (let i = 0; i < k - d - 1; i++) {
      B(c1);
      F(c1);
      B(c0);
    }
    let split = false;
    const half = Math.floor((d + 1) / 2);
    for (let i = 0; i < d + 1; i++) {
      if (i === half && d % 2 === 1) split = true;
      (split ? I : B)(c1);
      if (i === half && d % 2 === 0) split = true;
      (split ? I : B)(c0);
    }
    for (let i = 0; i < k - d - 1; i++) {
      W();
      (split ? I : B)(c0);
    }
    for (let i = 0; i < d + 1; i++) W();
    while (weights.length > 0) W();
    return acts;
  });
}

/** GPipe fill-drain, lowered onto k devices with the synchronous step ({@link gpipeCompute}). */
export function gpipeSchedule(m: number, k: number, mode: RematMode): Schedule {
  return lower(gpipeCompute(m, k, mode), chainPlacement(k), {
    step: 'all-reduce',
  });
}

/** 1F1B, lowered onto k devices with the synchronous step ({@link oneFOneBCompute}). */
export function oneFOneBSchedule(
  m: number,
  k: number,
  mode: RematMode,
): Schedule {
  return lower(oneFOneBCompute(m, k, mode), chainPlacement(k), {
    step: 'all-reduce',
  });
}

/** Forward-only schedule for evaluation: nothing is kept for backward, no step. */
export function evalSchedule(
  m: number,
  k: number,
  placement: readonly number[] = chainPlacement(k),
): Schedule {
  checkArgs(m, k);
  const compute: ComputeSchedule = Array.from({ length: k }, () => []);
  // a device runs its stages one after the other, every micro-batch through each
  placement.forEach((d, s) => {
    for (let i = 0; i < m; i++)
      compute[d]!.push({
        op: 'forward',
        stage: s,
        mb: i,
        keep: false,
        grad: false,
      });
  });
  return lower(compute, placement);
}

/**
 * The compute-only training schedule of a kind on k devices (`v`: stages per device of
 * interleaved 1F1B; see {@link placementOf} for where each stage runs).
 */
export function computeSchedule(
  kind: ScheduleKind,
  m: number,
  k: number,
  mode: RematMode,
  v = 2,
): ComputeSchedule {
  return scheduleSpec(kind).compute(m, k, mode, v);
}

/** The training schedule of a kind, lowered onto k devices (its {@link placementOf}) with the synchronous step. */
export function makeSchedule(
  kind: ScheduleKind,
  m: number,
  k: number,
  mode: RematMode,
  v = 2,
): Schedule {
  return lower(computeSchedule(kind, m, k, mode, v), placementOf(kind, k, v), {
    step: 'all-reduce',
  });
}

/**
 * Local parallelism (Laskin et al., 2020), compute only: every stage makes one local update
 * per micro-batch (`local_update`, then `local_step`); stage s works on micro-batch i while
 * stage s+1 works on micro-batch i-1. With `overlap` > 0 and `deterministic`, stage s (but the
 * last) applies the overlap gradient of micro-batch i-1 (`overlap_backward`) before its step
 * for micro-batch i, and that of micro-batch M-1 at the end (applied at the next mini-batch's
 * first step). The sends, the input gradients sent back and free-running overlap's polls are
 * the lowering's (see {@link localSchedule}).
 */
export function localCompute(
  m: number,
  k: number,
  overlap: number,
  deterministic: boolean,
): ComputeSchedule {
  checkArgs(m, k);
  return Array.from({ length: k }, (_, s) => {
    const fixed = overlap > 0 && deterministic && s < k - 1;
    const acts: ComputeAction[] = [];
    for (let i = 0; i < m; i++) {
      acts.push({ op: 'local_update', stage: s, mb: i });
      if (fixed && i > 0)
        acts.push({ op: 'overlap_backward', stage: s, mb: i - 1 });
      acts.push({ op: 'local_step', stage: s });
    }
    if (fixed) acts.push({ op: 'overlap_backward', stage: s, mb: m - 1 });
    return acts;
  });
}

/**
 * Local parallelism's schedule, lowered: {@link localCompute} with the activation sent on after
 * each update, and with `overlap` > 0 each stage but the first sending its input gradient back
 * (the previous stage backpropagates it through its last `overlap` blocks). With
 * `deterministic`, the previous stage receives it at the fixed point of {@link localCompute};
 * otherwise it applies whatever has arrived before each step (`poll_grads`), from this
 * mini-batch or an earlier one, and never waits (a {@link flushSchedule} collects what is
 * outstanding).
 */
export function localSchedule(
  m: number,
  k: number,
  overlap: number,
  deterministic: boolean,
): Schedule {
  return lower(
    localCompute(m, k, overlap, deterministic),
    chainPlacement(k),
    overlap > 0 ? { overlap: { deterministic } } : {},
  );
}

/** Local parallelism: every stage but the last waits for its outstanding overlap gradients (already lowered: one core op). */
export function flushSchedule(k: number): Schedule {
  return Array.from({ length: k }, (_, s) =>
    s < k - 1 ? [{ op: 'drain_grads', stage: s } as Action] : [],
  );
}

/**
 * L2L relay schedule (Pudipeddi et al., 2020, arXiv 2002.05645) for `layers` layers (blocks)
 * and m micro-batches on one device, stage 0; compute only (the relay talks to no other stage:
 * its lowering adds nothing). Forward runs layer by layer over all
 * micro-batches: load layer l, run the first micro-batch through l, prefetch l+1, run the other
 * micro-batches through l, release l. The prefetch comes after the layer's first compute so that
 * on a device with an asynchronous queue (webgpu) the upload of l+1 overlaps the GPU's work on l
 * (issued before it; the relay stage submits each compute action as it ends). The last layer is
 * not run forward: its forward, loss and backward are fused into its backward (the logits are
 * never stashed). Backward runs the layers in reverse: load l, re-compute and backprop the last
 * micro-batch from its stash, prefetch l-1, the other micro-batches (last first), push the
 * layer's gradient to the parameter server, release. The layer below the last stays loaded
 * across the turn from forward to backward, since backward needs it next. `optimizer_step`
 * closes the step (the parameter server applies the updates in the background).
 *
 * For layers = 3, m = 2 (`0L1F0` = layer 1, forward of micro-batch 0):
 *
 *     0L0LOAD 0L0F0 0L1PREF 0L0F1 0L0FREE  0L1LOAD 0L1F0 0L2PREF 0L1F1
 *     0L2LOAD 0L2B1 0L1PREF 0L2B0 0L2PUSH 0L2FREE  0L1LOAD 0L1B1 0L0PREF 0L1B0 0L1PUSH 0L1FREE
 *     0L0LOAD 0L0B1 0L0B0 0L0PUSH 0L0FREE 0STEP
 *
 * Throws {@link LayerwiseError} for m < 1 or layers < 1.
 */
export function relayCompute(
  layers: number,
  m: number,
  dropped: ReadonlySet<number> = new Set(),
): ComputeSchedule {
  checkArgs(m, 1);
  if (!Number.isInteger(layers) || layers < 1)
    throw new LayerwiseError(
      `layers must be a positive integer, got ${layers}`,
    );
  if (dropped.has(0) || dropped.has(layers - 1))
    throw new LayerwiseError(
      'LayerDrop never skips the first or the last layer',
    );
  // the layers this step relays: LayerDrop's skipped ones are not loaded, computed or pushed
  const run = Array.from({ length: layers }, (_, l) => l).filter(
    (l) => !dropped.has(l),
  );
  const stage = 0;
  const acts: ComputeAction[] = [];
  for (let j = 0; j < run.length - 1; j++) {
    const l = run[j]!;
    acts.push({ op: 'load_layer', stage, layer: l });
    for (let i = 0; i < m; i++) {
      acts.push({ op: 'layer_forward', stage, layer: l, mb: i, grad: true });
      if (i === 0)
        acts.push({ op: 'prefetch_layer', stage, layer: run[j + 1]! });
    }
    if (j < run.length - 2) acts.push({ op: 'release_layer', stage, layer: l });
  }
  for (let j = run.length - 1; j >= 0; j--) {
    const l = run[j]!;
    acts.push({ op: 'load_layer', stage, layer: l });
    for (let i = m - 1; i >= 0; i--) {
      acts.push({ op: 'layer_backward', stage, layer: l, mb: i });
      if (i === m - 1 && j > 0)
        acts.push({ op: 'prefetch_layer', stage, layer: run[j - 1]! });
    }
    acts.push(
      { op: 'push_grads', stage, layer: l },
      { op: 'release_layer', stage, layer: l },
    );
  }
  acts.push({ op: 'optimizer_step', stage });
  return [acts];
}

/** The relay's schedule ({@link relayCompute}, less the layers in `dropped`), lowered onto its one device. */
export function relaySchedule(
  layers: number,
  m: number,
  dropped?: ReadonlySet<number>,
): Schedule {
  return lower(relayCompute(layers, m, dropped), [0]);
}

/** L2L evaluation: every layer forward over all micro-batches, the last one recording the losses; prefetches as in {@link relayCompute}. */
export function relayEvalSchedule(layers: number, m: number): Schedule {
  checkArgs(m, 1);
  const stage = 0;
  const acts: ComputeAction[] = [];
  for (let l = 0; l < layers; l++) {
    acts.push({ op: 'load_layer', stage, layer: l });
    for (let i = 0; i < m; i++) {
      acts.push({ op: 'layer_forward', stage, layer: l, mb: i, grad: false });
      if (i === 0 && l + 1 < layers)
        acts.push({ op: 'prefetch_layer', stage, layer: l + 1 });
    }
    acts.push({ op: 'release_layer', stage, layer: l });
  }
  return lower([acts], [0]);
}

/** The stage schedules a pipelined relay runs on (layer actions have no split backward or several stages per device). */
export const RELAY_PIPELINE_SCHEDULES: readonly ScheduleKind[] = [
  'gpipe',
  '1f1b',
];

/**
 * Pipelined relay, L2L on K devices (issue 24; Pudipeddi et al., 2020, with GPipe's and 1F1B's
 * micro-batch flow): the stage-level schedule `stageLevel` (lowered, stage s on device s: a
 * gpipe or 1F1B training schedule without the norm all-reduce, or an evaluation schedule) with
 * each forward F(s,i) and backward B(s,i) expanded into the relay's layer actions over stage
 * s's layers `ranges[s]` (model block indices; LayerDrop's `dropped` left out):
 *
 * - F(s,i): for each layer in order, load_layer, layer_forward of micro-batch i, release_layer.
 *   In training the model's last layer is left to the backward (the relay computes its forward
 *   and the loss there).
 * - B(s,i): for each layer in reverse order, load_layer, layer_backward, push_grads (this
 *   micro-batch's gradient of the layer goes to the parameter server, which sums a layer's M
 *   pushes: the device never accumulates more than one layer's gradient), release_layer.
 * - A layer released and loaded again with only communication in between stays on the device;
 *   after the first compute of each loaded layer the device prefetches the next layer it loads.
 * - Training ends with each stage's optimizer_step. Sends and receives stay where the
 *   stage-level lowering put them.
 *
 * The device thus holds at most two layers' parameters and one layer's gradient whatever the
 * depth; the price is M uploads of each layer per pass instead of one (layer-major order,
 * {@link relayCompute}, would leave nothing for the next stage to overlap). A stage whose
 * layers are all dropped this step passes each micro-batch on: a layer_forward and a
 * layer_backward of its first (dropped) layer, which the relay stage runs as the identity,
 * unloaded. Throws {@link LayerwiseError} for an op with no relay form (a split backward) or
 * ranges that do not match the schedule's stages.
 */
export function relayPipelineSchedule(
  stageLevel: Schedule,
  ranges: ReadonlyArray<{ from: number; to: number }>,
  dropped: ReadonlySet<number> = new Set(),
): Schedule {
  const last = ranges[ranges.length - 1]!.to - 1;
  const keptOf = (s: number): number[] => {
    const r = ranges[s];
    if (!r)
      throw new LayerwiseError(
        `stage ${s} of the schedule has no layer range (${ranges.length} ranges)`,
      );
    const kept: number[] = [];
    for (let l = r.from; l < r.to; l++) if (!dropped.has(l)) kept.push(l);
    return kept;
  };
  return stageLevel.map((acts) => {
    const out: Action[] = [];
    const stages = new Set<number>();
    let trains = false;
    for (const a of acts) {
      const stage = a.stage;
      stages.add(stage);
      const kept =
        a.op === 'forward' || a.op === 'backward' ? keptOf(stage) : [];
      if (kept.length === 0 && (a.op === 'forward' || a.op === 'backward')) {
        // LayerDrop skipped the whole stage: its first layer passes the micro-batch on, unloaded
        const layer = ranges[stage]!.from;
        out.push(
          a.op === 'forward'
            ? { op: 'layer_forward', stage, layer, mb: a.mb, grad: a.grad }
            : { op: 'layer_backward', stage, layer, mb: a.mb },
        );
        trains ||= a.op === 'backward';
      } else if (a.op === 'forward') {
        for (const layer of kept) {
          if (a.grad && layer === last) continue;
          out.push(
            { op: 'load_layer', stage, layer },
            { op: 'layer_forward', stage, layer, mb: a.mb, grad: a.grad },
            { op: 'release_layer', stage, layer },
          );
        }
      } else if (a.op === 'backward') {
        trains = true;
        for (const layer of kept.reverse())
          out.push(
            { op: 'load_layer', stage, layer },
            { op: 'layer_backward', stage, layer, mb: a.mb },
            { op: 'push_grads', stage, layer },
            { op: 'release_layer', stage, layer },
          );
      } else if (a.op === 'reduce_grad_norm' || a.op === 'optimizer_step') {
        // the parameter server clips and steps
      } else if (declarationOf(a.op).core) {
        out.push(a);
      } else {
        throw new LayerwiseError(
          `a pipelined relay runs forwards and backwards, not ${formatAction(a)}; use --schedule ${RELAY_PIPELINE_SCHEDULES.join(' or ')}`,
        );
      }
    }
    if (trains)
      for (const stage of stages) out.push({ op: 'optimizer_step', stage });
    return withPrefetches(keepUploads(out));
  });
}

/**
 * The pipelined relay's training schedule: `kind`'s (gpipe or 1f1b) stage schedule of m
 * micro-batches on one device per range, expanded by {@link relayPipelineSchedule}.
 */
export function relayPipelineTraining(
  kind: ScheduleKind,
  m: number,
  ranges: ReadonlyArray<{ from: number; to: number }>,
  dropped?: ReadonlySet<number>,
): Schedule {
  const k = ranges.length;
  return relayPipelineSchedule(
    lower(computeSchedule(kind, m, k, 'always'), chainPlacement(k)),
    ranges,
    dropped,
  );
}

/** Drops each release_layer whose layer is loaded again next, with only communication in between. */
function keepUploads(acts: readonly Action[]): Action[] {
  const out: Action[] = [];
  for (let i = 0; i < acts.length; i++) {
    const a = acts[i]!;
    if (a.op === 'release_layer') {
      let j = i + 1;
      while (j < acts.length && declarationOf(acts[j]!.op).core) j++;
      const b = acts[j];
      if (
        b?.op === 'load_layer' &&
        b.layer === a.layer &&
        b.stage === a.stage
      ) {
        out.push(...acts.slice(i + 1, j)); // the communication in between
        i = j; // and neither the release nor the load
        continue;
      }
    }
    out.push(a);
  }
  return out;
}

/** After the first compute of each loaded layer: a prefetch of the next layer the list loads (if another). */
function withPrefetches(acts: readonly Action[]): Action[] {
  const out: Action[] = [];
  let pending: Action | null = null; // the prefetch due after the next compute
  acts.forEach((a, i) => {
    if (a.op === 'load_layer') {
      const next = acts.slice(i + 1).find((b) => b.op === 'load_layer');
      pending =
        next && next.op === 'load_layer' && next.layer !== a.layer
          ? { op: 'prefetch_layer', stage: next.stage, layer: next.layer }
          : null;
    }
    out.push(a);
    if (pending && (a.op === 'layer_forward' || a.op === 'layer_backward')) {
      out.push(pending);
      pending = null;
    }
  });
  return out;
}

/** Bubble fraction of a fill-drain pipeline with equal stages: (K - 1) / (M + K - 1). */
export function idealBubble(m: number, k: number): number {
  return (k - 1) / (m + k - 1);
}
