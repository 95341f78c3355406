/**
 * `npm run bench -- gpu`: single-device training throughput on a GPU, layerwise's webgpu
 * against plain TF.js webgpu and PyTorch on the same card (issue 36's table): charlm-small
 * (4 layers, d_model 256, context 128) and an 8-layer model (d_model 1024, 16 heads, context
 * 256), batch 32; for the large model also the L2L relay and GPipe K=2 on the one GPU. Each
 * layerwise configuration is its own `layerwise train` child process (a fresh GPU device and
 * shader cache), read back from its metrics.jsonl (tokens/s of the steps after the warm-up
 * ones) and summary.json (the webgpu dispatch, submit and readback counts per step); "not
 * captured" is the same run with LAYERWISE_WEBGPU_CAPTURE=0 (every step through TF.js, no
 * replayed step: pipeline/captured-step.ts), "plain TF.js" with LAYERWISE_WEBGPU_KERNELS=tfjs
 * (backend/index.ts: TF.js's own kernels and layerwise's composed forms, none of its WGSL
 * kernels) and not captured, TF.js as it is. PyTorch rows come from
 * bench/pytorch/charlm.py (the same model, batch, context and AdamW step) where
 * `python3 -c 'import torch'` works and torch sees CUDA, else one row says why not. Writes
 * `<out>/<name>.json` and `.md` naming the adapter (vendor, architecture, description).
 *
 * Sized to finish in under 5 minutes on an H100 (a device session): each configuration has a
 * wall-clock limit, the whole bench a budget; a configuration stopped at its limit reports the
 * steps it measured. `--quick` swaps the models for charlm-tiny (with the l2l and gpipe rows) and
 * charlm-small, for a software GPU such as Mesa's lavapipe.
 */
import { type ChildProcess, spawn, spawnSync } from 'node:child_process';
import {
  existsSync,
  mkdtempSync,
  readdirSync,
  readFileSync,
  rmSync,
} from 'node:fs';
import { tmpdir } from 'node:os';
import { join } from 'node:path';
import { fileURLToPath } from 'node:url';
import type { StepMetrics, Summary } from '../train/metrics.js';
import { buildCommit } from '../util/build-info.js';
import { LayerwiseError } from '../util/errors.js';
import { markdownTable, writeBenchResults } from './report.js';

/** Options of {@link benchGpu}. */
export interface GpuBenchOptions {
  /** charlm-tiny and charlm-small instead of charlm-small and the 8 x d1024 model. */
  quick: boolean;
  /** Measured steps of every configuration (default: each model's own, see {@link GPU_MODELS}). */
  steps?: number;
  /** Steps left out of tokens/s at the start of each layerwise run (shader compilation). */
  warmup: number;
  /** Configuration names or prefixes to run (e.g. `small`, `large/l2l`); all when absent. */
  configs?: string[];
  /** Wall-clock limit of one configuration, s. */
  configSeconds: number;
  /** Wall-clock budget of the whole bench, s: configurations past it are skipped. */
  budgetSeconds: number;
  /** The Python interpreter for the PyTorch rows. */
  python: string;
  out: string;
  /** Results file name (`<name>.json`, `<name>.md`). */
  name: string;
}

/** A model of the table: its `layerwise train` flags and charlm.py's. */
export interface GpuModel {
  /** The configurations' name prefix (`--configs`). */
  key: string;
  /** The table's heading. */
  label: string;
  /** Its `layerwise train` model flags. */
  cli: string[];
  /** charlm.py's shape flags (layers, d-model, heads, context). */
  torch: string[];
  /** Measured steps by default. */
  steps: number;
  /** Whether l2l and gpipe K=2 rows are run on it. */
  pipelines: boolean;
}

const shape = (l: number, d: number, h: number, c: number) =>
  ['--layers', l, '--d-model', d, '--heads', h, '--context', c].map(String);

