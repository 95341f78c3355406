/**
 * `npm run bench -- <name> [options]`: benchmarks that write JSON and a Markdown table to
 * bench/results/. Timings live here, never in tests.
 */
import { Command } from 'commander';
import { initBackend } from '../backend/index.js';
import { defaultBackend } from '../backend/names.js';
import {
  exitTwoOnBadCommandLine,
  nonNegativeNumber,
  positiveInteger,
  positiveIntegers,
  positiveNumber,
  probability,
  resultsFolder,
  wholeNumber,
} from '../cli/flags.js';
import { REMAT_MODES, SCHEDULE_KINDS } from '../schedule/schedule.js';
import { LayerwiseError } from '../util/errors.js';
import { benchBalance } from './balance.js';
import { benchGpipe } from './gpipe.js';

const program = new Command();
program.name('bench');
program
  .command('gpipe')
  .description('single vs gpipe throughput, bubble and peak device memory')
  .option('--preset <name>', 'model preset', 'charlm-small')
  .option('--batch-size <n>', 'mini-batch size', positiveInteger, 32)
  .option('--steps <n>', 'measured steps per configuration', positiveInteger, 4)
  .option(
    '--micro-batches <list>',
    'micro-batch counts',
    positiveIntegers,
    [1, 2, 4, 8],
  )
  .option('--stages <K>', 'pipeline stages', positiveInteger, 2)
  .option(
    '--schedules <list>',
    `schedules to compare (${SCHEDULE_KINDS.join(', ')})`,
    'gpipe',
  )
  .option(
    '--checkpoint <list>',
    `re-materialization modes (${REMAT_MODES.join(', ')})`,
    REMAT_MODES.join(','),
  )
  .option('--backend <name>', 'backend', 'wasm')
  .option('--precision <p>', 'compute precision: fp32 or bf16 (native)', 'fp32')
  .option(
    '--name <name>',
    'results file name (<name>.json, <name>.md)',
    'gpipe',
  )
  .option(
    '--rounds <n>',
    'every configuration once per round, rotated (medians reported)',
    positiveInteger,
    1,
  )
  .option('--out <dir>', 'results folder', resultsFolder, 'bench/results')
  .action(async (o) => {
    await initBackend(o.backend, { precision: o.precision }); // validates the name and precision before workers start
    const list = <T extends string>(
      v: string,
      valid: readonly T[],
      what: string,
    ): T[] =>
      String(v)
        .split(',')
        .map((x) => {
          if (!(valid as readonly string[]).includes(x))
            throw new LayerwiseError(
              `--${what}: unknown '${x}' (valid: ${valid.join(', ')})`,
            );
          return x as T;
        });
    await benchGpipe(
      {
        ...o,
        schedules: list(o.schedules, SCHEDULE_KINDS, 'schedules'),
        remats: list(o.checkpoint, REMAT_MODES, 'checkpoint'),
      },
      (s) => console.log(s),
    );
  });

program
  .command('backends')
  .description(
    'single-device tokens/s on wasm, cpu and native; native pipelines with one thread per stage',
  )
  .option('--preset <name>', 'model preset', 'charlm-small')
  .option('--batch-size <n>', 'mini-batch size', positiveInteger, 32)
  .option('--steps <n>', 'measured steps per configuration', positiveInteger, 4)
  .option(
    '--cpu-steps <n>',
    'measured steps on the (slow) cpu backend',
    positiveInteger,
    1,
  )
  .option('--out <dir>', 'results folder', resultsFolder, 'bench/results')
  .action(async (o) => {
    const { benchBackends } = await import('./backends.js');
    await benchBackends(o, (s) => console.log(s));
  });

