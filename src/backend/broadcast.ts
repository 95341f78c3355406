/** Batch broadcasting for the matrix-product kernels (wasm-matmul.ts, native.ts). */
import * as tf from '@tensorflow/tfjs-core';

/** For each flat index into `outBatch`, the flat index into the broadcast operand `inBatch`. */
export function broadcastIndex(
  outBatch: number[],
  inBatch: number[],
): number[] {
  const total = tf.util.sizeFromShape(outBatch);
  const pad = outBatch.length - inBatch.length;
  const index: number[] = new Array(total).fill(0);
  for (let i = 0; i < total; i++) {
    let rest = i;
    let flat = 0;
    let stride = 1;
    for (let d = outBatch.length - 1; d >= 0; d--) {
      const coord = rest % outBatch[d]!;
      rest = Math.floor(rest / outBatch[d]!);
      if (d >= pad) {
        const dim = inBatch[d - pad]!;
        flat += (dim === 1 ? 0 : coord) * stride;
        stride *= dim;
      }
    }
    index[i] = flat;
  }
  return index;
}
