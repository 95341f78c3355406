/**
 * The one place layerwise imports TensorFlow.js's core with its gradients.
 *
 * `@tensorflow/tfjs-core`'s Node bundle ships the ops and the engine but registers no
 * gradients: they are registered by the `@tensorflow/tfjs` union package's bundle (the
 * official way; tfjs-core's own `register_all_gradients` is an ES module with extension-less
 * imports that Node cannot load). Importing this module once per thread makes `tf.grads` work
 * for every stock op.
 */
import '@tensorflow/tfjs';
import * as tf from '@tensorflow/tfjs-core';

export { tf };

/**
 * TF.js's CPU backend (`MathBackendCPU`, which the native backend extends) prints, on its first
 * tensor in Node, "Hi, looks like you are running TensorFlow.js in Node.js. To speed things up
 * dramatically, install our node backend": advice that does not apply here (layerwise has its
 * own native backend). The banner is gated by the instance's private `firstUse` flag
 * (tfjs-backend-cpu backend_cpu.js, `write`), so the registered factory is wrapped to clear it;
 * every other TF.js warning still prints.
 */
function silenceNodeBanner(): void {
  type Quiet = { firstUse?: boolean };
  const made = (tf.engine() as unknown as { registry: Record<string, Quiet> })
    .registry.cpu;
  if (made) {
    made.firstUse = false;
    return;
  }
  const factory = tf.findBackendFactory('cpu');
  if (!factory) return;
  tf.removeBackend('cpu');
  tf.registerBackend(
    'cpu',
    () => {
      const b = factory() as unknown as Quiet;
      b.firstUse = false;
      return b as unknown as tf.KernelBackend;
    },
    1, // tfjs-backend-cpu's own priority
  );
}
silenceNodeBanner();

/**
 * Replaces `backendName`'s stock kernel `kernelName` by `wrap(stock)`, where `stock` is the
 * kernel function it replaces (for the cases the replacement leaves to it); the stock kernel's
 * setup and dispose functions are kept. One mechanism for every override of a backend package's
 * own kernel (the webgpu products, column sums, gather and f16 rounding; the wasm products and
 * layout kernels). Once per thread and kernel: a second call would wrap the wrapper.
 * @throws Error naming the kernel when the backend has none of that name (its package is not
 *   loaded yet: initBackend loads it first).
 */
export function wrapStockKernel(
  kernelName: string,
  backendName: string,
  wrap: (stock: tf.KernelFunc) => tf.KernelFunc,
): void {
  const stock = tf.getKernel(kernelName, backendName);
  if (stock === undefined)
    throw new Error(
      `${backendName} has no stock ${kernelName} kernel to wrap: load its backend package first (initBackend('${backendName}'))`,
    );
  tf.unregisterKernel(kernelName, backendName);
  tf.registerKernel({ ...stock, kernelFunc: wrap(stock.kernelFunc) });
}
