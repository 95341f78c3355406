/**
 * The device substrate: choose and initialise the TF.js backend of this thread ("device"), with
 * layerwise's extra kernels and gradients. Each Node worker_thread has its own tfjs-core engine,
 * so each worker calls {@link initBackend} itself.
 */

import * as tf from '@tensorflow/tfjs-core';
import { installDawn, requestShaderF16 } from './webgpu.js';
// tfjs-core 4.x registers no gradients itself; the union package's Node bundle registers all stock
// gradients into tfjs-core's global registry. It must load before our gradient overrides.
import '@tensorflow/tfjs';
import '@tensorflow/tfjs-backend-cpu';
import * as wasmBackend from '@tensorflow/tfjs-backend-wasm';
import { check, LayerwiseError } from '../util/errors.js';
import { registerAddGrad } from './add-grad.js';
import { registerComposedKernels } from './composed-kernels.js';
import { registerDenseKernel } from './dense.js';
import { setSubmitBatch } from './gpu-queue.js';
import { UNREAD_OUTPUT_GRADIENTS } from './kernel-names.js';
import { registerMatMulGrad, unreadGradient } from './matmul-grad.js';
import {
  BACKENDS,
  type BackendName,
  checkPrecision,
  PRECISIONS,
  type Precision,
} from './names.js';
import {
  type NativeBackend,
  nativeAddon,
  nativeUnavailable,
  registerNativeBackend,
} from './native.js';
import { policyOf } from './precision.js';
import { shareSavedTensors } from './saved-tensors.js';
import { registerWasmKernels } from './wasm-kernels.js';
import { registerWasmLayoutKernels } from './wasm-layout.js';
import { registerWasmMatMul } from './wasm-matmul.js';

export { BACKENDS, type BackendName, PRECISIONS, type Precision };

/** npm packages that provide the backends not built into this module (tfjs-node is optional: not a dependency). */
const OPTIONAL_PACKAGE: Record<'tensorflow' | 'webgpu', string> = {
  tensorflow: '@tensorflow/tfjs-node',
  webgpu: '@tensorflow/tfjs-backend-webgpu',
};

let registered = false;

/** Register layerwise's kernels and gradients into this thread's tfjs-core, once. */
function registerExtensions(): void {
  if (registered) return;
  registerWasmKernels();
  registerWasmLayoutKernels();
  registerWasmMatMul();
  registerMatMulGrad();
  registerAddGrad();
  // layerwise's own ops (kernel-names.ts) composed of stock ops on every backend but native,
  // which registers its own kernels (and copies the cpu backend's for any it lacks)
  for (const name of BACKENDS)
    if (name !== 'native') {
      registerComposedKernels(name);
      // a dense layer as one op over the backend's own product (native copies cpu's)
      registerDenseKernel(name);
    }
  registered = true;
}

/** Import a package that may not be installed; `undefined` if it is not resolvable. */
async function importOptional(specifier: string): Promise<unknown> {
  try {
    return await import(specifier);
  } catch (err) {
    const code = (err as { code?: string }).code;
    if (code === 'ERR_MODULE_NOT_FOUND' || code === 'MODULE_NOT_FOUND')
      return undefined;
    throw err;
  }
}

/** Make the optional backend `name` available by importing its package, or explain how to. */
async function loadOptional(name: 'tensorflow' | 'webgpu'): Promise<void> {
  if (tf.findBackendFactory(name) !== null) return;
  const pkg = OPTIONAL_PACKAGE[name];
  const candidates =
    name === 'tensorflow' ? [pkg, '@tensorflow/tfjs-node-gpu'] : [pkg];
  let found = false;
  for (const specifier of candidates) {
    if ((await importOptional(specifier)) !== undefined) {
      found = true;
      break;
    }
  }
  check(
    found,
    `backend '${name}' needs the npm package ${pkg}` +
      (name === 'tensorflow' ? ' (or @tensorflow/tfjs-node-gpu)' : '') +
      `: run \`npm install ${pkg}\``,
  );
  check(
    tf.findBackendFactory(name) !== null,
    name === 'webgpu'
      ? `${pkg} is installed but registered no 'webgpu' backend: this runtime has no WebGPU (navigator.gpu)`
      : `${pkg} is installed but registered its backend into another copy of @tensorflow/tfjs-core: ` +
          `install the version matching @tensorflow/tfjs-core ${tf.version_core}`,
  );
}

