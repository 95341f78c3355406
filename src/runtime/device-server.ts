/**
 * A device in its own process, on this host or another: a gRPC server (`layerwise worker
 * --listen HOST:PORT`) that one coordinator at a time drives. The coordinator opens a 'control'
 * link and sends the same requests a worker thread gets (runtime/stage-host.ts); the previous
 * stage's device opens a 'peer' link for activations and gradients. A link that does not
 * present the run's shared token, or comes from another layerwise version, is refused: a device
 * runs the model code it is sent, so an open port must not accept strangers. Binds to loopback
 * unless given another host; TLS where certificates are given.
 */
import * as grpc from '@grpc/grpc-js';
import { timingSafeEqual } from 'node:crypto';
import { Channel } from './channel.js';
import { DEVICE_SERVICE, LINK_OPTIONS, StreamPort, VERSION, dial, type TlsFiles } from './grpc-link.js';
import { serveStage } from './stage-host.js';

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

/** How long a device waits for its previous stage to link up after init, ms. */
const ACCEPT_TIMEOUT_MS = 30_000;

/**
 * Starts a device server. Resolves once it listens.
 * @throws Error when the address cannot be bound (in use, not an interface of this host).
 */
export async function startDeviceServer(o: DeviceServerOptions): Promise<DeviceServer> {
  const log = o.log ?? (() => undefined);
  const server = new grpc.Server(LINK_OPTIONS);
  let busy = false;
  let peerWaiter: ((ch: Channel) => void) | null = null;
  let pendingPeer: Channel | null = null;
  let finish!: () => void;
  const done = new Promise<void>((r) => (finish = r));
  const close = async () => {
    await new Promise<void>((r) => server.tryShutdown(() => r()));
    finish();
  };

  const refuse = (call: grpc.ServerDuplexStream<Buffer, Buffer>, code: grpc.status, details: string) => {
    log(`refused a link: ${details}`);
    call.emit('error', { code, details, metadata: new grpc.Metadata() });
  };

  const peerChannel = (port: StreamPort, what: string): Channel => {
    const ch = new Channel(port);
    port.onClose((why) => ch.fail(new Error(`the link to the ${what} stage was lost: ${why.message}`)));
    return ch;
  };

  server.addService(DEVICE_SERVICE, {
    link(call: grpc.ServerDuplexStream<Buffer, Buffer>) {
      const md = call.metadata;
      const token = String(md.get('layerwise-token')[0] ?? '');
      const version = String(md.get('layerwise-version')[0] ?? '');
      const role = String(md.get('layerwise-role')[0] ?? '');
      if (!sameToken(token, o.token)) return refuse(call, grpc.status.UNAUTHENTICATED, 'wrong token: the coordinator and every device need the same LAYERWISE_TOKEN');
      if (version !== VERSION) return refuse(call, grpc.status.FAILED_PRECONDITION, `version mismatch: this device runs layerwise ${VERSION}, the peer ${version || 'an unknown version'}; run the same version everywhere`);
      const port = new StreamPort(call);
      if (role === 'peer') {
        const ch = peerChannel(port, 'previous');
        if (peerWaiter) peerWaiter(ch);
        else pendingPeer = ch;
        return;
      }
      if (role !== 'control') return refuse(call, grpc.status.INVALID_ARGUMENT, `unknown link role '${role}'`);
      if (busy) return refuse(call, grpc.status.RESOURCE_EXHAUSTED, 'this device is busy with another coordinator');
      busy = true;
      log(`coordinator connected from ${call.getPeer()}`);
      const main = new Channel(port);
      port.onClose((why) => main.fail(new Error(`the coordinator's link was lost: ${why.message}`)));
      const links: StreamPort[] = [];
      void serveStage(main, async (link, side) => {
        if ('connect' in link) {
          const { port: p } = dial(link.connect, 'peer', o.token, o.tls);
          links.push(p);
          return peerChannel(p, side === 'next' ? 'next' : 'previous');
        }
        if (!('accept' in link)) throw new Error(`a process device cannot use a MessagePort for its ${side} stage`);
        if (pendingPeer) {
          const ch = pendingPeer;
          pendingPeer = null;
          return ch;
        }
        return new Promise<Channel>((resolve, reject) => {
          const timer = setTimeout(() => {
            peerWaiter = null;
            reject(new Error(`the previous stage did not link up within ${ACCEPT_TIMEOUT_MS / 1000} s`));
          }, ACCEPT_TIMEOUT_MS);
          peerWaiter = (ch) => {
            clearTimeout(timer);
            peerWaiter = null;
            resolve(ch);
          };
        });
      }).then(() => {
        for (const l of links) l.end();
        port.end();
        busy = false;
        pendingPeer = null;
        log('coordinator gone; run ended');
        if (o.once) void close();
      });
    },
  });

  const host = o.host ?? '127.0.0.1';
  const creds = o.tls?.cert && o.tls.key
    ? grpc.ServerCredentials.createSsl(o.tls.ca ?? null, [{ cert_chain: o.tls.cert, private_key: o.tls.key }], o.tls.ca !== undefined)
    : grpc.ServerCredentials.createInsecure();
  const hostPort = host.includes(':') ? `[${host}]:${o.port}` : `${host}:${o.port}`;
  const port = await new Promise<number>((resolve, reject) => server.bindAsync(hostPort, creds, (e, p) => (e ? reject(e) : resolve(p))));
  return { address: host.includes(':') ? `[${host}]:${port}` : `${host}:${port}`, done, close };
}
