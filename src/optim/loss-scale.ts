/**
 * Dynamic loss scaling for f16 training (Micikevicius et al., "Mixed Precision Training", ICLR
 * 2018; PyTorch's GradScaler): the loss is multiplied by a scale S before backward, so that
 * small gradients do not underflow f16; the step divides the gradients by S again. When any
 * gradient overflowed (the global norm is not finite) the step is skipped and S halved; after
 * `growthInterval` steps in a row without overflow S is doubled. Pure.
 */

/** The scaler's settings: PyTorch GradScaler's defaults. */
export const LOSS_SCALE_DEFAULTS = {
  /** Initial scale, 2^16. */
  initial: 65536,
  /** Steps without overflow after which the scale doubles. */
  growthInterval: 2000,
  /** The scale never drops below this: an overflow at it is a numeric fault, not f16's range. */
  min: 1,
} as const;

/** The scaler's state (saved with checkpoints, so a resumed run scales as the uninterrupted one). */
export interface LossScaleState {
  scale: number;
  /** Steps without overflow since the scale last changed. */
  goodSteps: number;
  /** Overflowed (skipped) steps so far. */
  overflows: number;
}

export function initialLossScale(
  initial: number = LOSS_SCALE_DEFAULTS.initial,
): LossScaleState {
  return { scale: initial, goodSteps: 0, overflows: 0 };
}

/**
 * The outcome of one step whose scaled gradients have the global squared norm `sumSquares`
 * (a sum over stages of the scaled gradients' squares): whether to skip it (overflow), the
 * clipping scale to apply to the scaled gradients (clip(norm / S) / S: the unscaling folded in)
 * and the next state. `clip(sq)` is the optimizer's global-norm clipping factor for an unscaled
 * squared norm. An overflow at the minimum scale returns `fault: true` (a real non-finite loss
 * or gradient, to be located as in fp32).
 */
export function lossScaleStep(
  st: LossScaleState,
  sumSquares: number,
  clip: (sq: number) => number,
  growthInterval: number = LOSS_SCALE_DEFAULTS.growthInterval,
): {
  skip: boolean;
  fault: boolean;
  gradScale: number;
  next: LossScaleState;
} {
  if (!Number.isFinite(sumSquares)) {
    if (st.scale <= LOSS_SCALE_DEFAULTS.min)
      return { skip: true, fault: true, gradScale: Number.NaN, next: st };
    return {
      skip: true,
      fault: false,
      gradScale: Number.NaN,
      next: {
        scale: Math.max(LOSS_SCALE_DEFAULTS.min, st.scale / 2),
        goodSteps: 0,
        overflows: st.overflows + 1,
      },
    };
  }
  const s = st.scale;
  const good = st.goodSteps + 1;
  return {
    skip: false,
    fault: false,
    gradScale: clip(sumSquares / (s * s)) / s,
    next:
      good >= growthInterval
        ? { scale: s * 2, goodSteps: 0, overflows: st.overflows }
        : { scale: s, goodSteps: good, overflows: st.overflows },
  };
}