/**
 * Select and initialise the TF.js backend `name` for the calling thread, then register
 * layerwise's wasm kernels (UnsortedSegmentSum, Conv2DBackpropFilter, fast BatchMatMul and
 * _FusedMatMul) and its broadcasting matMul gradient, once per thread (safe to call again, e.g.
 * to switch backend), and the composed form of each of layerwise's own kernels
 * (backend/composed-kernels.ts) where this backend has none of its own.
 *
 * `opts.threads`: for 'wasm', the XNNPACK thread count, effective only where the multithreaded
 * wasm binary loads (browsers with cross-origin isolation; Node loads the single-threaded SIMD
 * binary, so use one worker_thread per device instead); it must be given before the first wasm
 * initialisation in the thread. For 'native' it sets this thread's OpenMP team (default: all
 * cores). For 'tensorflow' it sets TF_NUM_INTRAOP_THREADS before the package is loaded. Ignored
 * by 'cpu' and 'webgpu'.
 *
 * `opts.precision`: the compute precision of the products ('fp32' by default; see
 * {@link PRECISIONS}). 'bf16' is the native backend's (NativeBackend.precision: bf16 operands on
 * oneDNN's bf16 matmul, float32 accumulation and outputs, parameters converted once per
 * version); every other backend has no bf16 kernels and refuses it.
 *
 * Throws {@link LayerwiseError} for an unknown name (listing the valid ones), for a missing
 * optional package (naming the npm package to install), for 'native' where its addon is not
 * built (saying how to build it), for a precision other than 'fp32' on a backend other than
 * 'native', or if the backend fails to initialise.
 */
export async function initBackend(
  name: string,
  opts: { threads?: number; precision?: Precision } = {},
): Promise<void> {
  check(
    (BACKENDS as readonly string[]).includes(name),
    `unknown backend '${name}': expected one of ${BACKENDS.join(', ')}`,
  );
  const backend = name as BackendName;
  const { threads, precision = 'fp32' } = opts;
  check(
    (PRECISIONS as readonly string[]).includes(precision),
    `unknown precision '${precision}': expected one of ${PRECISIONS.join(', ')}`,
  );
  checkPrecision(precision, backend);
  check(
    threads === undefined || (Number.isInteger(threads) && threads >= 1),
    `threads must be a positive integer, got ${threads}`,
  );
  registerExtensions();
  // saved tensors share their data without an Identity kernel and tape node each (saved-tensors.ts)
  shareSavedTensors();
  if (backend === 'wasm' && threads !== undefined)
    wasmBackend.setThreadsCount(threads);
  if (backend === 'tensorflow' && threads !== undefined)
    process.env.TF_NUM_INTRAOP_THREADS ??= String(threads);
  // navigator.gpu before the backend package is imported
  const dawn = backend === 'webgpu' ? await installDawn() : undefined;
  // WGSL's f16 type for a policy computing in f16 (backend/webgpu-f16.ts's kernels)
  if (dawn) requestShaderF16(policyOf(precision).compute === 'float16');
  if (backend === 'tensorflow' || backend === 'webgpu')
    await loadOptional(backend);
  // dispatches per submit where LAYERWISE_WEBGPU_SUBMIT_BATCH sets it (backend/gpu-queue.ts)
  if (backend === 'webgpu')
    setSubmitBatch(process.env.LAYERWISE_WEBGPU_SUBMIT_BATCH);
  // LAYERWISE_WEBGPU_KERNELS=tfjs keeps TF.js's own webgpu kernels and the composed forms: the
  // "plain TF.js webgpu" of `npm run bench -- gpu`
  if (backend === 'webgpu' && process.env.LAYERWISE_WEBGPU_KERNELS !== 'tfjs')
    await registerOwnWebGPUKernels();
  if (backend === 'native') {
    check(
      registerNativeBackend(),
      `backend 'native' is unavailable: ${nativeUnavailable()}; use --backend wasm`,
    );
    // always: setThreads starts this thread's OpenMP team with denormals flushed and signals
    // blocked in its workers (native/src/matmul.cc), which loading the addon no longer does
    const addon = nativeAddon()!;
    addon.setThreads(threads ?? addon.threads());
  }
  let ok: boolean;
  try {
    ok = await tf.setBackend(backend);
  } catch (err) {
    throw new LayerwiseError(
      `backend '${backend}' failed to initialise: ${(err as Error).message}`,
    );
  }
  check(
    ok,
    `backend '${backend}' failed to initialise (see the warning above)`,
  );
  await tf.ready();
  // the host's work per dispatch: uniforms and bind groups kept across steps (backend/webgpu-host.ts)
  if (backend === 'webgpu' && process.env.LAYERWISE_WEBGPU_KERNELS !== 'tfjs')
    (await import('./webgpu-host.js')).cutDispatchHostWork(tf.backend());
  // a kernel whose gradient leaves an output's gradient unread (kernel-names.ts
  // UNREAD_OUTPUT_GRADIENTS) gets the tape's placeholder: made now, before any backward counts tensors
  if ([...UNREAD_OUTPUT_GRADIENTS.keys()].some((k) => tf.getKernel(k, backend)))
    unreadGradient();
  await holdAtPrecision(backend, precision, dawn?.description);
}

