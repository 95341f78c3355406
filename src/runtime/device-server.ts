/**
 * A device in its own process, on this host or another: a gRPC server (`layerwise worker
 * --listen HOST:PORT`) that one coordinator at a time drives. The coordinator opens a 'control'
 * link and sends the same requests a worker thread gets; the previous stage's device opens a
 * 'peer' link for activations and gradients (or, for a worker-thread neighbour, which has no
 * server, the coordinator opens it on the thread's behalf: 'peer' or 'next-peer'). The process's main thread only moves bytes: the
 * stage computes in a worker thread (runtime/worker.js, as a thread device does) bridged to the
 * links by MessagePorts, so the network is read and written while the stage computes (a
 * computing thread cannot answer HTTP/2 flow control, which serialised transfer and compute). A link that does not
 * present the run's shared token, or comes from another layerwise version, is refused: a device
 * runs the model code it is sent, so an open port must not accept strangers. Binds to loopback
 * unless given another host; TLS where certificates are given.
 */

import { timingSafeEqual } from 'node:crypto';
import { type MessagePort, Worker } from 'node:worker_threads';
import * as grpc from '@grpc/grpc-js';
import { ownedBuffers } from './channel.js';
import {
  bridgeToPort,
  DEVICE_SERVICE,
  dial,
  LINK_OPTIONS,
  type PeerSide,
  StreamPort,
  sideOf,
  type TlsFiles,
  VERSION,
} from './grpc-link.js';
import type { RemoteLink } from './protocol.js';

/** Options of {@link startDeviceServer}. */
export interface DeviceServerOptions {
  /** Interface to bind; default 127.0.0.1 (loopback only). */
  host?: string;
  /** Port; 0 picks a free one. */
  port: number;
  /** The shared token a coordinator and the other devices must present. */
  token: string;
  /** Server certificate and key (and a CA to check clients' certificates) for TLS. */
  tls?: TlsFiles;
  /** Stop after the first coordinator's run (a device process a coordinator spawned). */
  once?: boolean;
  /** Where to say what happens (one line each). */
  log?: (line: string) => void;
}

/** A running device server. */
export interface DeviceServer {
  /** HOST:PORT it listens on. */
  address: string;
  /** Resolves when the server has stopped (with `once`, after its run). */
  done: Promise<void>;
  close(): Promise<void>;
}

const sameToken = (a: string, b: string): boolean => {
  const x = Buffer.from(a);
  const y = Buffer.from(b);
  return x.length === y.length && timingSafeEqual(x, y);
};

/** How long a device tries to reach the next stage's device, ms. */
const CONNECT_TIMEOUT_MS = 10_000;

/** How long a device waits for its previous stage to link up after init, ms. */
const ACCEPT_TIMEOUT_MS = 30_000;

/** The server's state that every link it accepts shares. */
interface ServerState {
  o: DeviceServerOptions;
  log: (line: string) => void;
  /** Whether a coordinator is connected (one at a time). */
  busy: boolean;
  /** A neighbour's (or replica's) link per side of the stage: waited for by init, or arrived before it. */
  peerWaiter: Partial<Record<PeerSide, (p: StreamPort) => void>>;
  pendingPeer: Partial<Record<PeerSide, StreamPort>>;
  /** Stops the server (once it has shut down, `done` resolves). */
  close: () => Promise<void>;
}

/** What the coordinator sends on its control link (an init request's links are remote). */
interface ControlMessage {
  type: string;
  method?: string;
  args?: {
    prev?: RemoteLink;
    next?: RemoteLink;
    replicaPrev?: RemoteLink;
    replicaNext?: RemoteLink;
  };
}

/** Refuses a link with a gRPC status and says so in the log. */
function refuse(
  s: ServerState,
  call: grpc.ServerDuplexStream<Buffer, Buffer>,
  code: grpc.status,
  details: string,
): void {
  s.log(`refused a link: ${details}`);
  call.emit('error', { code, details, metadata: new grpc.Metadata() });
}

/**
 * Answers one incoming link by its metadata: refused without the run's token or from another
 * layerwise version; a peer link ('peer', 'next-peer' and the replica roles) goes to the stage
 * waiting for it, or waits for init; a 'control' link starts a coordinator's run, unless one is
 * running already (refused as busy); any other role is refused.
 */
