/**
 * The transport between processes and hosts: one gRPC bidirectional stream per link
 * (@grpc/grpc-js; no .proto: frames are raw bytes). A {@link Channel} runs over it unchanged:
 * {@link StreamPort} gives a stream the `postMessage` / `on('message')` shape of a worker
 * thread's port. A message is encoded with Node's structured serializer (v8.serialize: plain
 * objects, numbers, strings and typed arrays, tensors as their raw bytes), cut into frames of
 * at most {@link FRAME_BYTES}, and written with backpressure: when the stream's buffer is full,
 * later frames wait for 'drain' in order.
 *
 * Every link carries metadata: the run's shared token, layerwise's version and the link's role
 * ('control': the coordinator's request/reply link to a device; 'peer' and 'next-peer': a
 * stage's link to its neighbour stage, see {@link LinkRole}). Keepalive pings every second, answered
 * within {@link KEEPALIVE_TIMEOUT_MS}, turn a dead host or a cut network into an error within
 * seconds, never a hang.
 */

import { createRequire } from 'node:module';
import { deserialize, serialize } from 'node:v8';
import { MessageChannel, type MessagePort } from 'node:worker_threads';
import * as grpc from '@grpc/grpc-js';
import { ownedBuffers, type PortLike } from './channel.js';

/** layerwise's version (package.json), which a device and its coordinator must share. */
export const VERSION: string = (
  createRequire(import.meta.url)('../../package.json') as { version: string }
).version;

/** Largest frame, bytes (gRPC's default receive limit is 4 MiB). */
export const FRAME_BYTES = 1 << 20;
/** A link whose peer does not answer a keepalive ping within this many ms fails. */
export const KEEPALIVE_TIMEOUT_MS = 3000;

const passBuffer = {
  serialize: (b: Buffer) => b,
  deserialize: (b: Buffer) => b,
};

/** The device service: one bidirectional stream of byte frames per link. */
export const DEVICE_SERVICE: grpc.ServiceDefinition = {
  link: {
    path: '/layerwise.Device/Link',
    requestStream: true,
    responseStream: true,
    requestSerialize: passBuffer.serialize,
    requestDeserialize: passBuffer.deserialize,
    responseSerialize: passBuffer.serialize,
    responseDeserialize: passBuffer.deserialize,
  },
};

/** Channel options of both ends: keepalive so that a silent peer fails the link in seconds. */
export const LINK_OPTIONS: grpc.ChannelOptions = {
  'grpc.keepalive_time_ms': 1000,
  'grpc.keepalive_timeout_ms': KEEPALIVE_TIMEOUT_MS,
  'grpc.keepalive_permit_without_calls': 1,
  'grpc.http2.min_ping_interval_without_data_ms': 500,
  'grpc.max_receive_message_length': FRAME_BYTES + 64,
  'grpc.max_send_message_length': FRAME_BYTES + 64,
};

/** The duplex stream of a link, client or server side. */
type LinkStream =
  | grpc.ClientDuplexStream<Buffer, Buffer>
  | grpc.ServerDuplexStream<Buffer, Buffer>;

const MORE = 0;
const LAST = 1;

/**
 * A gRPC link stream as a port a {@link Channel} can wrap. Messages are copied (there is no
 * transfer across processes). `onClose` hears once when the stream ends or fails, with why.
 */
export class StreamPort implements PortLike {
  private readonly listeners: Array<(v: unknown) => void> = [];
  private readonly closers: Array<(why: Error) => void> = [];
  private readonly parts: Buffer[] = [];
  private readonly pending: Buffer[] = [];
  private waiting = false;
  private closedWith: Error | null = null;
  /** Bytes sent and received (frame payloads), for the transport benchmark. */
  bytesOut = 0;
  bytesIn = 0;

  constructor(private readonly stream: LinkStream) {
    stream.on('data', (frame: Buffer) => this.receive(frame));
    stream.on('error', (e: Error) => this.close(e));
    stream.on('end', () => this.close(new Error('the peer closed the link')));
    stream.on('close', () => this.close(new Error('the link closed')));
  }

  postMessage(value: unknown): void {
    if (this.closedWith) throw this.closedWith;
    const bytes = serialize(value);
    this.bytesOut += bytes.length;
    for (let at = 0; at < bytes.length || at === 0; at += FRAME_BYTES) {
      const end = Math.min(bytes.length, at + FRAME_BYTES);
      const frame = Buffer.allocUnsafe(1 + end - at);
      frame[0] = end === bytes.length ? LAST : MORE;
      bytes.copy(frame, 1, at, end);
      this.pending.push(frame);
      if (end === bytes.length) break;
    }
    this.flush();
  }

  on(event: 'message', listener: (value: unknown) => void): this {
    if (event === 'message') this.listeners.push(listener);
    return this;
  }

  /** Calls `f` once when the link ends or fails (at once if it already has). */
  onClose(f: (why: Error) => void): void {
    if (this.closedWith) f(this.closedWith);
    else this.closers.push(f);
  }

  /**
   * After the link closed: what a later {@link postMessage} throws instead of the transport's
   * own error (the owner's explanation of the failure, e.g. a device that cannot be reached).
   */
  failWith(e: Error): void {
    if (this.closedWith) this.closedWith = e;
  }

