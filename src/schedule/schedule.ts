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

/** Re-materialization (activation checkpointing) modes, as in torchgpipe. */
export type RematMode = 'always' | 'except_last' | 'never';
export const REMAT_MODES: readonly RematMode[] = [
  'always',
  'except_last',
  'never',
];

/** Schedules this executor understands. */
export type ScheduleKind = 'gpipe' | '1f1b';
export const SCHEDULE_KINDS: readonly ScheduleKind[] = ['gpipe', '1f1b'];

/** One step of one stage's work. `mb` is the micro-batch index in [0, M). */
export type Action =
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
  /** Send the gradient of micro-batch mb's input to the previous stage. */
  | { op: 'send_grad'; mb: number }
  /** Contribute this stage's squared gradient norm and receive the global clipping scale. */
  | { op: 'reduce_grad_norm' }
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
   * layer's input; on the last layer (evaluation only) the micro-batch loss is recorded.
   */
  | { op: 'layer_forward'; layer: number; mb: number; grad: boolean }
  /**
   * L2L: re-computation of `layer` for micro-batch mb from its stashed input, then backward
   * from the incoming gradient; accumulates the layer's gradient and keeps the input gradient
   * for the layer below. On the last layer the loss is computed here (seeded with 1/M).
   */
  | { op: 'layer_backward'; layer: number; mb: number }
  /** L2L: download the layer's accumulated gradient and hand it to the parameter server. */
  | { op: 'push_grads'; layer: number }
  /** L2L: free the layer's parameters on the device. */
  | { op: 'release_layer'; layer: number };

/** Per stage, the list of its actions for one mini-batch. */
export type Schedule = Action[][];

const SHORT: Record<Action['op'], string> = {
  recv_act: 'RA',
  forward: 'F',
  send_act: 'SA',
  recv_grad: 'RG',
  backward: 'B',
  send_grad: 'SG',
  reduce_grad_norm: 'NORM',
  optimizer_step: 'STEP',
  local_update: 'L',
  overlap_backward: 'O',
  poll_grads: 'POLL',
  drain_grads: 'DRAIN',
  local_step: 'LSTEP',
  load_layer: 'LOAD',
  prefetch_layer: 'PREF',
  layer_forward: 'F',
  layer_backward: 'B',
  push_grads: 'PUSH',
  release_layer: 'FREE',
};

/** Compact text form of an action: `1F3`, `0B0`, `2STEP`. Forwards that recompute nothing print `F`, kept ones `Fk`. */
export function formatAction(stage: number, a: Action): string {
  if ('layer' in a)
    return `${stage}L${a.layer}${SHORT[a.op]}${'mb' in a ? a.mb : ''}`;
  const kind = a.op === 'forward' && a.keep && a.grad ? 'Fk' : SHORT[a.op];
  return 'mb' in a ? `${stage}${kind}${a.mb}` : `${stage}${kind}`;
}

/** One line per stage, actions separated by spaces. */
export function formatSchedule(s: Schedule): string {
  return s
    .map((acts, k) => acts.map((a) => formatAction(k, a)).join(' '))
    .join('\n');
}

/**
 * A stage's actions, one per line, with the action at `index` marked `<-- ERROR HERE` (as PyTorch
 * pipelining shows a failing schedule); at most `context` actions on each side, the rest counted.
 */
