/**
 * `layerwise schedule`: a named schedule's per-device grid in PyTorch pipelining's notation
 * (schedule/grid.ts), as text or as the CSV PyTorch's `_dump_csv` writes, with the simulated
 * bubble per device (forward 1, backward 2) and the peak activations per device (micro-batches
 * forwarded and not yet backwarded).
 */
import {
  gridToCsv,
  gridToText,
  peakInFlight,
  scheduleGrid,
} from '../schedule/grid.js';
import {
  computeSchedule,
  makeSchedule,
  placementOf,
  SCHEDULE_KINDS,
  type ScheduleKind,
  stagesPerDevice,
} from '../schedule/schedule.js';
import { simulate } from '../schedule/simulate.js';
import { LayerwiseError } from '../util/errors.js';

/** Options of `layerwise schedule`. */
export interface ScheduleOptions {
  schedule: string;
  stages: number;
  microBatches: number;
  /** Stages per device of interleaved-1f1b (default 2). */
  virtualStages?: number;
  format?: string;
}

/**
 * The text `layerwise schedule` prints. Throws {@link LayerwiseError} (exit 2) for an unknown
 * schedule or format, or stages or micro-batches that are not positive integers.
 */
export function printSchedule(o: ScheduleOptions): string {
  if (!(SCHEDULE_KINDS as readonly string[]).includes(o.schedule))
    throw new LayerwiseError(
      `unknown schedule '${o.schedule}'; valid: ${SCHEDULE_KINDS.join(', ')}`,
    );
  const format = o.format ?? 'text';
  if (format !== 'text' && format !== 'csv')
    throw new LayerwiseError(`unknown format '${format}'; valid: text, csv`);
  const kind = o.schedule as ScheduleKind;
  const k = o.stages;
  const m = o.microBatches;
  const v = o.virtualStages ?? 2;
  const compute = computeSchedule(kind, m, k, 'always', v);
  const placement = placementOf(kind, k, v);
  const grid = scheduleGrid(compute, placement);
  if (format === 'csv') return gridToCsv(grid).trimEnd();
  // each of a device's stages does 1/V of its work
  const per = stagesPerDevice(kind, v);
  const sim = simulate(makeSchedule(kind, m, k, 'always', v), (_d, a) =>
    a.op === 'forward' ||
    a.op === 'backward_input' ||
    a.op === 'backward_weight'
      ? 1 / per
      : a.op === 'backward'
        ? 2 / per
        : 0,
  );
  const peak = peakInFlight(compute);
  return [
    `${kind}, ${k} ${k === 1 ? 'device' : 'devices'}${per > 1 ? ` (${per} stages each; stage->device ${placement.map((d, s) => `${s}->${d}`).join(' ')})` : ''}, ${m} micro-batches`,
    gridToText(grid),
    `simulated bubble (forward 1, backward 2 = input 1 + weight 1, per device): ${sim.bubble.map((b, d) => `device ${d} ${b.toFixed(3)}`).join(', ')}`,
    `peak activations (micro-batches in flight): ${peak.map((p, d) => `device ${d} ${p}`).join(', ')}`,
  ].join('\n');
}
