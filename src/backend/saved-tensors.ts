/**
 * Saving a tensor for the backward without a kernel. tfjs-core 4.22's engine saves each tensor
 * a gradient needs (`saveTensorsForBackwardMode`, and a customGrad's `save`) as
 * `keep(clone(t))`, and its `clone` runs the `Identity` kernel through the whole `runKernel`
 * path and records a tape node for it. On the backends here `Identity` shares the data (a
 * reference count: tfjs-backend-cpu's, which native uses, tfjs-backend-webgpu's and
 * wasm-layout.ts's), so all that work makes a second handle on the same data: 166 kernel runs
 * and tape nodes of a charlm-small training step, about 25 us of engine work each on native.
 * {@link shareSavedTensors} replaces the engine's `clone` (used only for those saves) by the
 * sharing itself: a new tensor on the same data id, the backend's reference count raised, no
 * kernel, no tape node (a saved copy is read only by gradient functions, never by a forward
 * op, so no gradient flows through the dropped node). Other backends (tfjs-node's
 * `tensorflow`), and a tensor whose data is on another backend than the engine's, keep the
 * stock clone.
 */
import { tf } from './tfjs.js';

/** Backends whose `Identity` kernel shares its input's data (a reference count), as the saves here do. */
const SHARING: ReadonlySet<string> = new Set([
  'cpu',
  'native',
  'webgpu',
  'wasm',
]);

/** The engine fields {@link shareSavedTensors} reads (tfjs-core engine.ts, internal to 4.x). */
interface CloningEngine {
  clone(x: tf.Tensor): tf.Tensor;
  backend: tf.KernelBackend;
  backendName: string;
  state: {
    tensorInfo: { get(id: object): { backend: tf.KernelBackend } | undefined };
  };
  makeTensorFromTensorInfo(
    info: tf.TensorInfo,
    backend?: tf.KernelBackend,
  ): tf.Tensor;
}

const installed = new WeakSet<object>();

/**
 * Makes this thread's engine save tensors for the backward by sharing their data (see the
 * module's comment). Idempotent; bit-identical results (the same data is read).
 */
export function shareSavedTensors(): void {
  const engine = tf.engine() as unknown as CloningEngine;
  if (installed.has(engine)) return;
  installed.add(engine);
  const stock = engine.clone;
  engine.clone = function (this: CloningEngine, x: tf.Tensor): tf.Tensor {
    const info = this.state.tensorInfo.get(x.dataId);
    if (
      info === undefined ||
      info.backend !== this.backend ||
      !SHARING.has(this.backendName)
    )
      return stock.call(this, x);
    const y = this.makeTensorFromTensorInfo(
      { dataId: x.dataId, shape: x.shape, dtype: x.dtype },
      info.backend,
    );
    info.backend.incRef(x.dataId);
    return y;
  };
}
