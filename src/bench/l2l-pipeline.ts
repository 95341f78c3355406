/**
 * `npm run bench -- l2l-pipeline`: the pipelined relay (`--strategy l2l --stages K`, issue 24
 * item 1) against depth. charlm-small with 6, 12, 24 and 48 blocks (`--layers` 4..46 decoder
 * blocks) trains through the trainer with l2l on K devices (host stash, M micro-batches) and a
 * device budget large enough to pass, so summary.json carries each device's measured peak and
 * the peak predicted before training. Issue 24's bar: each device's peak at 48 blocks at most
 * 1.05x its peak at 6. For scale, the 6-block model also runs on the one-device relay and on
 * gpipe K (same M): tokens/s, host-to-device bytes per step. Writes l2l-pipeline.{json,md}.
 */
import { mkdtempSync, rmSync } from 'node:fs';
import { tmpdir } from 'node:os';
import { join } from 'node:path';
import { readStepMetrics } from '../train/metrics.js';
import { train } from '../train/trainer.js';
import { markdownTable, reportBenchResults, stepFigures } from './report.js';

export interface L2LPipelineBenchOptions {
  /** Blocks of each model of the sweep (decoder blocks + 2). */
  blocks: number[];
  stages: number;
  microBatches: number;
  batchSize: number;
  /** Steps per run; the first is left out of the step figures. */
  steps: number;
  backend: string;
  out: string;
}

/** One run's figures. */
interface RunFigures {
  run: string;
  blocks: number;
  /** Measured peak device bytes per device (summary.json). */
  peak_device_bytes: number[];
  /** Predicted before training, per device (plan/budget.ts); null for gpipe without the budget. */
  predicted_peak_device_bytes: number[] | null;
  /** Mean host-to-device bytes per step, summed over devices (steps after the first). */
  host_to_device_bytes: number;
  /** Median step seconds (steps after the first). */
  step_s: number;
  tokens_per_s: number;
}

const mib = (b: number) => (b / 2 ** 20).toFixed(1);

/** Runs the sweep and the comparison rows, writes the results; `log` hears each run. */
export async function benchL2LPipeline(
  o: L2LPipelineBenchOptions,
  log: (s: string) => void,
): Promise<RunFigures[]> {
  const dir = mkdtempSync(join(tmpdir(), 'layerwise-bench-l2l-pipeline-'));
  const runs: RunFigures[] = [];
  const k = o.stages;
  const one = async (
    run: string,
    blocks: number,
    flags: Record<string, unknown>,
  ): Promise<void> => {
    const fig = await trainRun(
      o,
      join(dir, `${run}-${blocks}`),
      run,
      blocks,
      flags,
    );
    runs.push(fig);
    log(
      `${run}, ${blocks} blocks: peak ${fig.peak_device_bytes.map(mib).join(' / ')} MiB (predicted ${fig.predicted_peak_device_bytes?.map(mib).join(' / ') ?? '-'}), ${mib(fig.host_to_device_bytes)} MiB host-to-device per step, step ${fig.step_s.toFixed(3)} s, ${fig.tokens_per_s.toFixed(0)} tokens/s`,
    );
  };
  try {
    for (const blocks of o.blocks)
      await one(`l2l K=${k}`, blocks, {
        strategy: 'l2l',
        stages: k,
        stash: 'host',
      });
    const base = Math.min(...o.blocks);
    await one('l2l K=1', base, { strategy: 'l2l', stash: 'host' });
    await one(`gpipe K=${k}`, base, {
      strategy: 'gpipe',
      stages: k,
      remat: 'always',
    });
  } finally {
    rmSync(dir, { recursive: true, force: true });
  }
  const sweep = runs.filter((r) => r.run === `l2l K=${k}`);
  const first = sweep[0]!;
  const last = sweep[sweep.length - 1]!;
  const growth = last.peak_device_bytes.map(
    (b, d) => b / first.peak_device_bytes[d]!,
  );
  await reportBenchResults(
    o.out,
    'l2l-pipeline',
    { options: o, runs, growth },
    l2lPipelineMarkdown(o, runs, { first, last, growth }),
    log,
  );
  return runs;
}

/**
 * Trains charlm-small with `blocks` blocks through the trainer (o's micro-batches, mini-batch,
 * steps and backend; a 4 GiB device budget; no evaluation) with `flags` on top, into `out`;
 * returns its figures from summary.json and its step metrics, labelled `run`.
 */
async function trainRun(
  o: L2LPipelineBenchOptions,
  out: string,
  run: string,
  blocks: number,
  flags: Record<string, unknown>,
): Promise<RunFigures> {
  const r = await train({
    preset: 'charlm-small',
    layers: blocks - 2,
    microBatches: o.microBatches,
    batchSize: o.batchSize,
    steps: o.steps,
    evalEvery: 0,
    evalBatches: 1,
    backend: o.backend,
    deviceMemory: '4GiB',
    out,
    ...flags,
  });
  const f = stepFigures(readStepMetrics(out));
  const s = r.summary;
  return {
    run,
    blocks,
    peak_device_bytes: s.peak_device_bytes ?? [],
    predicted_peak_device_bytes: s.predicted_peak_device_bytes ?? null,
    host_to_device_bytes: f.hostToDeviceBytes,
    step_s: f.stepSeconds,
    tokens_per_s: s.tokens_per_s ?? Number.NaN,
  };
}

/**
 * l2l-pipeline.md: the setting, one table row per run, and each device's peak at the deepest
 * sweep model (`last`) against the shallowest (`first`): `growth`, beside the 1.05x bar.
 */
function l2lPipelineMarkdown(
  o: L2LPipelineBenchOptions,
  runs: RunFigures[],
  sweep: { first: RunFigures; last: RunFigures; growth: number[] },
): string {
  const { first, last, growth } = sweep;
  return `# l2l-pipeline benchmark\n\nThe pipelined relay, \`--strategy l2l --stages ${o.stages}\` (each device relays its own stage's layers from the one parameter server; gpipe schedule, host stash), on charlm-small with more and more blocks, mini-batch ${o.batchSize}, ${o.microBatches} micro-batches, backend ${o.backend}, ${o.steps} steps per run (the first left out of the step figures), one run after the other on this machine. Peaks are summary.json's \`peak_device_bytes\` and \`predicted_peak_device_bytes\` (predicted before training).\n\n${markdownTable(
    {
      columns: [
        'run',
        'blocks',
        'peak MiB per device',
        'predicted MiB',
        'host-to-device MiB per step',
        'step s (median)',
        'tokens/s',
      ],
      rows: runs.map((r) => [
        r.run,
        r.blocks,
        r.peak_device_bytes.map(mib).join(' / '),
        r.predicted_peak_device_bytes?.map(mib).join(' / ') ?? '-',
        mib(r.host_to_device_bytes),
        r.step_s.toFixed(3),
        r.tokens_per_s.toFixed(0),
      ]),
    },
  )}\nPeak per device at ${last.blocks} blocks against ${first.blocks}: ${growth.map((g) => `${g.toFixed(3)}x`).join(' / ')} (bar: at most 1.05x).\n`;
}
