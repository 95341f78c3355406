// Matrix-product throughput on the wasm backend, stock TF.js vs layerwise's substrate.
// Usage: npm run build && node bench/substrate/matmul.mjs [stock|layerwise] [seconds-per-case]
// Prints one line per case: GFLOP/s and ms per call (median of timed repetitions).
import * as tf from '@tensorflow/tfjs-core';
import '@tensorflow/tfjs';
import '@tensorflow/tfjs-backend-wasm';

const mode = process.argv[2] ?? 'layerwise';
const seconds = Number(process.argv[3] ?? 1);
if (mode === 'stock') {
  await tf.setBackend('wasm');
  await tf.ready();
} else {
  const { initBackend } = await import('../../dist/backend/index.js');
  await initBackend('wasm');
}

/** Time `f` (which returns tensors; they are read back once and disposed) and print GFLOP/s. */
function bench(name, flops, f) {
  const once = () => tf.tidy(() => { const r = f(); (Array.isArray(r) ? r : [r]).forEach((t) => t.dataSync()); });
  once(); once();
  const times = [];
  const start = performance.now();
  while (performance.now() - start < seconds * 1000 || times.length < 3) {
    const s = performance.now();
    once();
    times.push(performance.now() - s);
  }
  times.sort((a, b) => a - b);
  const ms = times[times.length >> 1];
  console.log(`${mode.padEnd(9)} ${name.padEnd(44)} ${(flops / ms / 1e6).toFixed(2).padStart(7)} GFLOP/s ${ms.toFixed(2).padStart(9)} ms`);
}

const mm = (m, k, n, b = 1) => 2 * b * m * k * n;
const x = tf.randomNormal([256, 1024]);
const w = tf.randomNormal([1024, 1024]);
bench('x[256,1024] @ w[1024,1024]', mm(256, 1024, 1024), () => tf.matMul(x, w));
bench('x @ w^T (transposeB)', mm(256, 1024, 1024), () => tf.matMul(x, w, false, true));
bench('x^T @ y (transposeA) [1024,256]x[256,1024]', mm(1024, 256, 1024), () => tf.matMul(x, x, true, false));
const a = tf.randomNormal([8, 128, 64]);
const b = tf.randomNormal([8, 64, 128]);
bench('batched [8,128,64] @ [8,64,128]', mm(128, 64, 128, 8), () => tf.matMul(a, b));
const q = tf.randomNormal([32, 128, 64]);
const k = tf.randomNormal([32, 128, 64]);
const p = tf.randomNormal([32, 128, 128]);
bench('attention q@k^T [32,128,64]x[32,128,64]^T', mm(128, 64, 128, 32), () => tf.matMul(q, k, false, true));
bench('attention p@v [32,128,128]x[32,128,64]', mm(128, 128, 64, 32), () => tf.matMul(p, k));
const h = tf.randomNormal([8, 128, 512]);
const w2 = tf.randomNormal([512, 512]);
bench('dense 3-D [8,128,512] @ [512,512]', mm(1024, 512, 512), () => tf.matMul(h, w2));

// Training step of a 4-layer 1024-wide MLP (relu), batch 256: forward 2 + backward 4 flop/MAC.
const ws = [0, 1, 2, 3].map(() => tf.variable(tf.randomNormal([1024, 1024], 0, 0.03)));
const target = tf.randomNormal([256, 1024]);
const mlpLoss = () => {
  let y = x;
  ws.forEach((wi, i) => { y = tf.matMul(y, wi); if (i < 3) y = tf.relu(y); });
  return tf.mean(tf.square(tf.sub(y, target)));
};
bench('MLP 4x1024 train step (batch 256, fwd+bwd)', 3 * 4 * mm(256, 1024, 1024), () => {
  const { value, grads } = tf.variableGrads(mlpLoss, ws);
  return [value, ...Object.values(grads)];
});
// Attention core forward+backward: softmax(q k^T) v, B*H=32, T=128, dh=64.
bench('attention core fwd+bwd [32,128,64]', 3 * 2 * mm(128, 64, 128, 32), () =>
  tf.grads((qq, kk, vv) => tf.sum(tf.matMul(tf.softmax(tf.matMul(qq, kk, false, true)), vv)))([q, k, k]));
// Dense layer on 3-D input with a broadcast weight: fails with the stock gradient (shape mismatch).
try {
  bench('dense 3-D fwd+bwd [8,128,512]@[512,512]', 3 * mm(1024, 512, 512), () =>
    tf.grads((hh, ww) => tf.sum(tf.matMul(hh, ww)))([h, w2]));
} catch (err) {
  console.log(`${mode.padEnd(9)} dense 3-D fwd+bwd: ${err.message.split('\n')[0]}`);
}
