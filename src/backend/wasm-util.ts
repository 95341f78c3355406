/**
 * Helpers for writing JS-side kernels of the TF.js wasm backend: run another registered wasm
 * kernel on TensorInfos, release intermediates, and make zero-copy views into the wasm heap.
 * Follows the pattern of the backend's own JS kernels (@tensorflow/tfjs-backend-wasm
 * dist/kernels/*.js: `backend.makeOutput`, `backend.typedArrayFromHeap`, `backend.disposeData`).
 */

import type { BackendWasm } from '@tensorflow/tfjs-backend-wasm';
import * as tf from '@tensorflow/tfjs-core';

/** The wasm backend as seen by our kernels (its public class plus the exported C entry points). */
export type WasmBackend = BackendWasm & {
  wasm: BackendWasm['wasm'] & {
    cwrap(
      name: string,
      ret: null,
      args: string[],
    ): (...args: unknown[]) => void;
    tfjs: {
      registerTensor(id: number, size: number, offset: number): void;
      disposeData(id: number): void;
    };
  };
};

/** Attribute bag passed to a kernel. */
export type Attrs = Record<string, unknown>;

/**
 * Run the kernel registered as `name` for the wasm backend directly (no engine, no tape) and return
 * its single output. The caller owns the output and must {@link release} it unless returned.
 * Throws a plain Error if the kernel is not registered (a bug, not a user error).
 */
export function runWasm(
  backend: WasmBackend,
  name: string,
  inputs: Record<string, tf.TensorInfo>,
  attrs: Attrs = {},
): tf.TensorInfo {
  const kernel = tf.getKernel(name, 'wasm');
  if (kernel === undefined)
    throw new Error(`wasm kernel ${name} is not registered`);
  const out = kernel.kernelFunc({
    inputs,
    attrs: attrs as tf.NamedAttrMap,
    backend,
  });
  if (Array.isArray(out))
    throw new Error(`wasm kernel ${name} returned several outputs`);
  return out;
}

/** Drop one reference to an intermediate TensorInfo's data (frees the heap block at zero). */
export function release(backend: WasmBackend, ...infos: tf.TensorInfo[]): void {
  for (const info of infos) backend.disposeData(info.dataId);
}

/** The C-side tensor id of a TensorInfo's data, as passed to the wasm C entry points. */
export function wasmId(backend: WasmBackend, info: tf.TensorInfo): number {
  const data = backend.dataIdMap.get(info.dataId);
  if (data === undefined)
    throw new Error('tensor data is not on the wasm backend');
  return data.id;
}

/**
 * A fresh C-side tensor id aliasing `size` float32 elements of `base` starting at element
 * `elemOffset` (no copy). Give it back with {@link releaseView}, never with {@link release}:
 * the memory belongs to `base`. A fresh id per use matters because XNNPACK operators are cached
 * by the id of their weight tensor.
 */
export function makeView(
  backend: WasmBackend,
  base: tf.TensorInfo,
  elemOffset: number,
  size: number,
): number {
  const offset = backend.getMemoryOffset(base.dataId) + elemOffset * 4;
  const view = backend.makeOutput([size], 'float32', offset);
  const id = wasmId(backend, view);
  backend.dataIdMap.delete(view.dataId);
  return id;
}

/** Forget a view made by {@link makeView}; this also frees XNNPACK operators cached on it. */
export function releaseView(backend: WasmBackend, id: number): void {
  backend.wasm.tfjs.disposeData(id);
}
