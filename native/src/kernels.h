// layerwise native kernels: declarations shared by the N-API glue (addon.cc) and the kernels.
#pragma once
#include <algorithm>
#include <cstdint>
#include <functional>
#include <string>
#include <utility>
#include <vector>
#ifdef _OPENMP
#include <omp.h>
#endif
#if defined(__AVX2__) || defined(__AVX512F__)
#include <immintrin.h>
#endif

namespace layerwise {

// dst[0, n) = src[0, n), the whole 64-byte lines of dst written with non-temporal (streaming)
// stores, which skip reading each line before writing it (the read-for-ownership): for a kernel
// output that no kernel reads before it has left the caches anyway (AdamW's new p, m, v, layer
// norm's xhat for the backward), one pass of memory traffic less. The partial lines at either end
// are stored normally. Streaming stores are weakly ordered: the writing thread calls
// streamFence() before its output is read by another thread (before the end of its parallel
// region). A plain copy where the compiler does not target AVX-512.
inline void streamCopy(float* dst, const float* src, int64_t n) {
  int64_t i = 0;
#if defined(__AVX512F__)
  for (; i < n && (reinterpret_cast<uintptr_t>(dst + i) & 63) != 0; i++) dst[i] = src[i];
  for (; i + 16 <= n; i += 16) _mm512_stream_ps(dst + i, _mm512_loadu_ps(src + i));
#endif
  for (; i < n; i++) dst[i] = src[i];
}
// This thread's number in its OpenMP team (0 outside a parallel region).
inline int myMember() {
#ifdef _OPENMP
  return omp_get_thread_num();
#else
  return 0;
#endif
}

// The size of this thread's OpenMP team (1 outside a parallel region).
inline int myTeam() {
#ifdef _OPENMP
  return omp_get_num_threads();
#else
  return 1;
#endif
}

// This thread's even share [lo, hi) of `total` items split over its team, inside a parallel
// region (all of them outside one): contiguous, in member order, sizes differing by at most 1.
inline std::pair<int64_t, int64_t> myShare(int64_t total) {
  const int team = myTeam();
  const int64_t t = myMember();
  return {total * t / team, total * (t + 1) / team};
}

// This thread's share [lo, hi) of `total` items as myShare, its ends at multiples of `align` items
// (the last share ends at total): split by whole 64-byte lines (align 16 floats or 8 doubles),
// no two members write one line of a line-aligned array. Members past the lines get [total, total).
inline std::pair<int64_t, int64_t> myAlignedShare(int64_t total, int64_t align) {
  const auto [u0, u1] = myShare((total + align - 1) / align);
  return {std::min(total, u0 * align), std::min(total, u1 * align)};
}

// Inside a parallel region, after a barrier (every partial complete): adds the team's members
// 1.. team-1 partial arrays of n floats (member p's at part + (p - 1) * stride) into out, which
// holds member 0's, in member order, out's whole 64-byte lines split over the team. The same sums
// at any schedule; at one member, out as it is.
inline void addMemberPartials(float* out, const float* part, int64_t stride, int64_t n) {
  const int members = myTeam();
  const auto [lo, hi] = myAlignedShare(n, 64 / sizeof(float));
  for (int p = 1; p < members; p++) {
    const float* q = part + (p - 1) * stride;
#pragma omp simd
    for (int64_t i = lo; i < hi; i++) out[i] += q[i];
  }
}

// The number of threads a parallel region started here would have (omp_get_max_threads, 1
// inside a region, as nested regions are off): what a kernel sizes per-member scratch by.
inline int teamHere() {
#ifdef _OPENMP
  return omp_in_parallel() ? 1 : omp_get_max_threads();
#else
  return 1;
#endif
}

// A scratch array of at least n elements of T, its start 64-byte aligned, kept by the calling
// thread across calls (grown, never shrunk): an array of partial sums allocated on every call
// (hundreds of KiB: malloc may map it afresh, and the team then faults its pages in, every call)
// is allocated once. Each kernel keeps its own (a `thread_local ScratchOf<T>`), so a kernel
// calling another does not reuse its caller's.
template <typename T>
class ScratchOf {
 public:
  T* get(int64_t n) {
    const size_t want = static_cast<size_t>(n) + 64 / sizeof(T);
    if (store_.size() < want) store_.resize(want);
    const uintptr_t p = reinterpret_cast<uintptr_t>(store_.data());
    return reinterpret_cast<T*>((p + 63) & ~uintptr_t{63});
  }