program
  .command('transport')
  .description(
    'channel throughput (MB/s) and round-trip latency on loopback for threads, processes (gRPC) and a raw TCP socket; gpipe K=2 over threads vs processes',
  )
  .option('--mib <n>', 'MiB per throughput message', positiveNumber, 4)
  .option(
    '--messages <n>',
    'throughput messages per transport',
    positiveInteger,
    64,
  )
  .option(
    '--round-trips <n>',
    'round trips for the latency',
    positiveInteger,
    200,
  )
  .option(
    '--steps <n>',
    'measured gpipe steps per device kind',
    positiveInteger,
    4,
  )
  .option('--out <dir>', 'results folder', resultsFolder, 'bench/results')
  .action(async (o) => {
    const { benchTransport } = await import('./transport.js');
    await benchTransport(
      {
        mib: o.mib,
        messages: o.messages,
        roundTrips: o.roundTrips,
        steps: o.steps,
        out: o.out,
      },
      (s) => console.log(s),
    );
  });

program
  .command('webgpu')
  .description(
    'matmul GFLOP/s on webgpu (Dawn: the GPU, else a software GPU) beside native and wasm',
  )
  .option(
    '--sizes <list>',
    'matrix sizes n',
    positiveIntegers,
    [256, 512, 1024],
  )
  .option('--reps <n>', 'products per size', positiveInteger, 10)
  .option(
    '--preset <name>',
    'preset whose training tokens/s is measured',
    'charlm-small',
  )
  .option(
    '--steps <n>',
    'measured training steps (0: matmul only)',
    wholeNumber,
    3,
  )
  .option('--out <dir>', 'results folder', resultsFolder, 'bench/results')
  .action(async (o) => {
    const { benchWebGPU } = await import('./webgpu.js');
    await benchWebGPU(
      {
        sizes: o.sizes,
        reps: o.reps,
        preset: o.preset,
        steps: o.steps,
        out: o.out,
      },
      (s) => console.log(s),
    );
  });

program
  .command('webgpu-host')
  .description(
    "the host's side of webgpu: host us per dispatching kernel call, and host, polling and wall ms per step of a charlm-small single with the GPU's share made small (thread CPU time, Linux)",
  )
  .option('--calls <n>', 'kernel calls per round', positiveInteger, 2000)
  .option('--rounds <n>', 'rounds (median)', positiveInteger, 5)
  .option('--steps <n>', 'measured training steps (0: none)', wholeNumber, 60)
  .option('--warmup <n>', 'training steps not measured', wholeNumber, 5)
  .option('--out <dir>', 'results folder', resultsFolder, 'bench/results')
  .action(async (o) => {
    const { benchWebGPUHost } = await import('./webgpu-host.js');
    await benchWebGPUHost(
      {
        calls: o.calls,
        rounds: o.rounds,
        steps: o.steps,
        warmup: o.warmup,
        out: o.out,
      },
      (s) => console.log(s),
    );
  });

program
  .command('dense-gelu')
  .description(
    "the MLP's product + bias + GELU on webgpu: one op (one dispatch) vs dense then gelu, forward and forward + backward",
  )
  .option(
    '--rows <n>',
    'activation rows (batch x context)',
    positiveInteger,
    1024,
  )
  .option(
    '--d <n>',
    'model width (the product is d x 4d)',
    positiveInteger,
    256,
  )
  .option('--reps <n>', 'calls per timing', positiveInteger, 5)
  .option('--rounds <n>', 'timings per variant, alternated', positiveInteger, 5)
  .option('--out <dir>', 'results folder', resultsFolder, 'bench/results')
  .action(async (o) => {
    const { benchDenseGelu } = await import('./dense-gelu.js');
    await benchDenseGelu(o, (s) => console.log(s));
  });

