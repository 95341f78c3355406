/**
 * A browser device: a Web Worker running the same stage host as a Node worker thread
 * (src/runtime/worker.ts), over the worker_threads shim (web/shims/worker-threads.ts). Bundled
 * as worker.js beside the page's main.js, where src/runtime/device.ts looks for it.
 */
import './wasm-env.js';
import './stage-kinds.js';
import '../src/runtime/worker.js';
