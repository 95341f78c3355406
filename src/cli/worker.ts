/**
 * `layerwise worker --listen [HOST:]PORT`: a device server (runtime/device-server.ts) for
 * coordinators on other hosts. It accepts only links that present LAYERWISE_TOKEN and come
 * from the same layerwise version, serves one run at a time, and runs until interrupted.
 */
import { readFileSync } from 'node:fs';
import { startDeviceServer } from '../runtime/device-server.js';
import { check, LayerwiseError } from '../util/errors.js';

/** Options of {@link runWorker}, as the CLI parses them. */
export interface WorkerOptions {
  listen: string;
  tlsCert?: string;
  tlsKey?: string;
  tlsCa?: string;
  tlsClientAuth?: boolean;
}

function readPem(path: string | undefined, flag: string): Buffer | undefined {
  if (path === undefined) return undefined;
  try {
    return readFileSync(path);
  } catch (e) {
    throw new LayerwiseError(
      `${flag} ${path} cannot be read (${(e as Error).message.split('\n')[0]}); give a PEM file`,
    );
  }
}

/**
 * Starts the worker and resolves when it stops (SIGINT/SIGTERM).
 * @throws LayerwiseError for a bad --listen, a missing token or unreadable TLS files, or an address that cannot be bound.
 */
export async function runWorker(o: WorkerOptions): Promise<void> {
  const m = /^(?:(\[[0-9a-fA-F:.]+\]|[A-Za-z0-9.-]+):)?(\d{1,5})$/.exec(
    o.listen,
  );
  check(
    m !== null && Number(m[2]) < 65536,
    `--listen ${o.listen} is not [HOST:]PORT, e.g. 7070 or 0.0.0.0:7070`,
  );
  const token = process.env.LAYERWISE_TOKEN;
  check(
    token !== undefined && token.length >= 8,
    'set LAYERWISE_TOKEN (at least 8 characters) to the token the coordinator will present: a worker runs the model code it is sent, so it accepts no one without it',
  );
  check(
    (o.tlsCert === undefined) === (o.tlsKey === undefined),
    '--tls-cert and --tls-key go together',
  );
  check(
    !o.tlsClientAuth || o.tlsCa !== undefined,
    "--tls-client-auth needs --tls-ca, the CA that signs the clients' certificates",
  );
  const tls = o.tlsCert
    ? {
        cert: readPem(o.tlsCert, '--tls-cert'),
        key: readPem(o.tlsKey, '--tls-key'),
        ca: readPem(o.tlsCa, '--tls-ca'),
        requireClientCert: o.tlsClientAuth === true,
      }
    : undefined;
  const host = m![1]?.replace(/^\[|\]$/g, '') ?? '127.0.0.1';
  let server: Awaited<ReturnType<typeof startDeviceServer>>;
  try {
    server = await startDeviceServer({
      host,
      port: Number(m![2]),
      token: token!,
      tls,
      log: (l) => console.log(`layerwise worker: ${l}`),
    });
  } catch (e) {
    throw new LayerwiseError(
      `cannot listen on ${o.listen}: ${(e as Error).message.split('\n')[0]}; pick a free port or an address of this host`,
    );
  }
  console.log(
    `layerwise worker listening on ${server.address}${tls ? ' (TLS)' : ''}; waiting for a coordinator`,
  );
  const stop = () => void server.close();
  process.once('SIGINT', stop);
  process.once('SIGTERM', stop);
  await server.done;
}
