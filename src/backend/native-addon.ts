/**
 * Loading layerwise's N-API addon (native/, C++ on oneDNN and OpenMP), without TF.js: the
 * native backend (backend/native.ts) and the parameter server's host optimizer
 * (param-server/host-optimizer.ts) both use it. Built by `npm ci` where libdnnl-dev and a C++
 * compiler are installed; elsewhere {@link nativeAddon} is null and {@link nativeUnavailable}
 * says why. Each thread that loads it gets its own OpenMP team and flushes denormals to zero.
 */
import { createRequire } from 'node:module';
import { isMainThread } from 'node:worker_threads';

/**
 * Makes OpenMP's idle threads sleep rather than spin for long (OMP_WAIT_POLICY=passive, unless the
 * user chose a policy): several devices share the machine's cores, and one device's idle team must
 * not take cycles from another device's threads. Where the user chose neither a policy nor a spin
 * count, an idle team member first spins GOMP_SPINCOUNT=100000 rounds (about 2.5 ms on a 2026
 * Xeon) before it sleeps: kernels follow each other within microseconds in a step, and waking a
 * sleeping thread for each of them cost charlm-small's fp32 step at 2 threads about 5% (its
 * speedup over 1 thread 1.73-1.77x asleep, 1.80-1.81x spinning; `npm run bench -- kernels
 * --threads 1,2`), while a device waiting for its neighbours still gives its cores back within
 * milliseconds. libgomp reads the variable once, when the addon
 * first loads in any thread, and only the main thread's process.env reaches the C environment,
 * so the main thread calls this before it starts a device or optimizer thread
 * (runtime/device.ts, param-server/server.ts), and this module calls it when loaded there.
 * (The addon is linked NODELETE, so a worker thread that exits never unloads it, or libgomp,
 * under the OpenMP threads it started: that crashed the process.)
 */
export function configureOpenMP(): void {
  if (!isMainThread) return;
  if (
    process.env.OMP_WAIT_POLICY === undefined &&
    process.env.GOMP_SPINCOUNT === undefined
  )
    process.env.GOMP_SPINCOUNT = '100000';
  process.env.OMP_WAIT_POLICY ??= 'passive';
}

configureOpenMP();

