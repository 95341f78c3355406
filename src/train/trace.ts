/**
 * Pipeline timelines. Collects the executor's spans of every step and stage, and writes
 * - a Chrome trace event file (JSON; opens in Perfetto and chrome://tracing) with one track
 *   per stage: forward, backward, recompute, waits for activations/gradients/the norm
 *   all-reduce, optimizer step;
 * - an SVG drawing of the last steps, one row per stage, so the bubble can be seen without a
 *   browser tool;
 * - a per-stage summary: busy and idle (bubble) percentages and peak device bytes.
 * Format reference: Trace Event Format, "Complete events" (ph = 'X', microseconds).
 */

import type { ServerSpan } from '../param-server/server.js';
import { type TraceSpan, WAITING_LABELS } from '../pipeline/executor.js';
import type { StepReport } from '../strategies/strategy.js';
import { writeFileAtomic } from '../util/fsx.js';

/** A span placed on the run's timeline, ms since the first recorded step began. */
export interface TimelineSpan extends TraceSpan {
  /** The span's (virtual) stage; L2L: the device. */
  stage: number;
  /**
   * The row it is drawn on: the stage for pipelines; for L2L, 0 = the device's compute (host
   * side), 1 = its parameter transfers (uploads, waits for the parameter server, gradient
   * downloads), 2 + t = the parameter server's optimizer thread t; on webgpu, 1 = the device's
   * GPU (the GPU's execution of each compute action and upload: TraceSpan.gpu), 2 = transfers,
   * 3 + t = optimizer thread t. Spans of one track never overlap.
   */
  track: number;
  step: number;
  /** Absolute start and end, ms since the run's first step. */
  t0: number;
  t1: number;
}

/** Per-stage totals over the recorded steps. */
export interface StageSummary {
  stage: number;
  busyPct: number;
  idlePct: number;
  peakBytes: number;
}

/** L2L: the device's parameter transfers, drawn on a track of their own. */
const TRANSFERS = new Set([
  'load_layer',
  'upload',
  'wait_params',
  'prefetch_layer',
  'push_grads',
  'release_layer',
]);
const COLORS: Record<string, string> = {
  forward: '#4e79a7',
  backward: '#59a14f',
  backward_input: '#8cd17d',
  backward_weight: '#2f6b2a',
  recompute: '#f28e2b',
  optimizer_step: '#e15759',
  recv_act: '#dddddd',
  recv_grad: '#dddddd',
  reduce_grad_norm: '#bbbbbb',
  all_reduce_grads: '#b07aa1',
  grad_norm: '#edc948',
  send_act: '#9c755f',
  send_grad: '#9c755f',
  layer_forward: '#4e79a7',
  layer_backward: '#59a14f',
  upload: '#76b7b2',
  load_layer: '#76b7b2',
  prefetch_layer: '#76b7b2',
  push_grads: '#9c755f',
  release_layer: '#bab0ac',
  wait_params: '#dddddd',
  server_update: '#e15759',
};

/** Human label of a span: `F3`, `B3`, `I3` and `W3` (the split backward), `R3` (recompute), `wait act 3`, `step`. */
export function spanName(s: TraceSpan): string {
  const mb = s.mb >= 0 ? String(s.mb) : '';
  switch (s.label) {
    case 'forward':
      return `F${mb}`;
    case 'backward':
      return `B${mb}`;
    case 'backward_input':
      return `I${mb}`;
    case 'backward_weight':
      return `W${mb}`;
    case 'recompute':
      return `R${mb}`;
    case 'recv_act':
      return `wait act ${mb}`;
    case 'recv_grad':
      return `wait grad ${mb}`;
    case 'send_act':
      return `send act ${mb}`;
    case 'send_grad':
      return `send grad ${mb}`;
    case 'grad_norm':
      return 'grad norm';
    case 'reduce_grad_norm':
      return 'norm all-reduce';
    case 'all_reduce_grads':
      return 'gradient all-reduce';
    case 'optimizer_step':
      return 'step';
    case 'layer_forward':
      return `L${s.layer} F${mb}`;
    case 'layer_backward':
      return `L${s.layer} B${mb}`;
    case 'load_layer':
    case 'upload':
      return `upload L${s.layer}`;
    case 'prefetch_layer':
      return `prefetch L${s.layer}`;
    case 'wait_params':
      return `wait L${s.layer}`;
    case 'push_grads':
      return `grads L${s.layer}`;
    case 'release_layer':
      return `free L${s.layer}`;
    case 'server_update':
      return `update L${s.layer}`;
    default:
      return s.label;
  }
}

export class TraceRecorder {
  readonly spans: TimelineSpan[] = [];
  /**
   * @param keepSpans keep every span (for the trace files); otherwise only the totals.
   * @param deviceName the track name of device d (default `stage d`; data-parallel runs name
   *   the replica, e.g. `replica 1 stage 0`)
   */
  constructor(
    private readonly keepSpans = true,
    private readonly deviceName: (d: number) => string = (d) => `stage ${d}`,
  ) {}

