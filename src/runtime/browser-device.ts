/**
 * A browser tab as a device (`--devices thread,browser`): the coordinator serves the training
 * page (web/, built by esbuild into a fresh folder) on localhost, prints its URL with the
 * run's token, and waits; a tab that opens it connects back over a WebSocket and runs the
 * stage in a Web Worker (web/device.ts), with the same requests and replies a worker thread
 * gets (runtime/device.ts), encoded by runtime/wire-codec.ts.
 *
 * One WebSocket per tab carries three links, told apart by the first byte of each message:
 * the coordinator's control link and the tab's links to its previous and next stages. A
 * neighbour is a worker thread of this process (or another tab): its MessagePort stays here
 * and the coordinator relays it, so a tab needs no server of its own. A tab that closes, or
 * stops answering pings for {@link PING_TIMEOUT_MS}, fails every pending call with a
 * {@link StageError} saying so, within seconds.
 */

import { timingSafeEqual } from 'node:crypto';
import { mkdtempSync, rmSync } from 'node:fs';
import type { Server } from 'node:http';
import { tmpdir } from 'node:os';
import { join } from 'node:path';
import { MessagePort } from 'node:worker_threads';
import { type WebSocket, WebSocketServer } from 'ws';
import { LayerwiseError } from '../util/errors.js';
import { LINK_TAG } from './browser-link.js';
import { Channel, type PortLike } from './channel.js';
import { Device, StageError } from './device.js';
import { decodeMessage, encodeMessage } from './wire-codec.js';

/** A tab that answers no ping for this long is taken as gone, ms. */
export const PING_TIMEOUT_MS = 3000;

/** How long the coordinator waits for the tabs to open the URL, s (LAYERWISE_BROWSER_WAIT_S). */
const WAIT_S = Number(process.env.LAYERWISE_BROWSER_WAIT_S ?? 600);

/** The ArrayBuffers of a decoded message's typed arrays (its own copies: they can move). */
function buffersOf(v: unknown, out = new Set<ArrayBuffer>()): ArrayBuffer[] {
  if (v !== null && typeof v === 'object') {
    if (ArrayBuffer.isView(v)) {
      if (v.buffer instanceof ArrayBuffer) out.add(v.buffer);
    } else if (v instanceof Map) {
      for (const x of v.values()) buffersOf(x, out);
    } else for (const x of Object.values(v)) buffersOf(x, out);
  }
  return [...out];
}

/** One message of link `tag` as a WebSocket frame. */
function frame(tag: number, value: unknown): Uint8Array {
  const body = new Uint8Array(encodeMessage(value));
  const out = new Uint8Array(1 + body.length);
  out[0] = tag;
  out.set(body, 1);
  return out;
}

/**
 * The page's server for one run: HTTP for the built page, a WebSocket endpoint (`/device`)
 * for tabs that present the run's token.
 */
export class BrowserHub {
  private readonly waiting: Array<(ws: WebSocket) => void> = [];
  private static shared: Promise<BrowserHub> | undefined;

  private constructor(
    /** The URL a person (or a test's browser) opens; it holds the run's token. */
    readonly url: string,
    private readonly wss: WebSocketServer,
    private readonly closeHttp: () => Promise<void>,
    private readonly dir: string,
  ) {}

  /**
   * This process's hub, started on first use with `token` and kept until the process exits, so
   * the URL stays the same across the runs of a process: after a lost tab, `--max-restarts`
   * waits for a new tab at the URL the person already has.
   */
  static get(token: string): Promise<BrowserHub> {
    BrowserHub.shared ??= BrowserHub.start(token);
    BrowserHub.shared.catch(() => (BrowserHub.shared = undefined));
    return BrowserHub.shared;
  }

  /**
   * Builds the page into a temporary folder and serves it on 127.0.0.1
   * (LAYERWISE_BROWSER_PORT, default any free port).
   * @throws LayerwiseError when the page's sources (web/) or its bundler are missing.
   */
  static async start(token: string): Promise<BrowserHub> {
    const web = new URL('../../web/', import.meta.url);
    let build: (dir: string) => Promise<string>;
    let serve: (o: {
      dir: string;
      port: number;
    }) => Promise<{ url: string; server: Server; close(): Promise<void> }>;
    try {
      ({ build } = await import(new URL('build.mjs', web).href));
      ({ serve } = await import(new URL('serve.mjs', web).href));
    } catch (e) {
      throw new LayerwiseError(
        `a browser device needs the page's sources (web/) and esbuild (npm ci in a checkout of layerwise): ${(e as Error).message.split('\n')[0]}`,
      );
    }
    const dir = mkdtempSync(join(tmpdir(), 'layerwise-page-'));
    try {
      await build(dir);
      const { url, server, close } = await serve({
        dir,
        port: Number(process.env.LAYERWISE_BROWSER_PORT ?? 0),
      });
      const wss = new WebSocketServer({
        server,
        path: '/device',
        maxPayload: 2 ** 31 - 1,
        verifyClient: ({ req }, done) => {
          const given = Buffer.from(
            new URL(req.url ?? '/', 'http://x').searchParams.get('token') ?? '',
          );
          const want = Buffer.from(token);
          if (given.length === want.length && timingSafeEqual(given, want))
            done(true);
          else done(false, 401, 'wrong token: open the URL the run printed');
        },
      });
      const hub = new BrowserHub(
        `${url}?device=1&token=${encodeURIComponent(token)}`,
        wss,
        close,
        dir,
      );
      server.unref(); // the hub waits for tabs only while a run does
      process.once('exit', () => rmSync(dir, { recursive: true, force: true }));
      wss.on('connection', (ws) => {
        const take = hub.waiting.shift();
        if (take) take(ws);
        else ws.close(1013, 'every browser stage of this run has its tab');
      });
      return hub;
    } catch (e) {
      rmSync(dir, { recursive: true, force: true });
      throw e;
    }
  }

