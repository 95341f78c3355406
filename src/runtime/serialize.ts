/**
 * Moving tensors between devices: a tensor becomes {shape, dtype, data} with its own
 * ArrayBuffer, which postMessage transfers (zero-copy between threads) when listed in the
 * transfer list.
 */
import { tf } from '../backend/tfjs.js';
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
 * A fresh copy of t's values (float32 or int32; t stays its owner's). On the native backend the
 * copy is made without disowning t's array (backend/native.ts copyValues), so that the array
 * returns to the pool when t is disposed; elsewhere through an asynchronous read.
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
