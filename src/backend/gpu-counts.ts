/**
 * What a webgpu device has asked of its GPU ({@link GpuCounts}, counted by backend/gpu-queue.ts)
 * and the two ways counts combine: a step's counts as the difference of two readings
 * ({@link gpuCountsSince}, runtime/stage-host.ts) and several devices' or steps' counts summed
 * ({@link sumGpuCounts}, strategies/stage-results.ts and train/step-tally.ts). Declared once
 * here, without TF.js: the coordinator's side and the browser page import it.
 */

/**
 * How much a device has asked of its GPU so far: compute dispatches (programs run, TF.js's and
 * layerwise's kernels alike, layerwise's own pipelines included; buffer-to-buffer copies are not
 * dispatches), queue submits, readbacks (reads of a buffer back to the host,
 * each a round trip) and buffer-to-buffer copies recorded on TF.js's command encoders (each a
 * command and host work: TF.js's uploads through a staging buffer and its reads' copies to one,
 * layerwise's multi-tensor kernels' copies, the pass timer's). Cumulative counts; a step's are
 * the difference of two readings.
 */
export interface GpuCounts {
  dispatches: number;
  submits: number;
  readbacks: number;
  copies: number;
  /**
   * Steps whose forward and backward the device replayed from a captured step
   * (pipeline/captured-step.ts; on unless LAYERWISE_WEBGPU_CAPTURE=0) instead of running TF.js's programs;
   * their dispatches, copies and submits are counted above as the replay made them. Absent where
   * the counts come from elsewhere (the browser page's).
   */
  replays?: number;
  /**
   * CPU time of the device's thread, ms (gpu-queue.ts threadCpuMs), while no read was waiting for the
   * GPU: the host's side of the step (its JS, TF.js's engine and kernels, Dawn's encoding and
   * submits made on that thread; not the GPU's work, not other threads). Absent where the
   * thread's CPU time cannot be read (not Linux, a browser).
   */
  hostMs?: number;
  /**
   * CPU time of the device's thread, ms, while a read waited for the GPU (`pollMs`): Dawn's Node
   * bindings poll for finished GPU work from event-loop turns, keeping the thread busy most of
   * the wait (75% of it measured here), besides the read's own copy out of the mapped buffer.
   * Absent with hostMs.
   */
  pollMs?: number;
}

/** The counted events of {@link GpuCounts}: what a difference or a sum goes over. */
const COUNTED = ['dispatches', 'submits', 'readbacks', 'copies'] as const;

/**
 * The counts between two readings of one device (`after` - `before`): a step's. hostMs and
 * pollMs where both readings have them.
 */
export function gpuCountsSince(before: GpuCounts, after: GpuCounts): GpuCounts {
  const d = Object.fromEntries(
    COUNTED.map((k) => [k, after[k] - before[k]]),
  ) as Pick<GpuCounts, (typeof COUNTED)[number]> & { replays?: number };
  if (after.replays !== undefined)
    d.replays = after.replays - (before.replays ?? 0);
  return after.hostMs !== undefined && before.hostMs !== undefined
    ? {
        ...d,
        hostMs: after.hostMs - before.hostMs,
        pollMs: (after.pollMs ?? 0) - (before.pollMs ?? 0),
      }
    : d;
}

/**
 * The counts summed (devices of one step, or steps): zeros for none. hostMs and pollMs only
 * where every one has hostMs (a total that left a device or a step out would mislead).
 */
export function sumGpuCounts(counts: readonly GpuCounts[]): GpuCounts {
  const sum = (k: keyof GpuCounts) =>
    counts.reduce((s, c) => s + (c[k] ?? 0), 0);
  const total = Object.fromEntries(COUNTED.map((k) => [k, sum(k)])) as Pick<
    GpuCounts,
    (typeof COUNTED)[number]
  > & { replays?: number };
  if (counts.some((c) => c.replays !== undefined))
    total.replays = sum('replays');
  return counts.every((c) => c.hostMs !== undefined)
    ? { ...total, hostMs: sum('hostMs'), pollMs: sum('pollMs') }
    : total;
}

/** One kernel's GPU time over a step (or steps, summed): seconds in its passes and their count (backend/gpu-queue.ts, LAYERWISE_WEBGPU_KERNEL_TIMES). */
export interface KernelTime {
  seconds: number;
  dispatches: number;
}

/** Kernel times of several devices or steps summed by kernel (undefined where none has any). */
export function sumKernelTimes(
  all: ReadonlyArray<Record<string, KernelTime> | undefined>,
): Record<string, KernelTime> | undefined {
  const given = all.filter((k) => k !== undefined);
  if (given.length === 0) return undefined;
  const out: Record<string, KernelTime> = {};
  for (const k of given)
    for (const [name, t] of Object.entries(k)) {
      const o = (out[name] ??= { seconds: 0, dispatches: 0 });
      o.seconds += t.seconds;
      o.dispatches += t.dispatches;
    }
  return out;
}
