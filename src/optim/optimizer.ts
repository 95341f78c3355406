/**
 * Optimizers that run on a device, on one stage's parameters. Every strategy uses these, so a
 * pipeline's per-stage updates are exactly the single-device updates.
 *
 * - SGD with momentum, PyTorch convention: v <- mu v + g (+ wd p); p <- p - lr v.
 * - AdamW (Loshchilov & Hutter, 2019): Adam with bias correction and decoupled weight decay
 *   p <- p - lr (m^ / (sqrt(v^) + epsilon) + wd p).
 * For both, weight decay applies to matrices and kernels (rank >= 2), not to biases and
 * layer-norm gains.
 * Gradients are first multiplied by the global clipping scale (see {@link clipScale}).
 */
import * as tf from '@tensorflow/tfjs-core';
import {
  ADAMW_KERNEL,
  ADAMW_MULTI_KERNEL,
  SGD_KERNEL,
} from '../backend/kernel-names.js';
import { LayerwiseError } from '../util/errors.js';
import { decayRate } from './weight-decay.js';

export type OptimizerKind = 'sgd' | 'adamw';
export const OPTIMIZER_KINDS: readonly OptimizerKind[] = ['sgd', 'adamw'];

/** Optimizer hyper-parameters (plain JSON, sent to every stage). */
export interface OptimizerConfig {
  kind: OptimizerKind;
  /** SGD momentum mu. */
  momentum: number;
  beta1: number;
  beta2: number;
  epsilon: number;
  weightDecay: number;
  /** Maximum global gradient L2 norm; 0 disables clipping. */
  clipNorm: number;
}

/** Defaults: AdamW(0.9, 0.95, 1e-8), weight decay 0.01, clipping at norm 1. */
export function defaultOptimizerConfig(
  kind: OptimizerKind = 'adamw',
): OptimizerConfig {
  if (!OPTIMIZER_KINDS.includes(kind)) {
    throw new LayerwiseError(
      `unknown optimizer '${kind}'; valid: ${OPTIMIZER_KINDS.join(', ')}`,
    );
  }
  return {
    kind,
    momentum: 0.9,
    beta1: 0.9,
    beta2: 0.95,
    epsilon: 1e-8,
    weightDecay: kind === 'adamw' ? 0.01 : 0,
    clipNorm: 1,
  };
}

/**
 * Global-norm clipping scale: min(1, maxNorm / (norm + 1e-6)) where norm = sqrt(sumSquares)
 * is summed over every parameter of every stage. Returns 1 when maxNorm is 0.
 */
export function clipScale(sumSquares: number, maxNorm: number): number {
  if (!(maxNorm > 0)) return 1;
  const norm = Math.sqrt(sumSquares);
  return Math.min(1, maxNorm / (norm + 1e-6));
}

/** Serialized optimizer state: step count and, per parameter, its slot arrays (m, v or velocity). */
export interface OptimizerState {
  step: number;
  slots: Record<string, Record<string, Float32Array>>;
}

/** A device-side optimizer over named parameters. */
export class DeviceOptimizer {
  private step = 0;
  private readonly slots = new Map<string, Record<string, tf.Variable>>();
  constructor(readonly config: OptimizerConfig) {}

  private slot(name: string, p: tf.Variable, key: string): tf.Variable {
    let s = this.slots.get(name);
    if (!s) this.slots.set(name, (s = {}));
    if (!s[key]) {
      const zeros = tf.zerosLike(p);
      s[key] = tf.variable(zeros, false);
      zeros.dispose();
    }
    return s[key];
  }

