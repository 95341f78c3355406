/**
 * Free host buffers by length, handed out in the order they were first made: of the free buffers
 * of a length, the one made earliest. So a training step that asks for the same lengths in the
 * same order, and frees what it took, is handed the very same buffers every step, whatever order
 * it freed them in (a last-in-first-out list hands them out in the order the step before freed
 * them, a permutation that need not repeat). A step's kernels then run on the same arrays each
 * step: what a captured step compares and replays (as webgpu's pool hands out the first-made
 * free GPU buffer, pipeline/captured-step.ts), and each buffer keeps its place in the step.
 *
 * Bounded: a buffer given back past {@link capacityBytes} is not kept (the garbage collector
 * frees it).
 */
export class FreeList<T extends ArrayBufferView & { readonly length: number }> {
  /** Free buffers by length, each list in descending order of when its buffers were made. */
  private readonly lists = new Map<number, T[]>();
  /** When each buffer was made (a count), by its ArrayBuffer. */
  private readonly made = new WeakMap<ArrayBufferLike, number>();
  private madeSoFar = 0;
  /** Bytes of the free buffers. */
  bytes = 0;

  /** @param capacityBytes the most bytes of free buffers kept (bytes). */
  constructor(readonly capacityBytes: number) {}

  /** Marks `buffer` as made now (its place in the order), and returns it. */
  madeNow(buffer: T): T {
    this.made.set(buffer.buffer, this.madeSoFar++);
    return buffer;
  }

  /** The earliest-made free buffer of `length` elements, taken off the list, or undefined. */
  take(length: number): T | undefined {
    const buffer = this.lists.get(length)?.pop();
    if (buffer !== undefined) this.bytes -= buffer.byteLength;
    return buffer;
  }

  /** Puts `buffer` on the list (one never marked made counts as made now); false where that would pass the capacity. */
  give(buffer: T): boolean {
    if (this.bytes + buffer.byteLength > this.capacityBytes) return false;
    let list = this.lists.get(buffer.length);
    if (!list) this.lists.set(buffer.length, (list = []));
    const when = this.whenMade(buffer);
    let at = list.length; // descending: the earliest made last
    while (at > 0 && this.whenMade(list[at - 1]!) < when) at--;
    list.splice(at, 0, buffer);
    this.bytes += buffer.byteLength;
    return true;
  }

  private whenMade(buffer: T): number {
    let when = this.made.get(buffer.buffer);
    if (when === undefined)
      this.made.set(buffer.buffer, (when = this.madeSoFar++));
    return when;
  }

  /** Takes every free buffer whose memory is one of `buffers` off the list for good (a captured step's, pipeline/native-capture.ts). */
  claim(buffers: ReadonlySet<ArrayBufferLike>): void {
    for (const [length, list] of this.lists) {
      const kept = list.filter((b) => !buffers.has(b.buffer));
      for (const b of list)
        if (buffers.has(b.buffer)) this.bytes -= b.byteLength;
      if (kept.length === 0) this.lists.delete(length);
      else this.lists.set(length, kept);
    }
  }

  /** Drops every free buffer. */
  clear(): void {
    this.lists.clear();
    this.bytes = 0;
  }
}
