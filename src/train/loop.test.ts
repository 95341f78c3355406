/**
 * One training loop for Node and the page (issue 34): the page's run (web/run.ts's
 * `runInPage`, run here in Node on worker threads, its imports of the library pointed at this
 * build) and `layerwise train`'s (`train`) write the same metrics lines and summary for the
 * same flags, LayerDrop included; only timings differ.
 */
import assert from 'node:assert/strict';
import { mkdtempSync, readFileSync, rmSync, writeFileSync } from 'node:fs';
import { tmpdir } from 'node:os';
import { join } from 'node:path';
import { after, test } from 'node:test';
import { pathToFileURL } from 'node:url';
import { readStepMetrics, type StepMetrics, type Summary } from './metrics.js';
import { train } from './trainer.js';

/** The page's run loop, and the compiled library beside this test (dist/ mirrors src/). */
const WEB_RUN = new URL('../../web/run.ts', import.meta.url);
const LIBRARY = new URL('../', import.meta.url);

interface PageRun {
  summary: Summary;
  metrics: StepMetrics[];
  stopped: boolean;
}
type RunInPage = (
  opts: Record<string, unknown>,
  hooks?: { stopRequested?(): boolean },
) => Promise<PageRun>;

const tmp = mkdtempSync(join(tmpdir(), 'layerwise-loop-'));
after(() => rmSync(tmp, { recursive: true, force: true }));

/**
 * web/run.ts as a module of this build: esbuild strips its types (as the page's bundle does)
 * and its imports of `../src/X.js` point at this build's `X.js`, the trainer's own modules.
 */
async function loadRunInPage(): Promise<RunInPage> {
  const { transform } = await import('esbuild');
  const { code } = await transform(readFileSync(WEB_RUN, 'utf8'), {
    loader: 'ts',
    format: 'esm',
  });
  const js = code.replaceAll(/(['"])\.\.\/src\//g, `$1${LIBRARY.href}`);
  assert.doesNotMatch(
    js,
    /from\s*['"]\./,
    'web/run.ts imports the library only',
  );
  const file = join(tmp, 'run.mjs');
  writeFileSync(file, js);
  return ((await import(pathToFileURL(file).href)) as { runInPage: RunInPage })
    .runInPage;
}

/** A tiny character model: two decoder blocks (1 and 2) LayerDrop may skip, 5 steps, evaluations at 2, 4 and 5. */
const FLAGS = {
  preset: 'charlm-tiny',
  layers: 2,
  dModel: 16,
  heads: 2,
  context: 8,
  batchSize: 4,
  steps: 5,
  evalEvery: 2,
  evalBatches: 1,
  backend: 'cpu' as const,
  seed: 3,
  layerDrop: 0.5,
};

/** Fields that are measured times (they differ from run to run); everything else must agree. */
const TIMINGS = [
  'step_s',
  'tokens_per_s',
  'examples_per_s',
  'bubble',
  'wall_s',
];

function withoutTimings<T extends object>(x: T): Partial<T> {
  return Object.fromEntries(
    Object.entries(x).filter(([k]) => !TIMINGS.includes(k)),
  ) as Partial<T>;
}

for (const shape of [
  { strategy: 'single', stages: 1, microBatches: 1 },
  { strategy: 'gpipe', stages: 2, microBatches: 2 },
]) {
  test(`the page's loop and layerwise train write the same metrics lines and summary (${shape.strategy}, --layer-drop 0.5)`, async () => {
    const runInPage = await loadRunInPage();
    const page = await runInPage({ ...FLAGS, ...shape });
    const out = join(tmp, shape.strategy);
    const node = await train({ ...FLAGS, ...shape, out });
    const lines = readStepMetrics(out);
    assert.equal(page.stopped, false);
    assert.deepEqual(
      page.metrics.map((m) => m.step),
      [1, 2, 3, 4, 5],
    );
    assert.ok(
      lines.some((m) => (m.dropped_blocks ?? []).length > 0),
      `LayerDrop skipped no block in 5 steps: ${JSON.stringify(lines.map((m) => m.dropped_blocks))}`,
    );
    assert.deepEqual(
      page.metrics.map(withoutTimings),
      lines.map(withoutTimings),
    );
    const written = JSON.parse(
      readFileSync(join(out, 'summary.json'), 'utf8'),
    ) as Summary;
    assert.deepEqual(written, JSON.parse(JSON.stringify(node.summary)));
    assert.deepEqual(
      Object.keys(page.summary).sort(),
      Object.keys(written).sort(),
    );
    assert.deepEqual(
      withoutTimings(JSON.parse(JSON.stringify(page.summary)) as Summary),
      withoutTimings(written),
    );
  });
}

test("the page's loop stops when asked, once the steps submitted are done; its summary covers the steps done", async () => {
  const runInPage = await loadRunInPage();
  let asked = 0;
  const page = await runInPage(
    { ...FLAGS, strategy: 'single', stages: 1, microBatches: 1, steps: 50 },
    { stopRequested: () => ++asked > 3 },
  );
  assert.equal(page.stopped, true);
  assert.deepEqual(
    page.metrics.map((m) => m.step),
    [1, 2, 3],
  );
  assert.equal(page.summary.steps, 3);
  assert.equal(page.summary.final_loss, page.metrics[2]!.loss);
});