program
  .command('matmul-tiles')
  .description(
    "layerwise's webgpu product in each tiling (wgsl/matmul.ts TILINGS, forced) on the 8 x d1024 model's products: TFLOP/s, and which the size rule picks",
  )
  .option(
    '--shapes <list>',
    'products MxKxN[:tA][:tB], comma-separated (default: the 8 x d1024 model at 8,192 rows)',
  )
  .option(
    '--tilings <list>',
    'tilings to compare, comma-separated',
    't64,t128,t128x64,t64p',
  )
  .option('--reps <n>', 'products per timing', positiveInteger, 10)
  .option('--rounds <n>', 'timings per tiling, alternated', positiveInteger, 5)
  .option('--out <dir>', 'results folder', resultsFolder, 'bench/results')
  .action(async (o) => {
    const { benchMatMulTiles, MODEL_SHAPES } = await import(
      './matmul-tiles.js'
    );
    await benchMatMulTiles(
      {
        shapes: o.shapes ? String(o.shapes).split(',') : MODEL_SHAPES,
        tilings: String(o.tilings).split(','),
        reps: o.reps,
        rounds: o.rounds,
        out: o.out,
      },
      (s) => console.log(s),
    );
  });

program
  .command('gpu')
  .description(
    "issue 36's GPU table: layerwise webgpu, plain TF.js webgpu and PyTorch CUDA, charlm-small and 8 x d1024, batch 32; l2l and gpipe K=2 of the large model (each run its own process, all within --budget-seconds: a 5-minute device session)",
  )
  .option('--quick', 'charlm-tiny and charlm-small (a software GPU)', false)
  .option(
    '--steps <n>',
    "measured steps of every configuration (default: the model's)",
    positiveInteger,
  )
  .option(
    '--warmup <n>',
    'steps left out of tokens/s (shader compilation)',
    wholeNumber,
    2,
  )
  .option(
    '--configs <list>',
    'configurations or models to run, e.g. small,large/l2l (default: all)',
  )
  .option(
    '--config-seconds <s>',
    'wall-clock limit of one configuration',
    positiveNumber,
    75,
  )
  .option(
    '--budget-seconds <s>',
    'wall-clock budget of the whole bench',
    positiveNumber,
    270,
  )
  .option('--python <cmd>', 'Python for the PyTorch rows', 'python3')
  .option('--name <name>', 'results file name (<name>.json, <name>.md)', 'gpu')
  .option('--out <dir>', 'results folder', resultsFolder, 'bench/results')
  .action(async (o) => {
    const { benchGpu } = await import('./gpu.js');
    await benchGpu(
      { ...o, configs: o.configs?.split(',').filter(Boolean) },
      (s) => console.log(s),
    );
  });

program
  .command('kernels')
  .description(
    "where a training step's time goes, per kernel, on one backend (single device, in this thread)",
  )
  .option('--preset <name>', 'model preset', 'charlm-small')
  .option('--batch-size <n>', 'mini-batch size', positiveInteger, 32)
  .option('--backend <name>', 'backend', 'native')
  .option('--precision <p>', 'compute precision: fp32 or bf16', 'fp32')
  .option('--steps <n>', 'measured steps', positiveInteger, 3)
  .option(
    '--warmup <n>',
    "untimed steps at each thread count before the measured ones (V8 still optimizes the step's JS for tens of steps)",
    wholeNumber,
    1,
  )
  .option('--shapes', 'split the rows by input shapes', false)
  .option(
    '--threads <list>',
    'native only: OpenMP team sizes to measure at, comma-separated (e.g. 1,2)',
    positiveIntegers,
  )
  .option(
    '--cpu',
    "native only: also time each kernel on the OpenMP team's CPU clocks (a team wake-up around each call)",
    false,
  )
  .option(
    '--replay',
    "native only: then record one step's addon calls and time them replayed alone at each thread count (the step without TF.js)",
    false,
  )
  .option('--out <dir>', 'results folder', resultsFolder, 'bench/results')
  .action(async (o) => {
    const { benchKernels } = await import('./kernels.js');
    await benchKernels(o, (s) => console.log(s));
  });

