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

/**
 * Starts a device server. Resolves once it listens.
 * @throws Error when the address cannot be bound (in use, not an interface of this host).
 */
export async function startDeviceServer(
  o: DeviceServerOptions,
): Promise<DeviceServer> {
  const log = o.log ?? (() => undefined);
  const server = new grpc.Server(LINK_OPTIONS);
  let busy = false;
  // a neighbour's (or replica's) link per side of the stage: waited for by init, or arrived before it
  type Side = PeerSide;
  const peerWaiter: Partial<Record<Side, (p: StreamPort) => void>> = {};
  const pendingPeer: Partial<Record<Side, StreamPort>> = {};
  let finish!: () => void;
  const done = new Promise<void>((r) => (finish = r));
  const close = async () => {
    await new Promise<void>((r) => server.tryShutdown(() => r()));
    finish();
  };

  const refuse = (
    call: grpc.ServerDuplexStream<Buffer, Buffer>,
    code: grpc.status,
    details: string,
  ) => {
    log(`refused a link: ${details}`);
    call.emit('error', { code, details, metadata: new grpc.Metadata() });
  };

  server.addService(DEVICE_SERVICE, {
    link(call: grpc.ServerDuplexStream<Buffer, Buffer>) {
      const md = call.metadata;
      const token = String(md.get('layerwise-token')[0] ?? '');
      const version = String(md.get('layerwise-version')[0] ?? '');
      const role = String(md.get('layerwise-role')[0] ?? '');
      if (!sameToken(token, o.token))
        return refuse(
          call,
          grpc.status.UNAUTHENTICATED,
          'wrong token: the coordinator and every device need the same LAYERWISE_TOKEN',
        );
      if (version !== VERSION)
        return refuse(
          call,
          grpc.status.FAILED_PRECONDITION,
          `version mismatch: this device runs layerwise ${VERSION}, the peer ${version || 'an unknown version'}; run the same version everywhere`,
        );
      const port = new StreamPort(call);
      const side = sideOf(role);
      if (side) {
        // 'peer': the previous stage dialled this device; 'next-peer': the next stage did (the
        // replica roles: the previous or next replica in the ring)
        const waiter = peerWaiter[side];
        if (waiter) waiter(port);
        else pendingPeer[side] = port;
        return;
      }
      if (role !== 'control')
        return refuse(
          call,
          grpc.status.INVALID_ARGUMENT,
          `unknown link role '${role}'`,
        );
      if (busy)
        return refuse(
          call,
          grpc.status.RESOURCE_EXHAUSTED,
          'this device is busy with another coordinator',
        );
      busy = true;
      log(`coordinator connected from ${call.getPeer()}`);
      const peers: StreamPort[] = [];
      const worker = new Worker(new URL('./worker.js', import.meta.url));
      let ended = false;
      const end = (why: string) => {
        if (ended) return;
        ended = true;
        void worker.terminate();
        for (const l of peers) l.end();
        port.end();
        busy = false;
        delete pendingPeer.prev;
        delete pendingPeer.next;
        log(`run ended: ${why}`);
        if (o.once) void close();
      };
      port.onClose((why) =>
        end(`the coordinator's link closed (${why.message})`),
      );
      worker.on('error', (e) => end(`the stage thread crashed: ${e.message}`));
      worker.on('exit', () => end('the stage thread exited'));
      // the stage thread's replies and messages go to the coordinator as they are
      worker.on('message', (m) => {
        if (!ended) port.postMessage(m);
      });
      // a peer link bridged to a MessagePort the stage thread owns
      const bridge = async (
        link: RemoteLink,
        side: Side,
      ): Promise<MessagePort> => {
        let peer: StreamPort;
        if ('connect' in link) {
          // this device dials its next (stage or replica): it is that one's previous
          const d = dial(
            link.connect,
            side === 'replica-next' ? 'replica-peer' : 'peer',
            o.token,
            o.tls,
          );
          // fail init at once, saying why, when the next stage cannot be reached (address, TLS)
          await new Promise<void>((resolve, reject) =>
            d.client.waitForReady(Date.now() + CONNECT_TIMEOUT_MS, (e) =>
              e
                ? reject(
                    new Error(
                      `cannot link to the next stage's device at ${link.connect}: ${e.message}${o.tls ? " (with TLS: the workers need --tls-ca, the CA that signed each other's certificates)" : ''}`,
                    ),
                  )
                : resolve(),
            ),
          );
          peer = d.port;
        } else {
          peer =
            pendingPeer[side] ??
            (await new Promise<StreamPort>((resolve, reject) => {
              const timer = setTimeout(() => {
                delete peerWaiter[side];
                reject(
                  new Error(
                    `the ${side.endsWith('prev') ? 'previous' : 'next'} ${side.startsWith('replica') ? 'replica' : 'stage'} did not link up within ${ACCEPT_TIMEOUT_MS / 1000} s`,
                  ),
                );
              }, ACCEPT_TIMEOUT_MS);
              peerWaiter[side] = (p) => {
                clearTimeout(timer);
                delete peerWaiter[side];
                resolve(p);
              };
            }));
          delete pendingPeer[side];
        }
        peers.push(peer);
        return bridgeToPort(peer, side, () => !ended);
      };
      // the coordinator's requests go to the stage thread; init's remote links become MessagePorts first
      let queue = Promise.resolve();
      port.on('message', (m) => {
        queue = queue.then(async () => {
          const msg = m as {
            type: string;
            method?: string;
            args?: {
              prev?: RemoteLink;
              next?: RemoteLink;
              replicaPrev?: RemoteLink;
              replicaNext?: RemoteLink;
            };
          };
          const ports: MessagePort[] = [];
          if (msg.type === 'request' && msg.method === 'init' && msg.args) {
            try {
              const a = msg.args;
              const [prev, next, replicaPrev, replicaNext] = await Promise.all([
                a.prev ? bridge(a.prev, 'prev') : undefined,
                a.next ? bridge(a.next, 'next') : undefined,
                a.replicaPrev
                  ? bridge(a.replicaPrev, 'replica-prev')
                  : undefined,
                a.replicaNext
                  ? bridge(a.replicaNext, 'replica-next')
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
              port.postMessage({
                type: 'reply',
                id: (m as { id: number }).id,
                error: { name: 'Error', message: (e as Error).message },
              });
              return;
            }
          }
          if (!ended) worker.postMessage(msg, [...ports, ...ownedBuffers(msg)]);
        });
      });
    },
  });

  const host = o.host ?? '127.0.0.1';
  const creds =
    o.tls?.cert && o.tls.key
      ? grpc.ServerCredentials.createSsl(
          o.tls.ca ?? null,
          [{ cert_chain: o.tls.cert, private_key: o.tls.key }],
          o.tls.requireClientCert === true,
        )
      : grpc.ServerCredentials.createInsecure();
  const hostPort = host.includes(':')
    ? `[${host}]:${o.port}`
    : `${host}:${o.port}`;
  const port = await new Promise<number>((resolve, reject) =>
    server.bindAsync(hostPort, creds, (e, p) => (e ? reject(e) : resolve(p))),
  );
  return {
    address: host.includes(':') ? `[${host}]:${port}` : `${host}:${port}`,
    done,
    close,
  };
}