  private origin: number | null = null;
  /** Track names by track number. */
  readonly tracks = new Map<number, string>();
  private readonly peaks: number[] = [];
  private readonly busy: number[] = [];
  private readonly total: number[] = [];
  /** Whether a device ran several stages: span names then start with their stage (`3F2`). */
  private severalStages = false;

  /** A span's name in the trace: {@link spanName}, with its stage where a device runs several. */
  private nameOf(s: TimelineSpan): string {
    if (!this.severalStages) return spanName(s);
    const name = spanName(s);
    return name.includes(' ')
      ? `stage ${s.stage}: ${name}`
      : `${s.stage}${name}`;
  }

  /** Whether any span is half of a split backward (zero-bubble schedules): the legend then shows I and W. */
  private hasSplitBackward(): boolean {
    return this.spans.some(
      (s) => s.label === 'backward_input' || s.label === 'backward_weight',
    );
  }

  /** L2L: whether the run records the GPU's spans (webgpu), decided by its first report. */
  private gpuTrack: boolean | undefined;
  /** L2L: the devices of the run (a pipelined relay or replicas: several), each with its own tracks. */
  private relayDevices = 1;

  /** L2L: tracks per device (its own, its GPU's where recorded, its transfers). */
  private get relayTracks(): number {
    return this.gpuTrack ? 3 : 2;
  }

  /** Adds one step's report (its spans are aligned by each stage's start time). */
  add(step: number, r: StepReport): void {
    this.origin ??= Math.min(...r.startedAt);
    const relay = r.serverSpans !== undefined;
    if (relay)
      this.gpuTrack ??= r.traces.some((spans) => spans.some((s) => s.gpu));
    const g = this.gpuTrack ? 1 : 0; // tracks after the device's own move down by one
    if (relay) this.relayDevices = r.traces.length;
    r.traces.forEach((spans, stage) => {
      const base = r.startedAt[stage] - this.origin!;
      let busy = 0;
      let end = 0;
      if (!relay) this.tracks.set(stage, this.deviceName(stage));
      // L2L: each device's own track, its GPU's and its transfers', device after device
      const first = stage * this.relayTracks;
      for (const s of spans) {
        const track = relay
          ? first + (s.gpu ? 1 : TRANSFERS.has(s.label) ? 1 + g : 0)
          : stage;
        // a device running several stages (interleaved, V-shape): its spans name their stage
        if (!relay && s.stage !== stage) this.severalStages = true;
        if (this.keepSpans)
          this.spans.push({
            ...s,
            stage: relay ? stage : s.stage,
            track,
            step,
            t0: base + s.start,
            t1: base + s.end,
          });
        if (s.gpu) continue; // the GPU's time, not the stage's: busy and step time are the host's
        if (!WAITING_LABELS.has(s.label)) busy += s.end - s.start;
        end = Math.max(end, s.end);
      }
      this.busy[stage] = (this.busy[stage] ?? 0) + busy;
      this.total[stage] = (this.total[stage] ?? 0) + end;
      this.peaks[stage] = Math.max(this.peaks[stage] ?? 0, r.peakBytes[stage]);
    });
    if (relay) {
      for (let d = 0; d < this.relayDevices; d++) {
        const name = this.relayDevices > 1 ? `device ${d}` : 'device';
        const first = d * this.relayTracks;
        this.tracks.set(first, name);
        if (g) this.tracks.set(first + 1, `${name} GPU`);
        this.tracks.set(
          first + 1 + g,
          this.relayDevices > 1 ? `${name} transfers` : 'transfers',
        );
      }
      this.addServerSpans(step, r.serverSpans!);
    }
  }

  /**
   * L2L: the parameter server's optimizer updates (one track per optimizer thread). A step's
   * updates finish while the device works on later steps, so they arrive with later reports,
   * and the last step's after the run (Strategy.drainServerSpans); each is placed at its own
   * start time, under `step`, the step whose report brought it.
   */
  addServerSpans(step: number, spans: readonly ServerSpan[]): void {
    if (this.origin === null) return;
    for (const u of spans) {
      const track = this.relayDevices * this.relayTracks + u.thread;
      this.tracks.set(track, `PS thread ${u.thread}`);
      const t0 = u.startedAt - this.origin;
      if (this.keepSpans) {
        this.spans.push({
          label: 'server_update',
          op: 'optimizer_step',
          mb: -1,
          layer: u.layer,
          stage: 0,
          track,
          step,
          start: t0,
          end: t0 + u.ms,
          t0,
          t1: t0 + u.ms,
        });
      }
    }
  }

  /** Busy and idle percentages and peak bytes per stage over the recorded steps. */
  summary(): StageSummary[] {
    return this.total.map((t, stage) => {
      const busyPct = t > 0 ? (100 * this.busy[stage]) / t : 0;
      return {
        stage,
        busyPct,
        idlePct: 100 - busyPct,
        peakBytes: this.peaks[stage],
      };
    });
  }

