/**
 * Values a stage computes on its device during a step and reads on the host only at the step's
 * end (or when it needs them: the gradient-norm all-reduce), all at once and asynchronously.
 * A GPU device (webgpu in Node) cannot read synchronously at all, and on any device one read
 * per step instead of one per micro-batch keeps the device from stalling mid-schedule.
 */
import { gpuQueue } from '../backend/gpu-queue.js';
import { tf } from '../backend/tfjs.js';

export class PendingReads {
  /**
   * @param join whether {@link flush} reads the float32 tensors as one (default: where the
   * backend at the flush reads back from a device, webgpu: one round trip instead of one each;
   * a host backend's values are on the host already, and a join would only copy them).
   */
  constructor(private readonly join?: boolean) {}

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

  /**
   * Reads everything pending and hands each its values, in the order they were asked for. With
   * `join`, the float32 tensors are read as one: flattened and concatenated on the device, one
   * readback (a GPU round trip each: a step's losses and its gradient norm were two, one after
   * the other; a relay layer's gradients one each), each handed its own slice (a subarray of
   * one array: copy it to keep or transfer it apart from the others); other dtypes are read
   * alongside, each on its own.
   */
  async flush(): Promise<void> {
    const items = this.items;
    this.items = [];
    const floats = items.filter((i) => i.t.dtype === 'float32');
    let joined: tf.Tensor | null = null;
    try {
      if ((this.join ?? gpuQueue() !== null) && floats.length > 1)
        joined = tf.tidy(() =>
          tf.concat(floats.map((i) => tf.reshape(i.t, [-1]))),
        );
      const inJoined = (i: (typeof items)[number]) =>
        joined !== null && i.t.dtype === 'float32';
      const [all, ...values] = await Promise.all([
        joined?.data() as Promise<Float32Array> | undefined,
        ...items
          .filter((i) => !inJoined(i))
          .map(
            (i) =>
              i.t.data() as Promise<Float32Array | Int32Array | Uint8Array>,
          ),
      ]);
      // the joined values in the floats' order, the others' reads in theirs
      let at = 0;
      let next = 0;
      for (const it of items) {
        if (!inJoined(it)) it.use(values[next++]!);
        else {
          it.use(all!.subarray(at, at + it.t.size));
          at += it.t.size;
        }
      }
    } finally {
      joined?.dispose();
      for (const it of items) it.t.dispose();
    }
  }

  /** Drops everything pending (a failed step). */
  clear(): void {
    for (const it of this.items) it.t.dispose();
    this.items = [];
  }
}