program
  .command('bf16-matmul')
  .description(
    "native fp32 vs bf16 matrix products on charlm-small's shapes, with and without converting the operands",
  )
  .option(
    '--rows <n>',
    'activation rows (batch x context)',
    positiveInteger,
    4096,
  )
  .option('--reps <n>', 'repetitions per variant', positiveInteger, 10)
  .option('--threads <n>', 'OpenMP threads', positiveInteger)
  .option('--out <dir>', 'results folder', resultsFolder, 'bench/results')
  .action(async (o) => {
    const { benchBf16Matmul } = await import('./bf16-matmul.js');
    await benchBf16Matmul(o, (s) => console.log(s));
  });

program
  .command('precision')
  .description(
    'fp32 vs bf16 mixed precision on native: single and gpipe tokens/s in one run (bars: bf16 1.5x single, 1.4x gpipe K=2); optional convergence check',
  )
  .option('--preset <name>', 'model preset', 'charlm-small')
  .option('--batch-size <n>', 'mini-batch size', positiveInteger, 32)
  .option('--steps <n>', 'measured steps per configuration', positiveInteger, 6)
  .option('--stages <K>', 'gpipe stages', positiveInteger, 2)
  .option('--micro-batches <M>', 'gpipe micro-batches', positiveInteger, 4)
  .option(
    '--convergence <steps>',
    'also train charlm-tiny this many steps at each precision and compare validation losses (0: skip)',
    wholeNumber,
    0,
  )
  .option('--out <dir>', 'results folder', resultsFolder, 'bench/results')
  .action(async (o) => {
    const { benchPrecision } = await import('./precision.js');
    await benchPrecision(o, (s) => console.log(s));
  });

program
  .command('balance')
  .description(
    'gpipe throughput with --balance time vs the default (by parameters) on a model with uneven blocks; bubble vs (K-1)/(M+K-1)',
  )
  .option('--layers <n>', 'decoder layers', positiveInteger, 4)
  .option('--d-model <n>', 'model width', positiveInteger, 64)
  .option('--context <n>', 'context length', positiveInteger, 32)
  .option(
    '--vocab <n>',
    'vocabulary size (the wide head)',
    positiveInteger,
    4096,
  )
  .option('--batch-size <n>', 'mini-batch size', positiveInteger, 32)
  .option('--stages <K>', 'pipeline stages', positiveInteger, 2)
  .option(
    '--micro-batches <list>',
    'micro-batch counts',
    positiveIntegers,
    [4, 8],
  )
  .option('--steps <n>', 'measured steps per configuration', positiveInteger, 4)
  .option('--backend <name>', 'backend', 'wasm')
  .option('--out <dir>', 'results folder', resultsFolder, 'bench/results')
  .action(async (o) => {
    await initBackend(o.backend);
    await benchBalance(o, (s) => console.log(s));
  });

program
  .command('local')
  .description(
    'validation loss vs wall-clock for single, gpipe and local parallelism, and local throughput vs single',
  )
  .option('--preset <name>', 'model preset', 'charlm-small')
  .option('--batch-size <n>', 'mini-batch size', positiveInteger, 32)
  .option(
    '--seconds <s>',
    'training seconds per strategy and round',
    positiveNumber,
    60,
  )
  .option(
    '--rounds <n>',
    'rounds, each running every strategy once in a rotated order (figures are medians)',
    positiveInteger,
    3,
  )
  .option(
    '--eval-seconds <s>',
    'evaluate every this many training seconds',
    positiveNumber,
    15,
  )
  .option('--eval-batches <n>', 'validation batches', positiveInteger, 4)
  .option(
    '--gpipe-micro-batches <n>',
    'gpipe micro-batches',
    positiveInteger,
    8,
  )
  .option(
    '--local-micro-batches <n>',
    'local updates per mini-batch',
    positiveInteger,
    2,
  )
  .option('--lr <x>', 'learning rate', positiveNumber, 2e-3)
  .option('--backend <name>', 'backend', defaultBackend())
  .option('--out <dir>', 'results folder', resultsFolder, 'bench/results')
  .action(async (o) => {
    await initBackend(o.backend);
    // vega (local.ts's plot) is a devDependency: a production install (a device bundle) lacks it
    const { benchLocal } = await import('./local.js');
    await benchLocal(o, (s) => console.log(s));
  });

