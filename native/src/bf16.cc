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
#include <functional>
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

// One (batch, head) pair's product on bf16 views, built once: the primitive and its operands'
// memory objects, whose data handles each call points at the pair's views.
struct PairProduct {
  dnnl::matmul mm;
  dnnl::memory a, b, c;
};

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
  // attention's per-(batch, head) products (PairProduct), by shape, row strides and team size
  std::map<std::vector<int64_t>, PairProduct> pairs;
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

// c [m, n] (float32, row stride ldc) = op(a) op(b) for one (batch, head) pair of attention, a
// and b read in place (row strides lda, ldb; transposed: read as stored [k, m] / [n, k]), on
// the calling thread's team (one thread inside the pairs' parallel region): oneDNN's bf16 matmul
// where the CPU has bf16 products; else (emulated) sgemm on aw and bw, the same views into the
// operands widened to float32. Throws dnnl::error.
void pairProduct(Bf16Context& ctx, const uint16_t* a, const float* aw, int64_t lda, bool transA, const uint16_t* b, const float* bw,
                 int64_t ldb, bool transB, float* c, int64_t ldc, int64_t m, int64_t n, int64_t k) {
  if (!nativeBf16()) {
    const int s = dnnl_sgemm(transA ? 'T' : 'N', transB ? 'T' : 'N', m, n, k, 1.f, aw, lda, bw, ldb, 0.f, c, ldc);
    if (s != dnnl_success) throw dnnl::error(static_cast<dnnl_status_t>(s), "sgemm on widened bf16 operands");
    return;
  }
  using dt = dnnl::memory::data_type;
  using dims = dnnl::memory::dims;
  const std::vector<int64_t> key{omp_get_max_threads(), m, n, k, lda, ldb, ldc, transA, transB};
  auto it = ctx.pairs.find(key);
  if (it == ctx.pairs.end()) {
    const dnnl::memory::desc ad(dims{m, k}, dt::bf16, transA ? dims{1, lda} : dims{lda, 1});
    const dnnl::memory::desc bd(dims{k, n}, dt::bf16, transB ? dims{1, ldb} : dims{ldb, 1});
    const dnnl::memory::desc cd(dims{m, n}, dt::f32, dims{ldc, 1});
    dnnl::matmul mm(dnnl::matmul::primitive_desc(dnnl::matmul::desc(ad, bd, cd), ctx.engine));
    it = ctx.pairs.emplace(key, PairProduct{mm, dnnl::memory(ad, ctx.engine, nullptr), dnnl::memory(bd, ctx.engine, nullptr),
                                            dnnl::memory(cd, ctx.engine, nullptr)}).first;
  }
  PairProduct& pp = it->second;
  pp.a.set_data_handle(const_cast<uint16_t*>(a));
  pp.b.set_data_handle(const_cast<uint16_t*>(b));
  pp.c.set_data_handle(c);
  pp.mm.execute(ctx.stream, {{DNNL_ARG_SRC, pp.a}, {DNNL_ARG_WEIGHTS, pp.b}, {DNNL_ARG_DST, pp.c}});
  ctx.stream.wait();
}

// rows [T, dh] of float32 (row stride dh) rounded to bf16 into a view with row stride ld
void roundRows(const float* src, uint16_t* dst, int64_t rows, int64_t dh, int64_t ld) {
  for (int64_t r = 0; r < rows; r++) toBf16Serial(src + r * dh, dst + r * ld, dh);
}

// A member's scratch in the attention kernels: one pair's float32 scores / dP [T, T] and
// [T, dh] output, its bf16 dscores, and (emulated) float32 widenings of its bf16 P or dscores
struct PairScratch {
  std::vector<float> scores, out, wide;
  std::vector<uint16_t> square;
};

// Whole-call scratch: bf16 copies of float32 inputs (qkv, dctx, P) and (emulated) float32
// widenings of the products' bf16 operands
struct AttentionScratch {
  std::vector<uint16_t> qkv, dctx, p;
  std::vector<float> wideQkv, wideDctx;
};