/** The models: issue 36's two, and the `--quick` pair for a software GPU. */
export const GPU_MODELS: Record<'full' | 'quick', GpuModel[]> = {
  full: [
    {
      key: 'small',
      label: 'charlm-small (4 x d256, context 128)',
      cli: ['--preset', 'charlm-small'],
      torch: shape(4, 256, 4, 128),
      steps: 20,
      pipelines: false,
    },
    {
      key: 'large',
      label: '8 x d1024, 16 heads, context 256',
      cli: ['--preset', 'charlm-small', ...shape(8, 1024, 16, 256)],
      torch: shape(8, 1024, 16, 256),
      steps: 8,
      pipelines: true,
    },
  ],
  quick: [
    {
      key: 'tiny',
      label: 'charlm-tiny (2 x d64, context 64)',
      cli: ['--preset', 'charlm-tiny'],
      torch: shape(2, 64, 2, 64),
      steps: 4,
      pipelines: true,
    },
    {
      key: 'small',
      label: 'charlm-small (4 x d256, context 128)',
      cli: ['--preset', 'charlm-small'],
      torch: shape(4, 256, 4, 128),
      steps: 2,
      pipelines: false,
    },
  ],
};

/** One configuration: a layerwise child process or a PyTorch one. */
export interface GpuConfig {
  /** `<model>/<run>`, what `--configs` selects. */
  name: string;
  model: GpuModel;
  /** The table's row label. */
  run: string;
  kind: 'layerwise' | 'pytorch';
  /** Strategy flags (layerwise) or charlm.py's extra flags (PyTorch). */
  args: string[];
  env?: Record<string, string>;
}

/** The configurations of `models`, in the table's order. */
export function gpuConfigs(models: GpuModel[]): GpuConfig[] {
  const single = ['--strategy', 'single'];
  return models.flatMap((model): GpuConfig[] => {
    const c = (
      run: string,
      label: string,
      kind: GpuConfig['kind'],
      args: string[],
      env?: Record<string, string>,
    ): GpuConfig => ({
      name: `${model.key}/${run}`,
      model,
      run: label,
      kind,
      args,
      env,
    });
    return [
      c('layerwise', 'layerwise webgpu', 'layerwise', single),
      c('uncaptured', 'layerwise webgpu, not captured', 'layerwise', single, {
        LAYERWISE_WEBGPU_CAPTURE: '0',
      }),
      c('tfjs', 'plain TF.js webgpu', 'layerwise', single, {
        LAYERWISE_WEBGPU_KERNELS: 'tfjs',
        LAYERWISE_WEBGPU_CAPTURE: '0',
      }),
      c('pytorch-fp32', 'PyTorch CUDA fp32', 'pytorch', []),
      c('pytorch-sdpa', 'PyTorch CUDA SDPA', 'pytorch', ['--sdpa']),
      c('pytorch-sdpa-bf16', 'PyTorch CUDA SDPA + bf16', 'pytorch', [
        '--sdpa',
        '--bf16',
      ]),
      ...(model.pipelines
        ? [
            c('l2l', 'layerwise webgpu l2l, M=2', 'layerwise', [
              '--strategy',
              'l2l',
              '--micro-batches',
              '2',
            ]),
            c('gpipe-k2', 'layerwise webgpu gpipe K=2, M=4', 'layerwise', [
              '--strategy',
              'gpipe',
              '--stages',
              '2',
              '--micro-batches',
              '4',
            ]),
          ]
        : []),
    ];
  });
}

/** The configurations `--configs` selects: each entry a whole name or a prefix ending at '/'. */
export function selectConfigs(
  all: GpuConfig[],
  wanted: string[] | undefined,
): GpuConfig[] {
  if (!wanted?.length) return all;
  const picked = all.filter((c) =>
    wanted.some((w) => c.name === w || c.name.startsWith(`${w}/`)),
  );
  for (const w of wanted)
    if (!all.some((c) => c.name === w || c.name.startsWith(`${w}/`)))
      throw new LayerwiseError(
        `--configs: no configuration '${w}' (valid: ${all.map((c) => c.name).join(', ')}, or a model: ${[...new Set(all.map((c) => c.model.key))].join(', ')})`,
      );
  return picked;
}

