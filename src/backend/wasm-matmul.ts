/**
 * Fast matrix products on the TF.js wasm backend.
 *
 * Why the stock kernels are slow (tfjs-backend-wasm src/cc/batch_mat_mul_impl.cc, 4.22): the C++
 * `fused_batch_mat_mul` takes XNNPACK's fully-connected GEMM only when
 * `!transpose_a && !transpose_b && a_batch == 1 && b_batch == 1`. Every other case (any transpose,
 * any batch > 1: all matmul gradients and attention) falls into `slow_batch_matmul`, a scalar
 * blocked triple loop running at about 0.8 GFLOP/s, 10-20x slower than XNNPACK.
 *
 * These kernels route every float32 product to that fast path: transposed operands are transposed
 * explicitly (wasm Transpose kernel, memory-bound), a batched `a` times an unbatched `b` is folded
 * into one GEMM of `batch*M` rows, and a truly batched product runs one GEMM per batch item on
 * zero-copy views of the heap (with broadcasting of batch dimensions). XNNPACK packs `b` once per
 * C-side tensor id and caches the packed copy until that tensor is disposed, so a weight matrix
 * used untransposed as `b` is packed only once.
 */
import * as tf from '@tensorflow/tfjs-core';
import { broadcastIndex } from './broadcast.js';
import { wrapStockKernel } from './tfjs.js';
import {
  type Attrs,
  makeView,
  release,
  releaseView,
  runWasm,
  type WasmBackend,
  wasmId,
} from './wasm-util.js';

type RawMatMul = (
  aId: number,
  aShape: Uint8Array,
  aRank: number,
  bId: number,
  bShape: Uint8Array,
  bRank: number,
  transposeA: boolean,
  transposeB: boolean,
  outId: number,
) => void;

const rawByModule = new WeakMap<object, RawMatMul>();

/** The C entry point `BatchMatMul` of this backend's wasm module (cwrap'ed once per module). */
function rawMatMul(backend: WasmBackend): RawMatMul {
  let raw = rawByModule.get(backend.wasm);
  if (raw === undefined) {
    raw = backend.wasm.cwrap('BatchMatMul', null, [
      'number',
      'array',
      'number',
      'number',
      'array',
      'number',
      'number',
      'number',
      'number',
    ]) as RawMatMul;
    rawByModule.set(backend.wasm, raw);
  }
  return raw;
}

const shapeBytes = (shape: number[]): Uint8Array =>
  new Uint8Array(new Int32Array(shape).buffer);

/** XNNPACK GEMM out[M,N] = a[M,K] @ b[K,N] on C-side tensor ids (rows of `a` may span a batch). */
function gemm(
  backend: WasmBackend,
  aId: number,
  bId: number,
  outId: number,
  m: number,
  k: number,
  n: number,
): void {
  const aShape = [1, m, k];
  const bShape = [1, k, n];
  rawMatMul(backend)(
    aId,
    shapeBytes(aShape),
    3,
    bId,
    shapeBytes(bShape),
    3,
    false,
    false,
    outId,
  );
}

/** `x` with its last two axes swapped, as a new contiguous tensor. */
function transposeLast2(backend: WasmBackend, x: tf.TensorInfo): tf.TensorInfo {
  const r = x.shape.length;
  const perm = [...Array(r - 2).keys(), r - 1, r - 2];
  return runWasm(backend, 'Transpose', { x }, { perm });
}

/** Operands brought to plain row-major form: a is [...batchA, M, K], b is [...batchB, K, N]. */
interface Plain {
  a: tf.TensorInfo;
  b: tf.TensorInfo;
  temps: tf.TensorInfo[];
  m: number;
  k: number;
  n: number;
  outBatch: number[];
  outShape: number[];
}

