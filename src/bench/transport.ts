/**
 * `npm run bench -- transport`: what a stage-to-stage link costs on loopback, for each kind of
 * device. Channel throughput (MB/s: 4 MiB tensors one way, each acknowledged) and round-trip
 * latency (median of small messages) between this thread and a worker thread (MessagePort,
 * buffers transferred), a child process over gRPC (the devices' transport) and, as the floor,
 * a raw TCP socket to a child process; then gpipe K=2 M=8 on charlm-small over threads and
 * over processes. Writes transport.json and transport.md.
 */
import { type ChildProcess, spawn } from 'node:child_process';
import { connect } from 'node:net';
import { createInterface } from 'node:readline';
import { fileURLToPath } from 'node:url';
import { Worker } from 'node:worker_threads';
import { modelConfigFor, resolveConfig } from '../config/config.js';
import { makeBatcher } from '../data/batcher.js';
import { loadDataset } from '../data/index.js';
import { initParams } from '../model/init.js';
import { buildModel } from '../model/model.js';
import { dial } from '../runtime/grpc-link.js';
import { createStrategy } from '../strategies/index.js';
import { median } from '../util/stats.js';
import { onFrames } from './frames.js';
import { markdownTable, writeBenchResults } from './report.js';

export interface TransportBenchOptions {
  /** Payload of a throughput message, MiB. */
  mib: number;
  /** Throughput messages per transport. */
  messages: number;
  /** Round trips for the latency. */
  roundTrips: number;
  /** Measured gpipe steps per device kind. */
  steps: number;
  out: string;
}

/** One transport as the bench drives it: send a message, hear every answer. */
interface Link {
  send(m: { echo: boolean; data: unknown }): void;
  onAnswer(f: (m: unknown) => void): void;
  close(): Promise<void>;
}

const ECHO = fileURLToPath(new URL('./transport-echo.js', import.meta.url));

async function childAt(
  kind: 'grpc' | 'tcp',
): Promise<{ child: ChildProcess; address: string }> {
  const child = spawn(process.execPath, [ECHO, kind], {
    stdio: ['ignore', 'pipe', 'inherit'],
  });
  const line = await new Promise<string>((r) =>
    createInterface({ input: child.stdout! }).once('line', r),
  );
  return { child, address: /listening on (\S+)/.exec(line)![1]! };
}

async function threadLink(): Promise<Link> {
  const w = new Worker(ECHO);
  return {
    send: (m) =>
      w.postMessage(
        m,
        m.data instanceof Float32Array ? [m.data.buffer as ArrayBuffer] : [],
      ),
    onAnswer: (f) => w.on('message', f),
    close: async () => void (await w.terminate()),
  };
}

async function grpcLink(): Promise<Link> {
  const { child, address } = await childAt('grpc');
  const { port, client } = dial(address, 'peer', 'bench');
  return {
    send: (m) => port.postMessage(m),
    onAnswer: (f) => port.on('message', f),
    close: async () => {
      port.end();
      client.close();
      child.kill();
    },
  };
}

async function tcpLink(): Promise<Link> {
  const { child, address } = await childAt('tcp');
  const [host, p] = address.split(':');
  const sock = connect(Number(p), host);
  sock.setNoDelay(true);
  await new Promise((r) => sock.once('connect', r));
  const listeners: Array<(m: unknown) => void> = [];
  onFrames(sock, (frame) => {
    for (const l of listeners) l(frame);
  });
  return {
    send: (m) => {
      const payload =
        m.data instanceof Float32Array
          ? Buffer.from(m.data.buffer, m.data.byteOffset, m.data.byteLength)
          : Buffer.alloc(8);
      const head = Buffer.alloc(5);
      head.writeUInt32LE(payload.length, 0);
      head[4] = m.echo ? 1 : 0;
      sock.write(Buffer.concat([head, payload]));
    },
    onAnswer: (f) => listeners.push(f),
    close: async () => {
      sock.destroy();
      child.kill();
    },
  };
}

