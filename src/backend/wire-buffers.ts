import { coversOwnBuffer } from '../util/buffers.js';
import { BufferPool } from './buffer-pool.js';
import { FreeList } from './free-list.js';

/** The most bytes of free arrays a thread keeps for its messages, of each kind (bytes). */
export const WIRE_FREE_BYTES = 64 * 2 ** 20;

/**
 * The arrays that carry activations and gradients between stages on this thread
 * (runtime/stage-host.ts), recycled: a message's array is transferred to the receiving thread
 * (runtime/serialize.ts transferables), where it becomes the received tensor's values; when that
 * tensor is disposed, the array is free to carry one of this thread's own sends. A pipeline
 * stage sends as many arrays as it receives, of the same sizes (each activation sent comes back
 * as its gradient), so after the first step no message needs a new array. Before, each send
 * was a fresh array and each received one garbage: on a zbv device of charlm-small 16 MB a step
 * of each, which kept V8 collecting (a mark-compact about every step per device, 2026-11-29).
 *
 * Kept apart from the kernels' {@link BufferPool} on purpose: received arrays arrive new each
 * step, so handing them to kernels would change which arrays a step's kernels write from one
 * step to the next, which a native captured step (pipeline/native-capture.ts) relies on.
 *
 * Safety as the kernels' pool's: a received float32 array is reused only when no tensor holds
 * it and no caller has read it ({@link hold}, {@link release}, {@link disown}, called by the
 * backend), and never when a captured step reads it ({@link disown} from the capture's
 * recording). Bounded: beyond {@link WIRE_FREE_BYTES} of free arrays of a kind, freed ones go
 * to the garbage collector (a stage that receives more than it sends, as a local-parallelism
 * stage, whose gradients do not travel).
 */
export class WireBuffers {
  /** Received float32 arrays while tensors hold them, then free for sends. */
  private readonly f32: BufferPool;
  /** Free 2-byte arrays (a policy's wire format, backend/low-precision.ts narrowValues). */
  private readonly u16: FreeList<Uint16Array>;
  /** Arrays handed out for sends: reused (a free one) or new. */
  readonly stats = { reused: 0, allocated: 0 };

  /** @param capacityBytes the most bytes of free arrays kept of each kind (float32, 2-byte). */
  constructor(readonly capacityBytes = WIRE_FREE_BYTES) {
    this.f32 = new BufferPool(capacityBytes);
    this.u16 = new FreeList(capacityBytes);
  }

  /** A float32 array of `length` elements to send (contents undefined): the caller fills it and transfers it away. */
  takeF32(length: number): Float32Array {
    const before = this.f32.stats.reused;
    const a = this.f32.take(length);
    this.f32.disown(a);
    this.count(this.f32.stats.reused > before);
    return a;
  }

  /** A 2-byte array of `length` elements to send (contents undefined): the caller fills it and transfers it away. */
  takeU16(length: number): Uint16Array {
    const a = this.u16.take(length);
    this.count(a !== undefined);
    return a ?? new Uint16Array(length);
  }

  private count(reused: boolean): void {
    if (reused) this.stats.reused++;
    else this.stats.allocated++;
  }

  /** A received float32 array that is about to be a tensor's values: free for a send once no tensor holds it. */
  adopt(array: Float32Array): void {
    this.f32.adopt(array);
  }

  /** An array no tensor and no caller can see any more (a received 2-byte message once widened, a send's float32 copy once narrowed): free for a send now. */
  recycle(array: Float32Array | Uint16Array): void {
    if (array instanceof Float32Array) this.f32.recycle(array);
    else if (coversOwnBuffer(array)) this.u16.give(array);
  }

  /** Records that a tensor stores `values` (the backend's write and move). */
  hold(values: unknown): void {
    this.f32.hold(values);
  }

  /** Records that a tensor no longer stores `values`: an adopted array no tensor holds becomes free. */
  release(values: unknown): void {
    this.f32.release(values);
  }

  /** `values` escaped to a reader who may keep it (a read, a captured step's recording): never reused. */
  disown(values: unknown): void {
    this.f32.disown(values);
  }

  /** Bytes of free arrays held. */
  get freeBytes(): number {
    return this.f32.pooledBytes + this.u16.bytes;
  }

  /** Drops every free array (the garbage collector frees them). */
  clear(): void {
    this.f32.clear();
    this.u16.clear();
  }
}