function plainOperands(
  backend: WasmBackend,
  a: tf.TensorInfo,
  b: tf.TensorInfo,
  attrs: Attrs,
): Plain {
  const transposeA = attrs.transposeA === true;
  const transposeB = attrs.transposeB === true;
  const [a0, a1] = a.shape.slice(-2) as [number, number];
  const [b0, b1] = b.shape.slice(-2) as [number, number];
  const [m, k] = transposeA ? [a1, a0] : [a0, a1];
  const [kb, n] = transposeB ? [b1, b0] : [b0, b1];
  tf.util.assert(
    k === kb,
    () =>
      `Error in matMul: inner shapes (${k}) and (${kb}) of Tensors with shapes ${a.shape} and ` +
      `${b.shape} and transposeA=${transposeA} and transposeB=${transposeB} must match.`,
  );
  const outBatch = tf.broadcast_util.assertAndGetBroadcastShape(
    a.shape.slice(0, -2),
    b.shape.slice(0, -2),
  );
  const temps: tf.TensorInfo[] = [];
  const empty = m * n * k * tf.util.sizeFromShape(outBatch) === 0;
  const pa = transposeA && !empty ? transposeLast2(backend, a) : a;
  const pb = transposeB && !empty ? transposeLast2(backend, b) : b;
  if (pa !== a) temps.push(pa);
  if (pb !== b) temps.push(pb);
  return {
    a: pa,
    b: pb,
    temps,
    m,
    k,
    n,
    outBatch,
    outShape: [...outBatch, m, n],
  };
}

/** out = a @ b for plain operands, via XNNPACK; returns a new float32 tensor of `p.outShape`. */
function plainMatMul(backend: WasmBackend, p: Plain): tf.TensorInfo {
  const out = backend.makeOutput(p.outShape, 'float32');
  const { m, k, n } = p;
  const batch = tf.util.sizeFromShape(p.outBatch);
  if (batch * m * n === 0) return out;
  if (k === 0) {
    (backend.typedArrayFromHeap(out) as Float32Array).fill(0);
    return out;
  }
  const batchB = tf.util.sizeFromShape(p.b.shape.slice(0, -2));
  if (batchB === 1) {
    // a's batch folds into the rows of one GEMM; b keeps its own id, so its packing is cached.
    gemm(
      backend,
      wasmId(backend, p.a),
      wasmId(backend, p.b),
      wasmId(backend, out),
      batch * m,
      k,
      n,
    );
    return out;
  }
  const ia = broadcastIndex(p.outBatch, p.a.shape.slice(0, -2));
  const ib = broadcastIndex(p.outBatch, p.b.shape.slice(0, -2));
  for (let i = 0; i < batch; i++) {
    const va = makeView(backend, p.a, ia[i]! * m * k, m * k);
    const vb = makeView(backend, p.b, ib[i]! * k * n, k * n);
    const vo = makeView(backend, out, i * m * n, m * n);
    gemm(backend, va, vb, vo, m, k, n);
    releaseView(backend, va);
    releaseView(backend, vb);
    releaseView(backend, vo);
  }
  return out;
}

/** op(a) @ op(b) computed as written: explicit transposes, then XNNPACK. */
function direct(
  backend: WasmBackend,
  a: tf.TensorInfo,
  b: tf.TensorInfo,
  transposeA: boolean,
  transposeB: boolean,
): tf.TensorInfo {
  const p = plainOperands(backend, a, b, { transposeA, transposeB });
  const out = plainMatMul(backend, p);
  release(backend, ...p.temps);
  return out;
}

/**
 * Relative cost per element of XNNPACK packing the right operand (done on each fresh tensor id;
 * `xnn_pack_f32_gemm_io_w` reads it column-strided) against an explicit transpose
 * (wasm-layout.ts, cache-blocked). Measured on charlm-small shapes: packing [4096,1024] ~70 ms,
 * transposing it ~18 ms.
 */
const PACK_COST = 4;

/**
 * op(a) @ op(b), either directly or as (op(b)^T @ op(a)^T)^T, whichever moves fewer elements
 * (in transpose-equivalents): an explicit transpose moves its size; XNNPACK packs the right
 * operand (K*N) on each fresh tensor id at {@link PACK_COST} per element. Direct:
 * (tA ? MK : 0) + (tB ? KN : 0) + PACK_COST KN. Swapped: (tB ? 0 : KN) + (tA ? 0 : MK) +
 * PACK_COST MK + MN (the result is transposed back). An untransposed product is always direct,
 * so a weight `b` keeps its cached packing. Example: the weight gradient x[4096,256]^T @
 * dy[4096,1024] packs 4M elements direct (17M) but transposes dy and packs x swapped (8.3M).
 */
function product(
  backend: WasmBackend,
  a: tf.TensorInfo,
  b: tf.TensorInfo,
  tA: boolean,
  tB: boolean,
): tf.TensorInfo {
  const [a0, a1] = a.shape.slice(-2) as [number, number];
  const [b0, b1] = b.shape.slice(-2) as [number, number];
  const [m, k] = tA ? [a1, a0] : [a0, a1];
  const n = tB ? b0 : b1;
  const directCost = (tA ? m * k : 0) + (tB ? k * n : 0) + PACK_COST * k * n;
  const swappedCost =
    (tB ? 0 : k * n) + (tA ? 0 : m * k) + PACK_COST * m * k + m * n;
  if ((!tA && !tB) || directCost <= swappedCost || k !== (tB ? b1 : b0))
    return direct(backend, a, b, tA, tB);
  const outT = direct(backend, b, a, !tB, !tA);
  const out = transposeLast2(backend, outT);
  release(backend, outT);
  return out;
}