/** MB/s of `n` messages of `mib` MiB each acknowledged, and the median round trip (ms) of small echoed messages. */
async function measureLink(
  link: Link,
  o: TransportBenchOptions,
): Promise<{ mb_per_s: number; rtt_ms: number }> {
  const answers: Array<() => void> = [];
  link.onAnswer(() => answers.shift()?.());
  const answered = () => new Promise<void>((r) => answers.push(r));
  // throughput: a window of 4 messages in flight, as a pipeline keeps a few micro-batches moving
  const bytes = o.mib * 2 ** 20;
  const send = () => {
    const done = answered();
    link.send({ echo: false, data: new Float32Array(bytes / 4) });
    return done;
  };
  await send(); // warm
  const t0 = performance.now();
  const inflight: Array<Promise<void>> = [];
  for (let i = 0; i < o.messages; i++) {
    inflight.push(send());
    if (inflight.length >= 4) await inflight.shift();
  }
  await Promise.all(inflight);
  const secs = (performance.now() - t0) / 1000;
  const rtts: number[] = [];
  for (let i = 0; i < o.roundTrips; i++) {
    const done = answered();
    const t = performance.now();
    link.send({ echo: true, data: i });
    await done;
    rtts.push(performance.now() - t);
  }
  await link.close();
  return { mb_per_s: (o.messages * bytes) / 1e6 / secs, rtt_ms: median(rtts) };
}

export async function benchTransport(
  o: TransportBenchOptions,
  log: (s: string) => void,
): Promise<void> {
  const links: Array<[string, () => Promise<Link>]> = [
    ['worker thread (MessagePort)', threadLink],
    ['process (gRPC)', grpcLink],
    ['process (raw TCP)', tcpLink],
  ];
  const rows: Array<{ transport: string; mb_per_s: number; rtt_ms: number }> =
    [];
  for (const [name, open] of links) {
    const r = await measureLink(await open(), o);
    rows.push({ transport: name, ...r });
    log(
      `${name}: ${r.mb_per_s.toFixed(0)} MB/s, round trip ${r.rtt_ms.toFixed(3)} ms`,
    );
  }
  // the pipeline itself: gpipe K=2 M=8 on charlm-small over threads and over processes
  const base = resolveConfig({ preset: 'charlm-small', batchSize: 32 });
  const ds = await loadDataset(base.data);
  const model = buildModel(modelConfigFor(base, ds));
  const params = initParams(model.blocks, 1);
  const gp: Array<{ devices: string; tokens_per_s: number; step_s: number }> =
    [];
  for (const devices of ['thread', 'process']) {
    const cfg = resolveConfig({
      preset: 'charlm-small',
      batchSize: 32,
      strategy: 'gpipe',
      stages: 2,
      microBatches: 8,
      devices,
    });
    const s = await createStrategy(cfg, model, params);
    try {
      const batcher = makeBatcher(ds, {
        batchSize: 32,
        context: cfg.context ?? 128,
        seed: 1,
      });
      await s.trainStep(batcher.next(), 1e-4);
      const times: number[] = [];
      let tokens = 0;
      for (let i = 0; i < o.steps; i++) {
        const b = batcher.next();
        const t = performance.now();
        await s.trainStep(b, 1e-4);
        times.push((performance.now() - t) / 1000);
        tokens = b.tokens;
      }
      const step = median(times);
      gp.push({ devices, tokens_per_s: tokens / step, step_s: step });
      log(
        `gpipe K=2 M=8 over ${devices === 'thread' ? 'threads' : 'processes'}: ${(tokens / step).toFixed(0)} tokens/s`,
      );
    } finally {
      await s.close();
    }
  }
  const md =
    `# Transport (loopback)\n\n${o.mib} MiB tensors one way, 4 in flight, each acknowledged; round trip: median of ${o.roundTrips} small echoed messages.\n\n` +
    markdownTable({
      columns: ['transport', 'MB/s', 'round trip (ms)'],
      rows: rows.map((r) => [
        r.transport,
        r.mb_per_s.toFixed(0),
        r.rtt_ms.toFixed(3),
      ]),
    }) +
    `\n## gpipe K=2 M=8, charlm-small, batch 32\n\n` +
    markdownTable({
      columns: ['devices', 'tokens/s', 's/step'],
      rows: gp.map((g) => [
        g.devices,
        g.tokens_per_s.toFixed(0),
        g.step_s.toFixed(3),
      ]),
    });
  const files = await writeBenchResults(
    o.out,
    'transport',
    { options: o, links: rows, gpipe: gp },
    md,
  );
  log(`wrote ${files.join(', ')}`);
}
