// bfloat16 compute (Kalamkar et al., 2019, "A Study of BFLOAT16 for Deep Learning Training"):
// float32 to bf16 conversion, the batched matrix product on oneDNN's bf16 matmul primitive
// (bf16 operands, float32 accumulation, float32 or bf16 output) and attention's products on it.
// Why not the f32 matmul with fpmath_mode::bf16: oneDNN 2.6.3 still runs its f32 kernel then
// (measured); and why not its f32-to-bf16 reorder: it is several times slower than the
// vectorised loop below. On a CPU without avx512_bf16 or AMX the products are emulated (see
// product()): same numbers, f32 speed.
#include <dnnl.hpp>
#include <immintrin.h>
#include <omp.h>
#include <cstring>
#include <map>
#include <unordered_map>
#include <string>
#include <tuple>
#include <vector>
#include "kernels.h"
#include "signals.h"

namespace layerwise {

namespace {

// Conversions and copies up to this many elements run on the calling thread. In training one thread's
// memory bandwidth bounds them: charlm-small's activations (1-4M elements,
// read from L3 or memory) converted at 2.3-2.9 G elements/s on one thread, and spreading every
// conversion above 256K elements over the OpenMP team took its bf16 step from 377 to 343-358 ms
// (2 cores). Below this, the team's wake-up costs more than it saves.
constexpr int64_t kSerialCopy = int64_t{1} << 18;

// Round to nearest even on the upper 16 bits; NaN stays NaN (quiet), infinities stay.
inline uint16_t bf16Scalar(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  if ((u & 0x7fffffffu) > 0x7f800000u) return static_cast<uint16_t>((u >> 16) | 0x40u);
  u += 0x7fffu + ((u >> 16) & 1u);
  return static_cast<uint16_t>(u >> 16);
}

// One chunk [0, n) of the conversion, vectorised where the compiler targets AVX-512.
void convertChunk(const float* src, uint16_t* dst, int64_t n) {
  int64_t i = 0;
#if defined(__AVX512BF16__) && defined(__AVX512F__)
  // vcvtne2ps2bf16: 32 floats to 32 bf16 per instruction, round to nearest even
  for (; i + 32 <= n; i += 32) {
    const __m512 lo = _mm512_loadu_ps(src + i);
    const __m512 hi = _mm512_loadu_ps(src + i + 16);
    const __m512bh r = _mm512_cvtne2ps_pbh(hi, lo);  // low half from lo, high half from hi
    _mm512_storeu_si512(reinterpret_cast<void*>(dst + i), reinterpret_cast<__m512i>(r));
  }
#elif defined(__AVX512F__) && defined(__AVX512BW__)
  // integer round to nearest even, 16 floats at a time: u + 0x7fff + ((u >> 16) & 1), then >> 16
  const __m512i one = _mm512_set1_epi32(1), bias = _mm512_set1_epi32(0x7fff);
  const __m512i absMask = _mm512_set1_epi32(0x7fffffff), inf = _mm512_set1_epi32(0x7f800000);
  const __m512i quiet = _mm512_set1_epi32(0x00400000);
  for (; i + 16 <= n; i += 16) {
    const __m512i u = _mm512_castps_si512(_mm512_loadu_ps(src + i));
    const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(u, 16), one);
    __m512i r = _mm512_add_epi32(u, _mm512_add_epi32(bias, lsb));
    const __mmask16 nan = _mm512_cmpgt_epi32_mask(_mm512_and_si512(u, absMask), inf);
    r = _mm512_mask_mov_epi32(r, nan, _mm512_or_si512(u, quiet));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst + i), _mm512_cvtepi32_epi16(_mm512_srli_epi32(r, 16)));
  }
#endif
  for (; i < n; i++) dst[i] = bf16Scalar(src[i]);
}

// oneDNN's engine and stream of this thread (each device's worker thread has its own), and the
// matmul primitives built so far, by shape and team size: a primitive is built once per shape
// and team size and reused. oneDNN fixes a primitive's thread count (its work split) when it is
// built, from omp_get_max_threads(): one built before setThreads(2) ran on one thread ever after
// (the kernels bench at --threads 1,2: bf16 products 0.97x, attention 0.4x at 2 threads).
struct Bf16Context {
  dnnl::engine engine{dnnl::engine::kind::cpu, 0};
  dnnl::stream stream{engine};
  // team size, batchA, batchB, batch, m, n, k, transA, transB, bf16 C, bias
  using Key = std::tuple<int, int64_t, int64_t, int64_t, int64_t, int64_t, int64_t, bool, bool, bool, bool>;
  std::map<Key, dnnl::matmul> primitives;
  std::map<Key, std::string> impls;
  std::vector<uint16_t> scratchA, scratchB;  // converted float32 operands
  // attention's strided products (stridedProduct), by their operands' dims, strides and type
  std::map<std::vector<int64_t>, dnnl::matmul> strided;
};

