/**
 * Devices beyond one process: gpipe (K = 2, 3) and local over child processes equal the same
 * runs over worker threads, and so do lists that mix threads, processes and hosts; a device killed with SIGKILL mid-step stops the run within seconds
 * naming the stage and leaves no process behind; a device that stops answering (a cut link,
 * simulated with SIGSTOP) times out; a worker refuses a coordinator with the wrong token or
 * another version; links over TLS (test certificates made with openssl) train as threads do.
 */

import assert from 'node:assert/strict';
import { execFileSync } from 'node:child_process';
import { mkdtempSync, readFileSync, rmSync, writeFileSync } from 'node:fs';
import { tmpdir } from 'node:os';
import { join } from 'node:path';
import { test } from 'node:test';
import { resolveConfig, type TrainConfig } from '../config/config.js';
import { type Batch, makeBatcher } from '../data/batcher.js';
import { initParams } from '../model/init.js';
import { buildModel } from '../model/model.js';
import { getPreset } from '../model/presets.js';
import { Channel } from '../runtime/channel.js';
import { startDeviceServer } from '../runtime/device-server.js';
import { dial } from '../runtime/grpc-link.js';
import { maxParamDiff } from '../testing/assert-close.js';
import { tinyWhaleDataset, trainTinyLm } from '../testing/fixtures.js';
import { createStrategy } from './index.js';
import type { Strategy } from './strategy.js';

const SHAPE = { layers: 3, dModel: 32, heads: 2, context: 16 };
const ds = tinyWhaleDataset();

function setup(o: Partial<TrainConfig>) {
  const cfg = resolveConfig({
    preset: 'charlm-tiny',
    backend: 'wasm',
    batchSize: 8,
    threads: 1,
    ...SHAPE,
    ...o,
  } as Parameters<typeof resolveConfig>[0]);
  const model = buildModel(
    getPreset('charlm-tiny').make({ vocab: ds.vocab.size }, cfg),
  );
  const batcher = makeBatcher(ds, {
    batchSize: 8,
    context: SHAPE.context,
    seed: 2,
  });
  const batches: Batch[] = [batcher.next(), batcher.next(), batcher.next()];
  return { cfg, model, batches };
}

const run = (o: Partial<TrainConfig>) =>
  trainTinyLm(
    { backend: 'wasm', ...o },
    { shape: SHAPE, batchSize: 8, lrs: [3e-3, 2e-3, 1e-3] },
  );

/** The pids of the device processes this test process spawned and that are still alive. */
function devicePids(): number[] {
  try {
    const out = execFileSync(
      'pgrep',
      ['-P', String(process.pid), '-f', 'device-process.js'],
      { encoding: 'utf8' },
    );
    return out.split('\n').filter(Boolean).map(Number);
  } catch {
    return []; // pgrep exits 1 when nothing matches
  }
}

test('gpipe K=2 and K=3 (and zbv, two stages per device) and local K=2 over child processes equal the same runs over worker threads', async () => {
  const cases: Array<[string, Partial<TrainConfig>]> = [
    ['gpipe K=2', { strategy: 'gpipe', stages: 2, microBatches: 2 }],
    [
      'gpipe K=3 1f1b',
      {
        strategy: 'gpipe',
        stages: 3,
        microBatches: 4,
        schedule: '1f1b',
        remat: 'always',
      },
    ],
    [
      'local K=2',
      { strategy: 'local', stages: 2, microBatches: 2, deterministic: true },
    ],
    // two stages per device: messages for both share each link, in both directions
    [
      'gpipe K=2 zbv',
      { strategy: 'gpipe', stages: 2, microBatches: 4, schedule: 'zbv' },
    ],
  ];
  for (const [what, o] of cases) {
    const threads = await run(o);
    const procs = await run({ ...o, devices: 'process' });
    procs.losses.forEach((l, i) =>
      assert.ok(
        Math.abs(l - threads.losses[i]!) <= 1e-4,
        `${what} step ${i}: processes ${l} vs threads ${threads.losses[i]}`,
      ),
    );
    const d = maxParamDiff(procs.params, threads.params);
    assert.ok(
      d <= 1e-4,
      `${what}: parameters over processes differ from threads by ${d}`,
    );
  }
  assert.deepEqual(devicePids(), [], 'no device process outlives its run');
});