/** Kernel function for `BatchMatMul` on wasm: same contract as the stock kernel, fast for all cases. */
function batchMatMul(orig: tf.KernelFunc): tf.KernelFunc {
  return (args) => {
    const { a, b } = args.inputs as { a: tf.TensorInfo; b: tf.TensorInfo };
    if (a.dtype !== 'float32' || b.dtype !== 'float32') return orig(args);
    const attrs = args.attrs as Attrs;
    return product(
      args.backend as WasmBackend,
      a,
      b,
      attrs.transposeA === true,
      attrs.transposeB === true,
    );
  };
}

const ACTIVATION_KERNEL: Record<string, string> = {
  relu: 'Relu',
  relu6: 'Relu6',
  elu: 'Elu',
  sigmoid: 'Sigmoid',
  leakyrelu: 'LeakyRelu',
  prelu: 'Prelu',
};

/**
 * Kernel function for `_FusedMatMul` on wasm. Hands the stock kernel plain operands (explicit
 * transposes, batch folded into rows) when it can, else computes matmul, bias add and activation
 * as separate fast kernels.
 */
function fusedMatMul(orig: tf.KernelFunc): tf.KernelFunc {
  return (args) => {
    const inputs = args.inputs as Record<string, tf.TensorInfo | undefined>;
    const {
      a,
      b,
      bias,
      preluActivationWeights: prelu,
    } = inputs as Record<string, tf.TensorInfo>;
    if (a!.dtype !== 'float32' || b!.dtype !== 'float32') return orig(args);
    const backend = args.backend as WasmBackend;
    const attrs = args.attrs as Attrs;
    const p = plainOperands(backend, a!, b!, attrs);
    const batchB = tf.util.sizeFromShape(p.b.shape.slice(0, -2));
    const vectorish = (t: tf.TensorInfo | undefined) =>
      t === undefined || t.shape.length <= 1;
    let out: tf.TensorInfo;
    if (batchB === 1 && p.k > 0 && vectorish(bias) && vectorish(prelu)) {
      const rows = tf.util.sizeFromShape(p.outBatch) * p.m;
      const a3 = {
        dataId: p.a.dataId,
        shape: [1, rows, p.k],
        dtype: p.a.dtype,
      };
      const b3 = { dataId: p.b.dataId, shape: [1, p.k, p.n], dtype: p.b.dtype };
      const plainAttrs = { ...attrs, transposeA: false, transposeB: false };
      out = orig({
        ...args,
        inputs: { ...inputs, a: a3, b: b3 },
        attrs: plainAttrs,
      }) as tf.TensorInfo;
      out.shape = p.outShape;
    } else {
      out = plainMatMul(backend, p);
      if (bias !== undefined) {
        const sum = runWasm(backend, 'Add', { a: out, b: bias });
        release(backend, out);
        out = sum;
      }
      const activation = String(attrs.activation ?? 'linear');
      const kernel = ACTIVATION_KERNEL[activation];
      if (kernel !== undefined) {
        const inputs: Record<string, tf.TensorInfo> =
          kernel === 'Prelu' ? { x: out, alpha: prelu! } : { x: out };
        const act = runWasm(backend, kernel, inputs, {
          alpha: attrs.leakyreluAlpha,
        });
        release(backend, out);
        out = act;
      } else if (activation !== 'linear') {
        throw new Error(
          `_FusedMatMul: activation ${activation} is not supported on wasm`,
        );
      }
    }
    release(backend, ...p.temps);
    return out;
  };
}

/**
 * Replace the wasm backend's `BatchMatMul` and `_FusedMatMul` kernels by the fast versions above
 * (keeping each stock kernel for non-float32 inputs and its setup function). Idempotent only via
 * the caller: call once per thread, before or after the wasm backend is initialised.
 */
export function registerWasmMatMul(): void {
  for (const [name, make] of [
    ['BatchMatMul', batchMatMul],
    ['_FusedMatMul', fusedMatMul],
  ] as const) {
    wrapStockKernel(name, 'wasm', make);
  }
}