(await import('./param-server.js')).registerParamServerBench(program);

program
  .command('cores')
  .description(
    'tokens/s against kernel threads on one machine: native single fp32/bf16, the schedules and local at K = 2, 3, 4, PyTorch beside them where importable',
  )
  .option('--preset <name>', 'model preset', 'charlm-small')
  .option('--batch-size <n>', 'mini-batch size', positiveInteger, 32)
  .option('--steps <n>', 'timed steps per configuration', positiveInteger, 3)
  .option(
    '--warmup <n>',
    "untimed steps per configuration before the timed ones (V8 still optimizes the step's JS for tens of steps)",
    wholeNumber,
    1,
  )
  .option(
    '--threads <list>',
    "threads per device (and each K's default)",
    '1,2,4,8,16',
  )
  .option('--stages <list>', 'devices K of the pipelines and local', '2,3,4')
  .option(
    '--kinds <list>',
    'single, single-bf16, 1f1b, zb-h1, zbv, dualpipev, local',
    'single,single-bf16,1f1b,zb-h1,zbv,dualpipev,local',
  )
  .option(
    '--micro-batches <list>',
    'micro-batch counts of the pipeline schedules, a row each',
    '4,8',
  )
  .option(
    '--local-micro-batches <n>',
    'local updates per mini-batch',
    positiveInteger,
    2,
  )
  .option('--devices <kind>', 'thread or process (pinned)', 'thread')
  .option(
    '--rounds <n>',
    "measure each configuration n times, in rounds over them in a rotated order; each row is its median round's (a shared machine's drift spreads over all rows)",
  )
  .option(
    '--budget-s <s>',
    'start no configuration after this many seconds',
    positiveNumber,
    240,
  )
  .option(
    '--python <path>',
    "Python for bench/pytorch/charlm.py ('' skips it)",
    'python3',
  )
  .option(
    '--pytorch-script <path>',
    'charlm.py, where it is not at bench/pytorch/ beside dist/',
  )
  .option('--note <text>', 'a line for the results file about the run')
  .option('--name <name>', 'results file name', 'cores')
  .option('--out <dir>', 'results folder', resultsFolder, 'bench/results')
  .action(async (o) => {
    const { benchCores, parseCoresOptions } = await import('./cores.js');
    await benchCores(parseCoresOptions(o), (s) => console.log(s));
  });

program
  .command('layer-drop')
  .description(
    'l2l with --layer-drop P against 0: host-to-device bytes per step, step time, tokens/s',
  )
  .option('--layers <n>', 'decoder blocks of charlm-small', positiveInteger, 12)
  .option('--p <x>', 'drop probability compared with 0', probability, 0.5)
  .option(
    '--steps <n>',
    'steps per run (the first left out)',
    positiveInteger,
    8,
  )
  .option('--batch-size <n>', 'mini-batch size', positiveInteger, 32)
  .option('--micro-batches <n>', 'l2l micro-batches', positiveInteger, 4)
  .option(
    '--stages <n>',
    'l2l devices (more than 1: the pipelined relay)',
    positiveInteger,
    1,
  )
  .option('--backend <name>', 'backend', defaultBackend())
  .option('--out <dir>', 'results folder', resultsFolder, 'bench/results')
  .action(async (o) => {
    const { benchLayerDrop } = await import('./layer-drop.js');
    await benchLayerDrop(o, (s) => console.log(s));
  });

