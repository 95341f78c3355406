/**
 * Moving tensors between devices: a tensor becomes {shape, dtype, data} with its own
 * ArrayBuffer, which postMessage transfers (zero-copy between threads) when listed in the
 * transfer list.
 */
import { tf } from '../backend/tfjs.js';
import type { WireBuffers } from '../backend/wire-buffers.js';
import type { HostTensor } from '../data/microbatch.js';

/**
 * Copies a tensor to the host (an asynchronous read: a GPU device cannot read synchronously)
 * and disposes it. The copy is always fresh: some backends (cpu) return their own storage,
 * which other tensors may share and which must not be transferred away.
 */
export async function toWire(t: tf.Tensor): Promise<HostTensor> {
  try {
    const data = await copyOfValues(t);
    return {
      shape: t.shape.slice(),
      dtype: t.dtype as 'float32' | 'int32',
      data,
    };
  } finally {
    t.dispose();
  }
}

/**
 * A copy of t's values (float32 or int32; t stays its owner's) that no one else sees, for the
 * caller to send (transfer) away. On the native backend the copy is made without disowning t's
 * array (backend/native.ts copyValues), so that the array returns to the pool when t is
 * disposed, and a float32 copy is one of the backend's message arrays ({@link wireBuffers});
 * elsewhere a new array, through an asynchronous read.
 */
export async function copyOfValues(
  t: tf.Tensor,
): Promise<Float32Array | Int32Array> {
  const b = tf.backend() as {
    copyValues?: (id: tf.DataId) => Float32Array | Int32Array;
  };
  if (typeof b.copyValues === 'function') return b.copyValues(t.dataId);
  return ((await t.data()) as Float32Array | Int32Array).slice();
}

/** Creates a device tensor from a wire tensor. */
export function fromWire(w: HostTensor): tf.Tensor {
  return tf.tensor(w.data, w.shape, w.dtype);
}

/**
 * This thread's recycler of the arrays that carry tensors between stages (the native backend's,
 * backend/wire-buffers.ts), or undefined where the backend has none.
 */
export function wireBuffers(): WireBuffers | undefined {
  return (tf.backend() as { wire?: WireBuffers }).wire;
}

/**
 * Creates a device tensor from a wire tensor that another stage sent and this thread alone
 * holds (its array came through a channel): where the backend recycles message arrays
 * ({@link wireBuffers}), a float32 array is free to carry one of this thread's sends once the
 * tensor is disposed. Not for arrays a caller may keep (a step's inputs from the coordinator:
 * {@link fromWire}).
 */
export function fromReceivedWire(w: HostTensor): tf.Tensor {
  if (w.data instanceof Float32Array) wireBuffers()?.adopt(w.data);
  return fromWire(w);
}

/** The transfer list for wire tensors (their buffers). */
export function transferables(
  ws: Iterable<HostTensor | undefined>,
): ArrayBuffer[] {
  const out: ArrayBuffer[] = [];
  for (const w of ws)
    if (w && !out.includes(w.data.buffer as ArrayBuffer))
      out.push(w.data.buffer as ArrayBuffer);
  return out;
}

/** A copy of a wire tensor with its own buffer (a transferred buffer can go to one thread only). */
export function copyWire(w: HostTensor): HostTensor {
  return { shape: w.shape.slice(), dtype: w.dtype, data: w.data.slice() };
}