test('interleaved-1f1b on 3 devices (the last sends to the first over the ring link) over processes, and mixed with threads, equals threads', async () => {
  const o: Partial<TrainConfig> = {
    backend: 'wasm',
    strategy: 'gpipe',
    stages: 3,
    microBatches: 6,
    schedule: 'interleaved-1f1b',
    remat: 'never',
  };
  const shape = { ...SHAPE, layers: 4 }; // 6 blocks for 6 stages
  const go = (devices?: string) =>
    trainTinyLm(
      { ...o, ...(devices ? { devices } : {}) },
      { shape, batchSize: 6, lrs: [3e-3, 2e-3] },
    );
  const threads = await go();
  for (const devices of ['process', 'thread,process,thread']) {
    const r = await go(devices);
    r.losses.forEach((l, i) =>
      assert.ok(
        Math.abs(l - threads.losses[i]!) <= 1e-4,
        `${devices} step ${i}: ${l} vs threads ${threads.losses[i]}`,
      ),
    );
    const d = maxParamDiff(r.params, threads.params);
    assert.ok(d <= 1e-4, `${devices}: parameters differ from threads by ${d}`);
  }
  assert.deepEqual(devicePids(), [], 'no device process outlives its run');
});

test('one --devices list mixes threads, processes and hosts: thread,process equals thread,thread; process,thread,HOST:PORT equals threads', async () => {
  // a device server in this process stands for another host (its stage runs in a worker thread)
  const server = await startDeviceServer({ port: 0, token: 'mixed-token' });
  const env = { ...process.env };
  try {
    process.env.LAYERWISE_TOKEN = 'mixed-token';
    const cases: Array<[string, string, Partial<TrainConfig>]> = [
      [
        'thread,process',
        'thread,thread',
        { strategy: 'gpipe', stages: 2, microBatches: 2 },
      ],
      [
        // a process before a thread, a thread before a host: both bridged by the coordinator
        `process,thread,${server.address}`,
        'thread,thread,thread',
        { strategy: 'gpipe', stages: 3, microBatches: 4, schedule: '1f1b' },
      ],
    ];
    for (const [devices, reference, o] of cases) {
      const threads = await run({ ...o, devices: reference });
      const mixed = await run({ ...o, devices });
      assert.deepEqual(
        mixed.losses,
        threads.losses,
        `${devices}: the losses of ${reference}`,
      );
      const d = maxParamDiff(mixed.params, threads.params);
      assert.equal(
        d,
        0,
        `${devices}: parameters differ from ${reference}'s by ${d}`,
      );
    }
  } finally {
    process.env = env;
    await server.close();
  }
  assert.deepEqual(devicePids(), [], 'no device process outlives its run');
});

/** Starts a 3-stage gpipe over processes and a long step; `hurt` hurts stage 1's process once the step runs. */
async function failMidStep(
  hurt: (pid: number) => void,
): Promise<{ error: Error; seconds: number; s: Strategy }> {
  const { cfg, model, batches } = setup({
    strategy: 'gpipe',
    stages: 3,
    microBatches: 4,
    devices: 'process',
    layers: 6,
    dModel: 128,
    heads: 4,
    batchSize: 8,
  });
  const s = await createStrategy(cfg, model, initParams(model.blocks, 5));
  const pids = devicePids();
  assert.equal(pids.length, 3, 'three device processes');
  await s.trainStep(batches[0]!, 1e-3); // warm: every stage has run a step
  const stage1 = (s as unknown as { workers: Array<{ where: string }> })
    .workers[1]!.where;
  const pid = Number(/process (\d+)/.exec(stage1)![1]);
  const t0 = performance.now();
  const step = (async () => {
    for (let i = 0; i < 50; i++) await s.trainStep(batches[i % 3]!, 1e-3);
  })();
  setTimeout(() => hurt(pid), 200);
  const error = await step.then(
    () => new Error('no failure'),
    (e: Error) => e,
  );
  return { error, seconds: (performance.now() - t0) / 1000, s };
}

test('a device process killed with SIGKILL mid-step stops the run within seconds, naming the stage, with no process left', async () => {
  const { error, seconds, s } = await failMidStep((pid) =>
    process.kill(pid, 'SIGKILL'),
  );
  assert.match(
    error.message,
    /stage 1: device process \d+ at 127\.0\.0\.1:\d+ (exited \(SIGKILL\)|is gone)/,
  );
  assert.ok(seconds < 10, `the run stopped after ${seconds.toFixed(1)} s`);
  await s.close();
  await new Promise((r) => setTimeout(r, 300));
  assert.deepEqual(devicePids(), [], 'every device process is gone');
});

