import { coversOwnBuffer } from '../util/buffers.js';
import { FreeList } from './free-list.js';

/**
 * A pool of float32 output buffers for a host-memory backend (the native device).
 *
 * Why: a training step of charlm-small allocates about 2.8 GB of kernel outputs; a fresh
 * `new Float32Array(n)` is zero-filled by V8 (calloc: a memset over memory the kernel then
 * overwrites anyway), about 2.2 ms per 16 MB here, which came to a third of the step. Shapes
 * repeat from step to step, so the buffers a step frees are exactly the ones the next step
 * asks for: reusing them skips the memset and keeps the pages mapped and warm.
 *
 * Safety: a buffer is reused only when no tensor and no caller can still see it. The pool
 * hands out arrays it owns ({@link take}); the backend reports every array a tensor stores
 * ({@link hold}) and every array it frees ({@link release}). An owned array is returned to the
 * free list when the last tensor that holds it is disposed. It is disowned for good (never
 * reused) when a view into it is stored as another tensor's values (the cpu backend's Slice
 * returns subarrays) or when it escapes to a caller (`dataSync`, `data`: {@link disown}).
 * Arrays the pool did not hand out (user data, cpu-kernel outputs) are never touched.
 *
 * Free buffers are handed out in the order they were made ({@link FreeList}), so a step that
 * asks for the same lengths as the step before gets the same arrays.
 *
 * The free list is bounded ({@link capacityBytes}); beyond it, freed buffers go to the garbage
 * collector as before. Arrays smaller than {@link minBytes} (default 0: none) are not pooled.
 */
export class BufferPool {
  /** Free buffers by length (float32 elements), the first made handed out first ({@link FreeList}). */
  private readonly free: FreeList<Float32Array>;
  /** Owned arrays by their ArrayBuffer, with how many tensors hold each. Weak: an array a kernel took but never stored is simply collected. */
  private readonly owned = new WeakMap<
    ArrayBufferLike,
    { array: Float32Array; holders: number }
  >();
  /** Buffers handed out from the free list / freshly allocated (for tests and benchmarks). */
  readonly stats = { reused: 0, allocated: 0 };

  /**
   * @param capacityBytes the most bytes the free list keeps (bytes; default 512 MiB).
   * @param minBytes arrays smaller than this (bytes) are allocated normally and never pooled.
   */
  constructor(
    readonly capacityBytes = 512 * 2 ** 20,
    readonly minBytes = 0,
  ) {
    this.free = new FreeList(capacityBytes);
  }

  /**
   * A float32 array of `length` elements for a kernel's output. Its contents are undefined
   * (a reused buffer keeps old values): the kernel must write every element, or use
   * {@link takeZeroed}. Throws RangeError (from the typed-array constructor) on a negative or
   * too large length.
   */
  take(length: number): Float32Array {
    return this.get(length, false);
  }

  /** {@link take}, filled with zeros. */
  takeZeroed(length: number): Float32Array {
    return this.get(length, true);
  }

  private get(length: number, zeroed: boolean): Float32Array {
    if (length * 4 < this.minBytes) return new Float32Array(length);
    let array = this.free.take(length);
    if (array) {
      this.stats.reused++;
      if (zeroed) array.fill(0);
    } else {
      array = this.free.madeNow(new Float32Array(length));
      this.stats.allocated++;
    }
    this.owned.set(array.buffer, { array, holders: 0 });
    return array;
  }

  /** Records that a tensor now stores `values` (any typed array). */
  hold(values: unknown): void {
    if (!ArrayBuffer.isView(values)) return;
    const entry = this.owned.get(values.buffer);
    if (!entry) return;
    if (entry.array === values) entry.holders++;
    else this.owned.delete(values.buffer); // a view into an owned buffer: never reuse it
  }

  /** Records that a tensor no longer stores `values`; an owned array no tensor holds goes back to the free list. */
  release(values: unknown): void {
    if (!ArrayBuffer.isView(values)) return;
    const entry = this.owned.get(values.buffer);
    if (!entry || entry.array !== values) return;
    if (--entry.holders > 0) return;
    this.owned.delete(values.buffer);
    this.free.give(entry.array);
  }

  /**
   * Takes `array`, which the pool did not hand out (a message's array from another thread:
   * backend/wire-buffers.ts), as if it had: once the tensors that {@link hold} it let go, it is
   * free to hand out. Only an array that covers its own whole memory is taken
   * (util/buffers.ts coversOwnBuffer); returns whether it was.
   */
  adopt(array: Float32Array): boolean {
    if (!this.canReuse(array)) return false;
    if (!this.owned.has(array.buffer))
      this.owned.set(array.buffer, { array, holders: 0 });
    return true;
  }

  /** Puts `array`, which no tensor and no caller can see any more, straight on the free list (if it is one the pool could hand out: {@link canReuse}). */
  recycle(array: Float32Array): void {
    if (!this.canReuse(array)) return;
    this.owned.delete(array.buffer);
    this.free.give(array);
  }

  /** Whether `array`, made elsewhere, could be handed out: it covers its own whole memory (util/buffers.ts) and is not below {@link minBytes}. */
  private canReuse(array: Float32Array): boolean {
    return coversOwnBuffer(array) && array.length * 4 >= this.minBytes;
  }

  /** `values` escaped to a caller who may keep it: it is never reused. */
  disown(values: unknown): void {
    if (ArrayBuffer.isView(values)) this.owned.delete(values.buffer);
  }

  /**
   * Takes every array whose memory is one of `buffers` out of the pool for good: off the free
   * list, and never put back when its tensors are disposed (a captured step's arrays,
   * pipeline/native-capture.ts, which its replays write).
   */
  claim(buffers: ReadonlySet<ArrayBufferLike>): void {
    for (const b of buffers) this.owned.delete(b);
    this.free.claim(buffers);
  }

  /** Bytes held in the free list. */
  get pooledBytes(): number {
    return this.free.bytes;
  }

  /** Drops every free buffer (the garbage collector frees them). */
  clear(): void {
    this.free.clear();
  }
}
