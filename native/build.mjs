#!/usr/bin/env node
// Builds the native backend's addon (native/binding.gyp) at `npm ci` / `npm install`. Where
// oneDNN's headers (Debian/Ubuntu: apt-get install libdnnl-dev) or a C++ toolchain are missing,
// the install still succeeds: it says so once, and layerwise runs on wasm.
import { spawnSync } from 'node:child_process';
import { existsSync } from 'node:fs';
import { dirname, join } from 'node:path';
import { fileURLToPath } from 'node:url';

const here = dirname(fileURLToPath(import.meta.url));
const skip = (why) => {
  console.log(
    `layerwise: native backend not built (${why}); --backend native is unavailable, wasm is used`,
  );
  process.exit(0);
};
if (process.env.LAYERWISE_SKIP_NATIVE) skip('LAYERWISE_SKIP_NATIVE is set');
const headers = [
  '/usr/include/oneapi/dnnl/dnnl.h',
  '/usr/local/include/oneapi/dnnl/dnnl.h',
];
if (!headers.some(existsSync))
  skip(
    'oneDNN headers not found: apt-get install libdnnl-dev, then npm rebuild',
  );

// npm puts its node-gyp on PATH for lifecycle scripts; otherwise use the one npm ships with
const bundled = join(
  dirname(process.execPath),
  '..',
  'lib',
  'node_modules',
  'npm',
  'node_modules',
  'node-gyp',
  'bin',
  'node-gyp.js',
);
const [cmd, args] =
  spawnSync('node-gyp', ['--version'], { stdio: 'ignore' }).status === 0
    ? ['node-gyp', []]
    : [process.execPath, [bundled]];
// the headers of this Node (a system install has them): node-gyp must not download them
const prefix = join(dirname(process.execPath), '..');
const nodedir =
  process.env.npm_config_nodedir ||
  (existsSync(join(prefix, 'include', 'node', 'node_api.h'))
    ? prefix
    : undefined);
const r = spawnSync(
  cmd,
  [
    ...args,
    'rebuild',
    `--directory=${here}`,
    ...(nodedir ? [`--nodedir=${nodedir}`] : []),
  ],
  { stdio: ['ignore', 'ignore', 'pipe'], encoding: 'utf8' },
);
if (r.status !== 0) {
  const lines = (r.stderr ?? '')
    .split('\n')
    .filter((l) => /error/i.test(l))
    .slice(0, 3)
    .join(' | ');
  skip(
    `node-gyp failed${lines ? `: ${lines}` : r.error ? `: ${r.error.message}` : ''}`,
  );
}
console.log(
  'layerwise: native backend built (native/build/Release/layerwise_native.node)',
);
