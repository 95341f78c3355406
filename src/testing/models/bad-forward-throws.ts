/** A bad test model module: a block whose forward throws (an internal failure inside a stage, for the CLI's error path). */
import type { Block } from '../../model/block.js';

const broken: Block = {
  name: 'broken',
  params: [{ name: 'w', shape: [784, 10], init: { kind: 'zeros' } }],
  outputShape: ([b]) => [b!, 10],
  forward: () => {
    throw new Error('this block is broken on purpose');
  },
  flops: ([b]) => 2 * b! * 784 * 10,
};

export default { blocks: [broken], inputShape: [28, 28, 1] };
