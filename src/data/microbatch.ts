/**
 * Splitting a mini-batch into micro-batches (GPipe; torchgpipe's microbatch.py): M equal
 * chunks along the batch dimension. Equal sizes keep the loss of the mini-batch equal to the
 * mean of the micro-batch losses, which is what makes pipelined training identical to
 * single-device training.
 */
import { LayerwiseError } from '../util/errors.js';

/**
 * The one host-tensor type: a tensor's elements in host memory with its shape and dtype. Batches
 * are split into these, and they are what crosses a channel between devices (runtime/serialize.ts).
 * `data` holds exactly the tensor's elements.
 */
export interface HostTensor {
  shape: number[];
  dtype: 'float32' | 'int32';
  data: Float32Array | Int32Array;
}

/** A host array with its shape (dim 0 is the batch), as the batcher yields it; the dtype follows the array. */
export interface HostArray {
  data: Float32Array | Int32Array;
  shape: number[];
}

/**
 * Splits `t` ([N, ...]) into `m` tensors [N/m, ...] (copies). Throws {@link LayerwiseError}
 * when m does not divide N.
 */
export function splitMicroBatches(t: HostArray, m: number): HostTensor[] {
  const n = t.shape[0];
  if (!Number.isInteger(m) || m < 1 || n % m !== 0) {
    throw new LayerwiseError(
      `--micro-batches ${m} must divide the batch size ${n} (try a divisor of ${n})`,
    );
  }
  const rows = n / m;
  const per = t.data.length / n;
  const dtype = t.data instanceof Int32Array ? 'int32' : 'float32';
  return Array.from({ length: m }, (_, i) => ({
    shape: [rows, ...t.shape.slice(1)],
    dtype,
    data: t.data.slice(i * rows * per, (i + 1) * rows * per),
  }));
}
