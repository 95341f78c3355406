// bfloat16 compute (Kalamkar et al., 2019, "A Study of BFLOAT16 for Deep Learning Training"):
// float32 to bf16 conversion, and the batched matrix product on oneDNN's bf16 matmul primitive
// (bf16 operands, float32 accumulation and float32 output). Why not the f32 matmul with
// fpmath_mode::bf16: oneDNN 2.6.3 still runs its f32 kernel then (measured); and why not its
// f32-to-bf16 reorder: it is several times slower than the vectorised loop below. On a CPU
// without avx512_bf16 or AMX the products are emulated (see product()): same numbers, f32 speed.
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
// matmul primitives built so far, by shape: a primitive is built once per shape and reused.
struct Bf16Context {
  dnnl::engine engine{dnnl::engine::kind::cpu, 0};
  dnnl::stream stream{engine};
  // batchA, batchB, batch, m, n, k, transA, transB, bf16 C, bias
  using Key = std::tuple<int64_t, int64_t, int64_t, int64_t, int64_t, int64_t, bool, bool, bool, bool>;
  std::map<Key, dnnl::matmul> primitives;
  std::map<Key, std::string> impls;
  std::vector<uint16_t> scratchA, scratchB;  // converted float32 operands
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
  const Bf16Context::Key key{batchA, batchB, batch, m, n, k, transA, transB, cBf16, bias};
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

// Runs the cached batched product c[i] = op(a[i]) op(b[i]) on dense bf16 batches (attention's
// per-(batch, head) products as one primitive). Throws dnnl::error.
void batched(Bf16Context& ctx, const uint16_t* a, const uint16_t* b, float* c, int64_t batch, int64_t m, int64_t n, int64_t k, bool transA,
             bool transB);

// Per-thread scratch of the attention kernels: bf16 q, k, v [3, B, H, T, dh], a bf16 [B, H, T, dh]
// or [B, H, T, T] operand, and float32 products [B, H, T, dh] x3 and [B, H, T, T] (square: dP;
// wideP: the scores when P is kept only as bf16).
struct AttentionScratch {
  std::vector<uint16_t> qkv, x, y;
  std::vector<float> f[3], square, wideP;
};

template <typename T>
T* grow(std::vector<T>& v, int64_t n) {
  if (static_cast<int64_t>(v.size()) < n) v.resize(static_cast<size_t>(n));
  return v.data();
}

// n elements of an input held as float32 or bf16 (x), from element `at`, as bf16 into out
inline void segmentBf16(const Bf16Operand& x, int64_t at, uint16_t* out, int64_t n) {
  if (x.bf16 != nullptr)
    std::memcpy(out, x.bf16 + at, sizeof(uint16_t) * n);
  else
    convertChunk(x.f32 + at, out, n);
}

// qkv [B, T, 3, H, dh] (float32 or bf16) -> [3, B, H, T, dh] bf16 (q, k, v each dense per head)
void splitHeadsBf16(const Bf16Operand& qkv, uint16_t* out, int64_t B, int64_t T, int64_t H, int64_t dh) {
  const int64_t D = H * dh;
#pragma omp parallel for schedule(static) if (3 * B * T * D > kSerialCopy)
  for (int64_t bt = 0; bt < B * T; bt++) {
    const int64_t b = bt / T, t = bt % T;
    for (int64_t s = 0; s < 3; s++)
      for (int64_t h = 0; h < H; h++) segmentBf16(qkv, (bt * 3 + s) * D + h * dh, out + (((s * B + b) * H + h) * T + t) * dh, dh);
  }
}

// x [B, T, H, dh] (float32 or bf16) -> [B, H, T, dh] bf16
void headsFirstBf16(const Bf16Operand& x, uint16_t* out, int64_t B, int64_t T, int64_t H, int64_t dh) {
  const int64_t D = H * dh;
#pragma omp parallel for schedule(static) if (B * T * D > kSerialCopy)
  for (int64_t bt = 0; bt < B * T; bt++) {
    const int64_t b = bt / T, t = bt % T;
    for (int64_t h = 0; h < H; h++) segmentBf16(x, bt * D + h * dh, out + ((b * H + h) * T + t) * dh, dh);
  }
}

// y [B, H, T, dh] float32 -> its place in out, rows of `stride` floats: out[(b, t) row][h * dh ..];
// with outBf (same layout as out), also its bf16 rounding there, segment by segment; out may be
// null (only the bf16 rounding is written)
void headsBack(const float* y, float* out, int64_t B, int64_t T, int64_t H, int64_t dh, int64_t stride, uint16_t* outBf = nullptr) {
#pragma omp parallel for schedule(static) if (B * T * H * dh > kSerialCopy)
  for (int64_t bt = 0; bt < B * T; bt++) {
    const int64_t b = bt / T, t = bt % T;
    for (int64_t h = 0; h < H; h++) {
      const float* from = y + ((b * H + h) * T + t) * dh;
      if (out != nullptr) {
        float* o = out + bt * stride + h * dh;
        std::memcpy(o, from, sizeof(float) * dh);
        from = o;
      }
      if (outBf != nullptr) convertChunk(from, outBf + bt * stride + h * dh, dh);
    }
  }
}

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

void batched(Bf16Context& ctx, const uint16_t* a, const uint16_t* b, float* c, int64_t batch, int64_t m, int64_t n, int64_t k, bool transA,
             bool transB) {
  product(ctx, a, b, c, batch, batch, batch, m, n, k, transA, transB);
}

}  // namespace

