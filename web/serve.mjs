/**
 * Serves the built page (dist-web/) on localhost with the headers that make it cross-origin
 * isolated (SharedArrayBuffer for the parameter server): Cross-Origin-Opener-Policy:
 * same-origin and Cross-Origin-Embedder-Policy: require-corp. Any static server that sends
 * those two headers serves the page the same way.
 *
 * Usage: node web/serve.mjs [--port N] [--dir DIR]   (also exported: serve({ dir, port })).
 */
import { readFile, stat } from 'node:fs/promises';
import { createServer } from 'node:http';
import { extname, join, normalize, resolve } from 'node:path';
import { fileURLToPath } from 'node:url';

const TYPES = {
  '.html': 'text/html; charset=utf-8',
  '.js': 'text/javascript; charset=utf-8',
  '.css': 'text/css; charset=utf-8',
  '.map': 'application/json',
  '.json': 'application/json',
  '.wasm': 'application/wasm',
  '.txt': 'text/plain; charset=utf-8',
  '.png': 'image/png',
};

/** The headers of every response: cross-origin isolation, and no caching of a rebuilt page. */
export const ISOLATION_HEADERS = {
  'Cross-Origin-Opener-Policy': 'same-origin',
  'Cross-Origin-Embedder-Policy': 'require-corp',
  'Cross-Origin-Resource-Policy': 'same-origin',
  'Cache-Control': 'no-store',
};

/**
 * Starts the server on 127.0.0.1 (`port` 0: any free port); resolves with its URL, the
 * node:http server (a browser device's WebSocket shares it) and a close function.
 */
export async function serve({ dir, port = 0 }) {
  const root = resolve(dir);
  const server = createServer(async (req, res) => {
    const path = decodeURIComponent(
      new URL(req.url ?? '/', 'http://x').pathname,
    );
    const file = normalize(
      join(root, path.endsWith('/') ? `${path}index.html` : path),
    );
    if (!file.startsWith(root)) {
      res.writeHead(403, ISOLATION_HEADERS).end('forbidden');
      return;
    }
    try {
      if (!(await stat(file)).isFile()) throw new Error('not a file');
      const body = await readFile(file);
      res.writeHead(200, {
        ...ISOLATION_HEADERS,
        'Content-Type': TYPES[extname(file)] ?? 'application/octet-stream',
      });
      res.end(body);
    } catch {
      res.writeHead(404, {
        ...ISOLATION_HEADERS,
        'Content-Type': 'text/plain',
      });
      res.end(`not found: ${path}`);
    }
  });
  await new Promise((ok, fail) => {
    server.once('error', fail);
    server.listen(port, '127.0.0.1', ok);
  });
  const url = `http://127.0.0.1:${server.address().port}/`;
  return {
    url,
    server,
    close: () => new Promise((ok) => server.close(ok)),
  };
}

if (
  process.argv[1] &&
  resolve(process.argv[1]) === fileURLToPath(import.meta.url)
) {
  const arg = (name, dflt) => {
    const i = process.argv.indexOf(name);
    return i >= 0 ? process.argv[i + 1] : dflt;
  };
  const root = resolve(fileURLToPath(import.meta.url), '../..');
  const { url } = await serve({
    dir: arg('--dir', join(root, 'dist-web')),
    port: Number(arg('--port', '8080')),
  });
  console.log(`layerwise page: ${url}  (Ctrl-C stops)`);
}