Bf16Context& context() {
  thread_local Bf16Context ctx;
  return ctx;
}

// Memory descriptor of op(X) for a [batch, rows, cols] product operand stored row-major as
// [rows, cols], or [cols, rows] when transposed (read in place through its strides).
dnnl::memory::desc operandDesc(int64_t batch, int64_t rows, int64_t cols, bool trans, dnnl::memory::data_type dt) {
  using dims = dnnl::memory::dims;
  const dims strides = trans ? dims{rows * cols, 1, rows} : dims{rows * cols, cols, 1};
  return dnnl::memory::desc(dims{batch, rows, cols}, dt, strides);
}

// The bias of a product with one: float32 [1, 1, n], added to every row before C is rounded.
dnnl::memory::desc biasDesc(int64_t n) {
  return dnnl::memory::desc(dnnl::memory::dims{1, 1, n}, dnnl::memory::data_type::f32, dnnl::memory::dims{n, n, 1});
}

dnnl::matmul& primitive(Bf16Context& ctx, int64_t batchA, int64_t batchB, int64_t batch, int64_t m, int64_t n, int64_t k,
                        bool transA, bool transB, bool cBf16 = false, bool bias = false) {
  const Bf16Context::Key key{omp_get_max_threads(), batchA, batchB, batch, m, n, k, transA, transB, cBf16, bias};
  auto it = ctx.primitives.find(key);
  if (it != ctx.primitives.end()) return it->second;
  using dt = dnnl::memory::data_type;
  const auto src = operandDesc(batchA, m, k, transA, dt::bf16);
  const auto wei = operandDesc(batchB, k, n, transB, dt::bf16);
  const auto dst = operandDesc(batch, m, n, false, cBf16 ? dt::bf16 : dt::f32);
  const dnnl::matmul::primitive_desc pd(
      bias ? dnnl::matmul::desc(src, wei, biasDesc(n), dst) : dnnl::matmul::desc(src, wei, dst), ctx.engine);
  ctx.impls[key] = pd.impl_info_str();
  return ctx.primitives.emplace(key, dnnl::matmul(pd)).first->second;
}

template <typename T>
T* grow(std::vector<T>& v, int64_t n) {
  if (static_cast<int64_t>(v.size()) < n) v.resize(static_cast<size_t>(n));
  return v.data();
}

// A 4-D view [B, H, rows, cols] into a buffer: its dims and element strides. Attention's
// per-(batch, head) operands are such views: q, k and v read in place from qkv [B, T, 3, H, dh]
// (row stride 3 H dh), the context and its gradient in place in [B, T, H, dh], and the
// scores / probabilities dense [B, H, T, T] (transposed: the last two strides swapped).
struct View {
  dnnl::memory::dims dims, strides;
};

View headsOf(int64_t B, int64_t H, int64_t T, int64_t dh, int64_t rowStride, bool transposed = false) {
  return transposed ? View{{B, H, dh, T}, {T * rowStride, dh, 1, rowStride}} : View{{B, H, T, dh}, {T * rowStride, dh, rowStride, 1}};
}

View squareOf(int64_t B, int64_t H, int64_t T, bool transposed = false) {
  return View{{B, H, T, T}, {H * T * T, T * T, transposed ? 1 : T, transposed ? T : 1}};
}

