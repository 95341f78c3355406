/**
 * WebGPU in Node: Dawn's Node bindings (the npm package `webgpu`, prebuilt for linux-x64/arm64,
 * Windows and macOS) give a thread `navigator.gpu`, which `@tensorflow/tfjs-backend-webgpu`
 * needs before it is imported. The adapter is the machine's GPU where Dawn finds one (Vulkan,
 * Metal, D3D12) or a Vulkan software GPU (Mesa >= 24's lavapipe: `.ci/run` installs Mesa 25 from
 * bookworm-backports); without one, Mesa's software rasteriser through Dawn's OpenGL backend at
 * the 'compatibility' feature level (Debian 12's own lavapipe, Mesa 22, is too old for Dawn).
 * The main thread sets EGL_PLATFORM=surfaceless for devices on machines without a display
 * ({@link configureWebGPUEnvironment}): a worker thread's process.env does not reach native code.
 *
 * TF.js's synchronous reads (dataSync, arraySync) do not work on webgpu in Node (they need an
 * OffscreenCanvas); read with `await t.data()`.
 */
import { isMainThread } from 'node:worker_threads';
import { LayerwiseError } from '../util/errors.js';

/** What {@link installDawn} found. */
export interface DawnAdapter {
  /** The adapter's description, e.g. 'OpenGL version 4.5 (Core Profile) Mesa 22.3.6'. */
  description: string;
  /** The Dawn backend flags that gave it ([] for Dawn's default choice). */
  flags: string[];
  featureLevel: 'core' | 'compatibility';
}

let installed: DawnAdapter | undefined;

/**
 * Sets, in the main thread (where it reaches native code), what Dawn needs in device threads:
 * EGL_PLATFORM=surfaceless where there is no display, so Mesa's EGL runs headless.
 */
export function configureWebGPUEnvironment(): void {
  if (isMainThread && !process.env.DISPLAY && !process.env.WAYLAND_DISPLAY)
    process.env.EGL_PLATFORM ??= 'surfaceless';
}

configureWebGPUEnvironment();

/**
 * Installs Dawn's WebGPU as this thread's `navigator.gpu` (and the GPU* globals), choosing the
 * first adapter that works: Dawn's default backend at the core feature level, then OpenGL and
 * OpenGL ES at the compatibility level (a software GPU). LAYERWISE_DAWN_FLAGS (comma-separated
 * Dawn flags, e.g. `backend=vulkan`; a word without '=' continues the flag before it, so
 * `enable-dawn-features=disable_robustness,skip_validation` is one flag: {@link dawnFlags})
 * overrides the choice. Idempotent per thread.
 * @throws LayerwiseError when the package does not load or no adapter is found, saying what to install.
 */
export async function installDawn(): Promise<DawnAdapter> {
  if (installed) return installed;
  let mod: {
    create: (flags: string[]) => GPUish;
    globals: Record<string, unknown>;
  };
  try {
    mod = (await import('webgpu')) as unknown as typeof mod;
  } catch (e) {
    throw new LayerwiseError(
      `backend 'webgpu' needs the npm package webgpu (Dawn's Node bindings), which did not load: ${(e as Error).message.split('\n')[0]}; run npm ci`,
    );
  }
  Object.assign(globalThis, mod.globals);
  const given = process.env.LAYERWISE_DAWN_FLAGS;
  const tries: Array<[string[], 'core' | 'compatibility']> =
    given !== undefined
      ? [
          [dawnFlags(given), 'core'],
          [dawnFlags(given), 'compatibility'],
        ]
      : [
          [[], 'core'],
          [['backend=opengl'], 'compatibility'],
          [['backend=opengles'], 'compatibility'],
        ];
  for (const [flags, featureLevel] of tries) {
    const gpu = mod.create(flags);
    const adapter = await gpu.requestAdapter({ featureLevel });
    if (!adapter) continue;
    // TF.js asks for its own adapter: give it this one's flags and feature level
    const request = gpu.requestAdapter.bind(gpu);
    gpu.requestAdapter = async (o: Record<string, unknown> = {}) =>
      withShaderF16(await request({ ...o, featureLevel }));
    const nav = ((globalThis as { navigator?: object }).navigator ??=
      {}) as object;
    Object.defineProperty(nav, 'gpu', { value: gpu, configurable: true });
    installed = {
      description:
        adapter.info?.description || adapter.info?.vendor || 'unknown adapter',
      flags,
      featureLevel,
    };
    return installed;
  }
  throw new LayerwiseError(
    "backend 'webgpu' found no GPU adapter: no GPU driver (Vulkan, Metal, D3D12) and no OpenGL through EGL; " +
      'on Debian/Ubuntu without a GPU, apt-get install libegl1 libegl-mesa0 libgl1-mesa-dri for a software GPU',
  );
}

