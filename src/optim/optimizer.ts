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
  multiOrder,
  SGD_KERNEL,
} from '../backend/kernel-names.js';
import { LayerwiseError } from '../util/errors.js';
import { consecutiveRuns } from '../util/runs.js';
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

/** `n` clamped to [0, max]. */
const clamp = (n: number, max: number): number => Math.max(0, Math.min(max, n));

/**
 * `ps` cut, in order, into runs of at most `perCall` elements (a longer parameter alone);
 * one run where `perCall` is undefined.
 */
function splitByElements<T extends { readonly size: number }>(
  ps: ReadonlyArray<readonly [string, T]>,
  perCall: number | undefined,
): Array<Array<readonly [string, T]>> {
  if (perCall === undefined) return [[...ps]];
  return consecutiveRuns(
    ps.map((e) => e[1].size),
    perCall,
  ).map(([first, end]) => ps.slice(first, end));
}

/** Serialized optimizer state: step count and, per parameter, its slot arrays (m, v or velocity). */
export interface OptimizerState {
  step: number;
  slots: Record<string, Record<string, Float32Array>>;
}

/**
 * AdamW's moments of several parameters as two flat float32 tensors [total] (ADAMW_MULTI_KERNEL's
 * layout): `names[i]`'s elements (shape `shapes[i]`) from element `offsets[i]` on.
 */
interface FlatMoments {
  /** `names` joined: the layout's identity. */
  key: string;
  names: string[];
  shapes: number[][];
  offsets: number[];
  m: tf.Variable;
  v: tf.Variable;
}

/**
 * A device-side optimizer over named parameters. Its slots live per parameter, except AdamW's
 * moments on a backend with ADAMW_MULTI_KERNEL (webgpu, native), which live in two flat tensors
 * for the parameters of each of its calls ({@link FlatMoments}: the kernel binds them, no copies);
 * {@link getState} and {@link setState} give and take per-parameter slots either way.
 */