/** The addon's functions (native/src/addon.cc). Arrays are read and written in place. */
export interface NativeAddon {
  /**
   * c[i] = op(a[i]) @ op(b[i]) for i < batch, row-major; a[i] starts at i * aStride (0:
   * broadcast), likewise b; c is [batch, m, n]; op(a) is [m, k], op(b) is [k, n].
   */
  matmul(
    a: Float32Array,
    b: Float32Array,
    c: Float32Array,
    batch: number,
    aStride: number,
    bStride: number,
    m: number,
    n: number,
    k: number,
    transA: boolean,
    transB: boolean,
  ): void;
  /**
   * AdamW over p (see native/src/kernels.h); step is 1-based. In place, or into pOut, mOut and
   * vOut when given (all of p's length; RangeError otherwise).
   */
  adamw(
    p: Float32Array,
    g: Float32Array,
    m: Float32Array,
    v: Float32Array,
    lr: number,
    beta1: number,
    beta2: number,
    epsilon: number,
    weightDecay: number,
    step: number,
    gradScale: number,
    pOut?: Float32Array,
    mOut?: Float32Array,
    vOut?: Float32Array,
  ): void;
  /**
   * AdamW over many parameters in one OpenMP region (native/src/kernels.h adamwMulti): p[j],
   * g[j], m[j], v[j] and the outputs pOut[j], mOut[j], vOut[j] (which may be the inputs) all of
   * p[j]'s length; the first `decayed` parameters get `weightDecay`, the rest none; step is
   * 1-based. The same values as {@link adamw} on each. `pBf16[j]`, where given (p[j]'s length),
   * gets the bf16 rounding of the new p[j] (as toBf16 of pOut[j]). TypeError / RangeError on
   * arrays that are not Float32Arrays (Uint16Arrays) or whose counts or lengths differ.
   */
  adamwMulti(
    p: Float32Array[],
    g: Float32Array[],
    m: Float32Array[],
    v: Float32Array[],
    pOut: Float32Array[],
    mOut: Float32Array[],
    vOut: Float32Array[],
    lr: number,
    beta1: number,
    beta2: number,
    epsilon: number,
    weightDecay: number,
    decayed: number,
    step: number,
    gradScale: number,
    pBf16?: Array<Uint16Array | null>,
  ): void;
  /**
   * out[j] = sum of x[j]'s squares (each square in float32, summed in double, rounded to
   * float32), in one OpenMP region over all of them; out has x.length elements (RangeError otherwise).
   */
  sumSquaresMulti(x: Float32Array[], out: Float32Array): void;
  /** SGD (with momentum when `velocity` is given) over p: in place, or into pOut and velocityOut when given. */
  sgd(
    p: Float32Array,
    g: Float32Array,
    velocity: Float32Array | null,
    lr: number,
    momentum: number,
    weightDecay: number,
    gradScale: number,
    pOut?: Float32Array,
    velocityOut?: Float32Array | null,
  ): void;
  /** out = a op b with broadcasting (op: op code: Add 0, Sub 1, Multiply 2, RealDiv 3, Maximum 4, Minimum 5, SquaredDifference 6). */
  binary(
    op: number,
    a: Float32Array,
    aShape: number[],
    b: Float32Array,
    bShape: number[],
    out: Float32Array,
    outShape: number[],
  ): void;
  /** out = op(x) element-wise (op: op code, see backend/native.ts). */
  /** `param`: Step's alpha (the output where x <= 0). */
  unary(op: number, x: Float32Array, out: Float32Array, param?: number): void;
  /** out[r] = op(x[r, :]) over `inner` elements for r < outer (op: Sum 0, Mean 1, Max 2, Min 3). */
  reduce(
    op: number,
    x: Float32Array,
    out: Float32Array,
    outer: number,
    inner: number,
  ): void;
  /** out[j] = op(x[:, j]) over `outer` rows for j < inner (op: Sum 0, Mean 1, Max 2, Min 3); x float32 or bf16 values. */
  reduceOuter(
    op: number,
    x: Float32Array | Uint16Array,
    out: Float32Array,
    outer: number,
    inner: number,
  ): void;
  /** out = x with axes permuted by perm. */
  transpose(
    x: Float32Array,
    shape: number[],
    perm: number[],
    out: Float32Array,
  ): void;
  /** Softmax over the last axis of x [rows, cols]. */
  softmax(x: Float32Array, out: Float32Array, rows: number, cols: number): void;
  /** out[s, :] = sum of data[r, :] where ids[r] == s. */
  segmentSum(
    data: Float32Array,
    ids: Int32Array,
    out: Float32Array,
    n: number,
    inner: number,
    segments: number,
  ): void;
  /** out[o, j, :] = x[o, indices[j], :] for x [outer, axisSize, inner]. */
  gather(
    x: Float32Array,
    indices: Int32Array,
    out: Float32Array,
    outer: number,
    axisSize: number,
    inner: number,
  ): void;
  /** GELU (tanh approximation, model/layers.ts) element-wise. */
  gelu(x: Float32Array, out: Float32Array): void;
  /**
   * GELU of `x` (float32, or bf16 values) written only as its bf16 rounding into `out` (the same
   * values as toBf16 of gelu's output), with no float32 output. RangeError on a length mismatch.
   */
  geluToBf16(x: Float32Array | Uint16Array, out: Uint16Array): void;
  /** dy * GELU'(x) (each float32 or bf16 values), written only as its bf16 rounding into `dx`, as geluToBf16. */
  geluGradToBf16(
    x: Float32Array | Uint16Array,
    dy: Float32Array | Uint16Array,
    dx: Uint16Array,
  ): void;
  /** out = a op b (op as `binary`) for a and b of out's length, each float32 or bf16 values (bf16-only activations, read without widening them whole). */
  binarySameShape(
    op: number,
    a: Float32Array | Uint16Array,
    b: Float32Array | Uint16Array,
    out: Float32Array,
  ): void;
  /** layerNorm with x float32 or bf16 values, y and xhat written only as their bf16 roundings into `yBf` and `xhatBf`. */
  layerNormToBf16(
    x: Float32Array | Uint16Array,
    g: Float32Array,
    b: Float32Array,
    yBf: Uint16Array,
    xhatBf: Uint16Array,
    rstd: Float32Array,
    rows: number,
    cols: number,
    epsilon: number,
  ): void;
  /** layerNormGrad with dy and xhat each float32 or bf16 values. */
  layerNormGradAny(
    dy: Float32Array | Uint16Array,
    xhat: Float32Array | Uint16Array,
    rstd: Float32Array,
    g: Float32Array,
    dx: Float32Array,
    dg: Float32Array,
    db: Float32Array,
    rows: number,
    cols: number,
  ): void;
  /** dx = dy * GELU'(x) element-wise. */
  geluGrad(x: Float32Array, dy: Float32Array, dx: Float32Array): void;
  /** Layer norm over the last axis of x [rows, cols]: writes y and xhat [rows, cols] and rstd [rows]. */
  layerNorm(
    x: Float32Array,
    g: Float32Array,
    b: Float32Array,
    y: Float32Array,
    xhat: Float32Array,
    rstd: Float32Array,
    rows: number,
    cols: number,
    epsilon: number,
  ): void;
  /** Layer norm's gradient: writes dx [rows, cols], dg and db [cols]. */
  layerNormGrad(
    dy: Float32Array,
    xhat: Float32Array,
    rstd: Float32Array,
    g: Float32Array,
    dx: Float32Array,
    dg: Float32Array,
    db: Float32Array,
    rows: number,
    cols: number,
  ): void;
  /** Causal softmax of scale * x over the last axis of x [batch, t, t] (row i sees columns 0..i). */
  causalSoftmax(
    x: Float32Array,
    out: Float32Array,
    batch: number,
    t: number,
    scale: number,
  ): void;
  /**
   * The causal softmax's gradient over [batch, t, t]: row i's dx = scale * y * (dy - sum(dy * y))
   * over columns 0..i, and 0 beyond (dy's masked columns are not read).
   */
  causalSoftmaxGrad(
    y: Float32Array,
    dy: Float32Array,
    dx: Float32Array,
    batch: number,
    t: number,
    scale: number,
  ): void;
  /**
   * Fused causal self-attention: from qkv [B, T, 3, H, dh] writes ctx [B, T, H, dh] and the
   * attention probabilities p [B, H, T, T] (causal softmax of scale * q k^T).
   */
  causalAttention(
    qkv: Float32Array,
    ctx: Float32Array,
    p: Float32Array,
    batch: number,
    t: number,
    heads: number,
    dh: number,
    scale: number,
  ): void;
  /**
   * The bf16 run's attention (as causalAttention with bf16 products, float32 accumulation and
   * float32 softmax): `qkv` float32 or bf16 values, the probabilities and the context written
   * only as their bf16 roundings into `pBf` and `ctxBf`. Throws on a length mismatch or a oneDNN
   * failure.
   */
  causalAttentionToBf16(
    qkv: Float32Array | Uint16Array,
    pBf: Uint16Array,
    batch: number,
    t: number,
    heads: number,
    dh: number,
    scale: number,
    ctxBf: Uint16Array,
  ): void;
  /** The bf16 run's attention gradient: dctx, qkv and P each float32 or bf16 values; dqkv written only as its bf16 rounding into `dqkvBf`. */
  causalAttentionGradToBf16(
    dctx: Float32Array | Uint16Array,
    qkv: Float32Array | Uint16Array,
    p: Float32Array | Uint16Array,
    batch: number,
    t: number,
    heads: number,
    dh: number,
    scale: number,
    dqkvBf: Uint16Array,
  ): void;
  /** Its gradient: writes dqkv [B, T, 3, H, dh] from dctx [B, T, H, dh], qkv and p. */
  causalAttentionGrad(
    dctx: Float32Array,
    qkv: Float32Array,
    p: Float32Array,
    dqkv: Float32Array,
    batch: number,
    t: number,
    heads: number,
    dh: number,
    scale: number,
  ): void;
  /**
   * Mean softmax cross-entropy of logits [rows, classes] (float32, or bf16 values: widened a row
   * at a time inside the parallel loop, the same bits as widening them first) against labels
   * [rows]; writes the probabilities [rows, classes]; returns the loss (nats).
   */
  softmaxCrossEntropy(
    logits: Float32Array | Uint16Array,
    labels: Int32Array,
    probs: Float32Array,
    rows: number,
    classes: number,
  ): number;
  /** dlogits = (probs - onehot(labels)) * dyOverRows. */
  softmaxCrossEntropyGrad(
    probs: Float32Array,
    labels: Int32Array,
    dlogits: Float32Array,
    rows: number,
    classes: number,
    dyOverRows: number,
  ): void;
  /**
   * dst[i] = src[i] rounded to bfloat16 (nearest even; NaN stays NaN): the upper 16 bits of the
   * float32 pattern. Vectorised (vcvtne2ps2bf16 where built for AVX512-BF16). RangeError if dst
   * is shorter than src.
   */
  toBf16(src: Float32Array, dst: Uint16Array): void;
  /** dst[i] = the bf16 src[i] widened to float32 (exact). */
  fromBf16(src: Uint16Array, dst: Float32Array): void;
  /**
   * {@link matmul} with bfloat16 operands and float32 accumulation and C, on oneDNN's bf16
   * matmul primitive: a and b each bf16 values (Uint16Array) or float32 values (Float32Array,
   * converted per call into a per-thread scratch); aStride 0 or m * k, bStride 0 or k * n
   * (RangeError otherwise). Returns the oneDNN implementation that ran (e.g.
   * "brg:avx512_core_bf16"; on a CPU without bf16 instructions the bf16-rounded operands are
   * multiplied by sgemm, "emulated: ...").
   */
  matmulBf16(
    a: Float32Array | Uint16Array,
    b: Float32Array | Uint16Array,
    c: Float32Array,
    batch: number,
    aStride: number,
    bStride: number,
    m: number,
    n: number,
    k: number,
    transA: boolean,
    transB: boolean,
  ): string;
  /**
   * {@link matmulBf16} written only as C's bf16 rounding into `cBf` (oneDNN's bf16 destination:
   * float32 sums, rounded once), `bias` (float32 [n]) added to every row before the rounding. k
   * must be positive. RangeError on bad sizes; Error on a oneDNN failure.
   */
  matmulBf16To(
    a: Float32Array | Uint16Array,
    b: Float32Array | Uint16Array,
    cBf: Uint16Array,
    bias: Float32Array | undefined,
    batch: number,
    aStride: number,
    bStride: number,
    m: number,
    n: number,
    k: number,
    transA: boolean,
    transB: boolean,
  ): void;
  /**
   * What bf16 runs on here: oneDNN's effective ISA (e.g. "avx512_core_bf16"), whether the CPU
   * has bf16 dot-product instructions (avx512_bf16 or AMX), and the conversion's instructions.
   */
  bf16Info(): { isa: string; nativeBf16: boolean; conversion: string };
  /** Sets this thread's OpenMP team size. */
  setThreads(n: number): void;
  /** This thread's OpenMP team size. */
  threads(): number;
  /**
   * CPU seconds each member of this thread's OpenMP team has run so far (the thread's own CPU
   * clock), member 0 (this thread: the JS and every serial part of a kernel) first; length
   * threads(). Differences over a step split its work into what the team shared and what ran
   * on this thread alone, whatever else the machine runs.
   */
  teamCpuSeconds(): number[];
  /**
   * Binds this thread's OpenMP team to `cpus` (native/src/affinity.cc): member i (threads()
   * members, this thread member 0) runs on `cpus[i % cpus.length]` only, with sched_setaffinity
   * (Linux; elsewhere a no-op returning []), so a thread device's kernels stay on cores of its own
   * (runtime/pinning.ts). Returns each member's CPUs read back, member 0 first. Call it after
   * setThreads: members a larger team adds later inherit this thread's CPU.
   * @throws RangeError for an empty list, a CPU that is not an integer from 0 to 1023, or a CPU the
   * process may not run on (taskset, cgroup cpuset, container), naming it.
   */
  pinTeam(cpus: number[]): number[][];
  /** The CPUs each member of this thread's OpenMP team may run on (sched_getaffinity), member 0 first; [] off Linux. */
  teamAffinity(): number[][];
}

