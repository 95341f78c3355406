/**
 * Issue 23 item 8: a non-finite value in a bf16 step is named by stage, block, micro-batch and
 * step, as in float32 (the diagnosis replays the step at the run's precision), and nothing is
 * updated with it. Needs the native backend with bf16 instructions (skips saying why).
 */
import assert from 'node:assert/strict';
import { mkdtempSync, rmSync } from 'node:fs';
import { tmpdir } from 'node:os';
import { join } from 'node:path';
import { test } from 'node:test';
import { bf16Support } from '../backend/names.js';
import { nativeAddon, nativeUnavailable } from '../backend/native.js';
import { LayerwiseError } from '../util/errors.js';

const skip = !nativeAddon()
  ? `native backend unavailable: ${nativeUnavailable()}`
  : !bf16Support().nativeBf16
    ? `this CPU has no avx512_bf16 or AMX (${bf16Support().note})`
    : false;

test('a numeric fault in a bf16 step names its stage, block, micro-batch and step (gpipe K=2 and single)', {
  skip,
  timeout: 120_000,
}, async () => {
  const { train } = await import('../train/trainer.js');
  const dir = mkdtempSync(join(tmpdir(), 'layerwise-bf16-fault-'));
  try {
    for (const flags of [
      { strategy: 'gpipe', stages: 2, microBatches: 2 },
      { strategy: 'single' },
    ]) {
      // an absurd learning rate: the first update is finite but huge, a later forward overflows
      await assert.rejects(
        train({
          preset: 'charlm-tiny',
          layers: 2,
          dModel: 32,
          heads: 2,
          context: 16,
          batchSize: 8,
          evalBatches: 1,
          evalEvery: 0,
          steps: 10,
          lr: 1e6,
          warmup: 0,
          backend: 'native',
          precision: 'bf16',
          ...flags,
          out: join(dir, flags.strategy),
        }),
        (e: Error) => {
          assert.ok(e instanceof LayerwiseError, e.message);
          assert.match(
            e.message,
            /non-finite value at step \d+: the (output|loss|gradient|input).* (of )?block \d+ \(\w+\) on stage \d, micro-batch \d.*; nothing was updated with it/,
          );
          return true;
        },
      );
    }
  } finally {
    rmSync(dir, { recursive: true, force: true });
  }
});