  /**
   * One update of every parameter that has a gradient. `grads` are the accumulated gradients
   * (same shapes as the parameters); `lr` the learning rate of this step; `scale` the global
   * clipping scale. Gradients are not disposed.
   */
  apply(
    params: ReadonlyMap<string, tf.Variable>,
    grads: ReadonlyMap<string, tf.Tensor>,
    lr: number,
    scale: number,
  ): void {
    this.step++;
    const c = this.config;
    const t = this.step;
    if (this.applyMulti(params, grads, lr, scale)) return;
    // a backend with the fused update kernel (the native device) does each parameter in one pass
    const fused =
      tf.getKernel(
        c.kind === 'sgd' ? SGD_KERNEL : ADAMW_KERNEL,
        tf.getBackend(),
      ) !== undefined;
    for (const [name, p] of params) {
      const g0 = grads.get(name);
      if (!g0) continue;
      const wd = decayRate(c, p.rank);
      tf.tidy(() => {
        if (fused) {
          this.applyFused(name, p, g0, lr, scale, wd);
          return;
        }
        const g = scale === 1 ? g0 : tf.mul(g0, scale);
        if (c.kind === 'sgd') {
          const gw = wd > 0 ? tf.add(g, tf.mul(p, wd)) : g;
          if (c.momentum > 0) {
            const v = this.slot(name, p, 'velocity');
            v.assign(tf.add(tf.mul(v, c.momentum), gw));
            p.assign(tf.sub(p, tf.mul(v, lr)));
          } else {
            p.assign(tf.sub(p, tf.mul(gw, lr)));
          }
        } else {
          const m = this.slot(name, p, 'm');
          const v = this.slot(name, p, 'v');
          m.assign(tf.add(tf.mul(m, c.beta1), tf.mul(g, 1 - c.beta1)));
          v.assign(
            tf.add(tf.mul(v, c.beta2), tf.mul(tf.square(g), 1 - c.beta2)),
          );
          const mhat = tf.div(m, 1 - c.beta1 ** t);
          const vhat = tf.div(v, 1 - c.beta2 ** t);
          let upd = tf.div(mhat, tf.add(tf.sqrt(vhat), c.epsilon));
          if (wd > 0) upd = tf.add(upd, tf.mul(p, wd));
          p.assign(tf.sub(p, tf.mul(upd, lr)));
        }
      });
    }
  }

  /**
   * AdamW over every parameter that has a gradient in one kernel call, where the backend
   * registers ADAMW_MULTI_KERNEL (webgpu: one dispatch for the stage instead of three a
   * parameter; native: one OpenMP region over many instead of one a parameter), or in calls of at
   * most the kernel's `elementsPerCall` (kernel-names.ts), each call's outputs assigned before the
   * next. The decayed parameters go first (the kernel decays a prefix). Returns false, having
   * done nothing, where the kernel is missing, the optimizer is not AdamW, or parameters would
   * decay at different rates.
   */
  private applyMulti(
    params: ReadonlyMap<string, tf.Variable>,
    grads: ReadonlyMap<string, tf.Tensor>,
    lr: number,
    scale: number,
  ): boolean {
    const c = this.config;
    const kernel =
      c.kind === 'adamw'
        ? (tf.getKernel(ADAMW_MULTI_KERNEL, tf.getBackend()) as
            | (tf.KernelConfig & { elementsPerCall?: number })
            | undefined)
        : undefined;
    if (kernel === undefined) return false;
    const entries = [...params].filter(([name]) => grads.has(name));
    const rates = new Set(entries.map(([, p]) => decayRate(c, p.rank)));
    rates.delete(0);
    if (rates.size > 1) return false;
    const decays = ([, p]: [string, tf.Variable]) => decayRate(c, p.rank) > 0;
    const ordered = [
      ...entries.filter(decays),
      ...entries.filter((e) => !decays(e)),
    ];
    // slots made in the parameters' order, as the other paths make them (getState's order)
    for (const [name, p] of entries) {
      this.slot(name, p, 'm');
      this.slot(name, p, 'v');
    }
    const decayed = entries.filter(decays).length;
    const perCall = kernel.elementsPerCall ?? Number.POSITIVE_INFINITY;
    for (let from = 0; from < ordered.length; ) {
      let to = from + 1;
      let size = ordered[from]![1].size;
      while (to < ordered.length && size + ordered[to]![1].size <= perCall)
        size += ordered[to++]![1].size;
      const attrs = { lr, weightDecay: [...rates][0] ?? 0, scale };
      this.runMulti(ordered.slice(from, to), grads, attrs, decayed - from);
      from = to;
    }
    return true;
  }

