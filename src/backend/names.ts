/**
 * The names of the backends a device can run, without loading TF.js (the main thread validates
 * configurations before any device exists). 'wasm' and 'cpu' ship with layerwise; 'native' is
 * its own addon (native/, built by npm ci where libdnnl-dev and a compiler are installed);
 * 'tensorflow' and 'webgpu' are optional installs.
 */
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
 * Compute precisions: 'fp32' everywhere, or 'bf16' (mixed precision, Micikevicius et al., 2018;
 * Kalamkar et al., 2019): matrix products on bfloat16 operands with float32 accumulation,
 * everything else (norms, softmax, loss, gradients' sums, master weights and optimizer state)
 * float32. 'bf16' runs on the native backend only.
 */
export const PRECISIONS = ['fp32', 'bf16'] as const;
export type Precision = (typeof PRECISIONS)[number];

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