// c = a b per (batch, head) on views (float32 c): oneDNN's matmul on bf16 a and b where the CPU
// has bf16 products, else (emulated) its f32 matmul on a and b widened (aw, bw: the same views
// into float32 copies of the buffers). Built once per views and type. Throws dnnl::error.
void stridedProduct(Bf16Context& ctx, const View& a, const uint16_t* ab, const float* aw, const View& b, const uint16_t* bb,
                    const float* bw, const View& c, float* cp) {
  const bool bf = nativeBf16();
  using dt = dnnl::memory::data_type;
  const dt in = bf ? dt::bf16 : dt::f32;
  std::vector<int64_t> key{bf ? 1 : 0, omp_get_max_threads()};  // built for this team size (Bf16Context)
  for (const View* v : {&a, &b, &c}) {
    key.insert(key.end(), v->dims.begin(), v->dims.end());
    key.insert(key.end(), v->strides.begin(), v->strides.end());
  }
  const dnnl::memory::desc ad(a.dims, in, a.strides), bd(b.dims, in, b.strides), cd(c.dims, dt::f32, c.strides);
  auto it = ctx.strided.find(key);
  if (it == ctx.strided.end()) it = ctx.strided.emplace(key, dnnl::matmul(dnnl::matmul::primitive_desc(dnnl::matmul::desc(ad, bd, cd), ctx.engine))).first;
  void* ap = bf ? static_cast<void*>(const_cast<uint16_t*>(ab)) : static_cast<void*>(const_cast<float*>(aw));
  void* bp = bf ? static_cast<void*>(const_cast<uint16_t*>(bb)) : static_cast<void*>(const_cast<float*>(bw));
  it->second.execute(ctx.stream, {{DNNL_ARG_SRC, dnnl::memory(ad, ctx.engine, ap)},
                                  {DNNL_ARG_WEIGHTS, dnnl::memory(bd, ctx.engine, bp)},
                                  {DNNL_ARG_DST, dnnl::memory(cd, ctx.engine, cp)}});
  ctx.stream.wait();
}

// Per-thread scratch of the attention kernels: bf16 copies of float32 inputs (qkv, dctx, P) and
// the dscores, float32 scores / dP [B, H, T, T], a float32 [B, T, 3, H, dh] or [B, T, H, dh]
// output, and (emulated) float32 widenings of the products' bf16 operands.
struct AttentionScratch {
  std::vector<uint16_t> qkv, dctx, square;
  std::vector<float> scores, out, wideQkv, wideDctx, wideSquare;
};

// An input's bf16 values: as held, or converted into scratch (grown to n elements)
const uint16_t* bf16Of(const Bf16Operand& x, int64_t n, std::vector<uint16_t>& scratch) {
  if (x.bf16 != nullptr) return x.bf16;
  toBf16(x.f32, grow(scratch, n), n);
  return scratch.data();
}

// bf16 values widened for the emulated products (null where the CPU has bf16 products)
const float* emulated(const uint16_t* bf, int64_t n, std::vector<float>& wide) {
  if (nativeBf16()) return nullptr;
  fromBf16(bf, grow(wide, n), n);
  return wide.data();
}

// An emulated operand `off` elements in (null stays null: the CPU has bf16 products)
const float* at(const float* wide, int64_t off) { return wide == nullptr ? nullptr : wide + off; }

// c = op(a) op(b) on bf16 operands (batchA, batchB: 1 or batch), float32 accumulation and c:
// oneDNN's bf16 matmul where the CPU has bf16 instructions; elsewhere (oneDNN 2.6.3 has no bf16
// matmul on AVX2, and on AVX-512 without bf16 its emulation is slower than f32) the operands,
// already rounded to bf16, are widened to float32 and multiplied by sgemm: the same numbers up to
// the summation order, at f32 speed. Throws dnnl::error.
void product(Bf16Context& ctx, const uint16_t* a, const uint16_t* b, float* c, int64_t batchA, int64_t batchB, int64_t batch, int64_t m,
             int64_t n, int64_t k, bool transA, bool transB, uint16_t* cBf = nullptr, const float* bias = nullptr) {
  if (!nativeBf16()) {
    thread_local std::vector<float> fa, fb, fc;
    fromBf16(a, grow(fa, batchA * m * k), batchA * m * k);
    fromBf16(b, grow(fb, batchB * k * n), batchB * k * n);
    float* out = cBf != nullptr ? grow(fc, batch * m * n) : c;
    const int s = matmul(fa.data(), fb.data(), out, batch, batchA == 1 ? 0 : m * k, batchB == 1 ? 0 : k * n, m, n, k, transA, transB);
    if (s != 0) throw dnnl::error(static_cast<dnnl_status_t>(s), "sgemm on widened bf16 operands");
    if (bias != nullptr)
#pragma omp parallel for schedule(static) if (batch * m * n > kSerialCopy)
      for (int64_t r = 0; r < batch * m; r++)
        for (int64_t j = 0; j < n; j++) out[r * n + j] += bias[j];
    if (cBf != nullptr) toBf16(out, cBf, batch * m * n);
    return;
  }
  using dt = dnnl::memory::data_type;
  dnnl::matmul& mm = primitive(ctx, batchA, batchB, batch, m, n, k, transA, transB, cBf != nullptr, bias != nullptr);
  dnnl::memory src(operandDesc(batchA, m, k, transA, dt::bf16), ctx.engine, const_cast<uint16_t*>(a));
  dnnl::memory wei(operandDesc(batchB, k, n, transB, dt::bf16), ctx.engine, const_cast<uint16_t*>(b));
  dnnl::memory dst = cBf != nullptr ? dnnl::memory(operandDesc(batch, m, n, false, dt::bf16), ctx.engine, cBf)
                                    : dnnl::memory(operandDesc(batch, m, n, false, dt::f32), ctx.engine, c);
  std::unordered_map<int, dnnl::memory> args{{DNNL_ARG_SRC, src}, {DNNL_ARG_WEIGHTS, wei}, {DNNL_ARG_DST, dst}};
  if (bias != nullptr) args.emplace(DNNL_ARG_BIAS, dnnl::memory(biasDesc(n), ctx.engine, const_cast<float*>(bias)));
  mm.execute(ctx.stream, args);
  ctx.stream.wait();
}

}  // namespace

