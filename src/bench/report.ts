/** Bench output: results as JSON and as a Markdown table, written atomically under bench/results/. */
import { join } from 'node:path';
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
