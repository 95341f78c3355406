import assert from 'node:assert/strict';
import { test } from 'node:test';
import { resolveConfig, runModelConfig } from '../config/config.js';
import { loadDataset } from '../data/index.js';
import { sizeOf } from '../model/block.js';
import { loadModel, type Model } from '../model/model.js';
import '../strategies/index.js'; // registers the strategies, whose default resolveConfig gives
import { LayerwiseError } from '../util/errors.js';
import { checkWebGpuLimits, largestTensor } from './webgpu-limits.js';

async function charlm(o: { dModel?: number } = {}): Promise<Model> {
  const cfg = resolveConfig({ preset: 'charlm-tiny', out: 'unused', ...o });
  return loadModel(await runModelConfig(cfg, await loadDataset(cfg.data)));
}

/** Every parameter's and every block output's bytes at `n` examples (float32/int32: 4 bytes). */
function allTensorBytes(m: Model, n: number): number[] {
  const out = [4 * sizeOf(m.inputShape(n))];
  let shape = m.inputShape(n);
  for (const b of m.blocks) {
    for (const p of b.params) out.push(4 * sizeOf(p.shape));
    shape = b.outputShape(shape);
    out.push(4 * sizeOf(shape));
  }
  return out;
}

test('largestTensor finds the largest parameter or activation, at the micro-batch size', async () => {
  const m = await charlm();
  for (const n of [1, 4, 32]) {
    const t = largestTensor(m, n);
    assert.equal(t.bytes, Math.max(...allTensorBytes(m, n)));
    assert.equal(t.bytes, 4 * sizeOf(t.shape));
  }
  // a micro-batch of 1: a parameter is the largest; of 32: the logits
  assert.equal(largestTensor(m, 1).kind, 'parameter');
  assert.equal(largestTensor(m, 32).kind, 'activation');
});

test('checkWebGpuLimits passes a model at the limit and names the limit, tensor, size and fix over it', async () => {
  const m = await charlm();
  const t = largestTensor(m, 32);
  const at = (maxBufferSize: number, maxStorageBufferBindingSize: number) =>
    checkWebGpuLimits(m, 32, { maxBufferSize, maxStorageBufferBindingSize });
  at(t.bytes, t.bytes); // exactly fits
  assert.throws(
    () => at(2 ** 30, t.bytes - 1),
    (e: Error) =>
      e instanceof LayerwiseError &&
      /its largest tensor, the output of block \d+ \(head\) \[32, 64, \d+\], takes .* KiB, over the adapter's maxStorageBufferBindingSize of/.test(
        e.message,
      ) &&
      /more micro-batches .* or the wasm backend/.test(e.message),
  );
  assert.throws(() => at(t.bytes - 1, 2 ** 30), /maxBufferSize of/);
});

test("a model over SwiftShader's 1 GiB (d-model 16384) is refused before any tensor is made", async () => {
  const m = await charlm({ dModel: 16384 });
  assert.throws(
    () =>
      checkWebGpuLimits(m, 32, {
        maxBufferSize: 2 ** 30,
        maxStorageBufferBindingSize: 2 ** 30,
      }),
    /parameter w1 of block 1 \(.*\) \[16384, 65536\], takes 4 GiB, over the adapter's maxStorageBufferBindingSize of 1 GiB; use a smaller model .* or the wasm backend/,
  );
});
