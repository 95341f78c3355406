/**
 * Which device runs each stage (`--devices`): a worker thread of this process (`thread`, the
 * default), a process this coordinator spawns on this host (`process`, optionally with its own
 * backend, threads and environment: `process:backend=wasm+threads=1+CUDA_VISIBLE_DEVICES=1`),
 * or a device server another host runs (`HOST:PORT`, started there with `layerwise worker
 * --listen`; its own backend and threads: `HOST:PORT/backend=native+threads=8`), or a browser
 * tab that opens the page this coordinator serves (`browser`, `browser:backend=webgpu`; see
 * runtime/browser-device.ts).
 * One list may mix threads, processes and hosts; browser tabs mix with threads. Schedules,
 * stages, the executor and the strategies are the same on every kind; only the channel's
 * transport differs (runtime/links.ts: MessagePorts between threads, relayed over a WebSocket
 * for a tab, gRPC links between processes, bridged to a MessagePort for a thread).
 */

import { readFileSync } from 'node:fs';
import { BACKENDS } from '../backend/names.js';
import { check, LayerwiseError } from '../util/errors.js';
import { type Device, StageWorker } from './device.js';
import type { TlsFiles } from './grpc-link.js';
import {
  allowedCpus,
  type PinningInput,
  processPinning,
  threadPinning,
} from './pinning.js';
import {
  newRunToken,
  RemoteDevice,
  spawnDeviceProcess,
} from './remote-device.js';

/** Per-device choices that override the run's (`backend=wasm+threads=2`). */
export interface DeviceOptions {
  backend?: string;
  threads?: number;
}

/** One device of a run. */
export type DeviceSpec =
  | ({ kind: 'thread' } & DeviceOptions)
  | ({ kind: 'process'; env: Record<string, string> } & DeviceOptions)
  | ({ kind: 'host'; address: string } & DeviceOptions)
  | ({ kind: 'browser' } & DeviceOptions);

/** `backend=...`, `threads=...` and (processes) NAME=VALUE environment pairs joined by '+'. */
function parseSettings(
  d: string,
  text: string,
  envAllowed: boolean,
): DeviceOptions & { env: Record<string, string> } {
  const out: DeviceOptions & { env: Record<string, string> } = { env: {} };
  for (const kv of text.split('+').filter((x) => x !== '')) {
    const eq = kv.indexOf('=');
    check(
      eq > 0,
      `--devices entry '${d}': settings are KEY=VALUE pairs joined by '+', e.g. process:backend=wasm+threads=1+CUDA_VISIBLE_DEVICES=1`,
    );
    const [k, v] = [kv.slice(0, eq), kv.slice(eq + 1)];
    if (k === 'backend') {
      check(
        (BACKENDS as readonly string[]).includes(v),
        `--devices entry '${d}': unknown backend '${v}'; valid: ${BACKENDS.join(', ')}`,
      );
      out.backend = v;
    } else if (k === 'threads') {
      check(
        /^[1-9]\d*$/.test(v),
        `--devices entry '${d}': threads must be a positive integer, got '${v}'`,
      );
      out.threads = Number(v);
    } else {
      check(
        envAllowed && /^[A-Z_][A-Z0-9_]*$/.test(k),
        `--devices entry '${d}': '${k}' is not backend, threads${envAllowed ? ' or an environment variable (NAME in capitals)' : ''}`,
      );
      out.env[k] = v;
    }
  }
  return out;
}

/**
 * Parses `--devices` for `stages` devices times `replicas` (data parallelism: replica after
 * replica): a comma-separated list of `thread[:threads=N+backend=...]`, `process[:ENV=V+...]`,
 * `HOST:PORT` or `browser[:backend=...]`, one per device (a single entry is repeated for every
 * device). A device's own `threads=` sets its kernel threads, e.g. more for a device whose
 * stages hold more of the model (a V-shape's first device holds the embedding and the head).
 * @throws LayerwiseError naming the entry that is none of these, or a count that is not stages x replicas.
 */
