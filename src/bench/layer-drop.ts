/**
 * `npm run bench -- layer-drop`: what LayerDrop (--layer-drop, model/layer-drop.ts) saves the
 * L2L relay. The same l2l run (charlm-small with `--layers` blocks, the host stash) trains with
 * `--layer-drop 0` and with P, one after the other, through the trainer; the table gives each
 * run's mean host-to-device bytes per step (what the relay uploaded: kept layers only),
 * median step seconds and tokens/s (summary.json), and the ratios. Issue 24's bar: bytes at
 * P = 0.5 at most 0.65x of P = 0, and a lower step time. Writes layer-drop.{json,md}.
 */
import { mkdtempSync, rmSync } from 'node:fs';
import { tmpdir } from 'node:os';
import { join } from 'node:path';
import { readStepMetrics } from '../train/metrics.js';
import { train } from '../train/trainer.js';
import { markdownTable, stepFigures, writeBenchResults } from './report.js';

export interface LayerDropBenchOptions {
  /** Decoder blocks of charlm-small (--layers). */
  layers: number;
  /** The drop probability compared with 0. */
  p: number;
  steps: number;
  batchSize: number;
  microBatches: number;
  /** l2l devices (more than 1: the pipelined relay); default 1. */
  stages?: number;
  backend: string;
  out: string;
}

/** One run's figures. */
interface RunFigures {
  layer_drop: number;
  /** Mean over the steps after the first of host_to_device_bytes (bytes per step). */
  host_to_device_bytes: number;
  /** Median seconds of the steps after the first. */
  step_s: number;
  tokens_per_s: number;
  /** Mean blocks skipped per step. */
  dropped_blocks: number;
}

/** Runs the comparison and writes the results; `log` hears each run. */
export async function benchLayerDrop(
  o: LayerDropBenchOptions,
  log: (s: string) => void,
): Promise<RunFigures[]> {
  const dir = mkdtempSync(join(tmpdir(), 'layerwise-bench-layer-drop-'));
  const runs: RunFigures[] = [];
  try {
    for (const p of [0, o.p]) {
      const out = join(dir, `p${p}`);
      const r = await train({
        preset: 'charlm-small',
        layers: o.layers,
        strategy: 'l2l',
        stages: o.stages ?? 1,
        microBatches: o.microBatches,
        batchSize: o.batchSize,
        steps: o.steps,
        evalEvery: 0,
        evalBatches: 1,
        backend: o.backend,
        layerDrop: p,
        out,
      });
      const f = stepFigures(readStepMetrics(out));
      const ms = f.steps;
      const fig: RunFigures = {
        layer_drop: p,
        host_to_device_bytes: f.hostToDeviceBytes,
        step_s: f.stepSeconds,
        tokens_per_s: r.summary.tokens_per_s ?? Number.NaN,
        dropped_blocks:
          ms.reduce((a, m) => a + (m.dropped_blocks?.length ?? 0), 0) /
          ms.length,
      };
      runs.push(fig);
      log(
        `l2l --layer-drop ${p}: ${(fig.host_to_device_bytes / 2 ** 20).toFixed(1)} MiB host-to-device per step, step ${fig.step_s.toFixed(3)} s (median), ${fig.tokens_per_s.toFixed(0)} tokens/s, ${fig.dropped_blocks.toFixed(1)} blocks skipped per step`,
      );
    }
  } finally {
    rmSync(dir, { recursive: true, force: true });
  }
  const [base, drop] = runs as [RunFigures, RunFigures];
  const ratios = {
    host_to_device_bytes: drop.host_to_device_bytes / base.host_to_device_bytes,
    step_s: drop.step_s / base.step_s,
    tokens_per_s: drop.tokens_per_s / base.tokens_per_s,
  };
  const k = o.stages ?? 1;
  const name = k > 1 ? `layer-drop-k${k}` : 'layer-drop';
  const md = `# ${name} benchmark\n\nl2l${k > 1 ? ` --stages ${k} (the pipelined relay)` : ''} on charlm-small with ${o.layers} decoder blocks (${o.layers + 2} blocks: the embedding and the head are never skipped), mini-batch ${o.batchSize}, ${o.microBatches} micro-batches, backend ${o.backend}, host stash, ${o.steps} steps each (the first left out), one run after the other on this machine.\n\n${markdownTable(
    {
      columns: [
        '--layer-drop',
        'host-to-device MiB per step (mean)',
        'step s (median)',
        'tokens/s',
        'blocks skipped per step',
      ],
      rows: runs.map((r) => [
        r.layer_drop,
        (r.host_to_device_bytes / 2 ** 20).toFixed(1),
        r.step_s.toFixed(3),
        r.tokens_per_s.toFixed(0),
        r.dropped_blocks.toFixed(1),
      ]),
    },
  )}\nRatios at P = ${o.p} against P = 0: host-to-device bytes ${ratios.host_to_device_bytes.toFixed(2)}x (bar: at most 0.65x at P = 0.5), step time ${ratios.step_s.toFixed(2)}x, tokens/s ${ratios.tokens_per_s.toFixed(2)}x.\n`;
  const files = await writeBenchResults(
    o.out,
    name,
    { options: o, runs, ratios },
    md,
  );
  log(`wrote ${files.join(', ')}`);
  return runs;
}