/** One row of the results. Units: tokens/s, s, bytes. */
export interface GpuRow {
  config: string;
  model: string;
  run: string;
  tokens_per_s?: number;
  /** Median step time of the measured steps, s. */
  step_s_median?: number;
  steps_measured: number;
  final_loss?: number;
  dispatches_per_step?: number;
  submits_per_step?: number;
  readbacks_per_step?: number;
  /** GPU busy seconds over step seconds (timestamp queries; absent without them). */
  gpu_busy?: number;
  /** The device thread's CPU ms per step (summary.json host_ms_per_step; Linux). */
  host_ms_per_step?: number;
  /** Peak device bytes of the largest device. */
  peak_device_bytes?: number;
  /** PyTorch's device and version. */
  device?: string;
  /** Why a figure is missing or partial. */
  note?: string;
  command: string;
}

/** The adapter the bench ran on, as Dawn reports it (`GPUAdapter.info`). */
export interface GpuAdapterInfo {
  vendor?: string;
  architecture?: string;
  device?: string;
  description?: string;
  /** Dawn's backend flags and feature level (backend/webgpu.ts). */
  flags: string[];
  featureLevel: string;
}

/** The adapter a webgpu device in this process gets: installDawn's choice, then its `info`. */
async function adapterInfo(): Promise<GpuAdapterInfo> {
  const { installDawn } = await import('../backend/webgpu.js');
  const dawn = await installDawn();
  const gpu = (
    globalThis as {
      navigator?: {
        gpu?: {
          requestAdapter(): Promise<{ info?: Record<string, string> } | null>;
        };
      };
    }
  ).navigator?.gpu;
  const info = (await gpu?.requestAdapter())?.info ?? {};
  return {
    vendor: info.vendor || undefined,
    architecture: info.architecture || undefined,
    device: info.device || undefined,
    description: info.description || dawn.description,
    flags: dawn.flags,
    featureLevel: dawn.featureLevel,
  };
}

/** What a child process did: exit code, output, and whether the time limit stopped it. */
interface ChildResult {
  code: number | null;
  output: string;
  timedOut: boolean;
}

/** Runs `cmd args` with `env` added, SIGTERM at `limitS` (SIGKILL 10 s later). */
function runChild(
  cmd: string,
  args: string[],
  env: Record<string, string> | undefined,
  limitS: number,
): Promise<ChildResult> {
  return new Promise((resolve) => {
    const child: ChildProcess = spawn(cmd, args, {
      env: { ...process.env, ...env },
      stdio: ['ignore', 'pipe', 'pipe'],
    });
    let output = '';
    let timedOut = false;
    child.stdout?.on('data', (d) => (output += d));
    child.stderr?.on('data', (d) => (output += d));
    let kill: NodeJS.Timeout | undefined;
    const stop = setTimeout(() => {
      timedOut = true;
      child.kill('SIGTERM');
      kill = setTimeout(() => child.kill('SIGKILL'), 10_000);
    }, limitS * 1000);
    child.on('error', (e) => (output += `\n${e.message}`));
    child.on('close', (code) => {
      clearTimeout(stop);
      clearTimeout(kill);
      resolve({ code, output, timedOut });
    });
  });
}

/** The last line of `output` that says what went wrong (for a row's note). */
function lastLine(output: string): string {
  const lines = output.trim().split('\n').filter(Boolean);
  return (
    [...lines].reverse().find((l) => /error|Error|not /.test(l)) ??
    lines.at(-1) ??
    'no output'
  ).slice(0, 300);
}

const median = (xs: number[]) =>
  [...xs].sort((a, b) => a - b)[Math.floor(xs.length / 2)]!;

/** A run folder's metrics.jsonl lines and summary.json (absent when the run did not finish). */
function readRun(dir: string): { lines: StepMetrics[]; summary?: Summary } {
  const read = (f: string) => {
    try {
      return readFileSync(join(dir, f), 'utf8');
    } catch {
      return undefined;
    }
  };
  const s = read('summary.json');
  return {
    lines: (read('metrics.jsonl') ?? '')
      .split('\n')
      .filter(Boolean)
      .map((l) => JSON.parse(l) as StepMetrics),
    summary: s ? (JSON.parse(s) as Summary) : undefined,
  };
}

