/**
 * What a last stage records when it evaluates a micro-batch: the model's loss and its
 * evaluation metrics (model/model.ts Model.metrics), read off the device at the step's end.
 */
import { tf } from '../backend/tfjs.js';
import type { Model } from '../model/model.js';
import type { PendingReads } from './pending-reads.js';

/**
 * Computes the loss and metrics of the model's output [B/M, ...] against the labels on the
 * device and hands them to `record` once `reads` is flushed. The caller keeps `output` and
 * `labels`.
 */
export function recordEvaluation(
  reads: PendingReads,
  model: Model,
  output: tf.Tensor,
  labels: tf.Tensor,
  record: (loss: number, metrics: Record<string, number>) => void,
): void {
  let names: string[] = [];
  const values = tf.tidy(() => {
    const loss = model.loss(output, labels);
    const ms = model.metrics?.(output, labels) ?? {};
    names = Object.keys(ms);
    return tf.stack([loss, ...names.map((n) => ms[n]!)]);
  });
  reads.read(values, (v) =>
    record(
      Number(v[0]),
      Object.fromEntries(names.map((n, i) => [n, Number(v[i + 1])])),
    ),
  );
}