  /** Chrome trace event JSON. */
  chromeTrace(): string {
    const events: object[] = [...this.tracks].map(([t, name]) => ({
      name: 'thread_name',
      ph: 'M',
      pid: 1,
      tid: t,
      args: { name },
    }));
    for (const s of this.spans) {
      events.push({
        name: this.nameOf(s),
        cat: s.gpu ? `gpu ${s.label}` : s.label,
        ph: 'X',
        pid: 1,
        tid: s.track,
        ts: Math.round(s.t0 * 1000),
        dur: Math.max(1, Math.round((s.t1 - s.t0) * 1000)),
        args: {
          step: s.step,
          micro_batch: s.mb,
          ...(s.layer !== undefined ? { layer: s.layer } : {}),
          ...(s.gpu ? { host_ms_in_submit: s.submitMs } : {}),
        },
      });
    }
    return JSON.stringify({ traceEvents: events, displayTimeUnit: 'ms' });
  }

  /** SVG timeline of the last `steps` recorded steps: one row per stage, time left to right. */
  svg(steps = 2): string {
    const last = Math.max(...this.spans.map((s) => s.step));
    const shown = this.spans.filter(
      (s) => s.step > last - steps && s.t1 - s.t0 > 0,
    );
    const k = Math.max(...shown.map((s) => s.track)) + 1;
    const t0 = Math.min(...shown.map((s) => s.t0));
    const t1 = Math.max(...shown.map((s) => s.t1));
    const W = 1200;
    const left = 90;
    const row = 34;
    const top = 30;
    const x = (t: number) =>
      left + ((t - t0) / Math.max(1e-9, t1 - t0)) * (W - left - 10);
    const esc = (s: string) => s.replace(/&/g, '&amp;').replace(/</g, '&lt;');
    const parts: string[] = [];
    parts.push(
      `<svg xmlns="http://www.w3.org/2000/svg" width="${W}" height="${top + k * row + 50}" font-family="sans-serif" font-size="11">`,
    );
    parts.push(`<rect width="100%" height="100%" fill="white"/>`);
    parts.push(
      `<text x="${left}" y="18" font-size="13">pipeline timeline: last ${Math.min(steps, last)} step(s), ${(t1 - t0).toFixed(0)} ms; grey = waiting (bubble)</text>`,
    );
    for (let s = 0; s < k; s++) {
      const y = top + s * row;
      parts.push(
        `<text x="4" y="${y + row / 2 + 4}">${esc(this.tracks.get(s) ?? `stage ${s}`)}</text>`,
      );
      parts.push(
        `<rect x="${left}" y="${y + 2}" width="${W - left - 10}" height="${row - 4}" fill="#f7f7f7"/>`,
      );
    }
    for (const sp of shown) {
      const y = top + sp.track * row;
      const x0 = x(sp.t0);
      const w = Math.max(0.5, x(sp.t1) - x0);
      const name = this.nameOf(sp);
      parts.push(
        `<rect x="${x0.toFixed(2)}" y="${y + 4}" width="${w.toFixed(2)}" height="${row - 8}" fill="${COLORS[sp.label] ?? '#999'}" stroke="white" stroke-width="0.5"><title>${esc(`step ${sp.step} ${name}: ${(sp.t1 - sp.t0).toFixed(1)} ms`)}</title></rect>`,
      );
      if (w > 16 && !WAITING_LABELS.has(sp.label))
        parts.push(
          `<text x="${(x0 + w / 2).toFixed(2)}" y="${y + row / 2 + 4}" text-anchor="middle" fill="white">${esc(name)}</text>`,
        );
    }
    const legend = [...this.tracks.values()].includes('transfers')
      ? [
          'layer_forward',
          'layer_backward',
          'upload',
          'push_grads',
          'server_update',
          'wait_params',
        ]
      : [
          'forward',
          'backward',
          ...(this.hasSplitBackward()
            ? ['backward_input', 'backward_weight']
            : []),
          'recompute',
          'optimizer_step',
          'recv_act',
        ];
    const legendName: Record<string, string> = {
      recv_act: 'wait',
      backward_input: 'backward (input)',
      backward_weight: 'backward (weights)',
      wait_params: 'wait for PS',
      layer_forward: 'forward',
      layer_backward: 'recompute + backward',
      push_grads: 'grads to PS',
      server_update: 'PS optimizer',
    };
    legend.forEach((l, i) => {
      const lx = left + i * 150;
      const ly = top + k * row + 18;
      parts.push(
        `<rect x="${lx}" y="${ly - 10}" width="12" height="12" fill="${COLORS[l]}"/><text x="${lx + 16}" y="${ly}">${legendName[l] ?? l.replace('_', ' ')}</text>`,
      );
    });
    parts.push('</svg>');
    return `${parts.join('\n')}\n`;
  }

  /** Writes the Chrome trace to `path` and the SVG beside it (`.svg`). Returns both paths. */
  async write(path: string): Promise<[string, string]> {
    const svgPath = `${path.replace(/\.json$/i, '')}.svg`;
    await writeFileAtomic(path, this.chromeTrace());
    await writeFileAtomic(svgPath, this.svg());
    return [path, svgPath];
  }
}
