/** Bench output: results as JSON and as a Markdown table, written atomically under bench/results/. */
import { join } from 'node:path';
import type { StepMetrics } from '../train/metrics.js';
import { writeFileAtomic } from '../util/fsx.js';

/** One table: column names and rows of cells. */
export interface Table {
  columns: string[];
  rows: Array<Array<string | number>>;
}

/** Renders a Markdown table; numbers are printed as given (format them before). */
export function markdownTable(t: Table): string {
  const line = (cells: Array<string | number>) =>
    `| ${cells.map(String).join(' | ')} |`;
  return `${[line(t.columns), line(t.columns.map(() => '---')), ...t.rows.map(line)].join('\n')}\n`;
}

/** Writes `<dir>/<name>.json` and `<dir>/<name>.md`. Returns their paths. */
export async function writeBenchResults(
  dir: string,
  name: string,
  json: unknown,
  markdown: string,
): Promise<string[]> {
  const j = join(dir, `${name}.json`);
  const m = join(dir, `${name}.md`);
  await writeFileAtomic(j, `${JSON.stringify(json, null, 2)}\n`);
  await writeFileAtomic(m, markdown);
  return [j, m];
}

/**
 * What the benchmarks read off a run's steps after the first (which warms kernels up): the
 * mean host-to-device bytes per step, summed over devices, and the median step seconds (the
 * lower middle value for an even count).
 */
export function stepFigures(ms: readonly StepMetrics[]): {
  steps: StepMetrics[];
  hostToDeviceBytes: number;
  stepSeconds: number;
} {
  const steps = ms.slice(1);
  const h2d = steps.map((m) =>
    (m.host_to_device_bytes ?? []).reduce((x, y) => x + y, 0),
  );
  const s = steps.map((m) => m.step_s).sort((x, y) => x - y);
  return {
    steps,
    hostToDeviceBytes: h2d.reduce((a, b) => a + b, 0) / h2d.length,
    stepSeconds: s[Math.floor((s.length - 1) / 2)]!,
  };
}