/**
 * Dawn's `create` flags of LAYERWISE_DAWN_FLAGS: split at commas, a word without '=' joined to
 * the flag before it (Dawn's toggle lists are comma-separated themselves):
 * `backend=vulkan,enable-dawn-features=a,b` is ['backend=vulkan', 'enable-dawn-features=a,b'].
 * @throws LayerwiseError when the first word has no '=' (Dawn takes only key=value flags).
 */
export function dawnFlags(given: string): string[] {
  const flags: string[] = [];
  for (const word of given.split(',').filter(Boolean)) {
    if (word.includes('=')) flags.push(word);
    else if (flags.length > 0) flags[flags.length - 1] += `,${word}`;
    else
      throw new LayerwiseError(
        `LAYERWISE_DAWN_FLAGS: '${word}' is not a key=value flag (e.g. backend=vulkan or enable-dawn-features=disable_robustness)`,
      );
  }
  return flags;
}

/** The slice of Dawn's GPU object used here. */
interface GPUish {
  requestAdapter(o?: Record<string, unknown>): Promise<AdapterIsh | null>;
}

/** The slice of a GPUAdapter used here. */
interface AdapterIsh {
  info?: { description?: string; vendor?: string };
  features?: ReadonlySet<string>;
  requestDevice?(d?: { requiredFeatures?: unknown[] }): Promise<DeviceIsh>;
}

/** The slice of a GPUDevice used here. */
interface DeviceIsh {
  createShaderModule(d: { code: string; label?: string }): unknown;
}

let shaderF16Wanted = false;

/**
 * Asks that the devices this thread's adapters create from now on have the `shader-f16`
 * feature where the adapter has it (WGSL's f16 type; backend/webgpu-f16.ts's kernels), for a
 * policy that computes in f16 (backend/precision.ts `compute === 'float16'`). Call before the
 * backend's device is made (TF.js makes it once per thread, at the first `tf.setBackend('webgpu')`).
 */
export function requestShaderF16(wanted: boolean): void {
  shaderF16Wanted = wanted;
}

/**
 * WGSL's `enable f16;` must come before every declaration, but TF.js's program prelude
 * (makeShader) comes before a program's code: a shader whose code says `enable f16;` gets
 * the directive moved to the top of the module.
 */
export const ENABLE_F16 = 'enable f16;';

function hoistEnableF16(code: string): string {
  return code.includes(ENABLE_F16)
    ? `${ENABLE_F16}\n${code.replaceAll(ENABLE_F16, '')}`
    : code;
}

/**
 * `adapter` whose requestDevice adds `shader-f16` to the required features when
 * {@link requestShaderF16} asked for it and the adapter has it, and whose devices hoist
 * {@link ENABLE_F16} in the shaders they compile.
 */
function withShaderF16(adapter: AdapterIsh | null): AdapterIsh | null {
  const requestDevice = adapter?.requestDevice?.bind(adapter);
  if (!adapter || !requestDevice) return adapter;
  adapter.requestDevice = async (d = {}) => {
    const f16 = shaderF16Wanted && adapter.features?.has('shader-f16');
    const device = await requestDevice(
      f16
        ? {
            ...d,
            requiredFeatures: [...(d.requiredFeatures ?? []), 'shader-f16'],
          }
        : d,
    );
    const compile = device.createShaderModule.bind(device);
    device.createShaderModule = (m) =>
      compile({ ...m, code: hoistEnableF16(m.code) });
    return device;
  };
  return adapter;
}