export function formatScheduleError(
  stage: number,
  actions: readonly Action[],
  index: number,
  context = 6,
): string {
  const from = Math.max(0, index - context);
  const to = Math.min(actions.length, index + context + 1);
  const lines = [
    `schedule of stage ${stage}, action ${index + 1} of ${actions.length}:`,
  ];
  if (from > 0) lines.push(`  ... ${from} earlier`);
  for (let i = from; i < to; i++)
    lines.push(
      `  ${formatAction(stage, actions[i])}${i === index ? '  <-- ERROR HERE' : ''}`,
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

function fwd(
  stage: number,
  k: number,
  mb: number,
  keep: boolean,
  grad = true,
): Action[] {
  const out: Action[] = [];
  if (stage > 0) out.push({ op: 'recv_act', mb });
  out.push({ op: 'forward', mb, keep, grad });
  if (stage < k - 1) out.push({ op: 'send_act', mb });
  return out;
}

function bwd(stage: number, k: number, mb: number): Action[] {
  const out: Action[] = [];
  if (stage < k - 1) out.push({ op: 'recv_grad', mb });
  out.push({ op: 'backward', mb });
  if (stage > 0) out.push({ op: 'send_grad', mb });
  return out;
}

const STEP: Action[] = [{ op: 'reduce_grad_norm' }, { op: 'optimizer_step' }];

/**
 * GPipe fill-drain schedule for m micro-batches on k stages: every stage runs all forwards in
 * order, then all backwards in reverse order, then one synchronous optimizer step.
 * Throws {@link LayerwiseError} for m < 1 or k < 1.
 */
export function gpipeSchedule(m: number, k: number, mode: RematMode): Schedule {
  checkArgs(m, k);
  return Array.from({ length: k }, (_, s) => {
    const acts: Action[] = [];
    for (let i = 0; i < m; i++)
      acts.push(...fwd(s, k, i, keepsActivations(mode, i, m)));
    for (let i = m - 1; i >= 0; i--) acts.push(...bwd(s, k, i));
    return [...acts, ...STEP];
  });
}

/**
 * 1F1B (PipeDream-Flush, Narayanan et al., 2021): stage s runs min(k - s - 1, m) warm-up
 * forwards, then alternates one forward and one backward, then drains the remaining
 * backwards. Same bubble as GPipe, but at most k - s micro-batches are in flight per stage.
 */
export function oneFOneBSchedule(
  m: number,
  k: number,
  mode: RematMode,
): Schedule {
  checkArgs(m, k);
  return Array.from({ length: k }, (_, s) => {
    const acts: Action[] = [];
    const warm = Math.min(k - s - 1, m);
    let f = 0;
    let b = 0;
    for (; f < warm; f++)
      acts.push(...fwd(s, k, f, keepsActivations(mode, f, m)));
    while (b < m) {
      if (f < m) {
        acts.push(...fwd(s, k, f, keepsActivations(mode, f, m)));
        f++;
      }
      acts.push(...bwd(s, k, b));
      b++;
    }
    return [...acts, ...STEP];
  });
}

/** Forward-only schedule for evaluation: nothing is kept for backward. */
export function evalSchedule(m: number, k: number): Schedule {
  checkArgs(m, k);
  return Array.from({ length: k }, (_, s) => {
    const acts: Action[] = [];
    for (let i = 0; i < m; i++) acts.push(...fwd(s, k, i, false, false));
    return acts;
  });
}

/** The training schedule of a kind. */
export function makeSchedule(
  kind: ScheduleKind,
  m: number,
  k: number,
  mode: RematMode,
): Schedule {
  switch (kind) {
    case 'gpipe':
      return gpipeSchedule(m, k, mode);
    case '1f1b':
      return oneFOneBSchedule(m, k, mode);
    default:
      throw new LayerwiseError(
        `unknown schedule '${kind as string}'; valid: ${SCHEDULE_KINDS.join(', ')}`,
      );
  }
}

/**
 * Local parallelism (Laskin et al., 2020): every stage makes one local update per micro-batch
 * and passes its output on; nothing flows back unless `overlap` > 0, in which case each stage
 * but the first sends its input gradient to the previous stage, which backpropagates it through
 * its last `overlap` blocks. With `deterministic`, the previous stage applies the overlap
 * gradient of micro-batch i-1 at its step for micro-batch i (a fixed interleaving; the one of
 * micro-batch M-1 is applied at the next mini-batch's first step); otherwise it applies
 * whatever has arrived before each step, from this mini-batch or an earlier one, and never
 * waits (a {@link flushSchedule} collects what is outstanding).
 * Stage s works on micro-batch i while stage s+1 works on micro-batch i-1.
 */
export function localSchedule(
  m: number,
  k: number,
  overlap: number,
  deterministic: boolean,
): Schedule {
  checkArgs(m, k);
  return Array.from({ length: k }, (_, s) => {
    const receivesGrad = overlap > 0 && s < k - 1;
    const sendsGrad = overlap > 0 && s > 0;
    const acts: Action[] = [];
    for (let i = 0; i < m; i++) {
      if (s > 0) acts.push({ op: 'recv_act', mb: i });
      acts.push({ op: 'local_update', mb: i });
      if (s < k - 1) acts.push({ op: 'send_act', mb: i });
      if (sendsGrad) acts.push({ op: 'send_grad', mb: i });
      if (receivesGrad && deterministic && i > 0)
        acts.push(
          { op: 'recv_grad', mb: i - 1 },
          { op: 'overlap_backward', mb: i - 1 },
        );
      if (receivesGrad && !deterministic) acts.push({ op: 'poll_grads' });
      acts.push({ op: 'local_step' });
    }
    if (receivesGrad && deterministic)
      acts.push(
        { op: 'recv_grad', mb: m - 1 },
        { op: 'overlap_backward', mb: m - 1 },
      );
    return acts;
  });
}

/** Local parallelism: every stage but the last waits for its outstanding overlap gradients. */
export function flushSchedule(k: number): Schedule {
  return Array.from({ length: k }, (_, s) =>
    s < k - 1 ? [{ op: 'drain_grads' } as Action] : [],
  );
}

/**
 * L2L relay schedule (Pudipeddi et al., 2020, arXiv 2002.05645) for `layers` layers (blocks)
 * and m micro-batches on one device; one list. Forward runs layer by layer over all
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
export function relaySchedule(layers: number, m: number): Schedule {
  checkArgs(m, 1);
  if (!Number.isInteger(layers) || layers < 1)
    throw new LayerwiseError(
      `layers must be a positive integer, got ${layers}`,
    );
  const acts: Action[] = [];
  for (let l = 0; l < layers - 1; l++) {
    acts.push({ op: 'load_layer', layer: l });
    for (let i = 0; i < m; i++) {
      acts.push({ op: 'layer_forward', layer: l, mb: i, grad: true });
      if (i === 0) acts.push({ op: 'prefetch_layer', layer: l + 1 });
    }
    if (l < layers - 2) acts.push({ op: 'release_layer', layer: l });
  }
  for (let l = layers - 1; l >= 0; l--) {
    acts.push({ op: 'load_layer', layer: l });
    for (let i = m - 1; i >= 0; i--) {
      acts.push({ op: 'layer_backward', layer: l, mb: i });
      if (i === m - 1 && l > 0)
        acts.push({ op: 'prefetch_layer', layer: l - 1 });
    }
    acts.push(
      { op: 'push_grads', layer: l },
      { op: 'release_layer', layer: l },
    );
  }
  acts.push({ op: 'optimizer_step' });
  return [acts];
}

/** L2L evaluation: every layer forward over all micro-batches, the last one recording the losses; prefetches as in {@link relaySchedule}. */
export function relayEvalSchedule(layers: number, m: number): Schedule {
  checkArgs(m, 1);
  const acts: Action[] = [];
  for (let l = 0; l < layers; l++) {
    acts.push({ op: 'load_layer', layer: l });
    for (let i = 0; i < m; i++) {
      acts.push({ op: 'layer_forward', layer: l, mb: i, grad: false });
      if (i === 0 && l + 1 < layers)
        acts.push({ op: 'prefetch_layer', layer: l + 1 });
    }
    acts.push({ op: 'release_layer', layer: l });
  }
  return [acts];
}

/** Bubble fraction of a fill-drain pipeline with equal stages: (K - 1) / (M + K - 1). */
export function idealBubble(m: number, k: number): number {
  return (k - 1) / (m + k - 1);
}
