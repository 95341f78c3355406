/**
 * Values a stage computes on its device during a step and reads on the host only at the step's
 * end (or when it needs them: the gradient-norm all-reduce), all at once and asynchronously.
 * A GPU device (webgpu in Node) cannot read synchronously at all, and on any device one read
 * per step instead of one per micro-batch keeps the device from stalling mid-schedule.
 */
import { tf } from '../backend/tfjs.js';

export class PendingReads {
  private items: Array<{
    t: tf.Tensor;
    use: (values: Float32Array | Int32Array | Uint8Array) => void;
  }> = [];

  /**
   * Reads `t` later and hands its values to `use`. Takes `t` over (kept out of any enclosing
   * tidy, disposed once read); pass a clone to keep using it.
   */
  read(
    t: tf.Tensor,
    use: (values: Float32Array | Int32Array | Uint8Array) => void,
  ): void {
    this.items.push({ t: tf.keep(t), use });
  }

  /** Reads the first element of scalar `t` later into `set`. */
  scalar(t: tf.Tensor, set: (v: number) => void): void {
    this.read(t, (v) => set(Number(v[0])));
  }

  /** Reads everything pending, in the order it was asked for. */
  async flush(): Promise<void> {
    const items = this.items;
    this.items = [];
    try {
      const values = await Promise.all(
        items.map(
          (i) => i.t.data() as Promise<Float32Array | Int32Array | Uint8Array>,
        ),
      );
      items.forEach((it, k) => it.use(values[k]!));
    } finally {
      for (const it of items) it.t.dispose();
    }
  }

  /** Drops everything pending (a failed step). */
  clear(): void {
    for (const it of this.items) it.t.dispose();
    this.items = [];
  }
}
