/**
 * What a last stage records when it evaluates a micro-batch: the model's loss and its
 * evaluation metrics (model/model.ts Model.metrics), as numbers on the host.
 */
import { tf } from '../backend/tfjs.js';
import type { Model } from '../model/model.js';

/**
 * The loss and metrics of the model's output [B/M, ...] against the labels. Frees what it
 * creates; the caller keeps `output` and `labels`.
 */
export function evaluateOutput(model: Model, output: tf.Tensor, labels: tf.Tensor): { loss: number; metrics: Record<string, number> } {
  return tf.tidy(() => {
    const loss = model.loss(output, labels).dataSync()[0]!;
    const metrics: Record<string, number> = {};
    for (const [k, v] of Object.entries(model.metrics?.(output, labels) ?? {})) metrics[k] = v.dataSync()[0]!;
    return { loss, metrics };
  });
}
