/**
 * `--precision f16` on the webgpu backend (issue 23 item 6): the matrix products take their
 * operands rounded to IEEE half precision (f16) and accumulate in float32, the numerics of
 * f16 products on GPUs (Micikevicius et al., ICLR 2018); everything else (norms, softmax, the
 * loss, gradient sums, master weights, optimizer state) stays float32. layerwise's own products
 * (backend/webgpu-matmul.ts) round the operands as their tiles are loaded, in their one
 * dispatch; TF.js 4.22's stock kernels (LAYERWISE_WEBGPU_KERNELS=tfjs) are float32 only, so
 * there the operands are rounded by a shader of ours first ({@link RoundF16Program}:
 * nearest-even on the bits, f16's subnormals, values past f16's range made infinite so that
 * loss scaling sees the overflow). f16 numerics, float32 storage (documented as such in
 * README). The adapter must
 * have `shader-f16` (backend/index.ts checks); the device is made with it (backend/webgpu.ts
 * requestShaderF16) and GELU and its gradient then compute in f16 arithmetic
 * (backend/webgpu-kernels.ts useF16Arithmetic).
 */
import {
  type WebGPUProgram,
  webgpu_util,
} from '@tensorflow/tfjs-backend-webgpu';
import type { PrecisionPolicy } from './precision.js';
import { tf, wrapStockKernel } from './tfjs.js';
import { useF16Arithmetic } from './webgpu-kernels.js';
import { ownsWebGPUProducts, setProductOperands } from './webgpu-matmul.js';
import { ROUND_F16_WGSL } from './wgsl/matmul.js';

/** Rounds every element of a float32 tensor to the nearest f16 value and back (overflow: +-Infinity). */
class RoundF16Program implements WebGPUProgram {
  readonly variableNames = ['A'];
  readonly size = true;
  readonly workgroupSize: [number, number, number] = [64, 1, 1];
  readonly shaderKey = 'layerwise_round_f16';
  readonly outputShape: number[];
  readonly dispatchLayout: { x: number[] };
  readonly dispatch: [number, number, number];
  constructor(shape: number[]) {
    this.outputShape = shape;
    this.dispatchLayout = webgpu_util.flatDispatchLayout(shape);
    this.dispatch = webgpu_util.computeDispatch(
      this.dispatchLayout,
      shape,
      this.workgroupSize,
    );
  }
  getUserCode(): string {
    // the rounding is wgsl/matmul.ts's, which layerwise's own products apply as they load
    return `
      ${ROUND_F16_WGSL}
      fn main(index : i32) {
        if (index < uniforms.size) {
          setOutputAtIndex(index, roundF16(getAByOutputIndex(index)));
        }
      }
    `;
  }
}

interface WebGPUBackendish {
  runWebGPUProgram(
    p: WebGPUProgram,
    inputs: tf.TensorInfo[],
    dtype: tf.DataType,
  ): tf.TensorInfo;
  disposeData(id: object): void;
}

/** The products whose operands {@link registerF16Products} rounds. */
const PRODUCTS = ['BatchMatMul', '_FusedMatMul'] as const;

let registered = false;

/**
 * Makes this thread's webgpu BatchMatMul and _FusedMatMul take their two operands in the
 * policy's compute format, f16 (forward and backward: the gradients' products are BatchMatMuls
 * too), and GELU and its gradient compute in f16 where the device has shader-f16. Where the
 * products are layerwise's (backend/webgpu-matmul.ts) they round the operands as they load
 * them, in their one dispatch; TF.js's stock kernels (LAYERWISE_WEBGPU_KERNELS=tfjs) are wrapped
 * to round both operands first (two dispatches more). Once per thread.
 * @throws Error for a policy whose compute format is not float16.
 */
export function registerF16Products(policy: PrecisionPolicy): void {
  if (registered) return;
  if (policy.compute !== 'float16')
    throw new Error(
      `registerF16Products is for a policy computing in float16, not ${policy.compute} (${policy.name})`,
    );
  registered = true;
  useF16Arithmetic(true);
  if (ownsWebGPUProducts()) {
    setProductOperands(policy.compute);
    return;
  }
  for (const name of PRODUCTS)
    wrapStockKernel(name, 'webgpu', (stock) => ({ inputs, backend, attrs }) => {
      const b = backend as unknown as WebGPUBackendish;
      const round = (t: tf.TensorInfo) =>
        b.runWebGPUProgram(new RoundF16Program(t.shape), [t], 'float32');
      const a16 = round(inputs.a as tf.TensorInfo);
      const b16 = round(inputs.b as tf.TensorInfo);
      try {
        return stock({
          inputs: { ...inputs, a: a16, b: b16 },
          backend,
          attrs,
        });
      } finally {
        b.disposeData(a16.dataId);
        b.disposeData(b16.dataId);
      }
    });
}

/** Rounds `t` to f16 on this thread's webgpu backend (a new tensor; for tests). */
export function roundF16(t: tf.Tensor): tf.Tensor {
  const b = tf.backend() as unknown as WebGPUBackendish;
  const info = b.runWebGPUProgram(new RoundF16Program(t.shape), [t], 'float32');
  return tf.engine().makeTensorFromTensorInfo(info);
}