test('a device that stops answering (a cut link) fails the run with a timeout error, never a hang', async () => {
  let stopped = 0;
  const { error, seconds, s } = await failMidStep((pid) => {
    stopped = pid;
    process.kill(pid, 'SIGSTOP');
  });
  try {
    assert.match(error.message, /stage \d: /);
    console.log(
      `cut link: ${error.message.split('\n')[0]} after ${seconds.toFixed(1)} s`,
    );
    assert.ok(seconds < 15, `the run stopped after ${seconds.toFixed(1)} s`);
  } finally {
    try {
      if (stopped) process.kill(stopped, 'SIGCONT');
    } catch {
      // the strategy already killed it when the run failed
    }
    await s.close();
  }
  await new Promise((r) => setTimeout(r, 300));
  assert.deepEqual(devicePids(), [], 'every device process is gone');
});

test('no worker at a --devices address: a user error naming the address and the fix', async () => {
  const env = { ...process.env };
  process.env.LAYERWISE_TOKEN = 'some-token-123';
  try {
    await assert.rejects(
      run({ strategy: 'gpipe', stages: 2, devices: '127.0.0.1:1,127.0.0.1:1' }),
      (e: Error & { causeName?: string }) => {
        assert.match(
          e.message,
          /device host 127\.0\.0\.1:1 refused the run: no layerwise worker answers at 127\.0\.0\.1:1; start one there with layerwise worker --listen/,
        );
        assert.equal(
          e.causeName,
          'LayerwiseError',
          "the CLI reports it as the user's error (exit 2)",
        );
        return true;
      },
    );
  } finally {
    process.env = env;
  }
});

test('a worker refuses a coordinator with the wrong token or another version', async () => {
  const server = await startDeviceServer({ port: 0, token: 'the-right-token' });
  try {
    const refused = async (
      token: string,
      version?: string,
    ): Promise<string> => {
      const { port, client } = dial(
        server.address,
        'control',
        token,
        undefined,
        version,
      );
      const ch = new Channel(port);
      const why = await new Promise<string>((resolve) =>
        port.onClose((e) => resolve(e.message)),
      );
      ch.fail(new Error('done'));
      client.close();
      return why;
    };
    assert.match(
      await refused('a-wrong-token'),
      /UNAUTHENTICATED: wrong token/,
    );
    assert.match(
      await refused('the-right-token', '0.0.0-other'),
      /version mismatch: this device runs layerwise \d+\.\d+\.\d+, the peer 0\.0\.0-other/,
    );
  } finally {
    await server.close();
  }
});

/** A CA and a certificate for localhost/127.0.0.1 signed by it, made with openssl; null where openssl is missing. */
function makeCertificates(
  dir: string,
): { ca: string; cert: string; key: string } | null {
  const sh = (...a: string[]) =>
    execFileSync('openssl', a, { cwd: dir, stdio: 'pipe' });
  try {
    sh(
      'req',
      '-x509',
      '-newkey',
      'rsa:2048',
      '-nodes',
      '-keyout',
      'ca.key',
      '-out',
      'ca.pem',
      '-days',
      '1',
      '-subj',
      '/CN=layerwise-test-ca',
    );
    sh(
      'req',
      '-newkey',
      'rsa:2048',
      '-nodes',
      '-keyout',
      'w.key',
      '-out',
      'w.csr',
      '-subj',
      '/CN=localhost',
    );
    writeFileSync(
      join(dir, 'ext'),
      'subjectAltName=DNS:localhost,IP:127.0.0.1',
    );
    sh(
      'x509',
      '-req',
      '-in',
      'w.csr',
      '-CA',
      'ca.pem',
      '-CAkey',
      'ca.key',
      '-CAcreateserial',
      '-out',
      'w.pem',
      '-days',
      '1',
      '-extfile',
      'ext',
    );
    return {
      ca: join(dir, 'ca.pem'),
      cert: join(dir, 'w.pem'),
      key: join(dir, 'w.key'),
    };
  } catch {
    return null;
  }
}