  /**
   * The next tab that connects, as stage `index`'s device.
   * @throws StageError when none connects within LAYERWISE_BROWSER_WAIT_S (default 600) s.
   */
  async device(index: number): Promise<BrowserDevice> {
    const ws = await new Promise<WebSocket>((resolve, reject) => {
      const timer = setTimeout(() => {
        this.waiting.splice(this.waiting.indexOf(take), 1);
        reject(
          new StageError(
            index,
            `no browser tab opened ${this.url} within ${WAIT_S} s`,
          ),
        );
      }, WAIT_S * 1000);
      const take = (ws: WebSocket) => {
        clearTimeout(timer);
        resolve(ws);
      };
      this.waiting.push(take);
    });
    return new BrowserDevice(index, ws);
  }

  /** Stops serving and removes the built page. */
  async close(): Promise<void> {
    for (const c of this.wss.clients) c.terminate();
    this.wss.close();
    await this.closeHttp();
    rmSync(this.dir, { recursive: true, force: true });
  }
}

/** The coordinator's handle on a stage running in a browser tab. */
export class BrowserDevice extends Device {
  protected readonly ch: Channel;
  readonly where = 'browser tab';
  /** The coordinator's ends of this stage's neighbour links, by tag. */
  private readonly links = new Map<number, MessagePort>();
  private readonly heartbeat: ReturnType<typeof setInterval>;

  constructor(
    index: number,
    private readonly ws: WebSocket,
  ) {
    super(index);
    const listeners: Array<(v: unknown) => void> = [];
    const port: PortLike = {
      postMessage: (v) => this.send(v),
      on: (_event, l) => listeners.push(l),
    };
    this.ch = new Channel(port);
    ws.on('message', (data: Buffer) => {
      const m = decodeMessage(data.subarray(1));
      if (data[0] === LINK_TAG.control) for (const l of listeners) l(m);
      else this.links.get(data[0]!)?.postMessage(m, buffersOf(m));
    });
    let lastPong = Date.now();
    ws.on('pong', () => (lastPong = Date.now()));
    this.heartbeat = setInterval(() => {
      if (Date.now() - lastPong > PING_TIMEOUT_MS) ws.terminate();
      else ws.ping();
    }, 500);
    this.heartbeat.unref();
    ws.on('close', (code, reason) => {
      clearInterval(this.heartbeat);
      for (const p of this.links.values()) p.close();
      if (!this.closed)
        this.ch.fail(
          this.gone(`WebSocket ${code}${reason.length ? `: ${reason}` : ''}`),
        );
    });
  }

  /** The error of a lost tab: what every pending and later call of this device throws. */
  private gone(why: string): StageError {
    return new StageError(
      this.index,
      `the browser tab running this stage was closed or stopped answering (${why}); keep the tab open while the run trains`,
    );
  }

  /** Sends a control message; init's neighbour MessagePorts stay here and are relayed. */
  private send(v: unknown): void {
    const m = v as {
      type: string;
      method?: string;
      args?: Record<string, unknown>;
    };
    let out = v;
    if (m.type === 'request' && m.method === 'init' && m.args) {
      const args = { ...m.args };
      for (const side of ['prev', 'next'] as const) {
        const p = args[side];
        if (!(p instanceof MessagePort)) continue;
        const tag = LINK_TAG[side];
        this.links.set(tag, p);
        p.on('message', (x) => {
          if (this.ws.readyState === this.ws.OPEN) this.ws.send(frame(tag, x));
        });
        args[side] = { browserLink: side };
      }
      out = { ...m, args };
    }
    if (this.ws.readyState !== this.ws.OPEN)
      throw this.gone('its WebSocket is closing');
    this.ws.send(frame(LINK_TAG.control, out));
  }

  async terminate(): Promise<void> {
    if (!this.closed && !this.failed && this.pending === 0) {
      await Promise.race([
        this.call('shutdown', null).catch(() => undefined),
        new Promise((r) => setTimeout(r, 5000).unref()),
      ]);
    }
    if (!this.closed)
      this.ch.fail(new StageError(this.index, 'device was stopped'));
    this.closed = true;
    clearInterval(this.heartbeat);
    for (const p of this.links.values()) p.close();
    this.ws.close(1000, 'the run ended');
  }
}
