/**
 * Injected first into every browser entry (web/build.mjs): the little of Node's globals the
 * library touches outside Node-only paths: `process.env` / `pid` / `cwd()` (empty, for
 * messages), `on` / `once` / `off` (no process events in a page), and timers' `unref()` (Node's timers keep the process alive; a page has none):
 * `setTimeout` returns its numeric id as a Number object with `unref` / `ref`, which
 * `clearTimeout` still accepts.
 */

const g = globalThis as unknown as Record<string, unknown>;
g.process ??= {
  env: {},
  pid: 0,
  platform: 'browser',
  cwd: () => '/',
  versions: {},
  argv: [],
  // a page has no process events: listeners for 'exit' and the like are never called
  on: () => g.process,
  once: () => g.process,
  off: () => g.process,
};

type Timer = (...args: unknown[]) => number;
for (const name of ['setTimeout', 'setInterval'] as const) {
  const original = g[name] as Timer;
  if ((original as { layerwise?: boolean }).layerwise) continue;
  const wrapped = (...args: unknown[]) => {
    const id = new Number(original(...args)) as number & {
      unref(): unknown;
      ref(): unknown;
    };
    id.unref = () => id;
    id.ref = () => id;
    return id;
  };
  (wrapped as { layerwise?: boolean }).layerwise = true;
  g[name] = wrapped;
}
