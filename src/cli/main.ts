#!/usr/bin/env node
import cliProgress from 'cli-progress';
/**
 * The `layerwise` command: `train` a model with a strategy, `sample` text from a checkpoint,
 * `presets` to list models. User errors print one line and exit with status 2 (so does a device
 * over its --device-memory budget); a failing stage or any other error exits with status 1.
 */
import { Command } from 'commander';
import { BACKENDS, defaultBackend, precisionNote } from '../backend/names.js';
import { LOSSES } from '../model/loss-names.js';
import { PRESETS } from '../model/presets.js';
import { SCHEDULE_KINDS } from '../schedule/schedule.js';
import { STRATEGY_SPECS, specOf } from '../strategies/index.js';
import { threadsLine } from '../strategies/spec.js';
import { trainWithRestarts } from '../train/restarts.js';
import { sampleText } from '../train/sample.js';
import type { TrainHooks } from '../train/trainer.js';
import { LayerwiseError } from '../util/errors.js';
import { formatSize } from '../util/size.js';
import { exitTwoOnBadCommandLine, integer, number } from './flags.js';
import { reportError } from './report-error.js';

function hooks(): TrainHooks {
  const tty = process.stderr.isTTY;
  let bar: cliProgress.SingleBar | null = null;
  let every = 1;
  return {
    onStart({ config, model, params, bytes, ranges, startStep, budget }) {
      const stages = ranges.map(
        (r, i) =>
          `stage ${i}: blocks ${r.from}-${r.to - 1} (${model.blocks
            .slice(r.from, r.to)
            .map((b) => b.name)
            .join(', ')})`,
      );
      console.log(
        `model ${config.model ?? config.preset}: ${model.blocks.length} blocks, ${params.toLocaleString('en-US')} parameters, ${formatSize(bytes)} fp32`,
      );
      console.log(
        `strategy ${config.strategy} on ${config.backend}: ${stages.join('; ')}`,
      );
      if (config.precision !== 'fp32')
        console.log(
          `precision ${config.precision}: ${precisionNote(config.precision)}`,
        );
      for (const note of model.blocks.flatMap((b) => b.notes ?? []))
        console.log(`note: ${note}`);
      const setup = specOf(config.strategy).describeRun?.(config, bytes);
      if (setup) console.log(setup);
      const spec = specOf(config.strategy);
      const threads = threadsLine(
        config,
        spec.oneDevice,
        undefined,
        spec.deviceLoads?.(config, model, ranges),
      );
      if (threads) console.log(threads);
      if (budget?.budget !== undefined) {
        console.log(
          `device budget ${formatSize(budget.budget)}: predicted peak ${budget.predicted ? budget.predicted.map(formatSize).join(' / ') : 'not predicted'}`,
        );
      }
      if (startStep) console.log(`resuming at step ${startStep}`);
      every = Math.max(1, Math.round(config.steps / 20));
      if (tty) {
        bar = new cliProgress.SingleBar(
          {
            format:
              'step {value}/{total} [{bar}] loss {loss} | {rate} | ETA {eta_formatted}',
            hideCursor: true,
            etaBuffer: 20,
          },
          cliProgress.Presets.shades_classic,
        );
        bar.start(config.steps, startStep, { loss: '-', rate: '-' });
      }
    },
    warn(msg) {
      bar?.stop();
      bar = null;
      console.error(`layerwise: warning: ${msg}`);
    },
    onStep(m, total) {
      const rate =
        m.tokens_per_s !== undefined
          ? `${m.tokens_per_s.toFixed(0)} tokens/s`
          : `${(m.examples_per_s ?? 0).toFixed(0)} examples/s`;
      const acc =
        m.val_accuracy !== undefined
          ? ` acc ${(100 * m.val_accuracy).toFixed(1)}%`
          : '';
      const val =
        m.val_loss !== undefined ? ` val ${m.val_loss.toFixed(4)}${acc}` : '';
      if (bar) {
        bar.update(m.step, { loss: m.loss.toFixed(4) + val, rate });
        if (m.step === total) bar.stop();
      } else if (
        m.step % every === 0 ||
        m.step === total ||
        m.val_loss !== undefined
      ) {
        console.log(
          `step ${m.step}/${total} loss ${m.loss.toFixed(4)}${val} ${rate}`,
        );
      }
    },
  };
}

