/**
 * The training page (`npm run web`): a form (preset or a person's own .txt, strategy, stages,
 * micro-batches, steps, backend), a run in Web Worker devices (web/run.ts), and while it
 * trains a live chart of loss and tokens/s, the stages' bubble timeline, device memory per
 * stage, a progress bar and Stop; after it, a text sample and downloads (the model as TF.js
 * files, metrics.jsonl), and the summary as JSON in #summary.
 *
 * URL parameters fill the form and `autostart=1` starts the run:
 * `?preset=charlm-tiny&strategy=gpipe&stages=2&micro-batches=4&steps=50&autostart=1`; also
 * batch-size, eval-batches, eval-every, seed, lr and layer-drop, as the command line's flags.
 * For tests, `window.layerwise` holds the run's state, metrics lines and summary.
 * `?device=1&token=...` (the URL `layerwise train --devices ...,browser` prints) makes the tab a
 * device of that run instead (web/device.ts).
 */
import './wasm-env.js';
import 'uplot/dist/uPlot.min.css';
import * as tf from '@tensorflow/tfjs-core';
import uPlot from 'uplot';
import { initBackend } from '../src/backend/index.js';
import { paramKey } from '../src/model/block.js';
import type { LayerDropSchedule } from '../src/model/layer-drop.js';
import { PRESETS } from '../src/model/presets.js';
import type { WebGpuBufferLimits } from '../src/plan/webgpu-limits.js';
import { STRATEGY_SPECS, specOf } from '../src/strategies/index.js';
import type { StepMetrics, Summary } from '../src/train/metrics.js';
import { generateText } from '../src/train/sample.js';
import { serveAsDevice } from './device.js';
import { type PageRunResult, runInPage } from './run.js';

type State =
  | 'idle'
  | 'running'
  | 'stopping'
  | 'done'
  | 'stopped'
  | 'error'
  | 'device';

/** What tests read from the page. */
interface PageState {
  state: State;
  metrics: StepMetrics[];
  summary?: Summary;
  error?: string;
  /** The backends this browser offers: webgpu first where it gives an adapter, and wasm. */
  backends: string[];
  /**
   * The WebGPU adapter's buffer limits a webgpu run checks the model against (bytes), each
   * lowered to the URL's `webgpu-max-buffer` where given; absent without an adapter.
   */
  webgpuLimits?: WebGpuBufferLimits;
}

const page: PageState = { state: 'idle', metrics: [], backends: ['wasm'] };
(globalThis as { layerwise?: PageState }).layerwise = page;

const $ = <T extends HTMLElement>(id: string) =>
  document.getElementById(id) as T;
const form = $<HTMLFormElement>('setup');
const presetSel = $<HTMLSelectElement>('preset');
const fileInput = $<HTMLInputElement>('file');
const drop = $<HTMLDivElement>('drop');
const startBtn = $<HTMLButtonElement>('start');
const stopBtn = $<HTMLButtonElement>('stop');
const message = $<HTMLDivElement>('message');
const progress = $<HTMLProgressElement>('progress');

/** Presets whose data is text (the page has no image files): their names. */
const TEXT_PRESETS = Object.entries(PRESETS)
  .filter(([, p]) => p.defaultData === 'moby-dick')
  .map(([name]) => name);
for (const name of TEXT_PRESETS) presetSel.add(new Option(name, name));
// every registered strategy, in the registry's order; the default selected
for (const s of STRATEGY_SPECS) {
  const o = new Option(s.name, s.name, s.isDefault, s.isDefault);
  o.title = s.help;
  $<HTMLSelectElement>('strategy').add(o);
}

/** The person's own text, once a file is dropped or picked and read. */
let ownText: { name: string; text: string } | undefined;

function say(text: string, error = false): void {
  message.textContent = text;
  message.className = error ? 'error' : '';
}

/**
 * The UTF-8 text of a dropped or picked file, or a message saying why it cannot be trained on
 * (empty, binary, not UTF-8).
 */
async function readTextFile(
  file: File,
): Promise<{ text: string } | { error: string }> {
  if (file.size === 0)
    return {
      error: `${file.name} is empty: give a .txt file with some text in it`,
    };
  const bytes = new Uint8Array(await file.arrayBuffer());
  if (bytes.subarray(0, 8192).includes(0))
    return {
      error: `${file.name} is a binary file, not text: give a UTF-8 text file (.txt)`,
    };
  try {
    return { text: new TextDecoder('utf-8', { fatal: true }).decode(bytes) };
  } catch {
    return {
      error: `${file.name} is not UTF-8 text: save it as UTF-8 (a .txt file) and try again`,
    };
  }
}