/** Where `npm ci` builds the addon (native/binding.gyp), from dist/backend/. */
const ADDON_PATH = '../../native/build/Release/layerwise_native.node';

let addon: NativeAddon | null | undefined;
let unavailable = '';

/** The addon, loaded once per thread, or null when it is not built or does not load (see {@link nativeUnavailable}). */
export function nativeAddon(): NativeAddon | null {
  if (addon === undefined) {
    try {
      addon = createRequire(import.meta.url)(ADDON_PATH) as NativeAddon;
    } catch (e) {
      addon = null;
      const msg = (e as Error).message.split('\n')[0] ?? '';
      unavailable = /Cannot find module/.test(msg)
        ? 'the native addon is not built (npm ci builds it where libdnnl-dev and a C++ compiler are installed: apt-get install libdnnl-dev g++, then npm rebuild layerwise or npm ci)'
        : `the native addon does not load: ${msg}`;
    }
  }
  return addon;
}

/** Why the native backend is unavailable ('' when it is available). */
export function nativeUnavailable(): string {
  nativeAddon();
  return unavailable;
}

/** One call of a native addon function: its name and its arguments (arrays by reference). */
export interface AddonCall {
  name: string;
  args: unknown[];
  /** Wall ms the call took when recorded. */
  ms: number;
  /** What the call returned (a softmax cross-entropy's loss; most return nothing). */
  result?: unknown;
}