program
  .command('l2l-pipeline')
  .description(
    'the pipelined relay (l2l --stages K) against depth: peak device bytes per device, measured and predicted; one-device relay and gpipe for scale',
  )
  .option(
    '--blocks <list>',
    'blocks per model of the sweep (charlm-small)',
    positiveIntegers,
    [6, 12, 24, 48],
  )
  .option('--stages <n>', 'devices K', positiveInteger, 2)
  .option('--micro-batches <n>', 'micro-batches', positiveInteger, 4)
  .option('--batch-size <n>', 'mini-batch size', positiveInteger, 32)
  .option(
    '--steps <n>',
    'steps per run (the first left out)',
    positiveInteger,
    3,
  )
  .option('--backend <name>', 'backend', defaultBackend())
  .option('--out <dir>', 'results folder', resultsFolder, 'bench/results')
  .action(async (o) => {
    const { benchL2LPipeline } = await import('./l2l-pipeline.js');
    await benchL2LPipeline(o, (s) => console.log(s));
  });

program
  .command('l2l')
  .description(
    'l2l vs single: peak device memory and throughput against depth, largest model under a device budget, parameter server update rate',
  )
  .option(
    '--blocks <list>',
    'blocks per model of the depth sweep',
    positiveIntegers,
    [6, 12, 24, 48],
  )
  .option('--d-model <n>', 'model width of the sweep', positiveInteger, 128)
  .option('--context <n>', 'context length of the sweep', positiveInteger, 64)
  .option(
    '--batch-size <n>',
    'mini-batch size of the sweep',
    positiveInteger,
    16,
  )
  .option(
    '--micro-batches <n>',
    'l2l micro-batches in the sweep',
    positiveInteger,
    2,
  )
  .option(
    '--budget <size>',
    'device budget of the largest-model comparison',
    '768MiB',
  )
  .option('--steps <n>', 'measured steps per run', positiveInteger, 3)
  .option('--quick', 'skip the charlm-small throughput rows')
  .option('--backend <name>', 'backend', 'wasm')
  .option('--out <dir>', 'results folder', resultsFolder, 'bench/results')
  .action(async (o) => {
    await initBackend(o.backend);
    const { benchL2L } = await import('./l2l.js');
    const { parseSize } = await import('../util/size.js');
    await benchL2L(
      {
        ...o,
        budget: parseSize(o.budget, '--budget'),
      },
      (s) => console.log(s),
    );
  });

program
  .command('l2l-max')
  .description(
    'a few full l2l training steps of one large character Transformer (default 1.1 billion parameters, 4.4 GB fp32) on Moby-Dick',
  )
  .option('--layers <n>', 'decoder layers', positiveInteger, 22)
  .option('--d-model <n>', 'model width', positiveInteger, 2048)
  .option('--heads <n>', 'attention heads', positiveInteger, 16)
  .option('--context <n>', 'context length', positiveInteger, 32)
  .option('--batch-size <n>', 'mini-batch size', positiveInteger, 2)
  .option('--micro-batches <n>', 'micro-batches', positiveInteger, 1)
  .option('--steps <n>', 'training steps', positiveInteger, 2)
  .option(
    '--clip-norm <x>',
    'global gradient clipping (0: off; on holds a whole step of gradients in host memory)',
    nonNegativeNumber,
    0,
  )
  .option(
    '--server-threads <n>',
    "parameter server's optimizer threads",
    positiveInteger,
    1,
  )
  .option('--lr <x>', 'learning rate', positiveNumber, 1e-5)
  .option('--backend <name>', 'backend', 'wasm')
  .option('--out <dir>', 'results folder', resultsFolder, 'bench/results')
  .action(async (o) => {
    const { benchL2LMax } = await import('./l2l-max.js');
    await benchL2LMax(o, (s) => console.log(s));
  });

exitTwoOnBadCommandLine(program); // as bad input found later does below, and as `layerwise`

try {
  await program.parseAsync(process.argv);
} catch (e) {
  // bad input (a flag's value, an unknown configuration): the message names the fix; no stack
  if (!(e instanceof LayerwiseError)) throw e;
  console.error(`bench: ${e.message}`);
  process.exit(2);
}
process.exit(0);