async function useFile(file: File | undefined): Promise<void> {
  if (!file) return;
  const r = await readTextFile(file);
  if ('error' in r) {
    ownText = undefined;
    drop.firstChild!.textContent = 'drop a .txt file here, or ';
    say(r.error, true);
    return;
  }
  ownText = { name: file.name, text: r.text };
  drop.firstChild!.textContent = `${file.name} (${r.text.length} characters); another: `;
  say(`${file.name} loaded: ${r.text.length} characters`);
}

fileInput.addEventListener('change', () => void useFile(fileInput.files?.[0]));
drop.addEventListener('dragover', (e) => {
  e.preventDefault();
  drop.classList.add('over');
});
drop.addEventListener('dragleave', () => drop.classList.remove('over'));
drop.addEventListener('drop', (e) => {
  e.preventDefault();
  drop.classList.remove('over');
  void useFile(e.dataTransfer?.files[0]);
});

/** Offers webgpu where this browser gives an adapter (the devices are Web Workers, which see the same). */
async function detectBackends(): Promise<void> {
  const gpu = (
    navigator as {
      gpu?: {
        requestAdapter(): Promise<{ limits: WebGpuBufferLimits } | null>;
      };
    }
  ).gpu;
  const adapter = await gpu?.requestAdapter().catch(() => null);
  const sel = $<HTMLSelectElement>('backend');
  if (adapter) {
    page.backends = ['webgpu', 'wasm'];
    // `webgpu-max-buffer=BYTES` checks the model against a smaller GPU's limits (the tests use it)
    const cap = Number(
      new URLSearchParams(location.search).get('webgpu-max-buffer') ??
        Number.POSITIVE_INFINITY,
    );
    const at = (v: number) => (cap > 0 ? Math.min(v, cap) : v);
    page.webgpuLimits = {
      maxBufferSize: at(adapter.limits.maxBufferSize),
      maxStorageBufferBindingSize: at(
        adapter.limits.maxStorageBufferBindingSize,
      ),
    };
    sel.add(new Option('webgpu', 'webgpu'), 0);
    sel.value = 'webgpu';
  }
}

/** The live chart: loss (left axis) and tokens/s (right axis) by step. */
class LiveChart {
  private readonly data: [number[], number[], number[]] = [[], [], []];
  private readonly plot: uPlot;
  constructor(el: HTMLElement) {
    el.replaceChildren();
    this.plot = new uPlot(
      {
        width: 560,
        height: 260,
        scales: { x: { time: false }, loss: {}, tps: {} },
        series: [
          { label: 'step' },
          { label: 'loss', scale: 'loss', stroke: '#c33', width: 2 },
          { label: 'tokens/s', scale: 'tps', stroke: '#36c', width: 1 },
        ],
        axes: [
          {},
          { scale: 'loss', label: 'loss' },
          { scale: 'tps', side: 1, label: 'tokens/s', grid: { show: false } },
        ],
      },
      this.data,
      el,
    );
  }
  add(m: StepMetrics): void {
    this.data[0].push(m.step);
    this.data[1].push(m.loss);
    this.data[2].push(m.tokens_per_s ?? Number.NaN);
    this.plot.setData(this.data);
  }
}

const MB = 1024 * 1024;

function drawMemory(peaks: number[]): void {
  const max = Math.max(...peaks, 1);
  $('memory').replaceChildren(
    ...peaks.map((b, i) => {
      const row = document.createElement('div');
      row.className = 'stage';
      const bar = document.createElement('div');
      bar.className = 'bar';
      bar.style.width = `${(100 * b) / max}%`;
      const holder = document.createElement('div');
      holder.append(bar);
      row.append(`stage ${i}`, holder, `${(b / MB).toFixed(2)} MiB`);
      return row;
    }),
  );
}

/**
 * Shows the trace recorder's SVG (the same drawing `--trace` writes), scaled to the page's
 * width: it gives its size in pixels, so a viewBox of that size lets it shrink.
 */
