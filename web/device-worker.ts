/**
 * A browser device: a Web Worker running the same stage host as a Node worker thread
 * (src/runtime/worker.ts), over the worker_threads shim (web/shims/worker-threads.ts). Bundled
 * as worker.js beside the page's main.js, where src/runtime/device.ts looks for it.
 */
import './wasm-env.js';
// registers the 'webgpu' backend where this worker has navigator.gpu (the library imports it by
// a name it computes, which a bundle cannot resolve)
import '@tensorflow/tfjs-backend-webgpu';
import './stage-kinds.js';
import '../src/runtime/worker.js';