/** tokens/s (tokens over seconds, not a mean of rates) and the median step time (s) of the metrics lines after step `warmup`; undefined when none is. */
export function measuredRate(
  lines: StepMetrics[],
  warmup: number,
): { tokensPerS: number; stepS: number; n: number } | undefined {
  const kept = lines.filter((m) => m.step > warmup);
  if (!kept.length) return undefined;
  const secs = kept.reduce((a, m) => a + m.step_s, 0);
  const tokens = kept.reduce((a, m) => a + (m.tokens_per_s ?? 0) * m.step_s, 0);
  return {
    tokensPerS: tokens / secs,
    stepS: median(kept.map((m) => m.step_s)),
    n: kept.length,
  };
}

const CLI = fileURLToPath(new URL('../cli/main.js', import.meta.url));

/** Trains configuration `c` in a `layerwise train --backend webgpu` child; its row. */
async function runLayerwise(
  c: GpuConfig,
  steps: number,
  o: GpuBenchOptions,
  limitS: number,
): Promise<GpuRow> {
  const dir = mkdtempSync(join(tmpdir(), 'lw-gpu-bench-'));
  const flags = [
    ...c.model.cli,
    ...c.args,
    '--backend',
    'webgpu',
    '--batch-size',
    '32',
    '--steps',
    String(o.warmup + steps),
    '--eval-every',
    '0',
    '--eval-batches',
    '1',
  ];
  const env = Object.entries(c.env ?? {}).map(([k, v]) => `${k}=${v} `);
  const command = `${env.join('')}layerwise train ${flags.join(' ')}`;
  try {
    const r = await runChild(
      process.execPath,
      [CLI, 'train', ...flags, '--out', dir],
      c.env,
      limitS,
    );
    const { lines, summary } = readRun(dir);
    const rate = measuredRate(lines, o.warmup);
    const failed =
      r.code !== 0 && !r.timedOut ? `failed: ${lastLine(r.output)}` : '';
    const partial = r.timedOut
      ? `stopped at the ${limitS.toFixed(0)} s limit after ${lines.length} steps (no summary: no GPU counts)`
      : '';
    return {
      config: c.name,
      model: c.model.label,
      run: c.run,
      tokens_per_s: rate?.tokensPerS,
      step_s_median: rate?.stepS,
      steps_measured: rate?.n ?? 0,
      final_loss: lines.at(-1)?.loss,
      dispatches_per_step: summary?.dispatches_per_step,
      submits_per_step: summary?.submits_per_step,
      readbacks_per_step: summary?.readbacks_per_step,
      gpu_busy: summary?.gpu_busy,
      host_ms_per_step: summary?.host_ms_per_step,
      peak_device_bytes: summary
        ? Math.max(...summary.peak_device_bytes)
        : undefined,
      note: failed || partial || undefined,
      command,
    };
  } finally {
    rmSync(dir, { recursive: true, force: true });
  }
}

/** Whether PyTorch is importable by `python` and sees CUDA; else why not. */
export function probeTorch(python: string): {
  ok: boolean;
  why?: string;
} {
  const r = spawnSync(
    python,
    ['-c', 'import torch; print(torch.__version__, torch.cuda.is_available())'],
    { encoding: 'utf8', timeout: 120_000 },
  );
  if (r.status !== 0)
    return {
      ok: false,
      why: `not importable (\`${python} -c 'import torch'\`: ${lastLine(`${r.stderr ?? ''}${r.error?.message ?? ''}`)})`,
    };
  const [version, cuda] = r.stdout.trim().split(' ');
  return cuda === 'True'
    ? { ok: true }
    : { ok: false, why: `torch ${version} sees no CUDA device` };
}

/** bench/pytorch/charlm.py: in the working directory, else beside this build's dist/. */
function charlmScript(): string | undefined {
  return [
    join(process.cwd(), 'bench/pytorch/charlm.py'),
    fileURLToPath(new URL('../../bench/pytorch/charlm.py', import.meta.url)),
  ].find((p) => existsSync(p));
}

