/** Blocks of a character-level causal Transformer language model (pre-LN, GPT-2 style). */
import * as tf from '@tensorflow/tfjs-core';
import { LayerwiseError } from '../util/errors.js';
import type { Block } from './block.js';
import { causalSelfAttention, dense, denseGelu, layerNorm } from './layers.js';

/** Token + learned position embedding. Input: int32 token ids [B, T]; output [B, T, D]. */
export function embedding(
  name: string,
  vocab: number,
  context: number,
  d: number,
): Block {
  return {
    name,
    params: [
      {
        name: 'tok',
        shape: [vocab, d],
        init: { kind: 'normal', std: 0.02 },
        gathered: true,
      },
      {
        name: 'pos',
        shape: [context, d],
        init: { kind: 'normal', std: 0.02 },
        gathered: true,
      },
    ],
    outputShape: ([b, t]) => [b, t, d],
    forward(p, x) {
      const t = x.shape[1] as number;
      if (x.rank !== 2 || t > context) {
        throw new LayerwiseError(
          `embedding input must be token ids [B, T] with T <= context ${context}, got shape [${x.shape}]`,
        );
      }
      const tok = tf.gather(p.tok, x as tf.Tensor2D); // [B, T, D]
      const pos = t === context ? p.pos : tf.slice(p.pos, [0, 0], [t, d]);
      return tf.add(tok, pos);
    },
    flops: () => 0,
  };
}

/**
 * Pre-LN decoder block: x + attn(ln1(x)), then + mlp(ln2(x)) with a 4D-wide GELU MLP.
 * [B, T, D] -> [B, T, D]. 12 D^2 + 13 D parameters.
 */
export function decoderBlock(
  name: string,
  d: number,
  heads: number,
  nLayers: number,
): Block {
  const std = 0.02;
  const projStd = 0.02 / Math.sqrt(2 * nLayers); // GPT-2's scaled init of residual projections
  return {
    name,
    params: [
      { name: 'ln1_g', shape: [d], init: { kind: 'ones' } },
      { name: 'ln1_b', shape: [d], init: { kind: 'zeros' } },
      { name: 'wqkv', shape: [d, 3 * d], init: { kind: 'normal', std } },
      { name: 'bqkv', shape: [3 * d], init: { kind: 'zeros' } },
      { name: 'wo', shape: [d, d], init: { kind: 'normal', std: projStd } },
      { name: 'bo', shape: [d], init: { kind: 'zeros' } },
      { name: 'ln2_g', shape: [d], init: { kind: 'ones' } },
      { name: 'ln2_b', shape: [d], init: { kind: 'zeros' } },
      { name: 'w1', shape: [d, 4 * d], init: { kind: 'normal', std } },
      { name: 'b1', shape: [4 * d], init: { kind: 'zeros' } },
      { name: 'w2', shape: [4 * d, d], init: { kind: 'normal', std: projStd } },
      { name: 'b2', shape: [d], init: { kind: 'zeros' } },
    ],
    outputShape: (s) => s,
    forward(p, x) {
      const a = causalSelfAttention(
        layerNorm(x, p.ln1_g, p.ln1_b),
        heads,
        p.wqkv,
        p.bqkv,
        p.wo,
        p.bo,
      );
      const h = tf.add(x, a);
      const m = dense(
        denseGelu(layerNorm(h, p.ln2_g, p.ln2_b), p.w1, p.b1),
        p.w2,
        p.b2,
      );
      return tf.add(h, m);
    },
    flops: ([b, t]) => 2 * b * t * 12 * d * d + 4 * b * t * t * d,
  };
}

/** Final layer norm and projection to the vocabulary. [B, T, D] -> logits [B, T, V]. */
export function lmHead(name: string, d: number, vocab: number): Block {
  return {
    name,
    params: [
      { name: 'ln_g', shape: [d], init: { kind: 'ones' } },
      { name: 'ln_b', shape: [d], init: { kind: 'zeros' } },
      { name: 'w', shape: [d, vocab], init: { kind: 'normal', std: 0.02 } },
      { name: 'b', shape: [vocab], init: { kind: 'zeros' } },
    ],
    outputShape: ([b, t]) => [b, t, vocab],
    forward: (p, x) => dense(layerNorm(x, p.ln_g, p.ln_b), p.w, p.b),
    flops: ([b, t]) => 2 * b * t * d * vocab,
  };
}