function acceptLink(
  s: ServerState,
  call: grpc.ServerDuplexStream<Buffer, Buffer>,
) {
  const md = call.metadata;
  const token = String(md.get('layerwise-token')[0] ?? '');
  const version = String(md.get('layerwise-version')[0] ?? '');
  const role = String(md.get('layerwise-role')[0] ?? '');
  if (!sameToken(token, s.o.token))
    return refuse(
      s,
      call,
      grpc.status.UNAUTHENTICATED,
      'wrong token: the coordinator and every device need the same LAYERWISE_TOKEN',
    );
  if (version !== VERSION)
    return refuse(
      s,
      call,
      grpc.status.FAILED_PRECONDITION,
      `version mismatch: this device runs layerwise ${VERSION}, the peer ${version || 'an unknown version'}; run the same version everywhere`,
    );
  const port = new StreamPort(call);
  const side = sideOf(role);
  if (side) {
    // 'peer': the previous stage dialled this device; 'next-peer': the next stage did (the
    // replica roles: the previous or next replica in the ring)
    const waiter = s.peerWaiter[side];
    if (waiter) waiter(port);
    else s.pendingPeer[side] = port;
    return;
  }
  if (role !== 'control')
    return refuse(
      s,
      call,
      grpc.status.INVALID_ARGUMENT,
      `unknown link role '${role}'`,
    );
  if (s.busy)
    return refuse(
      s,
      call,
      grpc.status.RESOURCE_EXHAUSTED,
      'this device is busy with another coordinator',
    );
  s.busy = true;
  s.log(`coordinator connected from ${call.getPeer()}`);
  new CoordinatorRun(s, port); // lives on in the listeners of its link and its thread
}

/**
 * One coordinator's run on this device: a stage thread (runtime/worker.js) that the control
 * link's requests go to and whose replies and messages go back; init's remote links become
 * MessagePorts the thread owns. The run ends (thread stopped, links closed, the device free
 * again) when the control link closes or the thread crashes or exits.
 */
class CoordinatorRun {
  private readonly s: ServerState;
  /** The coordinator's control link. */
  private readonly port: StreamPort;
  /** The peer links bridged to the stage thread. */
  private readonly peers: StreamPort[] = [];
  private readonly worker: Worker;
  private ended = false;
  /** The coordinator's requests, handed to the stage thread one after another. */
  private queue = Promise.resolve();

  /** Starts the stage thread and wires it to the control link `port`. */
  constructor(s: ServerState, port: StreamPort) {
    this.s = s;
    this.port = port;
    const worker = new Worker(new URL('./worker.js', import.meta.url));
    this.worker = worker;
    port.onClose((why) =>
      this.end(`the coordinator's link closed (${why.message})`),
    );
    worker.on('error', (e) =>
      this.end(`the stage thread crashed: ${e.message}`),
    );
    worker.on('exit', () => this.end('the stage thread exited'));
    // the stage thread's replies and messages go to the coordinator as they are
    worker.on('message', (m) => {
      if (!this.ended) port.postMessage(m);
    });
    // the coordinator's requests go to the stage thread; init's remote links become MessagePorts first
    port.on('message', (m) => {
      this.queue = this.queue.then(() => this.forward(m));
    });
  }

  /** Ends the run once (the first `why` is logged): stops the thread, closes every link, frees the device; with `once`, closes the server. */
  private end(why: string): void {
    if (this.ended) return;
    this.ended = true;
    void this.worker.terminate();
    for (const l of this.peers) l.end();
    this.port.end();
    this.s.busy = false;
    delete this.s.pendingPeer.prev;
    delete this.s.pendingPeer.next;
    this.s.log(`run ended: ${why}`);
    if (this.s.o.once) void this.s.close();
  }

  /**
   * Hands coordinator message `m` to the stage thread (with its buffers). An init request's
   * remote links are bridged to MessagePorts first; when one fails, the coordinator gets init's
   * error reply instead and the thread nothing.
   */
  private async forward(m: unknown): Promise<void> {
    const msg = m as ControlMessage;
    const ports: MessagePort[] = [];
    if (msg.type === 'request' && msg.method === 'init' && msg.args) {
      try {
        const a = msg.args;
        const [prev, next, replicaPrev, replicaNext] = await Promise.all([
          a.prev ? this.bridge(a.prev, 'prev') : undefined,
          a.next ? this.bridge(a.next, 'next') : undefined,
          a.replicaPrev
            ? this.bridge(a.replicaPrev, 'replica-prev')
            : undefined,
          a.replicaNext
            ? this.bridge(a.replicaNext, 'replica-next')
            : undefined,
        ]);
        msg.args = {
          ...a,
          prev: prev as unknown as RemoteLink,
          next: next as unknown as RemoteLink,
          replicaPrev: replicaPrev as unknown as RemoteLink,
          replicaNext: replicaNext as unknown as RemoteLink,
        };
        ports.push(
          ...[prev, next, replicaPrev, replicaNext].filter(
            (x): x is MessagePort => x !== undefined,
          ),
        );
      } catch (e) {
        this.port.postMessage({
          type: 'reply',
          id: (m as { id: number }).id,
          error: { name: 'Error', message: (e as Error).message },
        });
        return;
      }
    }
    if (!this.ended)
      this.worker.postMessage(msg, [...ports, ...ownedBuffers(msg)]);
  }

