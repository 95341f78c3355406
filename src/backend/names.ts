/**
 * The names of the backends a device can run, without loading TF.js (the main thread validates
 * configurations before any device exists). 'wasm' and 'cpu' ship with layerwise; 'native' is
 * its own addon (native/, built by npm ci where libdnnl-dev and a compiler are installed);
 * 'tensorflow' and 'webgpu' are optional installs.
 */
import { check } from '../util/errors.js';
import { nativeAddon } from './native-addon.js';

export const BACKENDS = [
  'wasm',
  'cpu',
  'native',
  'tensorflow',
  'webgpu',
] as const;
export type BackendName = (typeof BACKENDS)[number];

/**
 * The backend a run uses unless told otherwise: 'native' where its addon loads (checked once,
 * in this thread, without TF.js), else 'wasm'.
 */
export function defaultBackend(): BackendName {
  return nativeAddon() ? 'native' : 'wasm';
}

/**
 * Compute precisions: 'fp32' everywhere, or mixed precision (Micikevicius et al., 2018;
 * Kalamkar et al., 2019): matrix products on low-precision operands with float32 accumulation,
 * everything else (norms, softmax, loss, gradients' sums, master weights and optimizer state)
 * float32. 'bf16' runs on the native backend (oneDNN's bf16 matmul); 'f16' on webgpu adapters
 * with shader-f16 (backend/webgpu-f16.ts: f16-rounded operands), with dynamic loss scaling.
 */
export const PRECISIONS = ['fp32', 'bf16', 'f16'] as const;
export type Precision = (typeof PRECISIONS)[number];

/**
 * Checks that `precision` runs on `backend`: 'bf16' on native (oneDNN's bf16 matmul), 'f16'
 * on webgpu (f16 products, loss scaling); 'fp32' everywhere. Throws {@link LayerwiseError}
 * naming the fix. (The adapter's shader-f16 is checked once the backend is up.)
 */
export function checkPrecision(precision: string, backend: string): void {
  check(
    precision !== 'bf16' || backend === 'native',
    `--precision bf16 needs --backend native (oneDNN's bf16 matmul); backend '${backend}' has no bf16 kernels: use --precision fp32, --backend native, or on webgpu --precision f16`,
  );
  check(
    precision !== 'f16' || backend === 'webgpu',
    `--precision f16 needs --backend webgpu (an adapter with shader-f16); backend '${backend}' has no f16 products: use --precision fp32${backend === 'native' ? ', or --precision bf16' : ''}`,
  );
}

/** What f16 runs as: f16-rounded product operands on webgpu (backend/webgpu-f16.ts), activations saved for the backward as f16, with dynamic loss scaling. */
export const F16_NOTE =
  "f16 products on webgpu: operands rounded to f16 by a shader, float32 accumulation; activations saved for the backward stored as f16, everything else float32 (TF.js's webgpu kernels are float32: f16 numerics, not f16 speed); dynamic loss scaling from 2^16";

/** The line a run with `precision` prints and saves about what it runs on. */
export function precisionNote(precision: string): string {
  return precision === 'f16' ? F16_NOTE : bf16Support().note;
}

/**
 * What bf16 runs on in this process: oneDNN's ISA and whether it has bf16 instructions, or why
 * there is no bf16 (no native addon). For logs, summaries and benchmark results.
 */
export function bf16Support(): {
  available: boolean;
  nativeBf16: boolean;
  isa: string;
  conversion: string;
  note: string;
} {
  const lib = nativeAddon();
  if (!lib)
    return {
      available: false,
      nativeBf16: false,
      isa: 'none',
      conversion: 'none',
      note: 'bf16 needs the native backend, whose addon is not built',
    };
  const i = lib.bf16Info();
  return {
    available: true,
    ...i,
    note: i.nativeBf16
      ? `bf16 on ${i.isa} (bf16 dot-product instructions), conversion by ${i.conversion}`
      : `bf16 emulated on ${i.isa}: this CPU has no avx512_bf16 or AMX, so the operands are rounded to bf16 and multiplied by fp32 sgemm (the same numbers, no speed-up over fp32)`,
  };
}