/** Runs configuration `c` with bench/pytorch/charlm.py on CUDA; its row. */
async function runPytorch(
  c: GpuConfig,
  steps: number,
  o: GpuBenchOptions,
  limitS: number,
): Promise<GpuRow> {
  const script = charlmScript();
  const args = [
    ...c.model.torch,
    '--batch-size',
    '32',
    '--steps',
    String(steps),
    '--device',
    'cuda',
    ...c.args,
  ];
  const row = {
    config: c.name,
    model: c.model.label,
    run: c.run,
    steps_measured: 0,
    command: `${o.python} bench/pytorch/charlm.py ${args.join(' ')}`,
  };
  if (!script) return { ...row, note: 'bench/pytorch/charlm.py not found' };
  const r = await runChild(o.python, [script, ...args], undefined, limitS);
  const json = r.output
    .split('\n')
    .find((l) => l.startsWith('{') && l.includes('tokens_per_s'));
  if (r.code !== 0 || !json)
    return {
      ...row,
      note: r.timedOut
        ? `stopped at the ${limitS.toFixed(0)} s limit`
        : `failed: ${lastLine(r.output)}`,
    };
  const p = JSON.parse(json) as {
    tokens_per_s: number;
    step_s: number[];
    device: string;
    torch: string;
  };
  return {
    ...row,
    tokens_per_s: p.tokens_per_s,
    step_s_median: median(p.step_s),
    steps_measured: p.step_s.length,
    device: `${p.device}, torch ${p.torch}`,
  };
}

/** A row that was not run, saying why. */
function skippedRow(c: GpuConfig, note: string): GpuRow {
  return {
    config: c.name,
    model: c.model.label,
    run: c.run,
    steps_measured: 0,
    note,
    command: '',
  };
}

const fmt = (x: number | undefined, digits = 0) =>
  x === undefined
    ? '-'
    : x.toLocaleString('en-US', {
        maximumFractionDigits: digits,
        minimumFractionDigits: digits,
      });

/** The Markdown page: the adapter, one table per model, the commands, and links to `earlier` pages (file names beside it). */
export function gpuMarkdown(
  adapter: GpuAdapterInfo,
  rows: GpuRow[],
  meta: { date: string; commit: string; wallS: number; command: string },
  earlier: string[] = [],
): string {
  const name = [adapter.vendor, adapter.architecture, adapter.device]
    .filter(Boolean)
    .join(' / ');
  const head =
    `# layerwise on a GPU: \`npm run bench -- gpu\`, ${meta.date}\n\n` +
    `Adapter: ${name || 'unknown'} (${adapter.description ?? 'no description'}; Dawn ${adapter.flags.join(',') || 'default backend'}, ${adapter.featureLevel} feature level). ` +
    `Commit ${meta.commit}; \`${meta.command}\`, ${meta.wallS.toFixed(0)} s in all. ` +
    'Single-device training, batch 32; tokens/s of the steps after the warm-up ones (layerwise) or after 2 (PyTorch, `bench/pytorch/charlm.py`); ' +
    "plain TF.js is the same run with `LAYERWISE_WEBGPU_KERNELS=tfjs` (none of layerwise's WGSL kernels). GPU counts per step from summary.json; host ms per step: the device thread's CPU time per step (summary.json `host_ms_per_step`).\n";
  const tables = [...new Set(rows.map((r) => r.model))].map((model) => {
    const mine = rows.filter((r) => r.model === model);
    const ref = mine.find((r) => r.config.endsWith('/layerwise'))?.tokens_per_s;
    const table = markdownTable({
      columns: [
        'run',
        'tokens/s',
        'vs layerwise webgpu',
        'median step, s',
        'dispatches / submits / readbacks per step',
        'GPU busy',
        'host ms per step',
        'last loss',
        'note',
      ],
      rows: mine.map((r) => [
        r.run,
        fmt(r.tokens_per_s),
        r.tokens_per_s && ref ? `${(r.tokens_per_s / ref).toFixed(2)}x` : '-',
        fmt(r.step_s_median, 3),
        r.dispatches_per_step === undefined
          ? '-'
          : `${fmt(r.dispatches_per_step)} / ${fmt(r.submits_per_step, 1)} / ${fmt(r.readbacks_per_step, 1)}`,
        r.gpu_busy === undefined ? '-' : `${(r.gpu_busy * 100).toFixed(0)}%`,
        fmt(r.host_ms_per_step, 1),
        fmt(r.final_loss, 4),
        r.note ?? r.device ?? '',
      ]),
    });
    return `\n## ${model}\n\n${table}`;
  });
  const commands = rows
    .filter((r) => r.command)
    .map((r) => `- ${r.config}: \`${r.command}\``)
    .join('\n');
  const history = earlier.length
    ? `\n## Earlier runs\n\n${earlier.map((f) => `- [${f}](${f})`).join('\n')}\n`
    : '';
  return `${head}${tables.join('')}\n## Commands\n\n${commands}\n${history}`;
}