/**
 * Gives this thread's initialised `backend` the run's precision policy: the policy it holds
 * tensors in (native, webgpu: backend/low-precision.ts devicePolicy; set at each
 * initialisation, so that a later fp32 run in the thread keeps no f16 run's), webgpu's f16
 * copies of saved activations where the policy stores them so, and f16 products where it
 * computes in f16 (which need an adapter with shader-f16: Mesa's lavapipe has it, Dawn's
 * OpenGL backend not; `adapterName` for the error).
 * @throws LayerwiseError naming the fix where f16 products have no shader-f16.
 */
async function holdAtPrecision(
  backend: string,
  precision: Precision,
  adapterName: string | undefined,
): Promise<void> {
  const policy = policyOf(precision);
  if (backend === 'native')
    (tf.backend() as NativeBackend).precision = precision;
  if (backend === 'webgpu') {
    (tf.backend() as { precision?: Precision }).precision = precision;
    if (policy.storage.saved === 'float16')
      (await import('./webgpu-f16.js')).installF16Saved(tf.backend());
  }
  if (policy.compute === 'float16') {
    const gpu = (globalThis as { navigator?: { gpu?: GPUWithAdapters } })
      .navigator?.gpu;
    const adapter = await gpu?.requestAdapter();
    check(
      adapter?.features?.has('shader-f16') === true,
      `--precision f16 needs a webgpu adapter with the shader-f16 feature; this one (${adapterName ?? 'unknown'}) has none: use --precision fp32, or a GPU (or Mesa's lavapipe) that has it`,
    );
    const { registerF16Products } = await import('./webgpu-f16.js');
    registerF16Products(policy);
  }
}

/** layerwise's WGSL kernels over TF.js's stock ones and the composed forms, for 'webgpu' in this thread. */
async function registerOwnWebGPUKernels(): Promise<void> {
  // the fused ops over the composed forms (backend/webgpu-kernels.ts)
  (await import('./webgpu-kernels.js')).registerWebGPUKernels();
  (await import('./webgpu-attention.js')).registerWebGpuAttention();
  (await import('./webgpu-gather.js')).registerWebGpuGather();
  // the products (BatchMatMul, _FusedMatMul) as tiled WGSL of ours (backend/webgpu-matmul.ts)
  (await import('./webgpu-matmul.js')).registerWebGPUMatMul();
  // the MLP's product + bias + GELU in one dispatch (backend/webgpu-matmul-gelu.ts)
  (await import('./webgpu-matmul-gelu.js')).registerWebGPUDenseGelu();
}

interface GPUWithAdapters {
  requestAdapter(): Promise<{ features?: ReadonlySet<string> } | null>;
}

/**
 * Lets the thread's backend finish and free its resources before the thread is stopped: a
 * webgpu device's queue is drained and the device destroyed (a worker thread terminated while
 * Dawn still works on its GPU queue crashed the process with SIGSEGV). No-op elsewhere.
 */
export async function releaseBackend(): Promise<void> {
  if (tf.engine().backendName !== 'webgpu') return;
  const b = tf.backend() as unknown as {
    device?: {
      queue: { onSubmittedWorkDone(): Promise<void> };
      destroy(): void;
    };
  };
  tf.disposeVariables();
  await b.device?.queue.onSubmittedWorkDone();
  b.device?.destroy();
}

/**
 * Size in bytes of the wasm backend's linear memory (heap) if the active backend is 'wasm', else
 * `undefined`. This is a high-water mark: wasm memory grows but never shrinks, and it includes
 * XNNPACK's packed weights and freed blocks. (The bytes held in tensors, and their exact peak,
 * come from backend/memory.ts, on every backend.)
 */
export function backendHeapBytes(): number | undefined {
  if (tf.getBackend() !== 'wasm') return undefined;
  const backend = tf.backend() as unknown as { wasm: { HEAPU8: Uint8Array } };
  return backend.wasm.HEAPU8.byteLength;
}