void toBf16Serial(const float* src, uint16_t* dst, int64_t n) { convertChunk(src, dst, n); }

void fromBf16Serial(const uint16_t* src, float* dst, int64_t n) {
  int64_t i = 0;
#if defined(__AVX512F__)
  // 16 bf16 to 16 floats per step: zero-extend to 32 bits, shift into the upper half
  for (; i + 16 <= n; i += 16) {
    const __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(src + i));
    _mm512_storeu_si512(reinterpret_cast<void*>(dst + i), _mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
  }
#endif
  for (; i < n; i++) {
    const uint32_t u = static_cast<uint32_t>(src[i]) << 16;
    std::memcpy(dst + i, &u, 4);
  }
}

namespace {

// One chunk of a conversion on the calling thread, either way
inline void convertSerial(const float* src, uint16_t* dst, int64_t n) { convertChunk(src, dst, n); }
inline void convertSerial(const uint16_t* src, float* dst, int64_t n) { fromBf16Serial(src, dst, n); }

// dst = src converted (float32 to bf16 or back), chunks spread over the team above kSerialCopy
template <typename Src, typename Dst>
void convert(const Src* src, Dst* dst, int64_t n) {
  constexpr int64_t kChunk = 1 << 14;  // elements per OpenMP task: 64 KiB of floats
  const int64_t chunks = (n + kChunk - 1) / kChunk;
#pragma omp parallel for schedule(static) if (n > kSerialCopy)
  for (int64_t c = 0; c < chunks; c++) {
    const int64_t from = c * kChunk;
    convertSerial(src + from, dst + from, std::min(kChunk, n - from));
  }
}

}  // namespace

void toBf16(const float* src, uint16_t* dst, int64_t n) { convert(src, dst, n); }

void fromBf16(const uint16_t* src, float* dst, int64_t n) { convert(src, dst, n); }