const program = new Command();
program
  .name('layerwise')
  .description(
    'Train deep networks split by layers: GPipe pipelines on worker-thread devices (TensorFlow.js)',
  );
// --debug (anywhere on the command line): an internal error prints its full report (stack, schedule)
program.option(
  '--debug',
  'on an internal error, print the full report (stack trace) too',
);
const debug = process.argv.includes('--debug');
const argv = process.argv.filter((a, i) => i < 2 || a !== '--debug');

program
  .command('train')
  .description(
    'train a model; writes metrics.jsonl, summary.json and a checkpoint into --out',
  )
  .option(
    '--preset <name>',
    `model preset (${Object.keys(PRESETS).join(', ')})`,
  )
  .option(
    '--model <module.js>',
    'your own model instead of a preset: an ES module whose default export is a tf.layers model, a function returning one, or a block list',
  )
  .option(
    '--loss <name>',
    `with --model: ${LOSSES.join(' | ')} (default: what the model declares, else from the data)`,
  )
  .option(
    '--data <name|path>',
    "moby-dick, mnist, fashion-mnist, a .txt path, idx:IMAGES,LABELS, a .jsonl file or npy:X.npy,Y.npy (default: the preset's)",
  )
  .option(
    '--devices <list>',
    "device of each stage: thread[:threads=N] (default) | process[:ENV=VALUE+...] | HOST:PORT of a `layerwise worker` | browser[:backend=wasm|webgpu] (a browser tab that opens the URL printed), comma-separated (LAYERWISE_TOKEN: the workers' token)",
  )
  .option(
    '--strategy <name>',
    STRATEGY_SPECS.map((s) => `${s.name}: ${s.help}`).join('; '),
  )
  .option(
    '--stash <place>',
    'l2l: where layer-boundary activations wait for backward: host (device memory constant in depth) | device',
  )
  .option(
    '--server-threads <n>',
    "l2l: worker threads of the parameter server's optimizer",
    integer,
  )
  .option(
    '--device-memory <size>',
    'device memory budget per device, e.g. 512MB or 2GiB; a run that cannot fit fails before training',
  )
  .option(
    '--overlap <n>',
    "local: blocks at the end of each stage also trained by the next stage's loss",
    integer,
  )
  .option(
    '--queue-depth <n>',
    'local: mini-batches in flight between the first and last stage (default: one per stage)',
    integer,
  )
  .option(
    '--deterministic',
    'local: fixed interleaving of overlap updates (reproducible) instead of free-running',
  )
  .option('--stages <K>', 'pipeline stages (devices)', integer)
  .option('--micro-batches <M>', 'micro-batches per mini-batch', integer)
  .option(
    '--replicas <R>',
    'data-parallel replicas: R copies of the devices (R*K), each on 1/R of every mini-batch, gradients summed by a ring all-reduce (l2l: by the parameter server); single, gpipe, l2l',
    integer,
  )
  .option('--batch-size <N>', 'mini-batch size (examples)', integer)
  .option(
    '--loss-scale <S>',
    '--precision f16: the initial dynamic loss scale (default 65536; halved at each overflow, whose step is skipped, doubled after 2000 steps without)',
    number,
  )
  .option(
    '--checkpoint <mode>',
    're-materialization: always | except_last | never',
  )
  .option(
    '--schedule <kind>',
    'gpipe (fill-drain) | 1f1b | zb-h1 (zero-bubble: 1F1B with the backward split into input and weight parts) | interleaved-1f1b (--virtual-stages V stages per device) | zbv (zero-bubble V-shape: 2 stages per device) | dualpipev (DualPipe of DeepSeek-V3 cut in half: V-shape, M >= 2K)',
  )
  .option(
    '--virtual-stages <V>',
    'stages per device of --schedule interleaved-1f1b (default 2)',
    integer,
  )
  .option(
    '--schedule-file <F.csv>',
    "a schedule in PyTorch pipelining's CSV (as 'layerwise schedule --format csv' writes it) instead of --schedule; checked before training",
  )
  .option(
    '--balance <list|kind>',
    "blocks per stage, e.g. 2,3,3, or flops (default: by the blocks' FLOP counts) | params (parameter count) | time | memory (profiled on --backend)",
  )
  .option('--steps <n>', 'optimizer steps', integer)
  .option('--lr <x>', 'peak learning rate', number)
  .option('--warmup <n>', 'linear warm-up steps', integer)
  .option('--decay <kind>', 'constant | cosine')
  .option('--optimizer <kind>', 'adamw | sgd')
  .option('--weight-decay <x>', 'weight decay', number)
  .option('--clip-norm <x>', 'clip the global gradient norm (0: off)', number)
  .option('--seed <n>', 'seed for initialisation and data order', integer)
  .option(
    '--layer-drop <P>',
    'LayerDrop: each step skips each block but the first and last with probability P (single, gpipe, l2l; evaluation runs every block)',
    number,
  )
  .option(
    '--layer-drop-schedule <kind>',
    'constant (LayerDrop, Fan et al.) | progressive (PLD, Zhang & He: keep probability falling to 1 - P, lower for deeper blocks)',
  )
  .option(
    '--backend <name>',
    `${BACKENDS.join(' | ')} (default: native where its addon is built, else wasm)`,
  )
  .option(
    '--threads <n>',
    "threads of each device's kernels (native backend); default: the cores divided among the devices, less one in 8 for the host's threads from 8 cores up",
    integer,
  )
  .option(
    '--precision <p>',
    'fp32 (default) | bf16: mixed precision on --backend native (products on bfloat16 operands with fp32 accumulation; weights, optimizer state, norms, softmax and loss fp32) | f16: on --backend webgpu with shader-f16 (products on f16-rounded operands, dynamic loss scaling; single and gpipe)',
  )
  .option('--layers <n>', 'override the preset: layers', integer)
  .option('--d-model <n>', 'override the preset: model width', integer)
  .option('--heads <n>', 'override the preset: attention heads', integer)
  .option(
    '--context <n>',
    'override the preset: context length (tokens)',
    integer,
  )
  .option(
    '--eval-every <n>',
    'validation every n steps (0: at the end only)',
    integer,
  )
  .option('--eval-batches <n>', 'validation batches per evaluation', integer)
  .option(
    '--save-every <n>',
    'checkpoint every n steps (0: at the end only)',
    integer,
  )
  .option(
    '--trace <file>',
    'write a Chrome trace (JSON) of every step, and an SVG timeline beside it',
  )
  .option('--out <dir>', 'output folder')
  .option(
    '--resume <dir>',
    'continue the run in this folder exactly where it stopped',
  )
  .option(
    '--overwrite',
    'start a new run in an --out folder that holds one (its checkpoints and metrics are deleted)',
  )
  .option(
    '--max-restarts <n>',
    'when a device is lost (process killed, host unreachable), restart the devices and resume from the last checkpoint, at most n times',
    integer,
    0,
  )
  .action(async (o) => {
    if (!o.preset && !o.model && !o.resume)
      throw new LayerwiseError(
        '--preset or --model is required (or --resume DIR); see layerwise train --help',
      );
    const { resume, checkpoint, maxRestarts, overwrite, ...rest } = o;
    // stopped (SIGTERM, Ctrl-C): a save's temporary files go (the previous checkpoint stays the
    // latest), the run folder's lock is released, and one line says how to continue the run
    const {
      removeSaveLeftovers,
      hasCheckpoint,
      restartCommand,
      startAgainCommand,
    } = await import('../train/checkpoint-io.js');
    const { releaseRunLocksSync } = await import('../train/run-folder.js');
    let runDir: string | undefined; // the run folder, once training started
    for (const [sig, code] of [
      ['SIGTERM', 143],
      ['SIGINT', 130],
    ] as const)
      process.once(sig, () => {
        removeSaveLeftovers();
        const dir = releaseRunLocksSync()[0] ?? runDir;
        const why = `stopped by ${sig === 'SIGINT' ? 'Ctrl-C (SIGINT)' : sig}`;
        let line: string;
        if (dir === undefined) line = `${why} before training started`;
        else if (hasCheckpoint(dir))
          line = `${why}; continue the run with 'layerwise train --resume ${dir}'`;
        else
          line = `${why} before the run's first checkpoint; start it again with: ${restartCommand(dir) ?? startAgainCommand(argv.slice(2))}`;
        process.stderr.write(
          `${process.stderr.isTTY ? '\n' : ''}layerwise: ${line}\n`,
        );
        process.exit(code);
      });
    const h = hooks();
    const onStart = h.onStart;
    h.onStart = (info) => {
      runDir = info.config.out;
      onStart?.(info);
    };
    const raw = { ...rest, remat: checkpoint }; // --checkpoint keeps torchgpipe's name for re-materialization
    const r = await trainWithRestarts(
      raw,
      resume,
      h,
      maxRestarts,
      (n, e, from) =>
        console.log(
          `${e.message.split('\n')[0]}; restarting the devices from ${from} (restart ${n} of ${maxRestarts})`,
        ),
      { overwrite, argv: argv.slice(2) },
    );
    const s = r.summary;
    const rate =
      s.tokens_per_s !== undefined
        ? `${s.tokens_per_s.toFixed(0)} tokens/s`
        : `${(s.examples_per_s ?? 0).toFixed(0)} examples/s`;
    console.log(
      `done: loss ${s.initial_loss.toFixed(4)} -> ${s.final_loss.toFixed(4)}, validation ${s.val_loss.toFixed(4)}${s.val_accuracy !== undefined ? ` (accuracy ${(100 * s.val_accuracy).toFixed(1)}%)` : ''}${s.val_bpc !== undefined ? ` (${s.val_bpc.toFixed(3)} bits/char)` : ''}, ${rate}, ` +
        `peak device ${s.peak_device_bytes.map(formatSize).join(' / ')}${s.wasm_heap_bytes ? ` (wasm heap ${s.wasm_heap_bytes.map(formatSize).join(' / ')})` : ''}, ` +
        `${s.wall_s.toFixed(1)} s; wrote ${r.outDir}`,
    );
    for (const st of r.stages) {
      console.log(
        `  ${s.devices !== undefined ? 'device' : 'stage'} ${st.stage}: busy ${st.busyPct.toFixed(1)}%, idle (bubble) ${st.idlePct.toFixed(1)}%, peak device ${formatSize(st.peakBytes)}`,
      );
    }
    if (r.traceFiles) console.log(`trace: ${r.traceFiles.join(', ')}`);
  });