  /** Ends the link from this side. */
  end(): void {
    if (this.closedWith) return;
    this.close(new Error('the link was closed by this side'));
    try {
      this.stream.end();
    } catch {
      // already gone
    }
  }

  private flush(): void {
    while (!this.waiting && this.pending.length) {
      const f = this.pending.shift()!;
      if (!this.stream.write(f)) {
        this.waiting = true;
        this.stream.once('drain', () => {
          this.waiting = false;
          this.flush();
        });
      }
    }
  }

  private receive(frame: Buffer): void {
    this.parts.push(frame.subarray(1));
    if (frame[0] !== LAST) return;
    const whole =
      this.parts.length === 1 ? this.parts[0]! : Buffer.concat(this.parts);
    this.parts.length = 0;
    this.bytesIn += whole.length;
    const value = deserialize(whole);
    for (const l of this.listeners) l(value);
  }

  private close(why: Error): void {
    if (this.closedWith) return;
    this.closedWith = why;
    for (const f of this.closers.splice(0)) f(why);
  }
}

/** Credentials of a link: TLS where the user gives certificates, else plain (loopback, trusted networks). */
export interface TlsFiles {
  /** PEM certificate authority that signed the peer's certificate (default: the system's). */
  ca?: Buffer;
  /** PEM certificate and key of this end. */
  cert?: Buffer;
  key?: Buffer;
  /** A server: accept only clients presenting a certificate `ca` signed. */
  requireClientCert?: boolean;
}

/**
 * The role of a link, sent in its metadata: 'control', the coordinator's; 'peer', the previous
 * stage's link to the device it dials; 'next-peer', the next stage's link to the device it
 * dials (a coordinator's, for a worker-thread device after a device server: see
 * remote-device.ts `bridgedLink`); 'replica-peer' and 'replica-next-peer' the same in the
 * ring of a stage's data-parallel replicas.
 */
export type LinkRole =
  | 'control'
  | 'peer'
  | 'next-peer'
  | 'replica-peer'
  | 'replica-next-peer';

/** Which link of a stage's device: to its neighbour stages, or in the ring of its replicas. */
export type PeerSide = 'prev' | 'next' | 'replica-prev' | 'replica-next';

/** The role a dialler presents so that the dialled device takes the link as its `side`. */
export function roleFor(side: PeerSide): LinkRole {
  return side === 'prev'
    ? 'peer'
    : side === 'next'
      ? 'next-peer'
      : side === 'replica-prev'
        ? 'replica-peer'
        : 'replica-next-peer';
}

/** The side a dialled device takes a link of `role` as (null: not a peer link). */
export function sideOf(role: string): PeerSide | null {
  return role === 'peer'
    ? 'prev'
    : role === 'next-peer'
      ? 'next'
      : role === 'replica-peer'
        ? 'replica-prev'
        : role === 'replica-next-peer'
          ? 'replica-next'
          : null;
}

/**
 * A peer link bridged to a MessagePort, for a stage thread that speaks MessagePorts: the link's
 * messages go to the port (their typed arrays' buffers moved, not copied) and the port's to the
 * link. When the link ends while `live()`, the port hears `{type: 'link-lost', side, why}`,
 * which runtime/worker.ts turns into a failed channel naming the `side` stage. Returns the
 * port to hand to the stage thread.
 */
export function bridgeToPort(
  peer: StreamPort,
  side: PeerSide,
  live: () => boolean = () => true,
): MessagePort {
  const { port1, port2 } = new MessageChannel();
  peer.on('message', (m) => port1.postMessage(m, ownedBuffers(m)));
  port1.on('message', (m) => {
    try {
      peer.postMessage(m);
    } catch {
      // the link is gone: the stage hears of it through 'link-lost'
    }
  });
  peer.onClose((why) => {
    if (live())
      port1.postMessage({ type: 'link-lost', side, why: why.message });
    port1.close();
  });
  return port2;
}

/**
 * Opens a link to the device server at `address` (HOST:PORT) in `role`, presenting `token`
 * and `version` (this layerwise's; tests present others).
 * The returned port fails (onClose) if the server refuses the link (wrong token or version:
 * the error carries the server's message) or the connection is lost.
 */
export function dial(
  address: string,
  role: LinkRole,
  token: string,
  tls?: TlsFiles,
  version = VERSION,
): { port: StreamPort; client: grpc.Client } {
  const creds =
    tls?.ca || tls?.cert
      ? grpc.credentials.createSsl(
          tls.ca ?? null,
          tls.key ?? null,
          tls.cert ?? null,
        )
      : grpc.credentials.createInsecure();
  const Client = grpc.makeGenericClientConstructor(DEVICE_SERVICE, 'Device');
  const client = new Client(address, creds, LINK_OPTIONS);
  const md = new grpc.Metadata();
  md.set('layerwise-token', token);
  md.set('layerwise-version', version);
  md.set('layerwise-role', role);
  const stream = (
    client as unknown as {
      link(md: grpc.Metadata): grpc.ClientDuplexStream<Buffer, Buffer>;
    }
  ).link(md);
  return { port: new StreamPort(stream), client };
}
