/**
 * Kernels layerwise adds to TF.js (not stock kernels): a backend that registers one runs the
 * fused version; elsewhere the model composes the same math from stock ops. Today only the native
 * backend (backend/native.ts) registers them.
 */

/** GELU, tanh approximation (model/layers.ts gelu): inputs {x}. */
export const GELU_KERNEL = 'LayerwiseGelu';
/** GELU's gradient: inputs {x, dy}, output dy * GELU'(x). */
export const GELU_GRAD_KERNEL = 'LayerwiseGeluGrad';