/** The addon's functions that set or read its OpenMP team rather than compute: never recorded. */
const TEAM_FUNCTIONS: ReadonlySet<string> = new Set([
  'setThreads',
  'threads',
  'teamCpuSeconds',
  'pinTeam',
  'teamAffinity',
  'bf16Info',
]);

/**
 * Runs `run` with every computing function of this thread's addon recorded as it is called (the
 * team's own, {@link TEAM_FUNCTIONS}, are not), each with its wall time, and returns the calls in
 * order (a call is listed once it returns: one inside another, none in this addon, would precede
 * it); the addon is as
 * before once it returns or throws. Arrays are recorded by reference, so replaying the calls
 * ({@link replayAddonCalls}) runs the same kernels on the same buffers, whatever those hold by
 * then: the kernels bench's replayed step (bench/kernels.ts), a training step's kernels without
 * TF.js between them.
 * @throws Error where the addon is not loaded ({@link nativeUnavailable} says why), and what
 * `run` throws.
 */
export function recordAddonCalls(run: () => void): AddonCall[] {
  const recording = startAddonRecording();
  try {
    run();
  } finally {
    recording.stop();
  }
  return recording.calls;
}

/** A recording of this thread's addon calls in progress ({@link startAddonRecording}). */
export interface AddonRecording {
  /** The calls so far, in order. */
  readonly calls: AddonCall[];
  /** Ends the recording (the addon as before); a second call does nothing. */
  stop(): void;
}

