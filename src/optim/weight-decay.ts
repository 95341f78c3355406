/**
 * Which parameters weight decay applies to, shared by the device optimizer (optim/optimizer.ts)
 * and the parameter server's host optimizer (param-server/host-optimizer.ts), which must give
 * the same updates. No TF.js here: the host optimizer runs in worker threads without it.
 */
import type { OptimizerConfig } from './optimizer.js';

/**
 * The decoupled weight-decay rate (per unit learning rate) of a parameter of rank `rank`:
 * `cfg.weightDecay` for matrices and kernels (rank >= 2), 0 for biases and gains, as in
 * minGPT and nanoGPT (decoupled decay: Loshchilov & Hutter, 2019).
 */
export function decayRate(
  cfg: Pick<OptimizerConfig, 'weightDecay'>,
  rank: number,
): number {
  return rank >= 2 ? cfg.weightDecay : 0;
}
