/**
 * The training page (web/, `npm run web`) in a real browser: Debian's chromium-headless-shell
 * driven by playwright-core, the page built by esbuild and served with cross-origin isolation.
 * The library runs in Web Workers there exactly as in Node, so a run in the page reproduces
 * the same run of `layerwise train` in Node on the same backend and seed.
 *
 * Skips, saying why, where no Chromium is installed (CI installs chromium-headless-shell).
 * LAYERWISE_SCREENSHOT=<file.png> also saves a screenshot of the page mid-run (the README's).
 */

import assert from 'node:assert/strict';
import { spawn, spawnSync } from 'node:child_process';
import { mkdtempSync, readFileSync, rmSync } from 'node:fs';
import { createServer } from 'node:http';
import type { AddressInfo } from 'node:net';
import { tmpdir } from 'node:os';
import { extname, join } from 'node:path';
import { after, before, describe, test } from 'node:test';
import { fileURLToPath } from 'node:url';
import type { Browser, Page } from 'playwright-core';
import { formatSize } from '../util/size.js';
import type { StepMetrics, Summary } from './metrics.js';

const CLI = fileURLToPath(new URL('../cli/main.js', import.meta.url));
/** web/ beside dist/: the page's build, server and browser finder (plain .mjs, not compiled). */
const WEB = new URL('../../web/', import.meta.url);

interface WebTools {
  findChromium(): string | undefined;
  launchChromium(): Promise<Browser>;
}
const chromium = (await import(new URL('chromium.mjs', WEB).href)) as WebTools;
const executable = chromium.findChromium();
const skip = executable
  ? false
  : 'no Chromium installed: apt-get install chromium-headless-shell (or set LAYERWISE_CHROMIUM) to run the browser tests';

/** What the page keeps in `window.layerwise` for tests. */
interface PageState {
  state: string;
  metrics: StepMetrics[];
  summary?: Summary;
  error?: string;
  backends: string[];
}

/** What a `layerwise train` process did. */
interface CliRun {
  code: number | null;
  /** stdout and stderr, as they came. */
  output: string;
  metrics: StepMetrics[];
  summary?: Summary;
}

/**
 * Runs `layerwise train` in Node with `args` (and a fresh --out); `onOutput` hears its output
 * so far as it comes. Resolves with its exit code, output, metrics lines and summary (if written).
 */
async function runCli(
  args: string[],
  onOutput?: (text: string) => void,
): Promise<CliRun> {
  const out = mkdtempSync(join(tmpdir(), 'lw-browser-node-'));
  try {
    const child = spawn(
      process.execPath,
      [CLI, 'train', ...args, '--out', out],
      { stdio: ['ignore', 'pipe', 'pipe'] },
    );
    let output = '';
    const hear = (d: Buffer) => {
      output += d;
      onOutput?.(output);
    };
    child.stdout.on('data', hear);
    child.stderr.on('data', hear);
    const code = await new Promise<number | null>((ok) =>
      child.on('close', ok),
    );
    const read = (f: string) => {
      try {
        return readFileSync(join(out, f), 'utf8');
      } catch {
        return undefined;
      }
    };
    const summary = read('summary.json');
    return {
      code,
      output,
      metrics: (read('metrics.jsonl') ?? '')
        .split('\n')
        .filter(Boolean)
        .map((l) => JSON.parse(l) as StepMetrics),
      summary: summary ? (JSON.parse(summary) as Summary) : undefined,
    };
  } finally {
    rmSync(out, { recursive: true, force: true });
  }
}

/** Runs `layerwise train` in Node; resolves with its metrics lines and summary. */
async function trainInNode(
  args: string[],
): Promise<{ metrics: StepMetrics[]; summary: Summary }> {
  const r = await runCli(args);
  assert.equal(r.code, 0, `layerwise train failed: ${r.output}`);
  return { metrics: r.metrics, summary: r.summary! };
}