/**
 * Starts recording every computing function of this thread's addon as {@link recordAddonCalls}
 * does, until `stop()`: for a recording that spans more than one function's run (a training
 * step's forward and backward, pipeline/native-capture.ts). Recordings do not nest.
 * @throws Error where the addon is not loaded, or a recording is in progress.
 */
export function startAddonRecording(): AddonRecording {
  const lib = nativeAddon() as unknown as Record<string, unknown> | null;
  if (!lib) throw new Error(`no native addon: ${nativeUnavailable()}`);
  if (recordingNow) throw new Error('an addon recording is in progress');
  const calls: AddonCall[] = [];
  const originals = new Map<string, (...args: unknown[]) => unknown>();
  for (const [name, f] of Object.entries(lib)) {
    if (typeof f !== 'function' || TEAM_FUNCTIONS.has(name)) continue;
    const fn = f as (...args: unknown[]) => unknown;
    originals.set(name, fn);
    lib[name] = (...args: unknown[]) => {
      const t0 = performance.now();
      const result = fn.apply(lib, args);
      calls.push({ name, args, ms: performance.now() - t0, result });
      return result;
    };
  }
  recordingNow = true;
  return {
    calls,
    stop() {
      if (originals.size === 0) return;
      for (const [name, fn] of originals) lib[name] = fn;
      originals.clear();
      recordingNow = false;
    },
  };
}

let recordingNow = false;

/** Calls each of `calls` ({@link recordAddonCalls}) again, in order, on this thread's addon; returns what each returned. */
export function replayAddonCalls(calls: readonly AddonCall[]): unknown[] {
  const lib = nativeAddon() as unknown as Record<
    string,
    (...args: unknown[]) => unknown
  >;
  return calls.map((c) => lib[c.name]!.apply(lib, c.args));
}
