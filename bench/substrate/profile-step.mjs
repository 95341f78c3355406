// Per-kernel profile of one training step of a charlm model on the wasm backend, run exactly as
// the `single` strategy runs it: a Stage over all blocks, forward with the tape kept ('never'),
// backward, gradient norm, optimizer step.
// Usage: npx tsc -p . && node bench/substrate/profile-step.mjs [steps=3] [batch=32] [backend=wasm]
//   env LAYERS, DMODEL, HEADS, CONTEXT, VOCAB override the charlm-small shape; TOP = rows shown.
// Every registered kernel of the backend is wrapped with a timer (self time: a JS kernel that
// runs other kernels through runWasm is charged only for its own work). Kernel time is grouped by
// phase: forward, backward (gradient functions run by tf.grads), optim (norm + update).
// "engine/JS" is the phase's wall time minus its kernel time (tape, gradient funcs, bookkeeping).
// Peak memory is the exact engine numBytes high-water mark (src/runtime/memory.ts).
import { initBackend } from '../../dist/backend/index.js';
import { buildModel } from '../../dist/model/model.js';
import { initParams } from '../../dist/model/init.js';
import { Stage } from '../../dist/pipeline/stage.js';
import { defaultOptimizerConfig, clipScale } from '../../dist/optim/optimizer.js';
import { peakBytes, resetPeakBytes, deviceBytes } from '../../dist/runtime/memory.js';
import { tf } from '../../dist/runtime/tfjs.js';

const steps = Number(process.argv[2] ?? 3);
const batch = Number(process.argv[3] ?? 32);
const backendName = process.argv[4] ?? 'wasm';
const env = (k, d) => Number(process.env[k] ?? d);
const cfg = {
  arch: 'charlm', layers: env('LAYERS', 4), dModel: env('DMODEL', 256), heads: env('HEADS', 4),
  context: env('CONTEXT', 128), vocab: env('VOCAB', 89),
};
const TOP = env('TOP', 25);

await initBackend(backendName);

// ---- kernel timers -------------------------------------------------------------------------
let phase = 'setup';
const stats = new Map(); // `${phase}|${kernel}` -> {ms, calls, shapes: Map}
const stack = []; // child time accumulators of the active kernels
let recording = false;
function record(name, shapeKey, ms) {
  const key = `${phase}|${name}`;
  let s = stats.get(key);
  if (!s) stats.set(key, (s = { phase, name, ms: 0, calls: 0, shapes: new Map() }));
  s.ms += ms;
  s.calls++;
  s.shapes.set(shapeKey, (s.shapes.get(shapeKey) ?? 0) + ms);
}
for (const k of tf.getKernelsForBackend(backendName)) {
  const orig = k.kernelFunc;
  tf.unregisterKernel(k.kernelName, backendName);
  tf.registerKernel({
    ...k,
    kernelFunc(args) {
      if (!recording) return orig(args);
      stack.push(0);
      const t0 = performance.now();
      let out;
      try {
        out = orig(args);
      } finally {
        const dt = performance.now() - t0;
        const child = stack.pop();
        if (stack.length > 0) stack[stack.length - 1] += dt;
        const shapes = Object.values(args.inputs).filter(Boolean).map((t) => `[${t.shape}]`).join('');
        const a = args.attrs ?? {};
        const extra = a.perm ? ` perm=${a.perm}` : a.transposeA || a.transposeB ? ` tA=${!!a.transposeA} tB=${!!a.transposeB}` : '';
        record(k.kernelName, shapes + extra, dt - child);
      }
      return out;
    },
  });
}

// ---- the model and one Stage, as in the single strategy ---------------------------------------
const model = buildModel(cfg);
const params = initParams(model.blocks, 1);
const opt = defaultOptimizerConfig('adamw');
const stage = new Stage(model, { from: 0, to: model.blocks.length }, params, opt);