void toBf16(const float* src, uint16_t* dst, int64_t n) {
  constexpr int64_t kChunk = 1 << 14;  // elements per OpenMP task: 64 KiB of floats
  const int64_t chunks = (n + kChunk - 1) / kChunk;
#pragma omp parallel for schedule(static) if (n > kSerialCopy)
  for (int64_t c = 0; c < chunks; c++) {
    const int64_t from = c * kChunk;
    convertChunk(src + from, dst + from, std::min(kChunk, n - from));
  }
}

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

void fromBf16(const uint16_t* src, float* dst, int64_t n) {
  constexpr int64_t kChunk = 1 << 14;
  const int64_t chunks = (n + kChunk - 1) / kChunk;
#pragma omp parallel for schedule(static) if (n > kSerialCopy)
  for (int64_t c = 0; c < chunks; c++) {
    const int64_t from = c * kChunk;
    fromBf16Serial(src + from, dst + from, std::min(kChunk, n - from));
  }
}

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
  auto operand = [](const Bf16Operand& x, int64_t count, std::vector<uint16_t>& scratch) -> uint16_t* {
    if (x.bf16 != nullptr) return const_cast<uint16_t*>(x.bf16);
    if (static_cast<int64_t>(scratch.size()) < count) scratch.resize(static_cast<size_t>(count));
    toBf16(x.f32, scratch.data(), count);
    return scratch.data();
  };
  uint16_t* av = operand(a, batchA * m * k, ctx.scratchA);
  uint16_t* bv = operand(b, batchB * k * n, ctx.scratchB);
  try {
    product(ctx, av, bv, c, batchA, batchB, batch, m, n, k, transA, transB, cBf, bias);
    if (impl != nullptr)
      *impl = nativeBf16() ? ctx.impls[Bf16Context::Key{batchA, batchB, batch, m, n, k, transA, transB, cBf != nullptr, bias != nullptr}]
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

int causalAttentionBf16(const Bf16Operand& qkv, float* ctx, float* p, int64_t batch, int64_t t, int64_t heads, int64_t dh, float scale,
                        uint16_t* ctxBf, uint16_t* pBf) {
  if (batch * t * heads * dh == 0) return 0;
  const SignalGuard guard;  // oneDNN's JIT kernels (signals.h)
  Bf16Context& c = context();
  thread_local AttentionScratch w;
  const int64_t B = batch, H = heads, T = t, BH = B * H, n = BH * T * dh;
  try {
    // q, k, v converted and laid out per head, so every product is one dense batched primitive
    uint16_t* x = grow(w.qkv, 3 * n);
    splitHeadsBf16(qkv, x, B, T, H, dh);
    float* scores = p != nullptr ? p : grow(w.wideP, BH * T * T);  // P kept only as bf16 (pBf) when p is null
    batched(c, x, x + n, scores, BH, T, T, dh, false, true);        // scores = q k^T [BH, T, T]
    uint16_t* pb = pBf != nullptr ? pBf : grow(w.x, BH * T * T);
    if (p != nullptr) {
      causalSoftmax(p, p, BH, T, scale);  // float32, in place
      toBf16(p, pb, BH * T * T);
    } else {
      causalSoftmaxToBf16(scores, pb, BH, T, scale);  // row by row, rounded while in L1
    }
    float* y = grow(w.f[0], n);
    batched(c, pb, x + 2 * n, y, BH, T, dh, T, false, false);  // P v [BH, T, dh]
    headsBack(y, ctx, B, T, H, dh, H * dh, ctxBf);             // -> ctx [B, T, H, dh]
  } catch (const dnnl::error& e) {
    return e.status == dnnl_success ? -1 : static_cast<int>(e.status);
  }
  return 0;
}

int causalAttentionGradBf16(const Bf16Operand& dctx, const Bf16Operand& qkv, const Bf16Operand& p, float* dqkv, int64_t batch, int64_t t,
                            int64_t heads, int64_t dh, float scale, uint16_t* dqkvBf) {
  if (batch * t * heads * dh == 0) return 0;
  const SignalGuard guard;  // oneDNN's JIT kernels (signals.h)
  Bf16Context& c = context();
  thread_local AttentionScratch w;
  const int64_t B = batch, H = heads, T = t, BH = B * H, n = BH * T * dh, D = H * dh;
  try {
    uint16_t* x = grow(w.qkv, 3 * n);
    splitHeadsBf16(qkv, x, B, T, H, dh);
    uint16_t* dc = grow(w.y, n);
    headsFirstBf16(dctx, dc, B, T, H, dh);
    uint16_t* sq = grow(w.x, BH * T * T);
    const uint16_t* pb = p.bf16;  // P as bf16: held so, or converted
    if (pb == nullptr) {
      toBf16(p.f32, sq, BH * T * T);
      pb = sq;
    }
    float* dq = grow(w.f[0], n);
    float* dk = grow(w.f[1], n);
    float* dv = grow(w.f[2], n);
    float* ds = grow(w.square, BH * T * T);
    batched(c, pb, dc, dv, BH, T, dh, T, true, false);         // dv = P^T dctx
    batched(c, dc, x + 2 * n, ds, BH, T, T, dh, false, true);  // dP = dctx v^T
    // dscores as bf16 into sq (P's bf16 copy there, if converted, is done with), row by row
    softmaxGradToBf16(p.f32 != nullptr ? p : Bf16Operand{nullptr, pb}, ds, sq, BH * T, T, scale);
    batched(c, sq, x + n, dq, BH, T, dh, T, false, false);     // dq = dscores k
    batched(c, sq, x, dk, BH, T, dh, T, true, false);          // dk = dscores^T q
    headsBack(dq, dqkv, B, T, H, dh, 3 * D, dqkvBf);
    headsBack(dk, dqkv == nullptr ? nullptr : dqkv + D, B, T, H, dh, 3 * D, dqkvBf == nullptr ? nullptr : dqkvBf + D);
    headsBack(dv, dqkv == nullptr ? nullptr : dqkv + 2 * D, B, T, H, dh, 3 * D, dqkvBf == nullptr ? nullptr : dqkvBf + 2 * D);
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
