/**
 * Where a page or Web Worker finds TF.js's wasm binaries (copied beside the bundle by
 * web/build.mjs), and which one it loads: the single-threaded SIMD binary, as in Node (one
 * device per worker; the same binary gives the same numbers as a Node run on wasm).
 */
import { setWasmPaths } from '@tensorflow/tfjs-backend-wasm';
import * as tf from '@tensorflow/tfjs-core';

setWasmPaths(new URL('./', import.meta.url).href);
tf.env().set('WASM_HAS_MULTITHREAD_SUPPORT', false);
