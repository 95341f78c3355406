/**
 * `npm run bench -- <name> [options]`: benchmarks that write JSON and a Markdown table to
 * bench/results/. Timings live here, never in tests.
 */
import { Command } from 'commander';
import { initBackend } from '../backend/index.js';
import { benchGpipe } from './gpipe.js';

const program = new Command();
program.name('bench');
program
  .command('gpipe')
  .description('single vs gpipe throughput, bubble and peak device memory')
  .option('--preset <name>', 'model preset', 'charlm-small')
  .option('--batch-size <n>', 'mini-batch size', (v) => Number(v), 32)
  .option('--steps <n>', 'measured steps per configuration', (v) => Number(v), 3)
  .option('--micro-batches <list>', 'micro-batch counts', '1,2,4,8')
  .option('--stages <K>', 'pipeline stages', (v) => Number(v), 2)
  .option('--backend <name>', 'backend', 'wasm')
  .option('--out <dir>', 'results folder', 'bench/results')
  .action(async (o) => {
    await initBackend(o.backend); // validates the name before workers start
    await benchGpipe({ ...o, microBatches: String(o.microBatches).split(',').map(Number) }, (s) => console.log(s));
  });

await program.parseAsync(process.argv);
process.exit(0);