program
  .command('sample')
  .description('generate text from a trained character model')
  .requiredOption('--checkpoint <dir>', 'run folder (or its checkpoint folder)')
  .option('--prompt <text>', 'text to continue', '\n')
  .option('--length <n>', 'characters to generate', integer, 300)
  .option('--temperature <x>', 'sampling temperature', number, 0.8)
  .option('--seed <n>', 'sampling seed', integer, 1)
  .option('--backend <name>', BACKENDS.join(' | '), defaultBackend())
  .action(async (o) => {
    process.stdout.write(`${await sampleText(o)}\n`);
  });

program
  .command('worker')
  .description(
    'run a device for coordinators on other hosts (layerwise train --devices HOST:PORT,...); the token comes from LAYERWISE_TOKEN',
  )
  .requiredOption(
    '--listen <[host:]port>',
    'where to listen; the host defaults to 127.0.0.1 (loopback only): give 0.0.0.0 or an address to accept other hosts',
  )
  .option('--tls-cert <file>', 'PEM certificate of this worker (TLS)')
  .option('--tls-key <file>', 'PEM private key of this worker (TLS)')
  .option(
    '--tls-ca <file>',
    "PEM certificate authority that signed the other workers' certificates (this worker links to the next stage's over TLS)",
  )
  .option(
    '--tls-client-auth',
    'accept only coordinators and workers that present a certificate --tls-ca signed',
  )
  .action(async (o) => {
    const { runWorker } = await import('./worker.js');
    await runWorker(o);
  });

