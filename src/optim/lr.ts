/** Learning-rate schedule: linear warm-up, then constant or cosine decay. */
import { LayerwiseError } from '../util/errors.js';

export interface LrSchedule {
  /** Peak learning rate. */
  lr: number;
  /** Steps of linear warm-up from lr/warmup to lr. */
  warmup: number;
  decay: 'constant' | 'cosine';
  /** Total steps (cosine reaches minRatio * lr at this step). */
  totalSteps: number;
  /** Floor of the cosine decay as a fraction of lr. */
  minRatio: number;
}

/** Learning rate for optimizer step `step` (0-based). */
export function learningRate(step: number, s: LrSchedule): number {
  if (!(s.lr > 0))
    throw new LayerwiseError(`--lr must be positive, got ${s.lr}`);
  if (s.warmup > 0 && step < s.warmup) return (s.lr * (step + 1)) / s.warmup;
  if (s.decay === 'constant') return s.lr;
  const span = Math.max(1, s.totalSteps - s.warmup);
  const progress = Math.min(1, (step - s.warmup) / span);
  return (
    s.lr *
    (s.minRatio + (1 - s.minRatio) * 0.5 * (1 + Math.cos(Math.PI * progress)))
  );
}
