/**
 * Whether typed array `a` covers the whole of its memory, and that memory is an ArrayBuffer of
 * its own (not a SharedArrayBuffer, shared with other threads): the only kind of array that can
 * be transferred to another thread without taking other arrays' values along
 * (runtime/channel.ts ownedBuffers), or handed out again by a pool once nothing holds it
 * (backend/buffer-pool.ts, backend/wire-buffers.ts, the native backend's bf16 buffers): a view
 * into a larger buffer shares it with other arrays.
 */
export function coversOwnBuffer(a: ArrayBufferView): boolean {
  return (
    a.byteOffset === 0 &&
    a.byteLength === a.buffer.byteLength &&
    a.buffer instanceof ArrayBuffer
  );
}