function drawTimeline(svgText: string): void {
  const el = $('timeline');
  el.innerHTML = svgText;
  const svg = el.querySelector('svg');
  if (svg && !svg.hasAttribute('viewBox'))
    svg.setAttribute(
      'viewBox',
      `0 0 ${svg.getAttribute('width')} ${svg.getAttribute('height')}`,
    );
  svg?.setAttribute('width', '100%');
  svg?.removeAttribute('height');
}

function download(name: string, text: string, type: string): HTMLAnchorElement {
  const a = document.createElement('a');
  a.href = URL.createObjectURL(new Blob([text], { type }));
  a.download = name;
  a.textContent = `download ${name}`;
  return a;
}

/**
 * 300 characters sampled from the trained model after a newline, or the text's first character
 * where it has no newline (temperature 0.8, seed 0, as `layerwise sample` does), on this thread's wasm backend; '' for a model that is not a
 * character model.
 */
async function sample(r: PageRunResult): Promise<string> {
  if (r.model.config.arch !== 'charlm' || r.dataset.kind !== 'text') return '';
  await initBackend('wasm');
  return generateText({
    model: r.model.config,
    params: r.params,
    vocab: r.dataset.vocab,
    // a newline, as `layerwise sample` starts, where the text has one; else its first character
    prompt: r.dataset.vocab.covers('\n')
      ? '\n'
      : r.dataset.vocab.decode(r.dataset.train.subarray(0, 1)),
    length: 300,
    temperature: 0.8,
    seed: 0,
  });
}

/**
 * A button that downloads the trained model as TF.js files (tf.io.browserDownloads):
 * layerwise-model.json (a tf.io weights manifest with the layerwise model configuration, as
 * `layerwise export` writes for a preset) and layerwise-model.weights.bin (float32).
 */
function modelDownload(r: PageRunResult): HTMLButtonElement {
  const button = document.createElement('button');
  button.textContent = 'download the model (TF.js files)';
  button.addEventListener('click', async () => {
    const named = r.model.blocks.flatMap((b, bi) =>
      b.params.map((p) => ({
        name: `${b.name}/${p.name}`,
        tensor: tf.tensor(r.params.get(paramKey(bi, p.name))!, p.shape),
      })),
    );
    try {
      const { data, specs } = await tf.io.encodeWeights(named);
      // the browser's 'downloads://' handler is tf.io.browserDownloads
      const [handler] = tf.io.getSaveHandlers('downloads://layerwise-model');
      await handler!.save!({
        modelTopology: { format: 'layerwise-weights', model: r.model.config },
        format: 'layerwise-weights',
        generatedBy: 'layerwise (browser page)',
        weightSpecs: specs,
        weightData: data,
      });
    } finally {
      tf.dispose(named.map((n) => n.tensor));
    }
  });
  return button;
}

let stopAsked = false;

/**
 * Settings the form does not show, from the URL only (each as `layerwise train`'s flag of the
 * same name): batch-size, eval-batches, eval-every, seed, lr, layer-drop, layer-drop-schedule,
 * and the model's shape: layers, d-model, heads, context. Missing: the preset's defaults.
 */
function advancedFromUrl() {
  const q = new URLSearchParams(location.search);
  const num = (key: string) => {
    const v = q.get(key);
    return v === null ? undefined : Number(v);
  };
  return {
    batchSize: num('batch-size'),
    evalBatches: num('eval-batches'),
    evalEvery: num('eval-every'),
    seed: num('seed'),
    lr: num('lr'),
    layerDrop: num('layer-drop'),
    layerDropSchedule: (q.get('layer-drop-schedule') ?? undefined) as
      | LayerDropSchedule
      | undefined,
    layers: num('layers'),
    dModel: num('d-model'),
    heads: num('heads'),
    context: num('context'),
  };
}

/**
 * Whether the page runs a strategy on one device: the ones that only run there (single) and
 * those that also do (l2l's relay alone); the stages field speaks for the pipelines.
 */
function onOneDevice(strategy: string): boolean {
  const spec = specOf(strategy);
  return spec.oneDevice || spec.anyStages === true;
}

/** The run the form (or the URL) describes. */
function formOptions() {
  const num = (id: string) => Number($<HTMLInputElement>(id).value);
  const strategy = $<HTMLSelectElement>('strategy').value;
  return {
    preset: presetSel.value,
    strategy,
    stages: onOneDevice(strategy) ? 1 : num('stages'),
    microBatches: num('microBatches'),
    steps: num('steps'),
    backend: $<HTMLSelectElement>('backend').value as 'wasm' | 'webgpu',
    text: ownText,
    webgpuLimits: page.webgpuLimits,
    ...advancedFromUrl(),
  };
}