 private:
  std::vector<T> store_;
};

// n rounded up to a multiple of the elements of T in a 64-byte line: the stride of per-member
// partial rows, so that two members' rows never share a line.
template <typename T>
constexpr int64_t lineStride(int64_t n) {
  constexpr int64_t per = 64 / static_cast<int64_t>(sizeof(T));
  return (n + per - 1) / per * per;
}

// Orders this thread's streaming stores before its later stores (sfence).
inline void streamFence() {
#if defined(__AVX2__) || defined(__AVX512F__)
  _mm_sfence();
#endif
}

// Batched row-major matrix product C[i] = op(A[i]) op(B[i]) for i < batch, on oneDNN's sgemm.
// A[i] starts at a + i * aStride (aStride 0: broadcast one matrix), likewise B; C is dense
// [batch, m, n]. op(A) is [m, k] (A stored [k, m] when transA), op(B) is [k, n] (B stored [n, k]
// when transB). Returns 0 or oneDNN's status.
int matmul(const float* a, const float* b, float* c, int64_t batch, int64_t aStride, int64_t bStride,
           int64_t m, int64_t n, int64_t k, bool transA, bool transB);

// Whether a team of `team` threads computes the product C = A^T B (a weight gradient: small
// [m, n], at most 65,536 elements, long reduction k >= 4 max(m, n)) by splitting k
// (splitReduction): never at one thread, whose sums stay oneDNN's own, bit for bit.
bool splitsReduction(int team, int64_t batch, int64_t m, int64_t n, int64_t k, bool transA, bool transB);
// C [m, n] (float32) = sum over the team's k-slices of slice(k0, k1, out): each member computes
// its slice's product alone (oneDNN single-threaded inside the region) into C (member 0) or a
// private partial, then the partials are added into C, the team split over C's elements: the
// float sums in another order than one product's. slice(k0, k1, out) writes out [m, n] = the
// product over rows [k0, k1) of A [k, m] and B [k, n] (k0 a multiple of 64), 0 or a status.
// Returns 0 or a nonzero status a slice returned.
int splitReduction(int64_t m, int64_t n, int64_t k, float* c, const std::function<int(int64_t, int64_t, float*)>& slice);

// Whether a team of `team` threads computes a product of `m` rows (one matrix, m >= n, at least
// 256 rows a member, or LAYERWISE_SPLIT_ROWS_MIN: 0 never) by blocks of rows (splitRows): never
// at one thread.
bool splitsRows(int team, int64_t batch, int64_t m, int64_t n);
// C = op(A) op(B) by contiguous blocks of whole 64-row blocks of op(A) over the team, where the
// element-wise kernels' static schedules put their shares: slice(m0, m1) multiplies rows [m0,
// m1) on the calling member alone (oneDNN single-threaded inside the region). Each C element is
// one product's sum, as oneDNN's single-threaded kernel adds it. Returns 0 or a nonzero status a
// slice returned.
int splitRows(int64_t m, const std::function<int(int64_t, int64_t)>& slice);

// AdamW on n parameters (Loshchilov & Hutter, 2019), the device optimizer's math:
// g' = g * gradScale; m = b1 m + (1-b1) g'; v = b2 v + (1-b2) g'^2;
// p = p * (1 - lr wd) - lr * (m / (1 - b1^t)) / (sqrt(v / (1 - b2^t)) + eps).
// The new p, m, v go to pOut, mOut, vOut, which may be p, m, v themselves (in place).
void adamw(const float* p, const float* g, const float* m, const float* v, float* pOut, float* mOut, float* vOut,
           int64_t n, double lr, double beta1, double beta2, double epsilon, double weightDecay, int64_t step,
           double gradScale);

// One parameter of adamwMulti: its n values p, gradient g, moments m and v, and where the new
// p, m, v go (may be p, m, v themselves).
struct AdamWTensor {
  const float *p, *g, *m, *v;
  float *pOut, *mOut, *vOut;
  int64_t n;
  uint16_t* pBf16 = nullptr;  // where given: the new p's bf16 rounding (as toBf16 of pOut), n elements
};
// adamw() over every tensor of `tensors` in one OpenMP region, the elements of all of them laid
// end to end and split evenly over the team (a stage's 54 parameters of ~0.1 ms each were one
// region each, too short to split); the first `decayed` tensors get weightDecay, the rest none.
// The same bits as adamw() on each tensor.
void adamwMulti(const std::vector<AdamWTensor>& tensors, int64_t decayed, double lr, double beta1, double beta2, double epsilon,
                double weightDecay, int64_t step, double gradScale);
// out[j] = sum of xs[j][i]^2 over i < sizes[j] (each square in float32, summed in double, rounded
// to float32: as the Square then Sum kernels), in one OpenMP region over all elements end to end.
void sumSquaresMulti(const std::vector<const float*>& xs, const std::vector<int64_t>& sizes, float* out);

// SGD on n parameters: v = mu v + (g * gradScale + wd p); p = p - lr v (velocity null: plain SGD,
// p = p - lr (g * gradScale + wd p)). New values to pOut and velOut (may alias p and velocity).
void sgd(const float* p, const float* g, const float* velocity, float* pOut, float* velOut, int64_t n, double lr,
         double momentum, double weightDecay, double gradScale);

int64_t product(const std::vector<int64_t>& shape);

// Element-wise out = a op b with NumPy broadcasting of a and b to outShape.
enum class BinaryOp { Add = 0, Sub = 1, Mul = 2, Div = 3, Max = 4, Min = 5, SquaredDifference = 6 };
bool binary(BinaryOp op, const float* a, const float* b, float* out, const std::vector<int64_t>& aShape,
            const std::vector<int64_t>& bShape, const std::vector<int64_t>& outShape);

// Element-wise out = op(x) over n elements.
enum class UnaryOp { Exp = 0, Log = 1, Sqrt = 2, Rsqrt = 3, Square = 4, Neg = 5, Sigmoid = 6, Tanh = 7, Relu = 8, Abs = 9, Reciprocal = 10, Step = 11, RoundBf16 = 12 };
// param: Step's alpha (the value where x <= 0); unused by the other ops
// RoundBf16: x rounded to bfloat16 (nearest, ties to even; NaN stays a quiet NaN) and widened back
bool unary(UnaryOp op, const float* x, float* out, int64_t n, float param = 0.f);

// GELU (tanh approximation, as x * sigmoid(x (c1 + c2 x^2))) and its gradient dx = dy * GELU'(x).
void gelu(const float* x, float* out, int64_t n);
void geluGrad(const float* x, const float* dy, float* dx, int64_t n);

// An input held as float32 (f32) or as bf16 values (bf16): exactly one of them not null. A bf16
// product operand: its bf16 values when the caller has them (a cached weight, a bf16-only
// activation), else its float32 values, which the product converts into a per-thread scratch
// first; the element-wise kernels below read either. Each element-wise kernel's float32 and
// bf16 entry points (gelu and geluToBf16, layerNorm and layerNormToBf16, ...) are one template
// over its inputs' and outputs' storage types in elementwise.cc, so their numbers are the same.
struct Bf16Operand {
  const float* f32 = nullptr;
  const uint16_t* bf16 = nullptr;
};
// The same, writing only the output's bf16 rounding (no float32 output): the bf16 run's GELU
// output and input gradient, read by products only. Same values as toBf16 of gelu/geluGrad's.
void geluToBf16(const Bf16Operand& x, uint16_t* out, int64_t n);
void geluGradToBf16(const Bf16Operand& x, const Bf16Operand& dy, uint16_t* dx, int64_t n);
// out = a op b element-wise for two inputs of the same n elements, each float32 or bf16.
bool binarySameShape(BinaryOp op, const Bf16Operand& a, const Bf16Operand& b, float* out, int64_t n);

// Layer normalisation over the last axis of x [rows, cols] (model/layers.ts layerNorm):
// xhat = (x - mean) * rstd, rstd = 1 / sqrt(var + epsilon), y = xhat * g + b; and its gradient
// dx = rstd (dy g - mean(dy g) - xhat mean(dy g xhat)), dg = sum_rows dy xhat, db = sum_rows dy.
void layerNorm(const float* x, const float* g, const float* b, float* y, float* xhat, float* rstd, int64_t rows, int64_t cols,
               float epsilon);
void layerNormGrad(const float* dy, const float* xhat, const float* rstd, const float* g, float* dx, float* dg, float* db,
                   int64_t rows, int64_t cols);
// The same with x / dy and xhat held as float32 or bf16 (read row by row, never widened whole);
// layerNormToBf16 writes y and xhat only as their bf16 roundings (xhat as the bf16 run keeps it
// for the gradient): the same values as toBf16 of layerNorm's.
void layerNormToBf16(const Bf16Operand& x, const float* g, const float* b, uint16_t* y, uint16_t* xhat, float* rstd, int64_t rows,
                     int64_t cols, float epsilon);
void layerNormGrad(const Bf16Operand& dy, const Bf16Operand& xhat, const float* rstd, const float* g, float* dx, float* dg, float* db,
                   int64_t rows, int64_t cols);

// out[r] = op(x[r, 0..inner)) for r < outer (sums in double).
enum class ReduceOp { Sum = 0, Mean = 1, Max = 2, Min = 3 };
void reduce(ReduceOp op, const float* x, float* out, int64_t outer, int64_t inner);

// out[j] = op over i < outer of x[i, j] for x [outer, inner] (reducing the leading axes).
void reduceOuter(ReduceOp op, const float* x, float* out, int64_t outer, int64_t inner);
// The same over x held as float32 or bf16 values (a bf16 run's bias gradient, read without widening it whole).
void reduceOuter(ReduceOp op, const Bf16Operand& x, float* out, int64_t outer, int64_t inner);

// out = x with its axes permuted: out.shape[d] = shape[perm[d]].
void transpose(const float* x, float* out, const std::vector<int64_t>& shape, const std::vector<int64_t>& perm);

// Softmax over the last axis of x [rows, cols].
void softmax(const float* x, float* out, int64_t rows, int64_t cols);

// Causal softmax of scale * x over the last axis of x [batch, t, t]: row i sees columns 0..i, the
// rest get 0 (model/layers.ts maskedSoftmax); its gradient dx = scale y (dy - sum(dy y)) per row,
// over columns 0..i, and 0 beyond (neither reads a masked column of x, y or dy).
void causalSoftmax(const float* x, float* out, int64_t batch, int64_t t, float scale);
void causalSoftmaxGrad(const float* y, const float* dy, float* dx, int64_t batch, int64_t t, float scale);
// The same written only as bf16 roundings, row by row while each row is in L1 (the bf16
// attention's P and dscores, both product operands); causalSoftmaxGradToBf16's y float32 or bf16.
// dx may be the memory y.bf16 is in (each row is read before it is written).
void causalSoftmaxToBf16(const float* x, uint16_t* out, int64_t batch, int64_t t, float scale);
void causalSoftmaxGradToBf16(const Bf16Operand& y, const float* dy, uint16_t* dx, int64_t batch, int64_t t, float scale);

// out[s, :] = sum of data[r, :] over rows r with ids[r] == s (ids outside [0, segments) skipped).
void segmentSum(const float* data, const int32_t* ids, float* out, int64_t n, int64_t inner, int64_t segments);

// out[o, j, :] = x[o, indices[j], :] for x [outer, axisSize, inner] (indices checked by the caller).
void gather(const float* x, const int32_t* indices, float* out, int64_t outer, int64_t axisSize, int64_t inner, int64_t count);

// Causal attention's products by blocks of kCausalRows rows: queries [r0, r1) see keys [0, r1)
// only, and keys [r0, r1) are seen by queries [r0, T) only, so a product over a pair's [T, T]
// scores or probabilities skips what the causal mask makes 0 but the blocks on the diagonal:
// at T = 128, a quarter of attention's products (more the longer T). Each block is one product,
// so smaller blocks skip more in more calls.
constexpr int64_t kCausalRows = 64;
// f(r0, r1) for each block of rows [r0, r1) of [0, t), in order
template <typename F>
void forCausalBlocks(int64_t t, F f) {
  for (int64_t r0 = 0; r0 < t; r0 += kCausalRows) f(r0, std::min(t, r0 + kCausalRows));
}
// Whether attention spreads its `pairs` (batch, head) pairs over the OpenMP team (at least two
// a member), each member's products single-threaded; otherwise the pairs run one after another,
// each product on the whole team.
bool spreadPairs(int64_t pairs);
// Causal multi-head self-attention (Vaswani et al., 2017) fused, reading q, k, v in place from
// qkv [B, T, 3, H, dh]: P[b, h] = causalSoftmax(scale q k^T) [T, T] (kept for the gradient, in p
// [B, H, T, T]) and ctx[b, :, h, :] = P v, ctx [B, T, H, dh]. Returns 0 or oneDNN's status.
int causalAttention(const float* qkv, float* ctx, float* p, int64_t batch, int64_t t, int64_t heads, int64_t dh, float scale);
// Its gradient: dqkv [B, T, 3, H, dh] from dctx [B, T, H, dh], qkv and the saved P.
int causalAttentionGrad(const float* dctx, const float* qkv, const float* p, float* dqkv, int64_t batch, int64_t t, int64_t heads,
                        int64_t dh, float scale);

// Mean softmax cross-entropy of logits [rows, classes] against class indices labels [rows]
// (a label outside [0, classes) contributes 0, as a one-hot of it is all zeros); writes the
// softmax probabilities to probs. Its gradient: dlogits = (probs - onehot(labels)) * dyOverRows.
double softmaxCrossEntropy(const float* logits, const int32_t* labels, float* probs, int64_t rows, int64_t classes);
// The same with logits float32 or bf16 values (a bf16 run's logits, read without a float32 copy; the same bits).
double softmaxCrossEntropy(const Bf16Operand& logits, const int32_t* labels, float* probs, int64_t rows, int64_t classes);
void softmaxCrossEntropyGrad(const float* probs, const int32_t* labels, float* dlogits, int64_t rows, int64_t classes, float dyOverRows);
// Geometry of a 2-D convolution or pooling, NHWC (TF.js backend_util.computeConv2DInfo /
// computePool2DInfo): x [batch, inHeight, inWidth, inChannels], filter [filterHeight, filterWidth,
// inChannels, outChannels] (HWIO), y [batch, outHeight, outWidth, outChannels]; dilations as TF
// (1: none); pads in input positions before (top, left) and after (bottom, right). Pooling uses
// outChannels = inChannels and dilation 1.
struct ConvGeometry {
  int64_t batch, inHeight, inWidth, inChannels, filterHeight, filterWidth, outChannels, outHeight, outWidth;
  int64_t strideHeight, strideWidth, dilationHeight, dilationWidth, padTop, padLeft, padBottom, padRight;
};

// Convolution on oneDNN's primitives (conv.cc): y = conv(x, w) (+ bias [outChannels] when not
// null, then ReLU when relu); dx = its gradient for x from dy; dw = its gradient for w. Return 0,
// or oneDNN's status (e.g. a geometry it does not take) with the output unspecified.
// bf16: the inputs (x and w; dy and w; x and dy) converted to bf16, f32 accumulation and outputs
// (emulated, as matmulBf16, where the CPU has no bf16 instructions).
int conv2d(const float* x, const float* w, const float* bias, float* y, const ConvGeometry& g, bool relu, bool bf16 = false);
int conv2dBackpropInput(const float* dy, const float* w, float* dx, const ConvGeometry& g, bool bf16 = false);
int conv2dBackpropFilter(const float* x, const float* dy, float* dw, const ConvGeometry& g, bool bf16 = false);

// Pooling (TF.js cpu semantics): max over the window's input positions (NaN never wins); the
// max pool gradient routes dy to the first maximum of each window in row-major order; the
// average divides by the positions inside the input, its gradient by the whole window's size.
void maxPool(const float* x, float* y, const ConvGeometry& g);
void maxPoolGrad(const float* x, const float* dy, float* dx, const ConvGeometry& g);
void avgPool(const float* x, float* y, const ConvGeometry& g);
void avgPoolGrad(const float* dy, float* dx, const ConvGeometry& g);

// bfloat16 (bf16.cc). dst[i] = src[i] rounded to bf16 (nearest even; NaN stays NaN), the upper
// 16 bits of the float32 pattern; vectorised with vcvtne2ps2bf16 where built for AVX512-BF16.
void toBf16(const float* src, uint16_t* dst, int64_t n);
// toBf16 on the calling thread only (for a chunk inside another kernel's parallel loop).
void toBf16Serial(const float* src, uint16_t* dst, int64_t n);
// dst[i] = src[i] widened to float32 (exact).
void fromBf16(const uint16_t* src, float* dst, int64_t n);
// fromBf16 on the calling thread only (for a chunk inside another kernel's parallel loop).
void fromBf16Serial(const uint16_t* src, float* dst, int64_t n);

// The batched product of matmul() above with bf16 operands, float32 accumulation and a float32
// C, on oneDNN's matmul primitive (one primitive per shape, built once per thread). aStride is 0
// (A broadcast) or m * k, bStride 0 or k * n (else -1). impl, when given, gets the primitive's
// implementation name (e.g. "brg:avx512_core_bf16"). Without bf16 instructions (nativeBf16()
// false) the bf16-rounded operands are widened and multiplied by sgemm instead: the same numbers
// up to the summation order. Returns 0 or oneDNN's status.
int matmulBf16(const Bf16Operand& a, const Bf16Operand& b, float* c, int64_t batch, int64_t aStride, int64_t bStride, int64_t m,
               int64_t n, int64_t k, bool transA, bool transB, std::string* impl = nullptr);
// The same product written only as C's bf16 rounding (oneDNN's bf16 destination: float32 sums,
// rounded once), `bias` (float32 [n], or null) added to every row before the rounding: a bf16
// run's product with a parameter, as autocast's Linear. k must be positive. Returns 0 or a status.
int matmulBf16To(const Bf16Operand& a, const Bf16Operand& b, uint16_t* c, const float* bias, int64_t batch, int64_t aStride, int64_t bStride,
                 int64_t m, int64_t n, int64_t k, bool transA, bool transB);

// causalAttention / causalAttentionGrad above with their products on bf16 operands (qkv, dctx
// and P converted once per call where held as float32; float32 accumulation). As the float32
// kernels, (batch, head) pairs are spread over the team, each pair's products single-threaded
// oneDNN matmuls reading q, k, v, dctx in place through their row strides (no head-splitting
// copies), its [T, T] scores and [T, dh] outputs float32 in the member's scratch (in its
// cache), each output row rounded into ctx's / dqkv's layout; the softmax and its gradient in
// float32, row by row, P and dscores rounded to bf16 as each row is done. Writes ctx, P and
// dqkv only as their bf16 roundings (the bf16 run's attention: products read them). On a CPU
// without bf16 products, the same on sgemm over the bf16 operands widened. Returns 0 or
// oneDNN's status.
int causalAttentionBf16(const Bf16Operand& qkv, uint16_t* ctx, uint16_t* p, int64_t batch, int64_t t, int64_t heads, int64_t dh, float scale);
int causalAttentionGradBf16(const Bf16Operand& dctx, const Bf16Operand& qkv, const Bf16Operand& p, uint16_t* dqkv, int64_t batch, int64_t t,
                            int64_t heads, int64_t dh, float scale);

// oneDNN's effective ISA on this CPU ("avx512_core_bf16", "avx512_core_amx", "avx2", ...),
// whether it has bf16 dot-product instructions (avx512_bf16 or AMX), and how toBf16 converts.
std::string cpuIsa();
bool nativeBf16();
const char* bf16Conversion();

// Flush denormal floats to zero (FTZ, DAZ) on this thread and its OpenMP team.
void flushDenormals();
// The same on this thread only: starts no OpenMP team.
void flushDenormalsHere();

// Threads of this thread's OpenMP team (each device worker thread has its own); flushes denormals.
void setThreads(int n);
int threads();
// CPU seconds each member of this thread's OpenMP team has run (CLOCK_THREAD_CPUTIME_ID), member
// 0 (the calling thread, JS included) first: what the kernels bench splits a step's work by.
std::vector<double> teamCpuSeconds();

}  // namespace layerwise