namespace {

// The product behind matmulBf16 and matmulBf16To (k > 0, m and n > 0): operands converted where
// given as float32, C written as float32 (c) or as its bf16 rounding (cBf, bias added first);
// `impl` (if not null) gets the implementation that ran. Returns 0 or oneDNN's status.
int bf16Product(const Bf16Operand& a, const Bf16Operand& b, float* c, uint16_t* cBf, const float* bias, int64_t batch, int64_t aStride,
                int64_t bStride, int64_t m, int64_t n, int64_t k, bool transA, bool transB, std::string* impl) {
  if ((aStride != 0 && aStride != m * k) || (bStride != 0 && bStride != k * n)) return -1;  // dense or broadcast only
  const SignalGuard guard;  // oneDNN's JIT kernels (signals.h)
  Bf16Context& ctx = context();
  const int64_t batchA = aStride == 0 ? 1 : batch, batchB = bStride == 0 ? 1 : batch;
  const uint16_t* av = bf16Of(a, batchA * m * k, ctx.scratchA);
  const uint16_t* bv = bf16Of(b, batchB * k * n, ctx.scratchB);
  try {
    // a weight gradient with a small output at 2+ threads: each member multiplies its slice of k
    if (cBf == nullptr && bias == nullptr && nativeBf16() && splitsReduction(omp_get_max_threads(), batch, m, n, k, transA, transB)) {
      const int s = splitReduction(m, n, k, c, [&](int64_t k0, int64_t k1, float* out) {
        try {
          product(context(), av + k0 * m, bv + k0 * n, out, 1, 1, 1, m, n, k1 - k0, true, false);
        } catch (const dnnl::error& e) {
          return e.status == dnnl_success ? -1 : static_cast<int>(e.status);
        }
        return 0;
      });
      if (impl != nullptr) *impl = "split over k on the team, one single-threaded oneDNN matmul per slice";
      return s;
    }
    // one long product at 2+ threads: each member multiplies its block of rows (matmul.cc splitRows)
    if (nativeBf16() && !transA && splitsRows(omp_get_max_threads(), batch, m, n)) {
      const int s = splitRows(m, [&](int64_t m0, int64_t m1) {
        try {
          product(context(), av + m0 * k, bv, c == nullptr ? nullptr : c + m0 * n, 1, 1, 1, m1 - m0, n, k, false, transB,
                  cBf == nullptr ? nullptr : cBf + m0 * n, bias);
        } catch (const dnnl::error& e) {
          return e.status == dnnl_success ? -1 : static_cast<int>(e.status);
        }
        return 0;
      });
      if (impl != nullptr) *impl = "split over rows on the team, one single-threaded oneDNN matmul per block";
      return s;
    }
    product(ctx, av, bv, c, batchA, batchB, batch, m, n, k, transA, transB, cBf, bias);
    if (impl != nullptr)
      *impl = nativeBf16() ? ctx.impls[Bf16Context::Key{omp_get_max_threads(), batchA, batchB, batch, m, n, k, transA, transB, cBf != nullptr, bias != nullptr}]
                           : "emulated: sgemm on bf16-rounded operands (" + cpuIsa() + ")";
  } catch (const dnnl::error& e) {
    return e.status == dnnl_success ? -1 : static_cast<int>(e.status);
  }
  return 0;
}

}  // namespace

int matmulBf16(const Bf16Operand& a, const Bf16Operand& b, float* c, int64_t batch, int64_t aStride, int64_t bStride, int64_t m,
               int64_t n, int64_t k, bool transA, bool transB, std::string* impl) {
  if (m == 0 || n == 0) return 0;
  if (k == 0) {
    std::memset(c, 0, sizeof(float) * batch * m * n);
    return 0;
  }
  return bf16Product(a, b, c, nullptr, nullptr, batch, aStride, bStride, m, n, k, transA, transB, impl);
}

int matmulBf16To(const Bf16Operand& a, const Bf16Operand& b, uint16_t* c, const float* bias, int64_t batch, int64_t aStride, int64_t bStride,
                 int64_t m, int64_t n, int64_t k, bool transA, bool transB) {
  if (m == 0 || n == 0) return 0;
  if (k == 0) return -1;
  return bf16Product(a, b, nullptr, c, bias, batch, aStride, bStride, m, n, k, transA, transB, nullptr);
}

int causalAttentionBf16(const Bf16Operand& qkv, uint16_t* ctx, uint16_t* p, int64_t batch, int64_t t, int64_t heads, int64_t dh, float scale) {
  if (batch * t * heads * dh == 0) return 0;
  const SignalGuard guard;  // oneDNN's JIT kernels (signals.h)
  Bf16Context& c = context();
  thread_local AttentionScratch w;
  const int64_t B = batch, H = heads, T = t, D = H * dh, L = 3 * D;
  try {
    const uint16_t* x = bf16Of(qkv, B * T * L, w.qkv);  // q, k, v read in place through their views
    const float* xw = emulated(x, B * T * L, w.wideQkv);
    float* scores = grow(w.scores, B * H * T * T);
    stridedProduct(c, headsOf(B, H, T, dh, L), x, xw, headsOf(B, H, T, dh, L, true), x + D, at(xw, D), squareOf(B, H, T),
                   scores);                           // scores = q k^T [B, H, T, T]
    causalSoftmaxToBf16(scores, p, B * H, T, scale);  // P, float32 row by row, rounded while in L1
    // ctx = P v, written in place into [B, T, H, dh] (float32), then rounded
    float* y = grow(w.out, B * T * D);
    const float* pw = emulated(p, B * H * T * T, w.wideSquare);
    stridedProduct(c, squareOf(B, H, T), p, pw, headsOf(B, H, T, dh, L), x + 2 * D, at(xw, 2 * D), headsOf(B, H, T, dh, D), y);
    toBf16(y, ctx, B * T * D);
  } catch (const dnnl::error& e) {
    return e.status == dnnl_success ? -1 : static_cast<int>(e.status);
  }
  return 0;
}

