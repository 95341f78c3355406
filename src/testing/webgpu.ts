/**
 * Skip reasons for tests that need a WebGPU adapter: `false` where the test can run, else one
 * line saying what is missing (node:test's `skip` prints it).
 */
import { installDawn } from '../backend/webgpu.js';

/** False where Dawn gives this process a WebGPU adapter with shader-f16 (Mesa's lavapipe has it); else why not. */
export async function noShaderF16(): Promise<string | false> {
  try {
    await installDawn();
    const gpu = (
      globalThis as {
        navigator?: {
          gpu?: {
            requestAdapter(): Promise<{ features: Set<string> } | null>;
          };
        };
      }
    ).navigator?.gpu;
    const a = await gpu?.requestAdapter();
    return a?.features.has('shader-f16')
      ? false
      : 'the webgpu adapter here has no shader-f16';
  } catch (e) {
    return `no WebGPU adapter here: ${(e as Error).message}`;
  }
}