  /**
   * One ADAMW_MULTI_KERNEL call over `part` (the first `decayed` of them decayed; any count,
   * clamped to the part), its outputs assigned to the parameters and their slots.
   */
  private runMulti(
    part: Array<[string, tf.Variable]>,
    grads: ReadonlyMap<string, tf.Tensor>,
    attrs: { lr: number; weightDecay: number; scale: number },
    decayed: number,
  ): void {
    const c = this.config;
    const ps = part.map(([, p]) => p);
    const ms = part.map(([name, p]) => this.slot(name, p, 'm'));
    const vs = part.map(([name, p]) => this.slot(name, p, 'v'));
    const gs = part.map(([name]) => grads.get(name)!);
    const n = part.length;
    tf.tidy(() => {
      const out = tf
        .engine()
        .runKernel(
          ADAMW_MULTI_KERNEL,
          [...ps, ...gs, ...ms, ...vs] as unknown as tf.NamedTensorMap,
          {
            ...attrs,
            beta1: c.beta1,
            beta2: c.beta2,
            epsilon: c.epsilon,
            decayed: Math.max(0, Math.min(n, decayed)),
            step: this.step,
          },
        ) as tf.Tensor[];
      for (let i = 0; i < n; i++) {
        ps[i]!.assign(out[i]!);
        ms[i]!.assign(out[n + i]!);
        vs[i]!.assign(out[2 * n + i]!);
      }
    });
  }

  /** The same update through the backend's fused kernel (backend/kernel-names.ts ADAMW_KERNEL, SGD_KERNEL). */
  private applyFused(
    name: string,
    p: tf.Variable,
    g: tf.Tensor,
    lr: number,
    scale: number,
    wd: number,
  ): void {
    const c = this.config;
    if (c.kind === 'sgd') {
      const velocity =
        c.momentum > 0 ? this.slot(name, p, 'velocity') : undefined;
      const inputs: tf.NamedTensorMap = velocity
        ? { p, g, velocity }
        : { p, g };
      const out = tf.engine().runKernel(SGD_KERNEL, inputs, {
        lr,
        momentum: c.momentum,
        weightDecay: wd,
        scale,
      }) as tf.Tensor[];
      p.assign(out[0]!);
      if (velocity) velocity.assign(out[1]!);
      return;
    }
    const m = this.slot(name, p, 'm');
    const v = this.slot(name, p, 'v');
    const attrs = {
      lr,
      beta1: c.beta1,
      beta2: c.beta2,
      epsilon: c.epsilon,
      weightDecay: wd,
      step: this.step,
      scale,
    };
    const out = tf
      .engine()
      .runKernel(ADAMW_KERNEL, { p, g, m, v }, attrs) as tf.Tensor[];
    p.assign(out[0]!);
    m.assign(out[1]!);
    v.assign(out[2]!);
  }

  /** Copies the state to the host (for checkpoints), reading asynchronously. */
  async getState(): Promise<OptimizerState> {
    const slots: OptimizerState['slots'] = {};
    for (const [name, s] of this.slots) {
      slots[name] = {};
      for (const [k, v] of Object.entries(s))
        slots[name][k] = ((await v.data()) as Float32Array).slice();
    }
    return { step: this.step, slots };
  }

  /** Restores a state from {@link getState}; shapes are taken from the parameters. */
  setState(
    state: OptimizerState,
    params: ReadonlyMap<string, tf.Variable>,
  ): void {
    this.dispose();
    this.step = state.step;
    for (const [name, s] of Object.entries(state.slots)) {
      const p = params.get(name);
      if (!p)
        throw new LayerwiseError(
          `optimizer state names parameter '${name}', which this model does not have`,
        );
      const rec: Record<string, tf.Variable> = {};
      for (const [k, arr] of Object.entries(s)) {
        if (arr.length !== p.size) {
          throw new LayerwiseError(
            `optimizer state '${name}.${k}' has ${arr.length} values, parameter has ${p.size}`,
          );
        }
        const init = tf.tensor(arr.slice(), p.shape); // copy: some backends keep the array
        rec[k] = tf.variable(init, false);
        init.dispose();
      }
      this.slots.set(name, rec);
    }
  }

  /** Frees the slot tensors. */
  dispose(): void {
    for (const s of this.slots.values())
      for (const v of Object.values(s)) v.dispose();
    this.slots.clear();
  }
}