/** The other GPU results pages in `dir` (gpu-*.md: hand runs, other cards), for the history. */
function earlierRuns(dir: string, name: string): string[] {
  try {
    return readdirSync(dir)
      .filter((f) => /^gpu.*\.md$/.test(f) && f !== `${name}.md`)
      .sort();
  } catch {
    return [];
  }
}

/**
 * Runs the selected configurations one after another (each in its own child process), then
 * writes `<out>/<name>.json` (adapter, options, rows) and `<out>/<name>.md`. Never fails on
 * one configuration: a failed, stopped or skipped one is a row with a note.
 * @throws LayerwiseError for an unknown `--configs` entry, bad step counts, or no webgpu adapter.
 */
export async function benchGpu(
  o: GpuBenchOptions,
  log: (s: string) => void,
): Promise<void> {
  if (!(Number.isInteger(o.warmup) && o.warmup >= 0))
    throw new LayerwiseError(
      `--warmup must be an integer >= 0, got ${o.warmup}`,
    );
  if (o.steps !== undefined && !(Number.isInteger(o.steps) && o.steps >= 1))
    throw new LayerwiseError(`--steps must be an integer >= 1, got ${o.steps}`);
  const configs = selectConfigs(
    gpuConfigs(GPU_MODELS[o.quick ? 'quick' : 'full']),
    o.configs,
  );
  const adapter = await adapterInfo();
  log(
    `adapter: ${[adapter.vendor, adapter.architecture, adapter.description].filter(Boolean).join(', ')}`,
  );
  const torch = configs.some((c) => c.kind === 'pytorch')
    ? probeTorch(o.python)
    : { ok: false };
  const t0 = performance.now();
  const rows: GpuRow[] = [];
  for (const c of configs) {
    const left = o.budgetSeconds - (performance.now() - t0) / 1000;
    const steps = o.steps ?? c.model.steps;
    let row: GpuRow;
    if (left < 10)
      row = skippedRow(c, "skipped: the bench's time budget is spent");
    else if (c.kind === 'pytorch' && !torch.ok)
      row = skippedRow(c, `PyTorch ${torch.why}`);
    else {
      const limit = Math.min(o.configSeconds, left);
      row = await (c.kind === 'pytorch' ? runPytorch : runLayerwise)(
        c,
        steps,
        o,
        limit,
      );
    }
    rows.push(row);
    log(
      `${c.name}: ${row.tokens_per_s === undefined ? '-' : `${fmt(row.tokens_per_s)} tokens/s`}${row.dispatches_per_step === undefined ? '' : `, ${fmt(row.dispatches_per_step)} dispatches/step`}${row.note ? ` (${row.note})` : ''}`,
    );
  }
  const wallS = (performance.now() - t0) / 1000;
  const meta = {
    date: new Date().toISOString().slice(0, 10),
    commit: buildCommit(),
    wallS,
    // as typed: bench/main.ts's argv after the script ([node, main.js, 'gpu', ...flags])
    command: `npm run bench -- ${process.argv.slice(2).join(' ')}`,
  };
  const files = await writeBenchResults(
    o.out,
    o.name,
    { ...meta, adapter, options: o, rows },
    gpuMarkdown(adapter, rows, meta, earlierRuns(o.out, o.name)),
  );
  log(`wrote ${files.join(', ')} (${wallS.toFixed(0)} s)`);
}