int causalAttentionGradBf16(const Bf16Operand& dctx, const Bf16Operand& qkv, const Bf16Operand& p, uint16_t* dqkv, int64_t batch, int64_t t,
                            int64_t heads, int64_t dh, float scale) {
  if (batch * t * heads * dh == 0) return 0;
  const SignalGuard guard;  // oneDNN's JIT kernels (signals.h)
  Bf16Context& c = context();
  thread_local AttentionScratch w;
  const int64_t B = batch, H = heads, T = t, D = H * dh, L = 3 * D, S = B * H * T * T;
  try {
    const uint16_t* x = bf16Of(qkv, B * T * L, w.qkv);
    const float* xw = emulated(x, B * T * L, w.wideQkv);
    const uint16_t* dc = bf16Of(dctx, B * T * D, w.dctx);
    const float* dcw = emulated(dc, B * T * D, w.wideDctx);
    const uint16_t* pb = bf16Of(p, S, w.square);  // P as bf16: held so, or converted
    float* g = grow(w.out, B * T * L);  // dq, dk, dv written in place into [B, T, 3, H, dh] (float32), then rounded
    float* ds = grow(w.scores, S);
    const View heads = headsOf(B, H, T, dh, L), headsT = headsOf(B, H, T, dh, L, true), ctxHeads = headsOf(B, H, T, dh, D);
    const float* pw = emulated(pb, S, w.wideSquare);
    stridedProduct(c, squareOf(B, H, T, true), pb, pw, ctxHeads, dc, dcw, heads, g + 2 * D);  // dv = P^T dctx
    stridedProduct(c, ctxHeads, dc, dcw, headsT, x + 2 * D, at(xw, 2 * D), squareOf(B, H, T), ds);  // dP = dctx v^T
    // dscores as bf16 into the square scratch (P's copy there, if converted, is done with), row by row
    uint16_t* sq = grow(w.square, S);
    softmaxGradToBf16(p, ds, sq, B * H * T, T, scale);
    const float* sw = emulated(sq, S, w.wideSquare);
    stridedProduct(c, squareOf(B, H, T), sq, sw, heads, x + D, at(xw, D), heads, g);           // dq = dscores k
    stridedProduct(c, squareOf(B, H, T, true), sq, sw, heads, x, xw, heads, g + D);            // dk = dscores^T q
    toBf16(g, dqkv, B * T * L);
  } catch (const dnnl::error& e) {
    return e.status == dnnl_success ? -1 : static_cast<int>(e.status);
  }
  return 0;
}

std::string cpuIsa() {
  switch (dnnl::get_effective_cpu_isa()) {
    case dnnl::cpu_isa::avx512_core_amx: return "avx512_core_amx";
    case dnnl::cpu_isa::avx512_core_bf16: return "avx512_core_bf16";
    case dnnl::cpu_isa::avx512_core_vnni: return "avx512_core_vnni";
    case dnnl::cpu_isa::avx512_core: return "avx512_core";
    case dnnl::cpu_isa::avx2_vnni: return "avx2_vnni";
    case dnnl::cpu_isa::avx2: return "avx2";
    case dnnl::cpu_isa::avx: return "avx";
    case dnnl::cpu_isa::sse41: return "sse41";
    default: return "other";
  }
}

bool nativeBf16() {
  static const bool native = [] {
    const auto isa = dnnl::get_effective_cpu_isa();
    return isa == dnnl::cpu_isa::avx512_core_bf16 || isa == dnnl::cpu_isa::avx512_core_amx;
  }();
  return native;
}

const char* bf16Conversion() {
#if defined(__AVX512BF16__) && defined(__AVX512F__)
  return "vcvtne2ps2bf16 (AVX512-BF16)";
#elif defined(__AVX512F__) && defined(__AVX512BW__)
  return "AVX-512 integer round-to-nearest-even";
#else
  return "scalar round-to-nearest-even";
#endif
}

}  // namespace layerwise
