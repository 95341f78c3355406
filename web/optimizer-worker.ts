/**
 * The parameter server's optimizer thread in the browser: a Web Worker running
 * src/param-server/optimizer-worker.ts (bundled as optimizer-worker.js beside main.js).
 */
import '../src/param-server/optimizer-worker.js';