export function parseDevices(
  spec: string | undefined,
  stages: number,
  replicas = 1,
): DeviceSpec[] {
  const k = stages * replicas;
  if (spec === undefined || spec.trim() === '')
    return Array.from({ length: k }, () => ({ kind: 'thread' as const }));
  const items = spec.split(',').map((s) => s.trim());
  const list =
    items.length === 1 ? Array.from({ length: k }, () => items[0]!) : items;
  check(
    list.length === k,
    replicas > 1
      ? `--devices lists ${list.length} devices but the run has ${replicas} replicas of ${stages} stage(s), ${k} devices; give one per device, replica after replica (or one for all)`
      : `--devices lists ${list.length} devices but the run has ${k} stages; give one per stage (or one for all)`,
  );
  return list.map((d): DeviceSpec => {
    if (d === 'thread' || d.startsWith('thread:')) {
      const { env: _env, ...o } = parseSettings(
        d,
        d === 'thread' ? '' : d.slice('thread:'.length),
        false,
      );
      return { kind: 'thread', ...o };
    }
    if (d === 'browser' || d.startsWith('browser:')) {
      const { env: _env, ...o } = parseSettings(
        d,
        d === 'browser' ? '' : d.slice('browser:'.length),
        false,
      );
      return { kind: 'browser', ...o };
    }
    if (d === 'process' || d.startsWith('process:')) {
      const { env, ...o } = parseSettings(
        d,
        d === 'process' ? '' : d.slice('process:'.length),
        true,
      );
      return { kind: 'process', env, ...o };
    }
    const slash = d.indexOf('/');
    const address = slash < 0 ? d : d.slice(0, slash);
    const m = /^(\[[0-9a-fA-F:.]+\]|[A-Za-z0-9.-]+):(\d{1,5})$/.exec(address);
    check(
      m !== null && Number(m[2]) > 0 && Number(m[2]) < 65536,
      `--devices entry '${d}' is not thread, process or HOST:PORT (a device started with layerwise worker --listen HOST:PORT), nor browser (a browser tab)`,
    );
    const { env: _env, ...o } = parseSettings(
      d,
      slash < 0 ? '' : d.slice(slash + 1),
      false,
    );
    return { kind: 'host', address, ...o };
  });
}

/**
 * Starts or connects the devices (runtime/links.ts links neighbours whatever they are).
 * `token`: the run's shared token; for `HOST:PORT` devices it must be the one their workers
 * were started with (LAYERWISE_TOKEN); spawned processes get a fresh one when it is undefined.
 * @throws LayerwiseError for a remote host without a token, or browser tabs mixed with
 * processes or hosts, or a LAYERWISE_PIN that is not 0 or 1.
 * `threads`: the run's kernel threads per device (a device's `threads=` overrides it); with
 * it, the devices on this host (worker threads and processes) get CPUs of their own
 * (runtime/pinning.ts): a process through its OpenMP environment, a thread by binding its team.
 */