program
  .command('export')
  .description(
    'write a trained run for plain TF.js: model.json + weights.bin (tf.loadLayersModel) for a tf.layers model, a weights manifest for presets',
  )
  .requiredOption('--run <dir>', 'run folder (or its checkpoint folder)')
  .requiredOption(
    '--out <dir>',
    'folder to write (new, or an earlier export, which is replaced)',
  )
  .action(async (o) => {
    const { exportRun } = await import('../train/export.js');
    const r = await exportRun(o.run, o.out);
    console.log(
      `exported ${r.params.toLocaleString('en-US')} parameters as ${r.format}: ${r.files.map((f) => `${o.out}/${f}`).join(', ')}`,
    );
  });

program
  .command('plan')
  .description(
    'for a device-memory budget: which strategy fits, with which balance and micro-batches, and how fast (profiles the model)',
  )
  .option(
    '--preset <name>',
    `model preset (${Object.keys(PRESETS).join(', ')})`,
  )
  .option(
    '--model <module.js>',
    'your own model instead of a preset (see train --model)',
  )
  .option(
    '--device-memory <size>',
    "memory per device, e.g. 512MB, 1.5GiB, 2e9 (default: this machine's memory shared by the devices)",
  )
  .option(
    '--stages <K>',
    "devices available (pipeline stages); default: train's",
    integer,
  )
  .option(
    '--batch-size <N>',
    "mini-batch size (examples); default: train's",
    integer,
  )
  .option(
    '--micro-batches <M>',
    'micro-batches (default: search the divisors of N)',
    integer,
  )
  .option('--backend <name>', BACKENDS.join(' | '))
  .option(
    '--precision <p>',
    'fp32 (default) | bf16 (native only): profile and plan at this compute precision',
  )
  .option('--optimizer <kind>', 'adamw | sgd')
  .option('--data <name|path>', "data set (default: the preset's)")
  .option('--layers <n>', 'override the preset: layers', integer)
  .option('--d-model <n>', 'override the preset: model width', integer)
  .option('--heads <n>', 'override the preset: attention heads', integer)
  .option(
    '--context <n>',
    'override the preset: context length (tokens)',
    integer,
  )
  .option('--json', 'print the plan as JSON')
  .action(async (o) => {
    const { runPlan } = await import('./plan.js');
    const { json, ...opts } = o;
    const r = await runPlan(opts);
    console.log(json ? JSON.stringify(r.plan, null, 2) : r.text);
  });