/** The page's state once its run has ended (done, stopped or error), polled every 200 ms. */
async function finished(page: Page, timeoutMs = 240_000): Promise<PageState> {
  await page.waitForFunction(
    () => {
      const s = (window as unknown as { layerwise?: PageState }).layerwise
        ?.state;
      return s === 'done' || s === 'stopped' || s === 'error';
    },
    undefined,
    { timeout: timeoutMs, polling: 200 },
  );
  return pageState(page);
}

function pageState(page: Page): Promise<PageState> {
  return page.evaluate(
    () => (window as unknown as { layerwise: PageState }).layerwise,
  );
}

/** The losses of `a` equal those of `b` step by step within `tol`. */
function assertLossesClose(
  a: number[],
  b: number[],
  tol: number,
  what: string,
): void {
  assert.equal(a.length, b.length, `${what}: step counts differ`);
  a.forEach((x, i) =>
    assert.ok(
      Math.abs(x - b[i]!) <= tol,
      `${what}: step ${i + 1} loss ${x} vs ${b[i]} (tolerance ${tol})`,
    ),
  );
}

test('the page and its shims type-check against the library (esbuild bundles without checking)', () => {
  const tsc = fileURLToPath(
    new URL('../../node_modules/typescript/bin/tsc', import.meta.url),
  );
  const r = spawnSync(
    process.execPath,
    [tsc, '-p', fileURLToPath(new URL('tsconfig.json', WEB))],
    { encoding: 'utf8' },
  );
  assert.equal(r.status, 0, `tsc -p web/tsconfig.json: ${r.stdout}${r.output}`);
});

test('--devices parses browser entries and refuses mixing them with processes or hosts', async () => {
  const { parseDevices, openDevices } = await import('../runtime/devices.js');
  assert.deepEqual(parseDevices('thread,browser:backend=webgpu', 2), [
    { kind: 'thread' },
    { kind: 'browser', backend: 'webgpu' },
  ]);
  assert.throws(
    () => parseDevices('browser:CUDA_VISIBLE_DEVICES=1', 1),
    /is not backend, threads/,
  );
  await assert.rejects(
    openDevices(parseDevices('process,browser', 2)),
    /mixes browser with process or HOST:PORT devices/,
  );
});