export async function openDevices(
  specs: readonly DeviceSpec[],
  token = process.env.LAYERWISE_TOKEN,
  threads?: number,
): Promise<Device[]> {
  if (specs.every((s) => s.kind === 'thread')) {
    const cpus = threadPinning(pinningInput(specs, threads));
    return specs.map((_, i) => new StageWorker(i, cpus[i]));
  }
  if (specs.some((s) => s.kind === 'browser')) {
    check(
      specs.every((s) => s.kind === 'thread' || s.kind === 'browser'),
      '--devices mixes browser with process or HOST:PORT devices; a browser tab links to threads and other tabs through this coordinator: use thread or browser for every stage',
    );
    return openBrowserDevices(specs, token ?? newRunToken());
  }
  const hosts = specs.some((s) => s.kind === 'host');
  if (hosts && !token)
    throw new LayerwiseError(
      '--devices names other hosts but LAYERWISE_TOKEN is not set; set it to the token the workers were started with',
    );
  const runToken = token ?? newRunToken();
  const tls = tlsFromEnv();
  const input = pinningInput(specs, threads);
  const pinned = processPinning(input);
  const cpus = threadPinning(input);
  const opened = await Promise.allSettled(
    specs.map(
      (s, i): Promise<Device> =>
        s.kind === 'thread'
          ? Promise.resolve(new StageWorker(i, cpus[i]))
          : s.kind === 'process'
            ? spawnDeviceProcess(i, runToken, { ...s.env, ...pinned[i] })
            : s.kind === 'host'
              ? Promise.resolve(
                  new RemoteDevice(i, s.address, runToken, undefined, tls),
                )
              : Promise.reject(new Error(`device ${i}: ${s.kind} here`)),
    ),
  );
  const failed = opened.find((r) => r.status === 'rejected');
  if (failed) {
    await Promise.all(
      opened.map((r) =>
        r.status === 'fulfilled' ? r.value.terminate() : undefined,
      ),
    );
    throw (failed as PromiseRejectedResult).reason;
  }
  return opened.map((r) => (r as PromiseFulfilledResult<Device>).value);
}

/**
 * What runtime/pinning.ts places the devices from: each device's kind, own environment and
 * kernel threads (its own `threads=`, else `threads`), the coordinator's environment and the
 * CPUs this process may use. No CPUs (nothing pinned) when a device's threads are unknown
 * (neither `threads` nor its own `threads=`).
 */
function pinningInput(
  specs: readonly DeviceSpec[],
  threads: number | undefined,
): PinningInput {
  const each = specs.map((s) => s.threads ?? threads);
  const known = each.every((t) => t !== undefined);
  return {
    devices: specs.map((s, i) => ({
      kind: s.kind,
      env: s.kind === 'process' ? s.env : undefined,
      threads: each[i] ?? 1,
    })),
    env: process.env,
    cpus: known ? allowedCpus() : undefined,
  };
}

/**
 * Starts the thread devices and serves the page for the browser ones: prints the URL to open
 * (on stderr) and waits for one tab per browser stage.
 * @throws StageError when a tab does not come in time (see BrowserHub.device).
 */
async function openBrowserDevices(
  specs: readonly DeviceSpec[],
  token: string,
): Promise<Device[]> {
  const { BrowserHub } = await import('./browser-device.js');
  const hub = await BrowserHub.get(token);
  const browsers = specs.flatMap((s, i) => (s.kind === 'browser' ? [i] : []));
  process.stderr.write(
    `layerwise: stage${browsers.length > 1 ? 's' : ''} ${browsers.join(', ')} run${browsers.length > 1 ? '' : 's'} in a browser tab: open ${hub.url}${browsers.length > 1 ? ` in ${browsers.length} tabs` : ''} (waiting)\n`,
  );
  const devices: Device[] = [];
  try {
    for (const [i, s] of specs.entries())
      devices.push(
        s.kind === 'thread' ? new StageWorker(i) : await hub.device(i),
      );
    return devices;
  } catch (e) {
    await Promise.all(devices.map((d) => d.terminate()));
    throw e;
  }
}

/**
 * TLS for links to other hosts' workers, from the environment: LAYERWISE_TLS_CA (the PEM CA
 * that signed the workers' certificates) and, for workers that check clients,
 * LAYERWISE_TLS_CERT and LAYERWISE_TLS_KEY. Undefined without LAYERWISE_TLS_CA.
 */
function tlsFromEnv(): TlsFiles | undefined {
  const read = (name: string): Buffer | undefined => {
    const path = process.env[name];
    if (!path) return undefined;
    try {
      return readFileSync(path);
    } catch (e) {
      throw new LayerwiseError(
        `${name}=${path} cannot be read (${(e as Error).message.split('\n')[0]}); point it at a PEM file`,
      );
    }
  };
  const ca = read('LAYERWISE_TLS_CA');
  return ca
    ? { ca, cert: read('LAYERWISE_TLS_CERT'), key: read('LAYERWISE_TLS_KEY') }
    : undefined;
}