let seed = 12345;
const rand = () => ((seed = (Math.imul(seed, 1664525) + 1013904223) >>> 0) / 2 ** 32);
function makeBatch() {
  const n = batch * cfg.context;
  const x = new Int32Array(n);
  const y = new Int32Array(n);
  for (let i = 0; i < n; i++) { x[i] = Math.floor(rand() * cfg.vocab); y[i] = Math.floor(rand() * cfg.vocab); }
  return [tf.tensor(x, [batch, cfg.context], 'int32'), tf.tensor(y, [batch, cfg.context], 'int32')];
}

const wall = [];
function step(rec) {
  recording = rec;
  const [x, y] = makeBatch();
  const t = {};
  resetPeakBytes();
  const p0 = performance.now();
  phase = 'forward';
  stage.forward(0, x, { keep: true, grad: true, labels: y });
  const p1 = performance.now();
  const peakFwd = peakBytes();
  phase = 'backward';
  stage.backward(0, null, 1);
  const p2 = performance.now();
  phase = 'optim';
  const scale = clipScale(stage.gradSquaredNorm(), opt.clipNorm);
  stage.step(1e-3, scale);
  const p3 = performance.now();
  phase = 'setup';
  recording = false;
  t.forward = p1 - p0; t.backward = p2 - p1; t.optim = p3 - p2; t.total = p3 - p0;
  t.peak = peakBytes(); t.peakFwd = peakFwd;
  t.loss = stage.losses.get(0);
  return t;
}

step(false); // warm-up: XNNPACK operator creation, heap growth
for (let i = 0; i < steps; i++) wall.push(step(true));

const median = (xs) => { const s = [...xs].sort((a, b) => a - b); return s[s.length >> 1]; };
const tokens = batch * cfg.context;
const GiB = 2 ** 30;
console.log(`charlm ${JSON.stringify(cfg)} batch ${batch} on ${backendName}; ${steps} timed steps (after 1 warm-up)`);
for (const k of ['forward', 'backward', 'optim', 'total']) {
  console.log(`  ${k.padEnd(9)} median ${median(wall.map((w) => w[k])).toFixed(0).padStart(6)} ms  (${wall.map((w) => w[k].toFixed(0)).join(', ')})`);
}
console.log(`  tokens/s  ${(tokens / median(wall.map((w) => w.total)) * 1000).toFixed(0)}   loss ${wall.map((w) => w.loss.toFixed(4)).join(', ')}`);
console.log(`  peak device memory ${(median(wall.map((w) => w.peak)) / GiB).toFixed(3)} GiB (end of forward ${(median(wall.map((w) => w.peakFwd)) / GiB).toFixed(3)} GiB), live after step ${(deviceBytes() / 2 ** 20).toFixed(1)} MiB`);

for (const ph of ['forward', 'backward', 'optim']) {
  const rows = [...stats.values()].filter((s) => s.phase === ph).sort((a, b) => b.ms - a.ms);
  const kernelMs = rows.reduce((s, r) => s + r.ms, 0) / steps;
  const phaseMs = median(wall.map((w) => w[ph]));
  console.log(`\n== ${ph}: kernels ${kernelMs.toFixed(0)} ms/step, engine/JS ${(phaseMs - kernelMs).toFixed(0)} ms/step`);
  for (const r of rows.slice(0, TOP)) {
    const topShape = [...r.shapes.entries()].sort((a, b) => b[1] - a[1])[0];
    console.log(`  ${r.name.padEnd(22)} ${(r.ms / steps).toFixed(1).padStart(8)} ms ${String(r.calls / steps).padStart(5)} calls  top: ${topShape[0]} ${(topShape[1] / steps).toFixed(1)} ms`);
  }
}
if (process.env.SHAPES) {
  console.log('\n== by kernel and shape (ms/step)');
  const all = [];
  for (const s of stats.values()) for (const [shape, ms] of s.shapes) all.push([s.phase, s.name, shape, ms / steps]);
  all.sort((a, b) => b[3] - a[3]);
  for (const [ph, n, sh, ms] of all.slice(0, Number(process.env.SHAPES))) console.log(`  ${ph.padEnd(8)} ${n.padEnd(20)} ${ms.toFixed(1).padStart(8)}  ${sh}`);
}
stage.dispose();