// Runs pair(bh, scratch) for bh in [0, pairs): spread over the team (spreadPairs), each member
// with its oneDNN products built for one thread (as matmul.cc runAlone), or in order on the
// calling thread. Returns 0, or a failing product's oneDNN status (-1 for any other failure).
int forEachPair(int64_t pairs, const std::function<void(int64_t, PairScratch&)>& pair) {
  const bool spread = spreadPairs(pairs);
  const int team = omp_get_max_threads();
  int status = 0;
#pragma omp parallel if (spread)
  {
    thread_local PairScratch scratch;
    if (spread) omp_set_num_threads(1);
#pragma omp for schedule(static)
    for (int64_t bh = 0; bh < pairs; bh++) {
      try {
        pair(bh, scratch);
      } catch (const dnnl::error& e) {
#pragma omp atomic write
        status = e.status == dnnl_success ? -1 : static_cast<int>(e.status);
      } catch (...) {  // (no exception may leave a parallel region) a failed scratch allocation
#pragma omp atomic write
        status = -1;
      }
    }
    if (spread) omp_set_num_threads(team);
  }
  return status;
}

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
  thread_local AttentionScratch w;
  const int64_t H = heads, T = t, D = H * dh, L = 3 * D;
  const uint16_t* x = bf16Of(qkv, batch * T * L, w.qkv);  // q, k, v read in place through their views
  const float* xw = emulated(x, batch * T * L, w.wideQkv);
  return forEachPair(batch * H, [&](int64_t bh, PairScratch& s) {
    Bf16Context& c = context();
    const int64_t off = bh / H * T * L + bh % H * dh;  // q's [T, dh] view in qkv; k's D on, v's 2 D on
    uint16_t* pb = p + bh * T * T;
    // scores = q k^T, by blocks of queries against the keys they see (forCausalBlocks)
    float* scores = grow(s.scores, T * T);
    forCausalBlocks(T, [&](int64_t r0, int64_t r1) {
      pairProduct(c, x + off + r0 * L, at(xw, off + r0 * L), L, false, x + off + D, at(xw, off + D), L, true, scores + r0 * T, T, r1 - r0, r1, dh);
    });
    causalSoftmaxToBf16(scores, pb, 1, T, scale);  // P, float32 row by row (masked scores unread), rounded while in L1
    const float* pw = emulated(pb, T * T, s.wide);
    float* y = grow(s.out, T * dh);
    forCausalBlocks(T, [&](int64_t r0, int64_t r1) {  // ctx = P v
      pairProduct(c, pb + r0 * T, at(pw, r0 * T), T, false, x + off + 2 * D, at(xw, off + 2 * D), L, false, y + r0 * dh, dh, r1 - r0, dh, r1);
    });
    roundRows(y, ctx + bh / H * T * D + bh % H * dh, T, dh, D);  // into its head's columns of [B, T, D]
  });
}

int causalAttentionGradBf16(const Bf16Operand& dctx, const Bf16Operand& qkv, const Bf16Operand& p, uint16_t* dqkv, int64_t batch, int64_t t,
                            int64_t heads, int64_t dh, float scale) {
  if (batch * t * heads * dh == 0) return 0;
  const SignalGuard guard;  // oneDNN's JIT kernels (signals.h)
  thread_local AttentionScratch w;
  const int64_t H = heads, T = t, D = H * dh, L = 3 * D;
  const uint16_t* x = bf16Of(qkv, batch * T * L, w.qkv);
  const float* xw = emulated(x, batch * T * L, w.wideQkv);
  const uint16_t* dc = bf16Of(dctx, batch * T * D, w.dctx);
  const float* dcw = emulated(dc, batch * T * D, w.wideDctx);
  const uint16_t* pAll = bf16Of(p, batch * H * T * T, w.p);  // P as bf16: held so, or converted
  return forEachPair(batch * H, [&](int64_t bh, PairScratch& s) {
    Bf16Context& c = context();
    const int64_t off = bh / H * T * L + bh % H * dh, ctxOff = bh / H * T * D + bh % H * dh;
    const uint16_t* pb = pAll + bh * T * T;
    const Bf16Operand pPair{p.f32 == nullptr ? nullptr : p.f32 + bh * T * T, p.f32 == nullptr ? pb : nullptr};
    float* y = grow(s.out, T * dh);
    // dv = P^T dctx (keys [j0, j1) are seen by queries [j0, T) only)
    const float* pw = emulated(pb, T * T, s.wide);
    forCausalBlocks(T, [&](int64_t j0, int64_t j1) {
      pairProduct(c, pb + j0 * T + j0, at(pw, j0 * T + j0), T, true, dc + ctxOff + j0 * D, at(dcw, ctxOff + j0 * D), D, false, y + j0 * dh,
                  dh, j1 - j0, dh, T - j0);
    });
    roundRows(y, dqkv + off + 2 * D, T, dh, L);
    // dP = dctx v^T over the columns each block of queries sees (the causal softmax gradient
    // reads no other); dscores = scale P (dP - rowsum(dP P)), 0 where masked, rounded to bf16 row by row
    float* dp = grow(s.scores, T * T);
    forCausalBlocks(T, [&](int64_t r0, int64_t r1) {
      pairProduct(c, dc + ctxOff + r0 * D, at(dcw, ctxOff + r0 * D), D, false, x + off + 2 * D, at(xw, off + 2 * D), L, true, dp + r0 * T, T,
                  r1 - r0, r1, dh);
    });
    uint16_t* sq = grow(s.square, T * T);
    causalSoftmaxGradToBf16(pPair, dp, sq, 1, T, scale);
    const float* sw = emulated(sq, T * T, s.wide);
    // dq = dscores k; dk = dscores^T q
    forCausalBlocks(T, [&](int64_t r0, int64_t r1) {
      pairProduct(c, sq + r0 * T, at(sw, r0 * T), T, false, x + off + D, at(xw, off + D), L, false, y + r0 * dh, dh, r1 - r0, dh, r1);
    });
    roundRows(y, dqkv + off, T, dh, L);
    forCausalBlocks(T, [&](int64_t j0, int64_t j1) {
      pairProduct(c, sq + j0 * T + j0, at(sw, j0 * T + j0), T, true, x + off + j0 * L, at(xw, off + j0 * L), L, false, y + j0 * dh, dh, j1 - j0,
                  dh, T - j0);
    });
    roundRows(y, dqkv + off + D, T, dh, L);
  });
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