export class DeviceOptimizer {
  private step = 0;
  private readonly slots = new Map<string, Record<string, tf.Variable>>();
  /** AdamW's moments of the multi-tensor kernel's parameters (none of them also in `slots`). */
  private flat: FlatMoments[] = [];
  /** The parameters' names in the order of the last update's map (getState's order). */
  private order: string[] = [];
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
    this.order = [...params.keys()];
    if (this.applyMulti(params, grads, lr, scale)) return;
    this.unflatten();
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
   * parameter; native: one OpenMP region over many instead of one a parameter), or in calls of
   * at most the kernel's `elementsPerCall` elements (kernel-names.ts; native 2^22), each call
   * with its own {@link FlatMoments} and its outputs assigned before the next. The parameters
   * go in the gradients' order, in kernel-names.ts multiOrder (the decayed ones first: the kernel
   * decays a prefix; and as the stage's sums of squares laid the gradients out). Returns false,
   * having done nothing, where the kernel is missing, the optimizer is not AdamW, or the decayed
   * parameters are not a prefix decayed at one rate.
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
    const names = [...grads.keys()].filter((name) => params.has(name));
    const ps = multiOrder(names.map((n) => params.get(n)!.shape)).map(
      (i) => [names[i]!, params.get(names[i]!)!] as const,
    );
    if (ps.length === 0) return true;
    // the kernel decays a prefix at one rate (multiOrder puts the decayed ranks first)
    const rates = ps.map(([, p]) => decayRate(c, p.rank));
    const decayed = rates.filter((r) => r > 0).length;
    if (rates.some((r, i) => (i < decayed ? r !== c.weightDecay : r !== 0)))
      return false;
    const parts = splitByElements(ps, kernel.elementsPerCall);
    const flats = this.flatFor(parts);
    let from = 0;
    parts.forEach((part, j) => {
      const attrs = { lr, scale, decayed: clamp(decayed - from, part.length) };
      this.runMulti(part, grads, flats[j]!, attrs);
      from += part.length;
    });
    return true;
  }

  /** One ADAMW_MULTI_KERNEL call over `part`, its outputs assigned to it and to `flat`. */
  private runMulti(
    part: ReadonlyArray<readonly [string, tf.Variable]>,
    grads: ReadonlyMap<string, tf.Tensor>,
    flat: FlatMoments,
    attrs: { lr: number; scale: number; decayed: number },
  ): void {
    const c = this.config;
    const n = part.length;
    tf.tidy(() => {
      const out = tf
        .engine()
        .runKernel(
          ADAMW_MULTI_KERNEL,
          [
            ...part.map(([, p]) => p),
            ...part.map(([name]) => grads.get(name)!),
            flat.m,
            flat.v,
          ] as unknown as tf.NamedTensorMap,
          {
            ...attrs,
            beta1: c.beta1,
            beta2: c.beta2,
            epsilon: c.epsilon,
            weightDecay: c.weightDecay,
            step: this.step,
          },
        ) as tf.Tensor[];
      part.forEach(([, p], i) => p.assign(out[i]!));
      flat.m.assign(out[n]!);
      flat.v.assign(out[n + 1]!);
    });
  }

  /**
   * The flat moments laid out for `parts` (each a list of (name, parameter), one kernel call's):
   * the current ones where the layout is the same (every step but the first, or where the
   * parameters updated change), else new ones holding each parameter's moments from its slots
   * (zeros for a parameter without any), the old flat tensors first moved back to slots.
   */
  private flatFor(
    parts: ReadonlyArray<ReadonlyArray<readonly [string, tf.Variable]>>,
  ): FlatMoments[] {
    const keys = parts.map((ps) => ps.map(([name]) => name).join('\n'));
    if (
      this.flat.length === keys.length &&
      this.flat.every((f, j) => f.key === keys[j])
    )
      return this.flat;
    this.unflatten();
    this.flat = parts.map((ps, j) => this.flatten(ps, keys[j]!));
    return this.flat;
  }

  /** One part's slots (or zeros) moved into two flat tensors, the slots freed. */
  private flatten(
    ps: ReadonlyArray<readonly [string, tf.Variable]>,
    key: string,
  ): FlatMoments {
    const names = ps.map(([name]) => name);
    const offsets: number[] = [];
    let total = 0;
    for (const [, p] of ps) {
      offsets.push(total);
      total += p.size;
    }
    const moment = (k: 'm' | 'v') =>
      tf.tidy(() =>
        tf.variable(
          tf.concat(
            ps.map(([name, p]) => {
              const slot = this.slots.get(name)?.[k];
              return slot ? tf.reshape(slot, [-1]) : tf.zeros([p.size]);
            }),
          ),
          false,
        ),
      );
    const [m, v] = [moment('m'), moment('v')];
    for (const name of names) {
      const s = this.slots.get(name);
      if (!s) continue;
      s.m?.dispose();
      s.v?.dispose();
      this.slots.delete(name);
    }
    const shapes = ps.map(([, p]) => [...p.shape]);
    return { key, names, shapes, offsets, m, v };
  }

  /** Moves the flat moments (if any) back into per-parameter slots. */
  private unflatten(): void {
    const flats = this.flat;
    this.flat = [];
    for (const f of flats) {
      f.names.forEach((name, i) => {
        const size = tf.util.sizeFromShape(f.shapes[i]!);
        const cut = (x: tf.Variable) =>
          tf.tidy(() =>
            tf.variable(
              tf.reshape(tf.slice(x, f.offsets[i]!, size), f.shapes[i]!),
              false,
            ),
          );
        this.slots.set(name, { m: cut(f.m), v: cut(f.v) });
      });
      f.m.dispose();
      f.v.dispose();
    }
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

  /**
   * Copies the state to the host (for checkpoints), reading asynchronously: per parameter (in
   * the order of the last update's parameter map), its slot arrays, whether they live per
   * parameter or in the flat moments.
   */
  async getState(): Promise<OptimizerState> {
    const found = new Map<string, Record<string, Float32Array>>();
    for (const [name, s] of this.slots) {
      const rec: Record<string, Float32Array> = {};
      for (const [k, v] of Object.entries(s))
        rec[k] = ((await v.data()) as Float32Array).slice();
      found.set(name, rec);
    }
    for (const f of this.flat) {
      const [m, v] = (await Promise.all([f.m.data(), f.v.data()])) as [
        Float32Array,
        Float32Array,
      ];
      f.names.forEach((name, i) => {
        const end = f.offsets[i]! + tf.util.sizeFromShape(f.shapes[i]!);
        found.set(name, {
          m: m.slice(f.offsets[i]!, end),
          v: v.slice(f.offsets[i]!, end),
        });
      });
    }
    const slots: OptimizerState['slots'] = {};
    for (const name of [...this.order, ...found.keys()]) {
      const rec = found.get(name);
      if (rec && !(name in slots)) slots[name] = rec;
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

  /** Frees the slot tensors and the flat moments. */
  dispose(): void {
    for (const s of this.slots.values())
      for (const v of Object.values(s)) v.dispose();
    this.slots.clear();
    for (const f of this.flat) {
      f.m.dispose();
      f.v.dispose();
    }
    this.flat = [];
  }
}
