/**
 * A dense layer with bias as one op on every backend: DENSE_KERNEL (backend/kernel-names.ts),
 * y = x w + b with x [..., Din], w [Din, Dout], b [Dout] (float32) -> [..., Dout].
 *
 * Why: model/layers.ts dense gave the backend's `_FusedMatMul` its operands as [1, rows, Din] and
 * [1, Din, Dout] through three Reshape ops (x in, w in, y out). Each is a kernel run, a tape node
 * and, in the backward, a Reshape of its gradient: six of a dense layer's ten kernel runs, 102 of
 * charlm-small's 254 a step, host work that does not shrink with cores (native) and costs
 * tens of microseconds each through TF.js's webgpu backend. Here the forward is one op: its
 * kernel runs the backend's own `_FusedMatMul` on views of x and w (the same data under those
 * shapes, as TF.js's Reshape kernel returns them), and its gradient (backend/matmul-grad.ts) runs
 * the same products and bias sum, on views, as the reshaped product's did. Same kernels on the
 * same shapes: the same numbers, bit for bit.
 */
import * as tf from '@tensorflow/tfjs-core';
import { checkDenseGelu, DENSE_KERNEL } from './kernel-names.js';

/** `t`'s data seen with `shape` (same size; the caller keeps `t` alive while the view is read). */
export function view(t: tf.TensorInfo, shape: number[]): tf.TensorInfo {
  return { dataId: t.dataId, shape, dtype: t.dtype };
}

/**
 * Runs the current backend's kernel `kernelName` on `inputs` directly, outside the engine (no
 * tape node, not in `tf.profile`), and returns its single output: a TensorInfo, or a tensor
 * where the kernel is composed of ops.
 * @throws Error where the backend has no such kernel.
 */
function runKernelDirectly(
  kernelName: string,
  inputs: Record<string, tf.TensorInfo>,
  attrs: tf.NamedAttrMap,
  backend: unknown = tf.backend(),
): tf.TensorInfo {
  const backendName = tf.getBackend();
  const kernel = tf.getKernel(kernelName, backendName);
  if (!kernel)
    throw new Error(`backend ${backendName} has no ${kernelName} kernel`);
  return kernel.kernelFunc({
    inputs: inputs as tf.NamedTensorInfoMap,
    attrs,
    backend: backend as tf.KernelBackend,
  }) as tf.TensorInfo;
}

/**
 * Runs the current backend's kernel `kernelName` on `inputs` (tensors or {@link view}s) and
 * returns its single output as a tensor of `shape` (the output's size): one kernel run, no
 * Reshape op and no tape node, for use where no tape records (a gradient function). The engine
 * does not run it, so `tf.profile` does not list it; kernel wrappers (the kernels bench) and the
 * webgpu counters do. Outputs a kernel returns as tensors (a composed kernel's) are reshaped by
 * the op.
 * @throws Error where the backend has no such kernel.
 */
export function kernelOnViews(
  kernelName: string,
  inputs: Record<string, tf.TensorInfo>,
  attrs: tf.NamedAttrMap,
  shape: number[],
): tf.Tensor {
  const out = runKernelDirectly(kernelName, inputs, attrs);
  if (out instanceof tf.Tensor) return reshaped(out, shape);
  return tf.engine().makeTensorFromTensorInfo({ ...out, shape });
}

/** `t` as `shape` by the Reshape op, `t` disposed (itself where it has that shape). */
function reshaped(t: tf.Tensor, shape: number[]): tf.Tensor {
  if (tf.util.arraysEqual(t.shape, shape)) return t;
  const r = tf.reshape(t, shape);
  t.dispose();
  return r;
}

/**
 * DENSE_KERNEL's kernel for whatever backend runs it: that backend's `_FusedMatMul` (looked up
 * at each call, so the native backend's copy of this registration runs native's product) on x
 * as [1, rows, Din] and w as [1, Din, Dout] plus b, returned as [..., Dout].
 */
