/**
 * Schedule files in PyTorch pipelining's compute-only CSV (torch/distributed/pipelining/
 * schedules.py `_dump_csv` / `_load_csv`): one row per device, one cell per time slot, a cell
 * `<stage><type><mb>` (F forward, B full backward, I and W the zero-bubble split backward's input
 * and weight parts), an empty cell for an idle slot, and the compound cell
 * `(0F3;3B1)OVERLAP_F_B` run as its parts in order. The stage-to-device placement is inferred
 * from the rows. {@link loadScheduleCsv} checks the file and throws one
 * {@link LayerwiseError} naming the offending action, with the schedule printed and its row
 * marked `<-- ERROR HERE`. Pure (no tensors, no files).
 */
import { LayerwiseError } from '../util/errors.js';
import { cellOf } from './grid.js';
import { OPS } from './ops.js';
import {
  type Action,
  type ComputeAction,
  type ComputeSchedule,
  keepsActivations,
  lower,
  type RematMode,
} from './schedule.js';
import { simulate } from './simulate.js';

/**
 * A cell's type letter and the compute op it names (PyTorch pipelining's `_ComputationType`):
 * each op's own short name (schedule/ops.ts), F, B, I and W.
 */
const CELL_OPS: Readonly<Record<string, ComputeAction['op']>> =
  Object.fromEntries(
    (['forward', 'backward', 'backward_input', 'backward_weight'] as const).map(
      (op) => [OPS[op].short, op],
    ),
  );

/** A checked schedule file: per device its compute actions, and stage s's device placement[s]. */
export interface LoadedSchedule {
  compute: ComputeSchedule;
  placement: number[];
  /** Micro-batches M (the largest index + 1). */
  m: number;
}

interface Cell {
  device: number;
  text: string;
  stage: number;
  type: string;
  mb: number;
}

function splitCells(row: string): string[] {
  return row.split(',').map((c) => c.trim());
}

/**
 * Throws the file's error: action `what` on `device` fails because `why`; the message shows the
 * grid (`shown`: per device, its cells; `.` for an empty one) with `<-- ERROR HERE` on its row.
 */
type Fail = (device: number, what: string, why: string) => never;

/** The {@link Fail} of a file whose rows split into the cells `shown`. */
function failIn(shown: readonly string[][]): Fail {
  return (device, what, why) => {
    const grid = shown
      .map(
        (cells, d) =>
          `  device ${d}: ${cells.map((c) => c || '.').join(' ')}${d === device ? `  <-- ERROR HERE (${what})` : ''}`,
      )
      .join('\n');
    throw new LayerwiseError(
      `schedule file: action ${what} on device ${device}: ${why}\n${grid}`,
    );
  };
}

/**
 * Parses each device's row (`shown[d]`: its cells) into its actions in order, an empty cell
 * skipped and a compound `(a;b)OVERLAP_F_B` cell as its parts. Fails on a cell that is not
 * `<stage><type><micro-batch>` or whose type is not F, B, I or W.
 */
function parseCells(shown: readonly string[][], fail: Fail): Cell[][] {
  return shown.map((row, device) =>
    row.flatMap((raw) => {
      if (raw === '') return [];
      const compound = /^\((.*)\)OVERLAP_F_B$/.exec(raw);
      const parts = compound ? compound[1].split(';') : [raw];
      return parts.map((p) => {
        const c = /^(\d+)([A-Z]+)(\d+)$/.exec(p.trim());
        if (!c)
          fail(
            device,
            p,
            'not a cell <stage><type><micro-batch> such as 1F3 (or an empty cell)',
          );
        const [, stage, type, mb] = c!;
        if (!(type in CELL_OPS))
          fail(device, p, `unknown type '${type}' (valid: F, B, I, W)`);
        return { device, text: p, stage: +stage, type, mb: +mb };
      });
    }),
  );
}

/**
 * The device of each stage (`placement[s]`), from the rows its actions are on. Fails on a stage
 * with actions on two devices; throws {@link LayerwiseError} when a stage below the largest has
 * no action.
 */
function inferPlacement(all: readonly Cell[], fail: Fail): number[] {
  const placement: number[] = [];
  for (const c of all) {
    const at = placement[c.stage];
    if (at !== undefined && at !== c.device)
      fail(
        c.device,
        c.text,
        `stage ${c.stage} also has actions on device ${at} (a stage runs on one device)`,
      );
    placement[c.stage] = c.device;
  }
  const stages = placement.length;
  for (let s = 0; s < stages; s++)
    if (placement[s] === undefined)
      throw new LayerwiseError(
        `schedule file: stage ${s} has no action (stages must be 0..${stages - 1})`,
      );
  return placement;
}

