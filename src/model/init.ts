import { Rng } from '../util/rng.js';
import type { Block, Init } from './block.js';
import { paramKey, sizeOf } from './block.js';

/** A model's parameter values on the host, keyed by {@link paramKey}. fp32. */
export type HostParams = Map<string, Float32Array>;

function fill(init: Init, out: Float32Array, rng: Rng): void {
  switch (init.kind) {
    case 'zeros':
      return;
    case 'ones':
      out.fill(1);
      return;
    case 'normal':
      for (let i = 0; i < out.length; i++) out[i] = rng.normal() * init.std;
      return;
    case 'uniform':
      for (let i = 0; i < out.length; i++)
        out[i] = (rng.next() * 2 - 1) * init.limit;
      return;
    case 'values':
      if (init.values.length !== out.length)
        throw new Error(
          `initial values have ${init.values.length} elements, the parameter ${out.length}`,
        );
      out.set(init.values);
      return;
    case 'initializer': {
      const values = init.draw(() => rng.next());
      if (values.length !== out.length)
        throw new Error(
          `the initializer drew ${values.length} elements, the parameter has ${out.length}`,
        );
      out.set(values);
      return;
    }
  }
}

/**
 * Draws the initial parameters of blocks `[from, to)` on the host. Each parameter has its own
 * random stream seeded by (seed, block index, parameter index), so the values do not depend on
 * how the model is partitioned, on the device or on the backend: every strategy starts from
 * exactly the same weights. With `shared`, every array is backed by its own SharedArrayBuffer
 * (which L2L's parameter server can adopt without a copy; see src/param-server/store.ts).
 */
export function initParams(
  blocks: readonly Block[],
  seed: number,
  from = 0,
  to = blocks.length,
  opts: { shared?: boolean } = {},
): HostParams {
  const out: HostParams = new Map();
  for (let b = from; b < to; b++)
    initBlockParams(
      blocks[b],
      seed,
      b,
      (name) => paramKey(b, name),
      out,
      opts.shared,
    );
  return out;
}

/**
 * Draws the parameters of one block into `out` under the keys `key(name)`, from the random
 * streams (seed, stream, parameter index). Model blocks use their index as the stream;
 * auxiliary heads use streams past the model's blocks.
 */
export function initBlockParams(
  block: Block,
  seed: number,
  stream: number,
  key: (name: string) => string,
  out: HostParams,
  shared = false,
): void {
  block.params.forEach((spec, j) => {
    const n = sizeOf(spec.shape);
    const values = shared
      ? new Float32Array(new SharedArrayBuffer(4 * n))
      : new Float32Array(n);
    const rng = new Rng(
      (Math.imul(seed + 1, 0x01000193) ^
        Math.imul(stream + 1, 0x9e3779b1) ^
        Math.imul(j + 1, 0x85ebca6b)) >>>
        0,
    );
    fill(spec.init, values, rng);
    out.set(key(spec.name), values);
  });
}
