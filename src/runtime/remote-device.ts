/**
 * The coordinator's handle on a device in another process: a device server
 * (runtime/device-server.ts) it reaches over gRPC, either a process it spawned on this host
 * ({@link spawnDeviceProcess}) or `layerwise worker --listen` on another host. Requests and
 * replies are those of a worker thread (runtime/device.ts). A device process that dies, or a
 * link that stops answering keepalive pings, fails every pending call with a {@link StageError}
 * naming the stage and where it ran, within seconds.
 */
import { type ChildProcess, spawn } from 'node:child_process';
import { randomBytes } from 'node:crypto';
import { createInterface } from 'node:readline';
import { fileURLToPath } from 'node:url';
import type { MessagePort } from 'node:worker_threads';
import type * as grpc from '@grpc/grpc-js';
import { Channel } from './channel.js';
import { Device, StageError } from './device.js';
import {
  bridgeToPort,
  dial,
  type PeerSide,
  roleFor,
  type StreamPort,
  type TlsFiles,
} from './grpc-link.js';

/** A fresh random token for the devices a coordinator spawns itself. */
export const newRunToken = (): string => randomBytes(24).toString('base64url');

export class RemoteDevice extends Device {
  protected readonly ch: Channel;
  private readonly port: StreamPort;
  private readonly client: grpc.Client;
  /** Links this coordinator opened to the device on a worker-thread neighbour's behalf. */
  private readonly bridged: Array<{ port: StreamPort; client: grpc.Client }> =
    [];
  readonly where: string;

  /**
   * Connects to the device server at `address` (HOST:PORT) as stage `index`'s coordinator.
   * `child`: the process behind it, when this coordinator spawned it (killed on terminate).
   */
  constructor(
    index: number,
    readonly address: string,
    private readonly token: string,
    private readonly child?: ChildProcess,
    private readonly tls?: TlsFiles,
  ) {
    super(index);
    this.where = child
      ? `process ${child.pid} at ${address}`
      : `host ${address}`;
    const { port, client } = dial(address, 'control', token, tls);
    this.port = port;
    this.client = client;
    this.ch = new Channel(port);
    port.onClose((why) => {
      if (this.closed) return;
      // refused, or never reachable: the user's setup (token, version, address), not a lost device
      const refused =
        /UNAUTHENTICATED|FAILED_PRECONDITION|RESOURCE_EXHAUSTED/.test(
          why.message,
        );
      if (refused || (!this.answered && /UNAVAILABLE/.test(why.message))) {
        const fix = refused
          ? ''
          : `; start one there with layerwise worker --listen ${address}, or fix the address in --devices`;
        const what = refused
          ? why.message.replace(/^\d+ [A-Z_]+: /, '')
          : `no layerwise worker answers at ${address}`;
        const err = new StageError(
          index,
          `device ${this.where} refused the run: ${what}${fix}`,
          'LayerwiseError',
        );
        this.port.failWith(err); // a request sent later (the init of a mixed pipeline) says so too
        this.ch.fail(err);
      } else {
        const err = new StageError(
          index,
          `device ${this.where} is gone: ${why.message}`,
        );
        this.port.failWith(err);
        this.ch.fail(err);
      }
    });
    child?.on('exit', (code, signal) => {
      if (!this.closed)
        this.ch.fail(
          new StageError(
            index,
            `device ${this.where} exited (${signal ?? `code ${code}`})`,
          ),
        );
    });
  }

  /**
   * A link to this device's stage for its neighbour on `side` when that neighbour is a worker
   * thread of this process, which has no server to accept a link and speaks MessagePorts: this
   * coordinator dials the device in the neighbour's place and bridges the link to the
   * MessagePort it returns, for the thread's init. The device's init must accept on `side`
   * (`{ accept: true }`). The link closes with this device.
   */
  bridgedLink(side: PeerSide): MessagePort {
    const d = dial(this.address, roleFor(side), this.token, this.tls);
    this.bridged.push(d);
    // the thread's side: this device is its next stage when the thread is this one's previous
    const theirs: Record<PeerSide, PeerSide> = {
      prev: 'next',
      next: 'prev',
      'replica-prev': 'replica-next',
      'replica-next': 'replica-prev',
    };
    return bridgeToPort(d.port, theirs[side], () => !this.closed);
  }

  async terminate(): Promise<void> {
    if (!this.closed)
      this.ch.fail(new StageError(this.index, 'device was stopped'));
    this.closed = true;
    for (const b of this.bridged.splice(0)) {
      b.port.end();
      b.client.close();
    }
    this.port.end();
    this.client.close();
    if (
      this.child &&
      this.child.exitCode === null &&
      this.child.signalCode === null
    ) {
      const gone = new Promise<void>((r) =>
        this.child!.once('exit', () => r()),
      );
      this.child.kill('SIGTERM');
      const t = setTimeout(() => this.child!.kill('SIGKILL'), 2000);
      await gone;
      clearTimeout(t);
    }
  }
}

/** Every device process this coordinator spawned and has not seen exit: killed if it exits first. */
const children = new Set<ChildProcess>();
process.once('exit', () => {
  for (const c of children) c.kill('SIGKILL');
});

/**
 * Spawns a device process on this host (runtime/device-process.ts) for stage `index` and
 * connects to it. `env`: extra environment (e.g. CUDA_VISIBLE_DEVICES).
 * @throws StageError when the process fails to start or to listen within 30 s.
 */
export async function spawnDeviceProcess(
  index: number,
  token: string,
  env: Record<string, string> = {},
): Promise<RemoteDevice> {
  const entry = fileURLToPath(new URL('./device-process.js', import.meta.url));
  const child = spawn(process.execPath, [entry], {
    env: { ...process.env, ...env, LAYERWISE_TOKEN: token },
    stdio: ['ignore', 'pipe', 'inherit'],
    // its own process group: a Ctrl-C in the terminal reaches only the coordinator, which
    // stops the run in order (the resume line, the lock released) and then these processes
    // (killed when it exits; they exit by themselves once it is gone)
    detached: true,
  });
  children.add(child);
  child.once('exit', () => children.delete(child));
  const address = await new Promise<string>((resolve, reject) => {
    const timer = setTimeout(
      () =>
        reject(
          new StageError(
            index,
            'device process did not start listening within 30 s',
          ),
        ),
      30_000,
    );
    const lines = createInterface({ input: child.stdout! });
    lines.once('line', (l) => {
      clearTimeout(timer);
      const m = /listening on (\S+)/.exec(l);
      if (m) resolve(m[1]!);
      else
        reject(
          new StageError(
            index,
            `device process said '${l}' instead of its address`,
          ),
        );
    });
    child.once('exit', (code, signal) => {
      clearTimeout(timer);
      reject(
        new StageError(
          index,
          `device process exited before listening (${signal ?? `code ${code}`})`,
        ),
      );
    });
  });
  return new RemoteDevice(index, address, token, child);
}
