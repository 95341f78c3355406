/**
 * `--precision f16` on the webgpu backend (issue 23 item 6): the matrix products take their
 * operands rounded to IEEE half precision (f16) and accumulate in float32, the numerics of
 * f16 products on GPUs (Micikevicius et al., ICLR 2018); everything else (norms, softmax, the
 * loss, gradient sums, master weights, optimizer state) stays float32. TF.js 4.22's webgpu
 * kernels are float32 only, so the operands are rounded by a shader of ours
 * ({@link RoundF16Program}: nearest-even on the bits, f16's subnormals, values past f16's range
 * made infinite so that loss scaling sees the overflow) before the backend's own BatchMatMul and _FusedMatMul
 * run: f16 numerics, float32 storage and speed (documented as such in README). The adapter must
 * have `shader-f16` (backend/index.ts checks); the device is made with it (backend/webgpu.ts
 * requestShaderF16) and GELU and its gradient then compute in f16 arithmetic
 * (backend/webgpu-kernels.ts useF16Arithmetic).
 */
import {
  type WebGPUProgram,
  webgpu_util,
} from '@tensorflow/tfjs-backend-webgpu';
import { tf } from './tfjs.js';
import { useF16Arithmetic } from './webgpu-kernels.js';

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
    // integer rounding of the mantissa to f16's 10 bits, nearest-even (GPU compilers may fold a
    // pack2x16float/unpack2x16float pair into nothing); f16's subnormals (below 2^-14) are
    // multiples of 2^-24; 65520 and beyond round to infinity; NaN stays NaN
    return `
      fn main(index : i32) {
        if (index < uniforms.size) {
          let a = getAByOutputIndex(index);
          let bits = bitcast<u32>(a);
          var r : f32;
          if ((bits & 0x7fffffffu) > 0x7f800000u) {
            r = a;
          } else if (abs(a) < 6.103515625e-05) {
            r = round(a * 16777216.0) / 16777216.0;
          } else {
            let lsb = (bits >> 13u) & 1u;
            r = bitcast<f32>((bits + 0xfffu + lsb) & 0xffffe000u);
            if (abs(r) > 65504.0) {
              r = sign(a) * uniforms.INFINITY;
            }
          }
          setOutputAtIndex(index, r);
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
 * Makes this thread's webgpu BatchMatMul and _FusedMatMul round their two operands to f16
 * first (forward and backward: the gradients' products are BatchMatMuls too), and GELU and its
 * gradient compute in f16 where the device has shader-f16. Once per thread.
 */
export function registerF16Products(): void {
  if (registered) return;
  registered = true;
  useF16Arithmetic(true);
  for (const name of PRODUCTS) {
    const stock = tf.getKernel(name, 'webgpu');
    if (!stock) throw new Error(`webgpu has no ${name} kernel to round`);
    tf.unregisterKernel(name, 'webgpu');
    tf.registerKernel({
      kernelName: name,
      backendName: 'webgpu',
      kernelFunc: ({ inputs, backend, attrs }) => {
        const b = backend as unknown as WebGPUBackendish;
        const round = (t: tf.TensorInfo) =>
          b.runWebGPUProgram(new RoundF16Program(t.shape), [t], 'float32');
        const a16 = round(inputs.a as tf.TensorInfo);
        const b16 = round(inputs.b as tf.TensorInfo);
        try {
          return stock.kernelFunc({
            inputs: { ...inputs, a: a16, b: b16 },
            backend,
            attrs,
          });
        } finally {
          b.disposeData(a16.dataId);
          b.disposeData(b16.dataId);
        }
      },
    });
  }
}

/** Rounds `t` to f16 on this thread's webgpu backend (a new tensor; for tests). */
export function roundF16(t: tf.Tensor): tf.Tensor {
  const b = tf.backend() as unknown as WebGPUBackendish;
  const info = b.runWebGPUProgram(new RoundF16Program(t.shape), [t], 'float32');
  return tf.engine().makeTensorFromTensorInfo(info);
}
