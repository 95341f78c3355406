/**
 * Builds the training page into dist-web/ with esbuild: main.js (the page), worker.js (a
 * device: a Web Worker), optimizer-worker.js (the parameter server's optimizer thread), TF.js's
 * wasm binaries and index.html. The library's Node-only imports resolve to the browser
 * versions in web/shims/ (the seam: the library code itself is the same as in Node).
 *
 * Usage: node web/build.mjs [outDir]   (also exported: build(outDir)).
 */
import { copyFileSync, mkdirSync, readdirSync } from 'node:fs';
import { dirname, join, resolve } from 'node:path';
import { fileURLToPath } from 'node:url';
import * as esbuild from 'esbuild';

const web = dirname(fileURLToPath(import.meta.url));
const root = resolve(web, '..');

/** Node-only module -> its browser version. */
const SHIMS = {
  'node:worker_threads': 'worker-threads.ts',
  'node:path': 'path.ts',
  'node:os': 'os.ts',
  'node:module': 'module.ts',
  'node:fs': 'fs.ts',
  'node:fs/promises': 'fs-promises.ts',
  'node:child_process': 'misc.ts',
  'node:crypto': 'misc.ts',
  'node:readline': 'misc.ts',
  'node:url': 'misc.ts',
  'node:v8': 'misc.ts',
  'node:zlib': 'misc.ts',
  '@grpc/grpc-js': 'misc.ts',
  'proper-lockfile': 'misc.ts',
  webgpu: 'webgpu.ts',
};

/** Resolves the library's Node-only imports to web/shims/ (only from our own sources). */
const shimPlugin = {
  name: 'layerwise-browser-shims',
  setup(build) {
    const filter = new RegExp(
      `^(${Object.keys(SHIMS)
        .map((k) => k.replace(/[/.@-]/g, '\\$&'))
        .join('|')})$`,
    );
    // the coordinator's side of browser devices (a server, in Node only)
    build.onResolve({ filter: /^\.\/browser-device\.js$/ }, (args) =>
      args.importer.includes(`${'/'}node_modules${'/'}`)
        ? undefined
        : { path: join(web, 'shims', 'browser-device.ts') },
    );
    build.onResolve({ filter }, (args) => {
      if (args.importer.includes(`${'/'}node_modules${'/'}`)) return undefined;
      return { path: join(web, 'shims', SHIMS[args.path]) };
    });
  },
};

/**
 * Builds the page into `outDir` (default dist-web/ at the repository root); resolves with
 * outDir. Throws esbuild's error (with its messages) when the build fails.
 */
export async function build(outDir = join(root, 'dist-web')) {
  mkdirSync(outDir, { recursive: true });
  await esbuild.build({
    absWorkingDir: root,
    entryPoints: {
      main: join(web, 'page.ts'),
      worker: join(web, 'device-worker.ts'),
      'optimizer-worker': join(web, 'optimizer-worker.ts'),
    },
    outdir: outDir,
    bundle: true,
    format: 'esm',
    platform: 'browser',
    target: 'es2022',
    splitting: false,
    sourcemap: true,
    inject: [join(web, 'shims', 'node-globals.ts')],
    plugins: [shimPlugin],
    logLevel: 'warning',
    logOverride: { 'unsupported-dynamic-import': 'silent' },
  });
  const wasmDir = join(root, 'node_modules/@tensorflow/tfjs-backend-wasm/dist');
  for (const f of readdirSync(wasmDir).filter((f) => f.endsWith('.wasm')))
    copyFileSync(join(wasmDir, f), join(outDir, f));
  copyFileSync(join(web, 'index.html'), join(outDir, 'index.html'));
  return outDir;
}

if (
  process.argv[1] &&
  resolve(process.argv[1]) === fileURLToPath(import.meta.url)
) {
  const out = await build(
    process.argv[2] ? resolve(process.argv[2]) : undefined,
  );
  console.log(`built the page into ${out}`);
}