  /**
   * A peer link bridged to a MessagePort the stage thread owns: dialled where `link` gives an
   * address (this device is that one's previous), else the link that side's device opened (or
   * opens). Rejects when the next device cannot be reached within {@link CONNECT_TIMEOUT_MS}, or
   * the previous one does not link up within {@link ACCEPT_TIMEOUT_MS}.
   */
  private async bridge(link: RemoteLink, side: PeerSide): Promise<MessagePort> {
    let peer: StreamPort;
    if ('connect' in link) {
      // this device dials its next (stage or replica): it is that one's previous
      const d = dial(
        link.connect,
        side === 'replica-next' ? 'replica-peer' : 'peer',
        this.s.o.token,
        this.s.o.tls,
      );
      // fail init at once, saying why, when the next stage cannot be reached (address, TLS)
      await ready(d.client, link.connect, this.s.o.tls);
      peer = d.port;
    } else {
      peer = this.s.pendingPeer[side] ?? (await acceptedPeer(this.s, side));
      delete this.s.pendingPeer[side];
    }
    this.peers.push(peer);
    return bridgeToPort(peer, side, () => !this.ended);
  }
}

/**
 * Resolves when `client` is connected to the next stage's device at `address`; rejects after
 * {@link CONNECT_TIMEOUT_MS} with an Error saying why (and, with TLS, what the workers need).
 */
function ready(
  client: grpc.Client,
  address: string,
  tls: TlsFiles | undefined,
): Promise<void> {
  return new Promise<void>((resolve, reject) =>
    client.waitForReady(Date.now() + CONNECT_TIMEOUT_MS, (e) =>
      e
        ? reject(
            new Error(
              `cannot link to the next stage's device at ${address}: ${e.message}${tls ? " (with TLS: the workers need --tls-ca, the CA that signed each other's certificates)" : ''}`,
            ),
          )
        : resolve(),
    ),
  );
}

/**
 * The link the device on `side` opens to this one (see {@link acceptLink}); rejects with an
 * Error when none arrives within {@link ACCEPT_TIMEOUT_MS}.
 */
function acceptedPeer(s: ServerState, side: PeerSide): Promise<StreamPort> {
  return new Promise<StreamPort>((resolve, reject) => {
    const timer = setTimeout(() => {
      delete s.peerWaiter[side];
      reject(
        new Error(
          `the ${side.endsWith('prev') ? 'previous' : 'next'} ${side.startsWith('replica') ? 'replica' : 'stage'} did not link up within ${ACCEPT_TIMEOUT_MS / 1000} s`,
        ),
      );
    }, ACCEPT_TIMEOUT_MS);
    s.peerWaiter[side] = (p) => {
      clearTimeout(timer);
      delete s.peerWaiter[side];
      resolve(p);
    };
  });
}

/** The server's credentials: TLS where a certificate and key are given, else none. */
function credentialsOf(tls: TlsFiles | undefined): grpc.ServerCredentials {
  return tls?.cert && tls.key
    ? grpc.ServerCredentials.createSsl(
        tls.ca ?? null,
        [{ cert_chain: tls.cert, private_key: tls.key }],
        tls.requireClientCert === true,
      )
    : grpc.ServerCredentials.createInsecure();
}

/** HOST:PORT, an IPv6 host in brackets. */
function hostPort(host: string, port: number): string {
  return host.includes(':') ? `[${host}]:${port}` : `${host}:${port}`;
}

/**
 * Starts a device server. Resolves once it listens.
 * @throws Error when the address cannot be bound (in use, not an interface of this host).
 */
export async function startDeviceServer(
  o: DeviceServerOptions,
): Promise<DeviceServer> {
  const log = o.log ?? (() => undefined);
  const server = new grpc.Server(LINK_OPTIONS);
  let finish!: () => void;
  const done = new Promise<void>((r) => (finish = r));
  const close = async () => {
    await new Promise<void>((r) => server.tryShutdown(() => r()));
    finish();
  };
  const state: ServerState = {
    o,
    log,
    busy: false,
    peerWaiter: {},
    pendingPeer: {},
    close,
  };
  server.addService(DEVICE_SERVICE, {
    link(call: grpc.ServerDuplexStream<Buffer, Buffer>) {
      acceptLink(state, call);
    },
  });
  const host = o.host ?? '127.0.0.1';
  const creds = credentialsOf(o.tls);
  const port = await new Promise<number>((resolve, reject) =>
    server.bindAsync(hostPort(host, o.port), creds, (e, p) =>
      e ? reject(e) : resolve(p),
    ),
  );
  return { address: hostPort(host, port), done, close };
}
