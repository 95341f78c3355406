/**
 * A compute-only schedule as a time grid, in PyTorch pipelining's notation
 * (torch/distributed/pipelining/schedules.py `_Action.__repr__` and `_dump_csv`): one row per
 * device, one cell per time slot, a cell `<stage><type><mb>` (type F: forward, B: full
 * backward; local parallelism's and the relay's ops print their compact form) and an empty
 * cell for an idle slot. Slots come from simulating the lowered schedule with every compute
 * action one slot long and communication free, so a cell sits at the first slot where its
 * inputs are there. Pure (no tensors).
 */
import { declarationOf } from './ops.js';
import {
  type ComputeAction,
  type ComputeSchedule,
  type LowerOptions,
  lower,
} from './schedule.js';
import { simulate } from './simulate.js';

/** Per device, per time slot, the compute action there (null: idle). */
export type ScheduleGrid = (ComputeAction | null)[][];

/** PyTorch's cell for an action: `1F3`, `0B0` (no keep flag: re-materialization is not part of the notation). */
export function cellOf(a: ComputeAction): string {
  const short = declarationOf(a.op).short;
  if ('layer' in a)
    return `${a.stage}L${a.layer}${short}${'mb' in a ? a.mb : ''}`;
  return 'mb' in a ? `${a.stage}${short}${a.mb}` : `${a.stage}${short}`;
}

/**
 * Lays out `compute` (placed by `placement`, stage s on device placement[s]) on time slots: each
 * compute action takes one slot, communication none. Throws the simulator's Error when the
 * schedule is invalid (a deadlock, a missing dependency).
 */
export function scheduleGrid(
  compute: ComputeSchedule,
  placement: readonly number[],
  opts: LowerOptions = {},
): ScheduleGrid {
  const lowered = lower(compute, placement, opts);
  const sim = simulate(lowered, (_d, a) => (declarationOf(a.op).core ? 0 : 1));
  const width = Math.round(sim.makespan);
  const grid: ScheduleGrid = lowered.map(() =>
    new Array<ComputeAction | null>(width).fill(null),
  );
  for (const e of sim.events) {
    if (declarationOf(e.action.op).core || e.end === e.start) continue;
    grid[e.device][Math.round(e.start)] = e.action as ComputeAction;
  }
  return grid;
}

/** The grid as PyTorch's `_dump_csv` writes it: one line per device, cells separated by commas, idle slots empty. */
export function gridToCsv(grid: ScheduleGrid): string {
  return `${grid.map((row) => row.map((a) => (a ? cellOf(a) : '')).join(',')).join('\n')}\n`;
}

/** The grid as aligned text: a header of slot numbers, one row per device, `.` for an idle slot. */
export function gridToText(grid: ScheduleGrid): string {
  const cells = grid.map((row) => row.map((a) => (a ? cellOf(a) : '.')));
  const w = Math.max(2, ...cells.flat().map((c) => c.length));
  const width = grid[0]?.length ?? 0;
  const head = `slot      ${Array.from({ length: width }, (_, t) => String(t).padStart(w)).join(' ')}`;
  return [
    head,
    ...cells.map(
      (row, d) =>
        `device ${String(d).padEnd(2)} ${row.map((c) => c.padStart(w)).join(' ')}`,
    ),
  ].join('\n');
}

/**
 * Peak activations per device: the largest number of (stage, micro-batch) pairs forwarded and
 * not yet backwarded (a full backward, or the input part of a split one: after it a micro-batch
 * holds only what its weight part reads) at any point of the device's order (what 1F1B bounds
 * by K - s).
 */
export function peakInFlight(compute: ComputeSchedule): number[] {
  return compute.map((acts) => {
    let cur = 0;
    let peak = 0;
    for (const a of acts) {
      if (a.op === 'forward' && a.grad) peak = Math.max(peak, ++cur);
      else if (a.op === 'backward' || a.op === 'backward_input') cur--;
    }
    return peak;
  });
}