async function start(): Promise<void> {
  if (page.state === 'running' || page.state === 'stopping') return;
  const opts = formOptions();
  page.state = 'running';
  page.metrics = [];
  page.summary = undefined;
  page.error = undefined;
  stopAsked = false;
  startBtn.disabled = true;
  stopBtn.disabled = false;
  $('summary').textContent = '';
  $('sample').textContent = '';
  $('downloads').replaceChildren();
  progress.value = 0;
  progress.max = opts.steps;
  say(
    `starting ${opts.strategy} on ${opts.stages} stage(s), ${opts.backend}...`,
  );
  const chart = new LiveChart($('chart'));
  try {
    const r = await runInPage(opts, {
      onStart: (i) =>
        say(
          `training ${opts.preset} (${i.params} parameters) on ${i.dataset}: ${opts.strategy}, blocks per stage ${i.ranges.map((r) => r.to - r.from).join('/')}, ${opts.backend}`,
        ),
      onStep: (m, _r, trace) => {
        page.metrics.push(m);
        progress.value = m.step;
        chart.add(m);
        drawMemory(m.peak_device_bytes);
        drawTimeline(trace.svg(2));
      },
      stopRequested: () => stopAsked,
      warn: (msg) => say(`warning: ${msg}`),
    });
    page.summary = r.summary;
    $('summary').textContent = JSON.stringify(r.summary, null, 2);
    $('sample').textContent = await sample(r);
    $('downloads').append(
      modelDownload(r),
      download(
        'metrics.jsonl',
        r.metrics.map((m) => `${JSON.stringify(m)}\n`).join(''),
        'application/x-ndjson',
      ),
      download(
        'summary.json',
        `${JSON.stringify(r.summary, null, 2)}\n`,
        'application/json',
      ),
    );
    page.state = r.stopped ? 'stopped' : 'done';
    say(
      r.stopped
        ? `stopped after step ${r.summary.steps}: final loss ${r.summary.final_loss.toFixed(4)}`
        : `done: loss ${r.summary.initial_loss.toFixed(4)} -> ${r.summary.final_loss.toFixed(4)}, validation ${r.summary.val_loss.toFixed(4)}`,
    );
  } catch (e) {
    page.state = 'error';
    page.error = (e as Error).message;
    say((e as Error).message, true);
  } finally {
    startBtn.disabled = false;
    stopBtn.disabled = true;
  }
}

form.addEventListener('submit', (e) => {
  e.preventDefault();
  void start();
});
stopBtn.addEventListener('click', () => {
  stopAsked = true;
  page.state = 'stopping';
  say('stopping after the current step...');
});

/** Fills the form from the URL's parameters; true when it asks to start at once. */
function fromUrl(): boolean {
  const q = new URLSearchParams(location.search);
  const set = (id: string, key: string) => {
    const v = q.get(key);
    if (v !== null) ($(id) as HTMLInputElement | HTMLSelectElement).value = v;
  };
  const preset = q.get('preset');
  if (preset !== null && !TEXT_PRESETS.includes(preset))
    presetSel.add(new Option(preset, preset)); // let the library say what is wrong with it
  set('preset', 'preset');
  set('strategy', 'strategy');
  set('stages', 'stages');
  set('microBatches', 'micro-batches');
  set('steps', 'steps');
  set('backend', 'backend');
  return q.get('autostart') === '1';
}

if (!crossOriginIsolated)
  say(
    'this page is not cross-origin isolated (no SharedArrayBuffer): serve it with npm run web, or send Cross-Origin-Opener-Policy: same-origin and Cross-Origin-Embedder-Policy: require-corp',
    true,
  );
const q = new URLSearchParams(location.search);
if (q.get('device') !== null) {
  // this tab is a device of a run in Node (`--devices thread,browser`): no form of its own
  form.hidden = true;
  page.state = 'device';
  void serveAsDevice(q.get('token') ?? '', (line, ended) => {
    say(line, ended === 'error');
    if (ended) page.state = ended;
  });
} else {
  await detectBackends();
  if (q.get('backend') === 'webgpu' && !page.backends.includes('webgpu'))
    say(
      'webgpu was asked for, but this browser gives no WebGPU adapter: using wasm',
      true,
    );
  if (fromUrl()) void start();
}
