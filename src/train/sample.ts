/**
 * Text generation from a trained character model, on one device in this thread:
 * autoregressive sampling with temperature over the last `context` characters.
 */
import { initBackend } from '../backend/index.js';
import { tf } from '../backend/tfjs.js';
import { Vocab } from '../data/vocab.js';
import { paramKey } from '../model/block.js';
import type { HostParams } from '../model/init.js';
import { buildModel, type CharLmConfig } from '../model/model.js';
import { check, LayerwiseError } from '../util/errors.js';
import { Rng } from '../util/rng.js';
import { findCheckpoint } from './checkpoint-io.js';

export interface SampleOptions {
  /** Run folder or checkpoint folder. */
  checkpoint: string;
  prompt?: string;
  /** Characters to generate. */
  length: number;
  /** Softmax temperature; lower is more conservative. */
  temperature: number;
  seed: number;
  backend: string;
}

/**
 * Generates `length` characters after `prompt`. Returns the prompt followed by the sample.
 * Throws {@link LayerwiseError} for a non-text checkpoint or prompt characters outside the
 * vocabulary.
 */
export async function sampleText(o: SampleOptions): Promise<string> {
  check(
    Number.isInteger(o.length) && o.length >= 0,
    `--length must be a non-negative integer, got ${o.length}`,
  );
  check(
    o.temperature > 0,
    `--temperature must be positive, got ${o.temperature}`,
  );
  const { ck } = await findCheckpoint(o.checkpoint);
  if (ck.model.arch !== 'charlm' || !ck.vocab) {
    throw new LayerwiseError(
      `checkpoint ${o.checkpoint} holds a ${ck.model.arch} model; 'sample' needs a character language model (charlm-*)`,
    );
  }
  const vocab = Vocab.fromJSON(ck.vocab);
  const prompt = o.prompt ?? '\n';
  if (prompt === '' && !vocab.covers('\n'))
    throw new LayerwiseError(
      `--prompt is empty and the model's text has no line breaks to start from; give a --prompt of at least one character`,
    );
  if (!vocab.covers(prompt)) {
    const missing = [
      ...new Set([...prompt].filter((c) => vocab.idOf(c) < 0)),
    ].join('');
    throw new LayerwiseError(
      `--prompt has characters the model never saw: ${JSON.stringify(missing)}`,
    );
  }
  await initBackend(o.backend);
  return generateText({
    model: ck.model,
    params: ck.params,
    vocab,
    prompt,
    length: o.length,
    temperature: o.temperature,
    seed: o.seed,
  });
}

/**
 * Generates `o.length` characters after `o.prompt` (whose characters the vocabulary covers;
 * an empty prompt starts from a line break, as at the start of a paragraph, which the result
 * leaves out)
 * with character model `o.model` and its parameters `o.params` (float32, keyed as
 * checkpoints key them), on this thread's current backend. Returns the prompt followed by the
 * sample. Used by {@link sampleText} and by the browser page, which has its parameters in
 * memory instead of a checkpoint.
 */
export function generateText(o: {
  model: CharLmConfig;
  params: HostParams;
  vocab: Vocab;
  prompt: string;
  length: number;
  temperature: number;
  seed: number;
}): string {
  const { vocab, prompt } = o;
  const model = buildModel(o.model);
  const ctx = o.model.context;
  const params = model.blocks.map((b, bi) =>
    Object.fromEntries(
      b.params.map((s) => [
        s.name,
        tf.tensor(o.params.get(paramKey(bi, s.name))!, s.shape),
      ]),
    ),
  );
  const start = prompt === '' ? 1 : 0; // an empty prompt: from a line break, not returned
  const ids = Array.from(vocab.encode(start ? '\n' : prompt));
  const rng = new Rng(o.seed);
  for (let i = 0; i < o.length; i++) {
    const window = ids.slice(-ctx);
    const probs = tf.tidy(() => {
      let h: tf.Tensor = tf.tensor2d(window, [1, window.length], 'int32');
      model.blocks.forEach((b, bi) => (h = b.forward(params[bi], h)));
      const last = tf
        .slice(h, [0, window.length - 1, 0], [1, 1, -1])
        .reshape([-1]);
      return tf.softmax(tf.div(last, o.temperature)).dataSync() as Float32Array;
    });
    let u = rng.next();
    let next = probs.length - 1;
    for (let j = 0; j < probs.length; j++) {
      u -= probs[j];
      if (u <= 0) {
        next = j;
        break;
      }
    }
    ids.push(next);
  }
  params.forEach((p) => tf.dispose(Object.values(p)));
  return vocab.decode(ids.slice(start));
}