test('over TLS: workers with certificates and a coordinator trusting their CA train as threads do; without the CA it cannot connect', async (t) => {
  const dir = mkdtempSync(join(tmpdir(), 'layerwise-tls-'));
  const files = makeCertificates(dir);
  if (!files) {
    t.skip('openssl is not installed: cannot make test certificates');
    return;
  }
  const tls = {
    ca: readFileSync(files.ca),
    cert: readFileSync(files.cert),
    key: readFileSync(files.key),
  };
  const servers = await Promise.all(
    [0, 1].map(() =>
      startDeviceServer({ port: 0, token: 'tls-test-token', tls }),
    ),
  );
  const env = { ...process.env };
  try {
    process.env.LAYERWISE_TOKEN = 'tls-test-token';
    process.env.LAYERWISE_TLS_CA = files.ca;
    const devices = servers.map((s) => s.address).join(',');
    const o: Partial<TrainConfig> = {
      strategy: 'gpipe',
      stages: 2,
      microBatches: 2,
    };
    const overTls = await run({ ...o, devices });
    const threads = await run(o);
    overTls.losses.forEach((l, i) =>
      assert.ok(
        Math.abs(l - threads.losses[i]!) <= 1e-4,
        `step ${i}: TLS ${l} vs threads ${threads.losses[i]}`,
      ),
    );
    delete process.env.LAYERWISE_TLS_CA;
    await assert.rejects(
      run({ ...o, devices }),
      /stage \d: device host 127\.0\.0\.1:\d+ (is gone|refused the run)/,
    );
  } finally {
    process.env = env;
    await Promise.all(servers.map((s) => s.close()));
    rmSync(dir, { recursive: true, force: true });
  }
});

test('--devices parses each device kind with its own backend, threads and environment, and names a bad entry', async () => {
  const { parseDevices } = await import('../runtime/devices.js');
  assert.deepEqual(parseDevices(undefined, 2), [
    { kind: 'thread' },
    { kind: 'thread' },
  ]);
  assert.deepEqual(parseDevices('process', 2), [
    { kind: 'process', env: {} },
    { kind: 'process', env: {} },
  ]);
  assert.deepEqual(
    parseDevices(
      'process:backend=cpu+threads=2+CUDA_VISIBLE_DEVICES=1,10.0.0.3:7070/backend=native+threads=8',
      2,
    ),
    [
      {
        kind: 'process',
        env: { CUDA_VISIBLE_DEVICES: '1' },
        backend: 'cpu',
        threads: 2,
      },
      { kind: 'host', address: '10.0.0.3:7070', backend: 'native', threads: 8 },
    ],
  );
  // worker threads with their own kernel threads (a V-shape's light first device)
  assert.deepEqual(
    parseDevices('thread:threads=1,thread,thread:threads=7', 3),
    [
      { kind: 'thread', threads: 1 },
      { kind: 'thread' },
      { kind: 'thread', threads: 7 },
    ],
  );
  const { deviceThreads } = await import('./spec.js');
  assert.deepEqual(
    deviceThreads(
      {
        threads: 0,
        backend: 'native',
        stages: 3,
        replicas: 1,
        devices: 'thread:threads=1,thread,thread:threads=7',
      },
      false,
      16,
    ),
    [1, 4, 7],
    'own threads, else the 14 kernel cores of 16 divided among 3',
  );
  assert.throws(
    () => parseDevices('thread:FOO=1', 1),
    /'FOO' is not backend, threads$/,
  );
  assert.throws(
    () => parseDevices('process,process,process', 2),
    /lists 3 devices but the run has 2 stages/,
  );
  assert.throws(
    () => parseDevices('gpu0', 1),
    /'gpu0' is not thread, process or HOST:PORT/,
  );
  assert.throws(
    () => parseDevices('process:backend=tpu', 1),
    /unknown backend 'tpu'/,
  );
  assert.throws(
    () => parseDevices('host:7070/FOO=1', 1),
    /'FOO' is not backend, threads$/,
  );
});

test('a device with its own backend: gpipe over a cpu process and a wasm process equals wasm threads', async () => {
  const o: Partial<TrainConfig> = {
    strategy: 'gpipe',
    stages: 2,
    microBatches: 2,
  };
  const threads = await run(o);
  const mixed = await run({ ...o, devices: 'process:backend=cpu,process' });
  mixed.losses.forEach((l, i) =>
    assert.ok(
      Math.abs(l - threads.losses[i]!) <= 1e-4,
      `step ${i}: cpu+wasm processes ${l} vs wasm threads ${threads.losses[i]}`,
    ),
  );
  assert.ok(maxParamDiff(mixed.params, threads.params) <= 1e-4);
});
