/**
 * The npm package `webgpu` (Dawn's Node bindings) for the browser bundle: the browser's own
 * `navigator.gpu` (in the page or a Web Worker), so backend/webgpu.ts's installDawn asks it
 * for an adapter as it asks Dawn in Node.
 */

/** The browser's WebGPU entry point, whatever flags are asked for (the browser chooses). */
export function create(_flags: string[]): unknown {
  const gpu = (globalThis.navigator as { gpu?: unknown } | undefined)?.gpu;
  if (!gpu) throw new Error('this browser has no WebGPU (navigator.gpu)');
  return gpu;
}

export const globals: Record<string, unknown> = {};

export default { create, globals };