describe('the training page in Chromium', { skip }, () => {
  let browser: Browser;
  let url: string;
  let close: () => Promise<void>;
  let outDir: string;

  before(async () => {
    outDir = mkdtempSync(join(tmpdir(), 'lw-web-'));
    const { build } = await import(new URL('build.mjs', WEB).href);
    const { serve } = await import(new URL('serve.mjs', WEB).href);
    await build(outDir);
    ({ url, close } = await serve({ dir: outDir }));
    browser = await chromium.launchChromium();
  });

  after(async () => {
    await browser?.close();
    await close?.();
    rmSync(outDir, { recursive: true, force: true });
  });

  /** A new tab with the page's errors collected (an uncaught one fails the test that reads them). */
  async function open(
    query: string,
  ): Promise<{ page: Page; errors: string[] }> {
    const page = await browser.newPage();
    const errors: string[] = [];
    page.on('pageerror', (e) => errors.push(e.message));
    await page.goto(`${url}?${query}`);
    return { page, errors };
  }

  test('gpipe K=2 in Web Workers on wasm trains 20 steps of charlm-tiny with the losses of the same run in Node; the autostart URL fills #summary with summary.json fields', async () => {
    const flags = {
      preset: 'charlm-tiny',
      strategy: 'gpipe',
      stages: '2',
      'micro-batches': '2',
      steps: '20',
      backend: 'wasm',
      'eval-batches': '2',
    };
    const node = trainInNode(
      Object.entries(flags).flatMap(([k, v]) => [`--${k}`, v]),
    );
    node.catch(() => undefined); // awaited below, after the page's run

    const { page, errors } = await open(
      `${new URLSearchParams(flags)}&autostart=1`,
    );
    const shot = process.env.LAYERWISE_SCREENSHOT;
    if (shot) {
      await page.setViewportSize({ width: 1200, height: 900 });
      await page.waitForFunction(
        () =>
          (window as unknown as { layerwise: PageState }).layerwise.metrics
            .length >= 12,
        undefined,
        { timeout: 240_000, polling: 100 },
      );
      await page.screenshot({ path: shot });
    }
    const s = await finished(page);
    assert.equal(s.state, 'done', `the page's run failed: ${s.error}`);
    assert.deepEqual(errors, []);
    const n = await node;
    assertLossesClose(
      s.metrics.map((m) => m.loss),
      n.metrics.map((m) => m.loss),
      1e-4,
      'page vs Node',
    );
    // #summary holds the summary as JSON: the same fields as summary.json, the same run
    const shown = JSON.parse(
      (await page.textContent('#summary')) ?? '',
    ) as Summary;
    assert.deepEqual(Object.keys(shown).sort(), Object.keys(n.summary).sort());
    for (const k of [
      'strategy',
      'backend',
      'preset',
      'params',
      'stages',
      'micro_batches',
      'balance',
      'batch_size',
      'steps',
    ] as const)
      assert.deepEqual(shown[k], n.summary[k], `summary field ${k}`);
    for (const k of ['initial_loss', 'final_loss', 'val_loss'] as const)
      assert.ok(
        Math.abs(shown[k] - n.summary[k]) <= 1e-4,
        `summary ${k}: page ${shown[k]} vs Node ${n.summary[k]}`,
      );
    // after the run: a text sample and the downloads
    assert.ok(((await page.textContent('#sample')) ?? '').length > 100);
    assert.equal(
      await page.locator('#downloads a, #downloads button').count(),
      3,
    );
    await page.close();
  });

  // two steps (the second's loss shows the first's update) of four sequences: WebGPU on
  // SwiftShader compiles its shaders in the first step, which takes most of this test
  test("single, l2l and webgpu single in the page: l2l equals single within 1e-4, webgpu equals wasm within 1e-3 and runs layerwise's WGSL kernels (Node's webgpu dispatch count)", async (t) => {
    // the same webgpu run in Node (Dawn), started now and awaited at the end: its dispatches
    // per step are those of layerwise's WGSL kernels, which the page's devices (worker.js, also
    // the tab of --devices browser:backend=webgpu) must register too
    const nodeGpu = runCli([
      ...['--preset', 'charlm-tiny', '--strategy', 'single', '--steps', '2'],
      ...['--batch-size', '4', '--eval-batches', '1', '--backend', 'webgpu'],
    ]);
    nodeGpu.catch(() => undefined); // awaited below
    const run = async (query: string) => {
      const { page, errors } = await open(
        `preset=charlm-tiny&steps=2&batch-size=4&eval-batches=1&autostart=1&${query}`,
      );
      const s = await finished(page);
      await page.close();
      assert.equal(s.state, 'done', `${query}: ${s.error}`);
      assert.deepEqual(errors, []);
      return s;
    };
    const single = await run('strategy=single&backend=wasm');
    const l2l = await run('strategy=l2l&micro-batches=2&backend=wasm');
    assert.equal(l2l.summary?.strategy, 'l2l');
    assertLossesClose(
      l2l.metrics.map((m) => m.loss),
      single.metrics.map((m) => m.loss),
      1e-4,
      'l2l vs single',
    );
    if (!single.backends.includes('webgpu')) {
      t.skip('this Chromium gives no WebGPU adapter (SwiftShader)');
      return;
    }
    const gpu = await run('strategy=single&backend=webgpu');
    assert.equal(gpu.summary?.backend, 'webgpu');
    assertLossesClose(
      gpu.metrics.map((m) => m.loss),
      single.metrics.map((m) => m.loss),
      1e-3,
      'webgpu vs wasm',
    );
    const node = await nodeGpu;
    if (node.code !== 0) {
      t.diagnostic(
        `no webgpu in Node here, the page's kernels are not compared with Node's: ${node.output.trim().split('\n').at(-1)}`,
      );
      return;
    }
    // the same kernels: TF.js's stock webgpu kernels alone dispatch about 3x as many
    assert.ok(
      (node.summary?.dispatches_per_step ?? 0) > 0,
      'Node counted dispatches',
    );
    assert.equal(
      gpu.summary?.dispatches_per_step,
      node.summary?.dispatches_per_step,
      "the page's webgpu dispatches per step equal Node's (layerwise's WGSL kernels)",
    );
    assertLossesClose(
      gpu.metrics.map((m) => m.loss),
      node.metrics.map((m) => m.loss),
      1e-3,
      'page webgpu vs Node webgpu',
    );
  });

  test("a model over the WebGPU adapter's buffer limits gets a message naming the limit, the size and the fix, before any worker starts", async (t) => {
    const run = async (query: string) => {
      const { page, errors } = await open(
        `preset=charlm-tiny&steps=2&eval-batches=1&backend=webgpu&autostart=1&${query}`,
      );
      const s = await finished(page, 60_000);
      const limits = await page.evaluate(
        () =>
          (
            window as unknown as {
              layerwise: { webgpuLimits?: Record<string, number> };
            }
          ).layerwise.webgpuLimits,
      );
      const message = (await page.textContent('#message')) ?? '';
      // the tab lives on: the form takes another run
      assert.equal(await page.isEnabled('#start'), true);
      assert.deepEqual(errors, []);
      await page.close();
      return { s, limits, message };
    };
    const big = await run('strategy=single&d-model=16384');
    if (!big.limits) {
      t.skip('this Chromium gives no WebGPU adapter (SwiftShader)');
      return;
    }
    // the adapter's own limit (SwiftShader: 1 GiB) against a 4 GiB weight; nothing was allocated
    const limit = Math.min(
      big.limits.maxBufferSize!,
      big.limits.maxStorageBufferBindingSize!,
    );
    assert.ok(limit < 4 * 2 ** 30, `this adapter's limit is ${limit} bytes`);
    assert.equal(big.s.state, 'error');
    assert.equal(big.s.metrics.length, 0);
    assert.match(
      big.message,
      new RegExp(
        `largest tensor, the parameter w1 of block 1 .*\\[16384, 65536\\], takes 4 GiB, over the adapter's (maxStorageBufferBindingSize|maxBufferSize) of ${formatSize(limit)}; use a smaller model .* or the wasm backend`,
      ),
    );
    // webgpu-max-buffer lowers the limits: charlm-tiny's logits (a micro-batch of 16) are over 64 KiB
    const small = await run(
      'strategy=gpipe&stages=2&micro-batches=2&webgpu-max-buffer=65536',
    );
    assert.equal(small.s.state, 'error');
    assert.match(
      small.message,
      /the output of block 3 \(head\) \[16, 64, \d+\], takes .* over the adapter's maxStorageBufferBindingSize of 64 KiB; use more micro-batches/,
    );
  });

  test('the built page works from any static server: at a sub-path, with only the two isolation headers (l2l needs SharedArrayBuffer)', async () => {
    // a bare file server, not web/serve.mjs: what a person's nginx or GitHub-Pages-like host does
    const TYPES: Record<string, string> = {
      '.html': 'text/html',
      '.js': 'text/javascript',
      '.css': 'text/css',
      '.wasm': 'application/wasm',
    };
    const server = createServer((req, res) => {
      const path = new URL(req.url ?? '/', 'http://x').pathname;
      const rel = path.replace(/^\/static\/layerwise\//, '') || 'index.html';
      const headers = {
        'Cross-Origin-Opener-Policy': 'same-origin',
        'Cross-Origin-Embedder-Policy': 'require-corp',
      };
      try {
        const body = readFileSync(join(outDir, rel.replace(/\.\./g, '')));
        res.writeHead(200, {
          ...headers,
          'Content-Type': TYPES[extname(rel)] ?? 'application/octet-stream',
        });
        res.end(body);
      } catch {
        res.writeHead(404, headers).end();
      }
    });
    await new Promise<void>((ok) => server.listen(0, '127.0.0.1', ok));
    const { port } = server.address() as AddressInfo;
    try {
      const page = await browser.newPage();
      const errors: string[] = [];
      page.on('pageerror', (e) => errors.push(e.message));
      await page.goto(
        `http://127.0.0.1:${port}/static/layerwise/?preset=charlm-tiny&strategy=l2l&micro-batches=2&steps=2&batch-size=4&eval-batches=1&backend=wasm&autostart=1`,
      );
      const s = await finished(page, 120_000);
      assert.equal(s.state, 'done', s.error);
      assert.equal(await page.evaluate(() => crossOriginIsolated), true);
      assert.equal(s.metrics.length, 2);
      assert.deepEqual(errors, []);
      await page.close();
    } finally {
      server.close();
    }
  });

  test('Stop ends the run after the current step, with the summary of the steps done', async () => {
    const { page, errors } = await open(
      'preset=charlm-tiny&strategy=gpipe&stages=2&micro-batches=2&steps=500&eval-every=0&eval-batches=1&backend=wasm&autostart=1',
    );
    await page.waitForFunction(
      () =>
        (window as unknown as { layerwise: PageState }).layerwise.metrics
          .length >= 2,
      undefined,
      { timeout: 120_000, polling: 100 },
    );
    await page.click('#stop');
    const s = await finished(page);
    assert.equal(s.state, 'stopped', s.error);
    assert.ok(s.metrics.length < 500);
    assert.equal(s.summary?.steps, s.metrics.length);
    assert.match(
      (await page.textContent('#message')) ?? '',
      new RegExp(`stopped after step ${s.metrics.length}`),
    );
    assert.deepEqual(errors, []);
    await page.close();
  });

  test("a binary or empty file, picked or dropped, or a text too short, gets a message on the page; a person's own text trains", async () => {
    const { page, errors } = await open(
      'preset=charlm-tiny&steps=2&eval-batches=1&backend=wasm',
    );
    const message = () => page.textContent('#message');
    await page.setInputFiles('#file', {
      name: 'weights.bin',
      mimeType: 'application/octet-stream',
      buffer: Buffer.from([0x89, 0x50, 0x4e, 0x47, 0, 0, 0, 13, 0xff]),
    });
    await page.waitForFunction(() =>
      document.getElementById('message')?.textContent?.includes('binary'),
    );
    assert.match((await message()) ?? '', /weights\.bin is a binary file/);
    await page.setInputFiles('#file', {
      name: 'empty.txt',
      mimeType: 'text/plain',
      buffer: Buffer.alloc(0),
    });
    await page.waitForFunction(() =>
      document.getElementById('message')?.textContent?.includes('empty'),
    );
    // dropped: a drop event carrying the file, as a person's drag from the desktop makes
    await page.evaluate(() => {
      const dt = new DataTransfer();
      dt.items.add(
        new File([new Uint8Array([0, 1, 2, 3, 0, 255])], 'image.png'),
      );
      document
        .getElementById('drop')!
        .dispatchEvent(new DragEvent('drop', { dataTransfer: dt }));
    });
    await page.waitForFunction(() =>
      document.getElementById('message')?.textContent?.includes('image.png'),
    );
    assert.match((await message()) ?? '', /image\.png is a binary file/);
    assert.equal((await pageState(page)).state, 'idle');
    // a text too short to hold a validation batch: the library's message, on the page
    const pickText = async (name: string, text: string) => {
      await page.setInputFiles('#file', {
        name,
        mimeType: 'text/plain',
        buffer: Buffer.from(text),
      });
      await page.waitForFunction(
        (n) =>
          document
            .getElementById('message')
            ?.textContent?.includes(`${n} loaded`),
        name,
      );
    };
    await pickText('short.txt', 'Call me Ishmael.');
    await page.click('#start');
    const short = await finished(page);
    assert.equal(short.state, 'error');
    assert.match((await message()) ?? '', /short\.txt .* give a longer text/);
    // a person's own text trains, and the sample speaks its alphabet
    const text = 'It was the best of times, it was the worst of times. ';
    await pickText('dickens.txt', text.repeat(400));
    await page.click('#start');
    const s = await finished(page);
    assert.equal(s.state, 'done', s.error);
    assert.ok(Number.isFinite(s.summary?.final_loss));
    const sample = (await page.textContent('#sample')) ?? '';
    assert.ok(sample.length > 100);
    assert.ok(
      [...sample].every((c) => text.includes(c)),
      sample,
    );
    assert.deepEqual(errors, []);
    await page.close();
  });

  /** A run with `--devices thread,browser` whose printed URL a new tab opens; `onTab` gets the tab. */
  async function runWithTab(
    args: string[],
    onTab?: (page: Page) => void,
  ): Promise<CliRun> {
    let opened = false;
    return runCli(args, (text) => {
      const m = /open (http\S+)/.exec(text);
      if (!m || opened) return;
      opened = true;
      void browser.newPage().then(async (page) => {
        await page.goto(m[1]!);
        onTab?.(page);
      });
    });
  }

  const DEVICE_RUN = [
    '--preset',
    'charlm-tiny',
    '--strategy',
    'gpipe',
    '--stages',
    '2',
    '--micro-batches',
    '2',
    '--backend',
    'wasm',
    '--eval-batches',
    '1',
  ];

  /** The reference: the same 6 steps on two worker threads (started once, when first asked). */
  let reference: Promise<{ metrics: StepMetrics[] }> | undefined;
  const onThreads = () => {
    reference ??= trainInNode([
      ...DEVICE_RUN,
      '--steps',
      '6',
      '--devices',
      'thread,thread',
    ]);
    reference.catch(() => undefined); // awaited by the tests
    return reference;
  };

  test('--devices thread,browser: a tab joins as stage 1 and the losses equal --devices thread,thread', async () => {
    const threads = onThreads();
    let tab: Page | undefined;
    const r = await runWithTab(
      [...DEVICE_RUN, '--steps', '6', '--devices', 'thread,browser'],
      (p) => (tab = p),
    );
    assert.equal(r.code, 0, r.output);
    assert.match(r.output, /stage 1 runs in a browser tab: open http/);
    assertLossesClose(
      r.metrics.map((m) => m.loss),
      (await threads).metrics.map((m) => m.loss),
      1e-3,
      'thread,browser vs thread,thread',
    );
    await tab!.waitForFunction(() =>
      document.getElementById('message')?.textContent?.includes('run ended'),
    );
    assert.match(
      (await tab!.textContent('#message')) ?? '',
      /this tab ran stage 1/,
    );
    await tab!.close();
  });

  // WebGPU on SwiftShader compiles its shaders in the first step and runs slowly: two steps of
  // four sequences (the second's loss shows the first's update), against the same on threads
  test('--devices thread,browser:backend=webgpu: stage 1 on WebGPU in the tab equals thread,thread on wasm within 1e-3', async (t) => {
    const SMALL = ['--steps', '2', '--batch-size', '4'];
    const threads = trainInNode([
      ...DEVICE_RUN,
      ...SMALL,
      '--devices',
      'thread,thread',
    ]);
    threads.catch(() => undefined); // awaited below
    let tab: Page | undefined;
    let onWebgpu: Promise<boolean> | undefined;
    const r = await runWithTab(
      [...DEVICE_RUN, ...SMALL, '--devices', 'thread,browser:backend=webgpu'],
      (p) => {
        tab = p;
        onWebgpu = p
          .waitForFunction(
            () =>
              document
                .getElementById('message')
                ?.textContent?.includes('runs stage 1 of the run on webgpu'),
            undefined,
            { timeout: 120_000, polling: 50 },
          )
          .then(
            () => true,
            () => false,
          );
      },
    );
    const adapter = await tab?.evaluate(
      async () =>
        (await (
          navigator as { gpu?: { requestAdapter(): Promise<unknown> } }
        ).gpu?.requestAdapter()) != null,
    );
    if (r.code !== 0 && adapter === false) {
      t.skip('this Chromium gives no WebGPU adapter (SwiftShader)');
      return;
    }
    assert.equal(r.code, 0, r.output);
    await tab!.waitForFunction(() =>
      document.getElementById('message')?.textContent?.includes('run ended'),
    );
    assert.match(
      (await tab!.textContent('#message')) ?? '',
      /this tab ran stage 1/,
    );
    assert.equal(
      await onWebgpu,
      true,
      'the tab said it runs stage 1 on webgpu',
    );
    assert.match(r.output, /stage 1 runs in a browser tab: open http/);
    assertLossesClose(
      r.metrics.map((m) => m.loss),
      (await threads).metrics.map((m) => m.loss),
      1e-3,
      'thread,browser:backend=webgpu vs thread,thread',
    );
    await tab!.close();
  });

  test('--max-restarts: after its tab is closed the run waits for a new tab at the same URL and resumes exactly', {
    timeout: 240_000,
  }, async () => {
    const threads = onThreads();
    const urls: string[] = [];
    let firstTab: Page | undefined;
    let closing = false;
    const r = await runCli(
      [
        ...DEVICE_RUN,
        '--steps',
        '6',
        '--save-every',
        '2',
        '--max-restarts',
        '1',
        '--devices',
        'thread,browser',
      ],
      (text) => {
        // the first tab is closed once step 3 is reported (step 2's checkpoint is saved by then)
        if (firstTab && !closing && /step 3\/6/.test(text)) {
          closing = true;
          void firstTab.close();
        }
        const printed = [...text.matchAll(/open (http\S+)/g)].map((m) => m[1]!);
        if (printed.length === urls.length) return;
        const url = printed[urls.length]!;
        urls.push(url);
        void browser.newPage().then(async (tab) => {
          if (urls.length === 1) firstTab = tab;
          await tab.goto(url);
        });
      },
    );
    assert.equal(r.code, 0, r.output);
    assert.match(
      r.output,
      /browser tab running this stage was closed.*restarting the devices from the checkpoint in .* \(restart 1 of 1\)/,
    );
    assert.equal(urls.length, 2);
    assert.equal(urls[1], urls[0]);
    assertLossesClose(
      r.metrics.map((m) => m.loss),
      (await threads).metrics.map((m) => m.loss),
      1e-3,
      'restarted thread,browser vs thread,thread',
    );
  });

  test('--devices thread,browser: closing the tab ends the run at once as a user error (exit 2, one line with the command that goes on), no hang', {
    timeout: 120_000,
  }, async () => {
    const r = await runWithTab(
      [...DEVICE_RUN, '--steps', '100000', '--devices', 'thread,browser'],
      async (tab) => {
        await tab.waitForFunction(() =>
          document
            .getElementById('message')
            ?.textContent?.includes('this tab runs stage 1'),
        );
        await tab.close();
      },
    );
    // a lost tab is the user's machine, not a bug: exit 2, one line, and how to go on
    assert.equal(r.code, 2, r.output);
    const errors = r.output
      .split('\n')
      .filter((l) => /^layerwise: (internal )?error/.test(l));
    assert.equal(errors.length, 1, r.output);
    assert.match(
      errors[0]!,
      // closed before the first checkpoint: the command that starts it again (else --resume DIR)
      /^layerwise: error: stage 1: the browser tab running this stage was closed or stopped answering .*; no checkpoint was saved yet: start it again with: layerwise train .*--devices thread,browser.* --overwrite/,
    );
    assert.doesNotMatch(r.output, /internal error/);
  });
});