program
  .command('schedule')
  .description(
    "print a schedule's per-device grid (PyTorch pipelining's notation), its simulated bubble and peak activations per device",
  )
  .requiredOption('--schedule <kind>', SCHEDULE_KINDS.join(' | '))
  .requiredOption('--stages <K>', 'pipeline stages (devices)', integer)
  .requiredOption('--micro-batches <M>', 'micro-batches', integer)
  .option(
    '--virtual-stages <V>',
    'stages per device of interleaved-1f1b',
    integer,
    2,
  )
  .option('--format <text|csv>', "text, or csv as PyTorch's _dump_csv", 'text')
  .action(async (o) => {
    const { printSchedule } = await import('./schedule.js');
    console.log(printSchedule(o));
  });

program
  .command('presets')
  .description('list the model presets')
  .action(() => {
    for (const [name, p] of Object.entries(PRESETS))
      console.log(
        `${name.padEnd(14)} ${p.description} (data: ${p.defaultData})`,
      );
  });

exitTwoOnBadCommandLine(program);

// every failure goes through one path: one line, never a bare stack (see report-error.ts)
process.on('uncaughtException', (e) => process.exit(reportError(e, { debug })));
process.on('unhandledRejection', (e) =>
  process.exit(reportError(e, { debug })),
);
try {
  await program.parseAsync(argv);
  process.exit(0);
} catch (e) {
  process.exit(reportError(e, { debug }));
}