/**
 * Checks that every stage has, for each of the `m` micro-batches, one F and either one B or one
 * I and one W, and no action twice. Fails naming the repeated, conflicting or missing action.
 */
function checkComplete(
  all: readonly Cell[],
  placement: readonly number[],
  m: number,
  fail: Fail,
): void {
  const seen = new Set<string>();
  for (const c of all) {
    const key = `${c.stage}${c.type}${c.mb}`;
    if (seen.has(key)) fail(c.device, c.text, 'appears twice');
    seen.add(key);
  }
  for (let s = 0; s < placement.length; s++)
    for (let mb = 0; mb < m; mb++) {
      const has = (type: string) => seen.has(`${s}${type}${mb}`);
      const split = has('I') || has('W');
      if (split && has('B'))
        fail(
          placement[s],
          `${s}B${mb}`,
          `micro-batch ${mb} has both B and a split backward (I, W): give it B, or I and W`,
        );
      for (const type of ['F', ...(split ? ['I', 'W'] : ['B'])])
        if (!has(type))
          fail(
            placement[s],
            `${s}${type}${mb}`,
            `missing: stage ${s} needs for each of the ${m} micro-batches one F and one B (or one I and one W)`,
          );
    }
}

/** The compute schedule of the parsed cells: a forward keeps its activations by `remat` (of `m` micro-batches) and records gradients. */
function computeOf(
  cells: readonly Cell[][],
  remat: RematMode,
  m: number,
): ComputeSchedule {
  return cells.map((row) =>
    row.map(
      (c): ComputeAction =>
        c.type === 'F'
          ? {
              op: 'forward',
              stage: c.stage,
              mb: c.mb,
              keep: keepsActivations(remat, c.mb, m),
              grad: true,
            }
          : ({
              op: CELL_OPS[c.type]!,
              stage: c.stage,
              mb: c.mb,
            } as ComputeAction),
    ),
  );
}

/** `compute` lowered on `placement` (one all-reduce step); a lowering error rethrown as the file's {@link LayerwiseError}. */
function lowerFile(compute: ComputeSchedule, placement: number[]): Action[][] {
  try {
    return lower(compute, placement, { step: 'all-reduce' });
  } catch (e) {
    throw new LayerwiseError(`schedule file: ${(e as Error).message}`);
  }
}

/**
 * Simulates the lowered schedule; fails when it deadlocks or misses a dependency, naming the
 * compute action the failure is at (the failing action, or the next compute action on its
 * device). A simulation error that names no action of `lowered` is rethrown as it is.
 */
function checkSimulated(
  lowered: Action[][],
  compute: ComputeSchedule,
  fail: Fail,
): void {
  try {
    simulate(lowered);
  } catch (e) {
    const a = (e as { action?: Action }).action;
    const device = a ? lowered.findIndex((acts) => acts.includes(a)) : -1;
    if (!a || device < 0) throw e;
    // the compute action the failure is at: the failing one, or the next one on its device
    const from = lowered[device].indexOf(a);
    const at = lowered[device]
      .slice(from)
      .find((x) => compute[device].includes(x as ComputeAction));
    const why = (e as Error).message.replace(
      /^invalid schedule: stage \d+ \{.*?\}: /,
      '',
    );
    fail(device, at ? cellOf(at as ComputeAction) : String(a.op), why);
  }
}

/**
 * Parses and checks a schedule file's text: cell syntax; F and B only; a stage on one device;
 * stages 0..S-1 all present; every stage has one F and one B per micro-batch 0..M-1; stages
 * on different devices only between neighbouring devices (d, d + 1); no deadlock and every
 * dependency met (the lowered schedule simulated). Forwards keep activations by `remat`.
 * Throws {@link LayerwiseError} with the offending action named and the schedule printed with
 * `<-- ERROR HERE` on its row.
 */
export function loadScheduleCsv(
  text: string,
  remat: RematMode = 'never',
): LoadedSchedule {
  const rows = text.replace(/\r/g, '').replace(/\n+$/, '').split('\n');
  const shown = rows.map(splitCells);
  const fail = failIn(shown);
  const cells = parseCells(shown, fail);
  const all = cells.flat();
  if (all.length === 0)
    throw new LayerwiseError('schedule file: no actions in it');
  const placement = inferPlacement(all, fail);
  const m = Math.max(...all.map((c) => c.mb)) + 1;
  checkComplete(all, placement, m, fail);
  const compute = computeOf(cells, remat, m);
  const lowered = lowerFile(compute, placement);
  checkSimulated(lowered, compute, fail);
  return { compute, placement, m };
}
