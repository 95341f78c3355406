/**
 * The optimizer math of the eager parameter server (EPS): SGD with momentum and AdamW as tight
 * loops over Float32Arrays in host memory, one tensor at a time, with no TF.js and no allocation.
 *
 * Source: L2L's eager parameter server runs the optimizer on the host, on fp32 master weights,
 * while the device computes the next layer (Pudipeddi et al., 2020, "Training Large Neural
 * Networks with Constant Memory using a New Execution Algorithm", arXiv 2002.05645). The idea of
 * a fused, single-pass host Adam is ZeRO-Offload's CPU Adam (Ren et al., 2021, arXiv
 * 2101.06840), here in plain JavaScript (V8 compiles the loop to scalar machine code).
 *
 * The update rules are exactly those of {@link DeviceOptimizer} (src/optim/optimizer.ts), so a
 * step on the host equals a step on a device up to float32 rounding: the host computes each
 * element in float64 and rounds once when it stores, the device rounds after every op.
 *
 * {@link nativeHostUpdate} is the same update in the native addon (float32 arithmetic,
 * vectorised; tested equal within 1e-6), which the optimizer threads use where it is built.
 *
 * This module must not import TF.js: it runs in the optimizer worker threads.
 */
import type { NativeAddon } from '../backend/native-addon.js';
import type { OptimizerConfig } from '../optim/optimizer.js';
import { decayRate } from '../optim/weight-decay.js';

/**
 * Slot names of an optimizer's state per parameter, as {@link DeviceOptimizer} names them:
 * `['m', 'v']` for AdamW, `['velocity']` for SGD with momentum > 0, `[]` for plain SGD.
 */
export function slotNames(cfg: OptimizerConfig): string[] {
  if (cfg.kind === 'adamw') return ['m', 'v'];
  return cfg.momentum > 0 ? ['velocity'] : [];
}

function need(
  slots: Record<string, Float32Array>,
  name: string,
  n: number,
): Float32Array {
  const s = slots[name];
  if (!(s instanceof Float32Array))
    throw new Error(`hostUpdate: missing optimizer slot '${name}'`);
  if (s.length !== n)
    throw new Error(
      `hostUpdate: optimizer slot '${name}' has ${s.length} values, the parameter ${n}`,
    );
  return s;
}

/** The checks both updates make before changing anything; the element count and the weight decay that applies. */
function checkUpdate(
  cfg: OptimizerConfig,
  rank: number,
  p: Float32Array,
  g: Float32Array,
  step: number,
): { n: number; wd: number } {
  const n = p.length;
  if (g.length !== n)
    throw new Error(
      `hostUpdate: gradient has ${g.length} values, the parameter ${n}`,
    );
  if (cfg.kind === 'adamw' && !(step >= 1))
    throw new Error(`hostUpdate: AdamW needs a 1-based step, got ${step}`);
  return { n, wd: decayRate(cfg, rank) };
}

/**
 * One optimizer update of one parameter tensor, in place, in a single pass over its elements.
 *
 * - `cfg`: the optimizer (kind, momentum, betas, epsilon, weight decay; `clipNorm` is not used here:
 *   the caller passes the resulting global `scale`).
 * - `rank`: the parameter's number of dimensions; weight decay applies only when rank >= 2
 *   (matrices and kernels, not biases and gains), as in {@link DeviceOptimizer}.
 * - `p`: the parameter's fp32 values (any shape, flattened), updated in place.
 * - `g`: its gradient, same length, read only (multiplied by `scale` on the fly).
 * - `slots`: its optimizer state, updated in place: `{m, v}` for AdamW, `{velocity}` for SGD
 *   with momentum > 0, nothing for plain SGD; each the same length as `p`, zeros before the
 *   first step.
 * - `lr`: learning rate of this step; `scale`: global gradient-clipping scale (1 = none);
 *   `step`: the 1-based step number t (AdamW's bias correction 1 - beta^t; unused by SGD).
 *
 * Updates (g' = scale g, wd = weightDecay if rank >= 2 else 0):
 * - SGD: v <- mu v + g' + wd p; p <- p - lr v (mu = 0: p <- p - lr (g' + wd p)).
 * - AdamW: m <- b1 m + (1-b1) g'; v <- b2 v + (1-b2) g'^2;
 *   p <- p - lr (m/(1-b1^t) / (sqrt(v/(1-b2^t)) + epsilon) + wd p).
 *
 * Throws an Error (before changing anything) if `g` or a slot has another length than `p`, if a
 * needed slot is missing, or if AdamW gets a step < 1.
 */
export function hostUpdate(
  cfg: OptimizerConfig,
  rank: number,
  p: Float32Array,
  g: Float32Array,
  slots: Record<string, Float32Array>,
  lr: number,
  scale: number,
  step: number,
): void {
  const { n, wd } = checkUpdate(cfg, rank, p, g, step);
  if (cfg.kind === 'sgd') {
    const mu = cfg.momentum;
    if (mu > 0) {
      const vel = need(slots, 'velocity', n);
      for (let i = 0; i < n; i++) {
        const pi = p[i];
        const vi = mu * vel[i] + (g[i] * scale + wd * pi);
        vel[i] = vi;
        p[i] = pi - lr * vi;
      }
    } else {
      for (let i = 0; i < n; i++) {
        const pi = p[i];
        p[i] = pi - lr * (g[i] * scale + wd * pi);
      }
    }
    return;
  }
  const m = need(slots, 'm', n);
  const v = need(slots, 'v', n);
  const b1 = cfg.beta1;
  const b2 = cfg.beta2;
  const a1 = 1 - b1;
  const a2 = 1 - b2;
  const epsilon = cfg.epsilon;
  // Constants folded out of the loop (equal in exact arithmetic to the rule above):
  // lr m^ = k m with k = lr / (1 - b1^t); sqrt(v^) = sqrt(v) s2 with s2 = 1 / sqrt(1 - b2^t);
  // p - lr wd p = decay p. Per element: one sqrt and one division (the loop's bottleneck).
  const k = lr / (1 - b1 ** step);
  const s2 = 1 / Math.sqrt(1 - b2 ** step);
  const decay = 1 - lr * wd;
  for (let i = 0; i < n; i++) {
    const gi = g[i] * scale;
    const mi = b1 * m[i] + a1 * gi;
    const vi = b2 * v[i] + a2 * gi * gi;
    m[i] = mi;
    v[i] = vi;
    p[i] = p[i] * decay - (k * mi) / (Math.sqrt(vi) * s2 + epsilon);
  }
}

/**
 * {@link hostUpdate} in the native addon (`lib`, backend/native-addon.ts): the same arguments,
 * checks and update rule, computed in float32 with the per-step constants in float64, on the
 * calling thread's OpenMP team. Throws an Error like {@link hostUpdate}.
 */
export function nativeHostUpdate(
  lib: NativeAddon,
  cfg: OptimizerConfig,
  rank: number,
  p: Float32Array,
  g: Float32Array,
  slots: Record<string, Float32Array>,
  lr: number,
  scale: number,
  step: number,
): void {
  const { n, wd } = checkUpdate(cfg, rank, p, g, step);
  if (cfg.kind === 'sgd') {
    lib.sgd(
      p,
      g,
      cfg.momentum > 0 ? need(slots, 'velocity', n) : null,
      lr,
      cfg.momentum,
      wd,
      scale,
    );
    return;
  }
  lib.adamw(
    p,
    g,
    need(slots, 'm', n),
    need(slots, 'v', n),
    lr,
    cfg.beta1,
    cfg.beta2,
    cfg.epsilon,
    wd,
    step,
    scale,
  );
}
