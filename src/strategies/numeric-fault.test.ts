import assert from 'node:assert/strict';
import { test } from 'node:test';
import { describeFaults } from './numeric-fault.js';

const ranges = [0, 1, 2, 3].map((i) => ({ from: i, to: i + 1 }));

test('a non-finite gradient norm the diagnosis did not reproduce names its stage, or its device and the stages on it', () => {
  const chain = describeFaults([], [1, Number.NaN, 2, 3], ranges);
  assert.match(
    chain.message,
    /gradient norm was not finite on stage 1 \(blocks 1-1\): NaN/,
  );
  // the V-shape: stages 0 and 3 on device 0, stages 1 and 2 on device 1
  const v = describeFaults(
    [],
    [1, Number.POSITIVE_INFINITY],
    ranges,
    [0, 1, 1, 0],
  );
  assert.match(
    v.message,
    /on device 1 \(stage 1, blocks 1-1; stage 2, blocks 2-2\): Infinity/,
  );
  // a fault found names its block, stage and micro-batch
  const f = describeFaults(
    [
      {
        what: 'activation',
        stage: 2,
        block: 2,
        blockName: 'decoder1',
        mb: 5,
        value: 'NaN',
      },
    ],
    [1, Number.NaN],
    ranges,
    [0, 1, 1, 0],
  );
  assert.match(f.message, /block 2 \(decoder1\) on stage 2, micro-batch 5/);
});