function denseKernel({
  inputs,
  backend,
}: {
  inputs: tf.NamedTensorInfoMap;
  backend: unknown;
}): tf.TensorInfo {
  const { x, w, b } = inputs as Record<'x' | 'w' | 'b', tf.TensorInfo>;
  const [rows, din, dout] = checkDenseGelu(x, w, b, DENSE_KERNEL);
  const shape = [...x.shape.slice(0, -1), dout];
  const out = runKernelDirectly(
    '_FusedMatMul',
    { a: view(x, [1, rows, din]), b: view(w, [1, din, dout]), bias: b! },
    {
      transposeA: false,
      transposeB: false,
      activation: 'linear',
      leakyreluAlpha: 0.2,
    },
    backend,
  );
  if (out instanceof tf.Tensor) return reshaped(out, shape);
  return { ...out, shape };
}

/**
 * Registers DENSE_KERNEL for the backend `backendName` unless it has one. Safe to call again.
 * (The native backend copies the cpu backend's registration; the kernel finds the running
 * backend's product at each call.)
 */
export function registerDenseKernel(backendName: string): void {
  if (tf.getKernel(DENSE_KERNEL, backendName) !== undefined) return;
  tf.registerKernel({
    kernelName: DENSE_KERNEL,
    backendName,
    kernelFunc: denseKernel as unknown as tf.KernelFunc,
  });
}

/**
 * x W + b as one `_FusedMatMul` kernel, x: [..., Din], w: [Din, Dout], b: [Dout] -> [...,
 * Dout], where DENSE_KERNEL is not registered (TF.js used without initBackend; and the
 * reference DENSE_KERNEL equals bit for bit, model/layers.test.ts; and the MLP's composed dense +
 * GELU, composed-kernels.ts). Not `tf.fused.matMul`: that op
 * wraps the kernel in a tf.customGrad, whose gradient computes dx, dW and db at once; the
 * kernel run directly takes the gradient registered for it (backend/matmul-grad.ts), one lazy
 * closure per input, so a zero-bubble schedule's split
 * backward (pipeline/split-backward.ts) computes dx in its input part and dW, db in its weight
 * part. Same kernels, same numbers. x goes to the kernel's [1, N, Din] in one reshape and the
 * product comes back in one (not through [N, Din] and [N, Dout]): each reshape in a recorded
 * forward is three kernel runs (it, the clone the tape saves of its input, its gradient), which
 * were most of a step's kernel runs.
 */
export function fusedDense(
  x: tf.Tensor,
  w: tf.Tensor,
  b: tf.Tensor,
): tf.Tensor {
  const din = x.shape[x.shape.length - 1] as number;
  const dout = w.shape[1] as number;
  const a3 = tf.reshape(x, [1, x.size / din, din]);
  const b3 = tf.reshape(w, [1, din, dout]);
  const y = tf
    .engine()
    .runKernel(
      '_FusedMatMul',
      { a: a3, b: b3, bias: b } as unknown as tf.NamedTensorMap,
      {
        transposeA: false,
        transposeB: false,
        activation: 'linear',
        leakyreluAlpha: 0.2,
      },
    ) as tf.Tensor;
  return tf.reshape(y, [...x.shape.slice(0, -1), dout]);
}

/** Backends found to run DENSE_KERNEL (kernels are registered once and stay: a yes is kept). */
const denseBackends = new Set<string>();

/**
 * Whether the current backend runs DENSE_KERNEL (it is registered and the backend has
 * `_FusedMatMul`): two kernel-registry lookups the first time a backend answers yes, one set
 * lookup after (model/layers.ts asks at every dense layer).
 */
export function hasDenseKernel(): boolean {
  const backendName = tf.getBackend();
  if (denseBackends.has(backendName)) return true;
  const yes =
    tf.getKernel(DENSE_KERNEL, backendName) !== undefined &&
    tf.getKernel('_FusedMatMul', backendName) !== undefined;
  if (yes) denseBackends.add(backendName);
  return yes;
}
