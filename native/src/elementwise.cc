// Element-wise, reduction, layout and indexing kernels of the native backend, float32, over
// the device's OpenMP team. Shapes come as int64 vectors; broadcasting follows NumPy (as TF.js).
#include <algorithm>
#include <cmath>
#include <cstring>
#include <memory>
#include <type_traits>
#include <utility>
#include <vector>
#include "kernels.h"

namespace layerwise {

namespace {

constexpr int64_t kParallel = 1 << 15;  // elements below which a kernel stays on one thread

// exp(x) for float32 without libm, so that loops of it vectorise: x = n ln2 + r (Cody-Waite, |r| <=
// ln2/2), e^r by its degree-6 Taylor polynomial (relative error < 2e-7 on that range), times 2^n
// built in the exponent bits. Overflows to +inf above 88.72, underflows to 0 below -87.3.
inline float fastExp(float x) {
  x = std::min(std::max(x, -87.3f), 88.72f);
  const float n = std::nearbyint(x * 1.44269504088896341f);
  const float r = (x - n * 0.693145751953125f) - n * 1.428606765330187e-06f;
  float p = 1.f / 720.f;
  p = p * r + 1.f / 120.f;
  p = p * r + 1.f / 24.f;
  p = p * r + 1.f / 6.f;
  p = p * r + 0.5f;
  p = p * r + 1.f;
  p = p * r + 1.f;
  int32_t bits = (static_cast<int32_t>(n) + 127) << 23;
  float scale;
  std::memcpy(&scale, &bits, sizeof scale);
  return p * scale;
}

// Storage types of the kernels' inputs and outputs, which compute in float32: float, or bf16
// values (uint16_t, the upper 16 bits of a float32 pattern). A kernel is one template over them:
// a block (or row) of an input is load()ed as float32 (in place for float, widened into a
// thread's L1-sized buffer for bf16), its results written at target() (the output itself for
// float, the buffer for bf16) and store()d (nothing for float, rounded to nearest even for bf16),
// the conversions vectorised (bf16.cc). A Bf16Operand (float32 or bf16, chosen at run time) is
// given to a template through visit().
using bf16 = uint16_t;
template <typename T>
constexpr bool kFloat = std::is_same_v<T, float>;  // held as float32: read and written in place

inline const float* load(const float* p, int64_t, float*) { return p; }
inline const float* load(const bf16* p, int64_t len, float* buf) {
  fromBf16Serial(p, buf, len);
  return buf;
}
inline float* target(float* p, float*) { return p; }
inline float* target(bf16*, float* buf) { return buf; }
inline void store(const float*, float*, int64_t) {}
inline void store(const float* v, bf16* p, int64_t len) { toBf16Serial(v, p, len); }

// f(x.f32) or f(x.bf16), whichever x holds
template <typename F>
void visit(const Bf16Operand& x, F f) {
  if (x.f32 != nullptr)
    f(x.f32);
  else
    f(x.bf16);
}

// Elements per block of an element-wise kernel reading or writing bf16 (mapElements): loaded,
// computed and stored while the block's float32 values are in L1 (4 KiB). 64 KiB blocks (out of
// L1) made the bf16 kernels up to 1.7x slower than the float32 ones.
constexpr int64_t kBlock = 1 << 10;

// The second input of a one-input kernel (mapElements)
struct NoInput {};
template <typename T>
constexpr bool kNone = std::is_same_v<T, NoInput>;

// f(x) (b a NoInput) or f(x, y) over [0, n) of a (and b) stored element by element into out.
// All float32: one vectorised loop over the team in place. Otherwise in blocks spread over the
// team: a's and b's block loaded as float32, f's results at target() and stored into out while
// in L1. No float32 copy of a whole bf16 input or output.
template <typename F, typename Out, typename A, typename B>
void mapElements(F f, Out* out, const A* a, const B* b, int64_t n) {
  if constexpr (kFloat<Out> && kFloat<A> && (kFloat<B> || kNone<B>)) {
#pragma omp parallel for simd schedule(static) if (n > kParallel)
    for (int64_t i = 0; i < n; i++) {
      if constexpr (kNone<B>)
        out[i] = f(a[i]);
      else
        out[i] = f(a[i], b[i]);
    }
  } else {
    const int64_t blocks = (n + kBlock - 1) / kBlock;
#pragma omp parallel if (n > kParallel)
    {
      std::vector<float> bufA(kFloat<A> ? 0 : kBlock), bufB(kFloat<B> || kNone<B> ? 0 : kBlock), bufO(kFloat<Out> ? 0 : kBlock);
#pragma omp for schedule(static)
      for (int64_t c = 0; c < blocks; c++) {
        const int64_t from = c * kBlock, len = std::min(n, from + kBlock) - from;
        const float* pa = load(a + from, len, bufA.data());
        float* o = target(out + from, bufO.data());
        if constexpr (kNone<B>) {
#pragma omp simd
          for (int64_t i = 0; i < len; i++) o[i] = f(pa[i]);
        } else {
          const float* pb = load(b + from, len, bufB.data());
#pragma omp simd
          for (int64_t i = 0; i < len; i++) o[i] = f(pa[i], pb[i]);
        }
        store(o, out + from, len);
      }
    }
  }
}

template <typename F>
void binaryLoop(F f, const float* a, const float* b, float* out, const std::vector<int64_t>& aShape,
                const std::vector<int64_t>& bShape, const std::vector<int64_t>& outShape) {
  const int64_t size = product(outShape);
  const int64_t aSize = product(aShape), bSize = product(bShape);
  if (size == 0) return;
  if (aSize == size && bSize == size) {
    mapElements(f, out, a, b, size);
    return;
  }
  if (bSize == 1) {
    const float bv = b[0];
#pragma omp parallel for simd schedule(static) if (size > kParallel)
    for (int64_t i = 0; i < size; i++) out[i] = f(a[i], bv);
    return;
  }
  if (aSize == 1) {
    const float av = a[0];
#pragma omp parallel for simd schedule(static) if (size > kParallel)
    for (int64_t i = 0; i < size; i++) out[i] = f(av, b[i]);
    return;
  }
  // general: strides of a and b in the output's axes (0 where broadcast), innermost axis as a loop
  const int rank = static_cast<int>(outShape.size());
  std::vector<int64_t> sa(rank, 0), sb(rank, 0);
  for (int d = rank - 1, stA = 1, stB = 1, da = (int)aShape.size() - 1, db = (int)bShape.size() - 1; d >= 0; d--, da--, db--) {
    if (da >= 0) {
      sa[d] = aShape[da] == 1 ? 0 : stA;
      stA *= static_cast<int>(aShape[da]);
    }
    if (db >= 0) {
      sb[d] = bShape[db] == 1 ? 0 : stB;
      stB *= static_cast<int>(bShape[db]);
    }
  }
  const int64_t inner = outShape[rank - 1];
  const int64_t rows = size / inner;
  const int64_t ia = sa[rank - 1], ib = sb[rank - 1];
  // fewer rows than the team can share (a [2, 1M] + [1M]): rows in pieces of whole 64-byte lines,
  // at least 4096 elements, each (row, piece) an item; splitting rows only left threads idle
  const int team = teamHere();
  int64_t piece = inner;
  if (rows < 2 * team && size > kParallel) {
    const int64_t split = (2 * team + rows - 1) / rows;
    piece = std::max<int64_t>(4096, ((inner + split - 1) / split + 15) / 16 * 16);
  }
  const int64_t pieces = (inner + piece - 1) / piece;
#pragma omp parallel for schedule(static) if (size > kParallel)
  for (int64_t item = 0; item < rows * pieces; item++) {
    const int64_t r = item / pieces, i0 = (item % pieces) * piece, i1 = std::min(inner, i0 + piece);
    int64_t rest = r, offA = 0, offB = 0;
    for (int d = rank - 2; d >= 0; d--) {
      const int64_t c = rest % outShape[d];
      rest /= outShape[d];
      offA += c * sa[d];
      offB += c * sb[d];
    }
    float* o = out + r * inner;
    const float* pa = a + offA;
    const float* pb = b + offB;
    if (ia == 1 && ib == 1) {
#pragma omp simd
      for (int64_t i = i0; i < i1; i++) o[i] = f(pa[i], pb[i]);
    } else if (ia == 1) {
#pragma omp simd
      for (int64_t i = i0; i < i1; i++) o[i] = f(pa[i], pb[0]);
    } else if (ib == 1) {
#pragma omp simd
      for (int64_t i = i0; i < i1; i++) o[i] = f(pa[0], pb[i]);
    } else {
      for (int64_t i = i0; i < i1; i++) o[i] = f(pa[0], pb[0]);
    }
  }
}

template <typename F>
void unaryLoop(F f, const float* x, float* out, int64_t n) {
#pragma omp parallel for simd schedule(static) if (n > kParallel)
  for (int64_t i = 0; i < n; i++) out[i] = f(x[i]);
}

}  // namespace

int64_t product(const std::vector<int64_t>& shape) {
  int64_t p = 1;
  for (int64_t d : shape) p *= d;
  return p;
}

namespace {

// Runs run(f) with BinaryOp op's element function f(x, y); false for an unknown op.
template <typename Run>
bool withBinaryOp(BinaryOp op, Run run) {
  switch (op) {
    case BinaryOp::Add: run([](float x, float y) { return x + y; }); return true;
    case BinaryOp::Sub: run([](float x, float y) { return x - y; }); return true;
    case BinaryOp::Mul: run([](float x, float y) { return x * y; }); return true;
    case BinaryOp::Div: run([](float x, float y) { return x / y; }); return true;
    case BinaryOp::Max: run([](float x, float y) { return x > y || std::isnan(x) ? x : y; }); return true;
    case BinaryOp::Min: run([](float x, float y) { return x < y || std::isnan(x) ? x : y; }); return true;
    case BinaryOp::SquaredDifference: run([](float x, float y) { return (x - y) * (x - y); }); return true;
  }
  return false;
}

}  // namespace

bool binary(BinaryOp op, const float* a, const float* b, float* out, const std::vector<int64_t>& aShape,
            const std::vector<int64_t>& bShape, const std::vector<int64_t>& outShape) {
  return withBinaryOp(op, [&](auto f) { binaryLoop(f, a, b, out, aShape, bShape, outShape); });
}

bool unary(UnaryOp op, const float* x, float* out, int64_t n, float param) {
  switch (op) {
    case UnaryOp::Exp: unaryLoop([](float v) { return v > 88.72f ? INFINITY : fastExp(v); }, x, out, n); return true;
    case UnaryOp::Log: unaryLoop([](float v) { return std::log(v); }, x, out, n); return true;
    case UnaryOp::Sqrt: unaryLoop([](float v) { return std::sqrt(v); }, x, out, n); return true;
    case UnaryOp::Rsqrt: unaryLoop([](float v) { return 1.f / std::sqrt(v); }, x, out, n); return true;
    case UnaryOp::Square: unaryLoop([](float v) { return v * v; }, x, out, n); return true;
    case UnaryOp::Neg: unaryLoop([](float v) { return -v; }, x, out, n); return true;
    case UnaryOp::Sigmoid: unaryLoop([](float v) { return 1.f / (1.f + fastExp(-v)); }, x, out, n); return true;
    case UnaryOp::Tanh: unaryLoop([](float v) { return std::tanh(v); }, x, out, n); return true;
    case UnaryOp::Relu: unaryLoop([](float v) { return v > 0.f ? v : (std::isnan(v) ? v : 0.f); }, x, out, n); return true;
    case UnaryOp::Abs: unaryLoop([](float v) { return std::fabs(v); }, x, out, n); return true;
    case UnaryOp::Reciprocal: unaryLoop([](float v) { return 1.f / v; }, x, out, n); return true;
    case UnaryOp::Step: {  // selects, not branches: vectorizes
      const float a = param;
#pragma omp parallel for simd schedule(static) if (n > kParallel)
      for (int64_t i = 0; i < n; i++) {
        const float v = x[i];
        const float s = v > 0.f ? 1.f : a;
        out[i] = v != v ? v : s;
      }
      return true;
    }
    case UnaryOp::RoundBf16: {  // one pass, as util/bf16.ts toBf16 then the exact widening
#pragma omp parallel for simd schedule(static) if (n > kParallel)
      for (int64_t i = 0; i < n; i++) {
        uint32_t u;
        std::memcpy(&u, &x[i], 4);
        const uint32_t rounded = (u + 0x7fffu + ((u >> 16) & 1u)) & 0xffff0000u;
        const uint32_t quiet = (u | 0x00400000u) & 0xffff0000u;
        const uint32_t r = (u & 0x7fffffffu) > 0x7f800000u ? quiet : rounded;
        std::memcpy(&out[i], &r, 4);
      }
      return true;
    }
  }
  return false;
}

// GELU, tanh approximation as x * sigmoid(u), u = x (c1 + c2 x^2) (model/layers.ts gelu)
constexpr float kGeluC1 = 1.5957691216057308f;   // 2 sqrt(2 / pi)
constexpr float kGeluC2 = 0.0713548162726009f;   // 0.044715 c1

// GELU(v) and dy * GELU'(v), written once for the float32 and the bf16 kernels
inline float geluOf(float v) {
  const float s = 1.f / (1.f + fastExp(-v * (kGeluC1 + kGeluC2 * v * v)));
  return v * s;
}

inline float geluGradOf(float v, float dy) {
  const float v2 = v * v;
  const float s = 1.f / (1.f + fastExp(-v * (kGeluC1 + kGeluC2 * v2)));
  const float du = v * (kGeluC1 + 3.f * kGeluC2 * v2);
  return dy * (s + du * (s - s * s));
}

namespace {

// GELU of x into out, and dx = dy * GELU'(x); each storage float or bf16
template <typename X, typename Out>
void geluOver(const X* x, Out* out, int64_t n) {
  mapElements([](float v) { return geluOf(v); }, out, x, static_cast<const NoInput*>(nullptr), n);
}

template <typename X, typename D, typename Out>
void geluGradOver(const X* x, const D* dy, Out* dx, int64_t n) {
  mapElements([](float v, float d) { return geluGradOf(v, d); }, dx, x, dy, n);
}

}  // namespace

void gelu(const float* x, float* out, int64_t n) { geluOver(x, out, n); }

void geluGrad(const float* x, const float* dy, float* dx, int64_t n) { geluGradOver(x, dy, dx, n); }

void geluToBf16(const Bf16Operand& x, uint16_t* out, int64_t n) {
  visit(x, [&](auto xs) { geluOver(xs, out, n); });
}

void geluGradToBf16(const Bf16Operand& x, const Bf16Operand& dy, uint16_t* dx, int64_t n) {
  visit(x, [&](auto xs) { visit(dy, [&](auto ds) { geluGradOver(xs, ds, dx, n); }); });
}

bool binarySameShape(BinaryOp op, const Bf16Operand& a, const Bf16Operand& b, float* out, int64_t n) {
  return withBinaryOp(op, [&](auto f) { visit(a, [&](auto as) { visit(b, [&](auto bs) { mapElements(f, out, as, bs, n); }); }); });
}

namespace {

// Layer norm of x's rows (float or bf16) into y and xhat (both float or both bf16) and rstd, a row at a time
template <typename X, typename Y>
void layerNormOver(const X* x, const float* g, const float* b, Y* y, Y* xhat, float* rstd, int64_t rows, int64_t cols, float epsilon) {
#pragma omp parallel if (rows * cols > kParallel && rows > 1)
  {
    std::vector<float> inBuf(kFloat<X> ? 0 : cols), yBuf(kFloat<Y> ? 0 : cols), xhBuf(kFloat<Y> ? 0 : cols);
#pragma omp for schedule(static)
    for (int64_t r = 0; r < rows; r++) {
      const float* in = load(x + r * cols, cols, inBuf.data());
      double s = 0;
#pragma omp simd reduction(+ : s)
      for (int64_t i = 0; i < cols; i++) s += in[i];
      const float mean = static_cast<float>(s / static_cast<double>(cols));
      double q = 0;
#pragma omp simd reduction(+ : q)
      for (int64_t i = 0; i < cols; i++) q += static_cast<double>(in[i] - mean) * (in[i] - mean);
      const float rs = 1.f / std::sqrt(static_cast<float>(q / static_cast<double>(cols)) + epsilon);
      rstd[r] = rs;
      float* xh = target(xhat + r * cols, xhBuf.data());
      float* o = target(y + r * cols, yBuf.data());
#pragma omp simd
      for (int64_t i = 0; i < cols; i++) {
        xh[i] = (in[i] - mean) * rs;
        o[i] = xh[i] * g[i] + b[i];
      }
      store(xh, xhat + r * cols, cols);
      store(o, y + r * cols, cols);
    }
  }
}

// layerNormGrad over dy and xhat each float or bf16 (read row by row, never widened whole)
template <typename D, typename XH>
void layerNormGradOver(const D* dy, const XH* xhat, const float* rstd, const float* g, float* dx, float* dg, float* db, int64_t rows,
                       int64_t cols) {
  // dx per row (rows split over the team); dg and db as each member's partial sums over its rows,
  // in double, in a vector of its own (4 KiB at 256 columns: from its thread's malloc arena, in
  // its cache), then added in member order with whole lines of columns split over the team. They
  // were added one member at a time in a critical section (in whatever order members came:
  // sums that changed from run to run), then copied out by the calling thread alone. (The
  // partials as rows of one scratch kept by the calling thread made the kernel 1.3-1.7x slower
  // at 2 threads, for reasons not found; the members' own vectors match the critical version.)
  const bool parallel = rows * cols > kParallel && rows > 1;
  const int64_t stride = lineStride<double>(cols);
  std::vector<double*> parts(parallel ? teamHere() : 1);
#pragma omp parallel if (parallel)
  {
    std::vector<double> mine(2 * stride, 0.0);
    double* pgr = mine.data();
    double* pbr = pgr + stride;
    parts[myMember()] = pgr;
    std::vector<float> dyBuf(kFloat<D> ? 0 : cols), xhBuf(kFloat<XH> ? 0 : cols);
#pragma omp for schedule(static)
    for (int64_t r = 0; r < rows; r++) {
      const float* d = load(dy + r * cols, cols, dyBuf.data());
      const float* xh = load(xhat + r * cols, cols, xhBuf.data());
      double m1 = 0, m2 = 0;
#pragma omp simd reduction(+ : m1, m2)
      for (int64_t i = 0; i < cols; i++) {
        const float dxh = d[i] * g[i];
        m1 += dxh;
        m2 += static_cast<double>(dxh) * xh[i];
        pgr[i] += static_cast<double>(d[i]) * xh[i];
        pbr[i] += d[i];
      }
      const float a = static_cast<float>(m1 / static_cast<double>(cols));
      const float c = static_cast<float>(m2 / static_cast<double>(cols));
      float* o = dx + r * cols;
      const float rs = rstd[r];
#pragma omp simd
      for (int64_t i = 0; i < cols; i++) o[i] = (d[i] * g[i] - a - xh[i] * c) * rs;
    }
    // (the loop's barrier: every partial is complete) each member adds its lines of columns
    // over the members in order: at one thread, member 0's sums as they are
    const int members = myTeam();
    const auto [c0, c1] = myAlignedShare(cols, 64 / sizeof(double));
    for (int64_t i = c0; i < c1; i++) {
      double sg = parts[0][i], sb = parts[0][stride + i];
      for (int p = 1; p < members; p++) {
        sg += parts[p][i];
        sb += parts[p][stride + i];
      }
      dg[i] = static_cast<float>(sg);
      db[i] = static_cast<float>(sb);
    }
#pragma omp barrier
  }
}

}  // namespace

void layerNorm(const float* x, const float* g, const float* b, float* y, float* xhat, float* rstd, int64_t rows, int64_t cols,
               float epsilon) {
  layerNormOver(x, g, b, y, xhat, rstd, rows, cols, epsilon);
}

void layerNormToBf16(const Bf16Operand& x, const float* g, const float* b, uint16_t* y, uint16_t* xhat, float* rstd, int64_t rows,
                     int64_t cols, float epsilon) {
  visit(x, [&](auto xs) { layerNormOver(xs, g, b, y, xhat, rstd, rows, cols, epsilon); });
}

void layerNormGrad(const float* dy, const float* xhat, const float* rstd, const float* g, float* dx, float* dg, float* db,
                   int64_t rows, int64_t cols) {
  layerNormGradOver(dy, xhat, rstd, g, dx, dg, db, rows, cols);
}

void layerNormGrad(const Bf16Operand& dy, const Bf16Operand& xhat, const float* rstd, const float* g, float* dx, float* dg, float* db,
                   int64_t rows, int64_t cols) {
  visit(dy, [&](auto ds) { visit(xhat, [&](auto xs) { layerNormGradOver(ds, xs, rstd, g, dx, dg, db, rows, cols); }); });
}

namespace {

// Elements per piece of a row reduce() splits (rows fewer than the team's threads): 64 KiB of
// floats, summed in double on one thread, the pieces' sums then added in order
constexpr int64_t kReducePiece = int64_t{1} << 14;

// Max or Min of m and x, where a NaN x wins (so a NaN anywhere in a row is its max and min)
template <typename T>
inline T extremum(ReduceOp op, T m, T x) {
  return (op == ReduceOp::Max ? x > m : x < m) || std::isnan(x) ? x : m;
}

// op over row[0, n) on the calling thread: the sum in double (Sum, Mean: not divided here), or the
// max / min as a float (a NaN wins)
inline double reduceRow(ReduceOp op, const float* row, int64_t n) {
  if (op == ReduceOp::Sum || op == ReduceOp::Mean) {
    double s = 0;
#pragma omp simd reduction(+ : s)
    for (int64_t i = 0; i < n; i++) s += row[i];
    return s;
  }
  float m = n > 0 ? row[0] : (op == ReduceOp::Max ? -INFINITY : INFINITY);
  if (op == ReduceOp::Max) {
    for (int64_t i = 1; i < n; i++) m = extremum(ReduceOp::Max, m, row[i]);
  } else {
    for (int64_t i = 1; i < n; i++) m = extremum(ReduceOp::Min, m, row[i]);
  }
  return m;
}

}  // namespace

void reduce(ReduceOp op, const float* x, float* out, int64_t outer, int64_t inner) {
  const bool sum = op == ReduceOp::Sum || op == ReduceOp::Mean;
  const auto finish = [&](double v) { return static_cast<float>(op == ReduceOp::Mean ? v / static_cast<double>(inner) : v); };
  const int team = teamHere();
  const int64_t pieces = (inner + kReducePiece - 1) / kReducePiece;  // per row
  if (team > 1 && outer < 2 * team && pieces > 1 && outer * inner > kParallel) {
    // fewer rows than the team can share (a loss's mean, a whole gradient's sum: one row): each
    // row in fixed pieces over the team, each piece's sum (max, min) kept, then combined in
    // order. The rows were split over the team, so one row ran on one thread. At one thread the
    // rows below, as before (their bits unchanged); the pieces' sums at any team of 2 or more.
    thread_local ScratchOf<double> scratch;
    double* part = scratch.get(outer * pieces);
#pragma omp parallel for schedule(static)
    for (int64_t j = 0; j < outer * pieces; j++) {
      const int64_t r = j / pieces, from = (j % pieces) * kReducePiece;
      part[j] = reduceRow(op, x + r * inner + from, std::min(kReducePiece, inner - from));
    }
    for (int64_t r = 0; r < outer; r++) {
      const double* p = part + r * pieces;
      double v = p[0];
      for (int64_t j = 1; j < pieces; j++) v = sum ? v + p[j] : extremum(op, v, p[j]);
      out[r] = finish(v);
    }
    return;
  }
#pragma omp parallel for schedule(static) if (outer * inner > kParallel && outer > 1)
  for (int64_t r = 0; r < outer; r++) out[r] = finish(reduceRow(op, x + r * inner, inner));
}

namespace {

// Rows per block of a column sum (sumColumnsByBlocks): a fixed count, so that the sums do not
// depend on the team size
constexpr int64_t kRowBlock = 128;

// out[j] = sum (or mean) over i < outer of x[i, j], for outer >= 2 kRowBlock: each block of
// kRowBlock rows summed in double into its own partial row (blocks spread over the team, each
// thread reading whole rows, contiguous), the partials then added in block order. The column
// split of reduceOuterOver had each thread read half of every row, and the hardware prefetcher
// fetched the other half too: at 2 threads a [4096, 1024] bias gradient took 1.75x the CPU
// time of one thread (1.2x speedup on the threads' CPU clocks).
template <typename X>
void sumColumnsByBlocks(bool mean, const X* x, float* out, int64_t outer, int64_t inner) {
  const int64_t blocks = (outer + kRowBlock - 1) / kRowBlock;
  const int64_t stride = lineStride<double>(inner);  // each block's partial row in whole 64-byte lines
  // kept from call to call (256 KiB at [4096, 1024]: allocated per call, malloc may map it afresh
  // and the team fault its pages in every call);
  // not zeroed here: each block's partial row starts as its first row, on the thread that sums it
  thread_local ScratchOf<double> scratch;
  double* part = scratch.get(blocks * stride);
#pragma omp parallel
  {
    std::vector<float> buf(kFloat<X> ? 0 : inner);
#pragma omp for schedule(static)
    for (int64_t blk = 0; blk < blocks; blk++) {
      double* acc = part + blk * stride;
      const int64_t first = blk * kRowBlock, end = std::min(outer, (blk + 1) * kRowBlock);
      const float* row = load(x + first * inner, inner, buf.data());
#pragma omp simd
      for (int64_t c = 0; c < inner; c++) acc[c] = 0.0 + row[c];
      for (int64_t i = first + 1; i < end; i++) {
        row = load(x + i * inner, inner, buf.data());
#pragma omp simd
        for (int64_t c = 0; c < inner; c++) acc[c] += row[c];
      }
    }
    // the partials added in block order, whole lines of columns split over the team (after the
    // loop's barrier): the same sums at any team size, and no serial pass. Each member adds its
    // columns in a small local row (in L1) and writes each output once: adding into block 0's
    // row in place had members write lines their neighbours also wrote (false sharing), on
    // every block, where a member's share was not whole lines (89 columns over 16 threads)
    const auto [c0, c1] = myAlignedShare(inner, 64 / sizeof(double));
    constexpr int64_t kCols = 256;
    alignas(64) double sum[kCols];
    for (int64_t from = c0; from < c1; from += kCols) {
      const int64_t w = std::min(kCols, c1 - from);
      const double* p0 = part + from;
#pragma omp simd
      for (int64_t c = 0; c < w; c++) sum[c] = p0[c];
      for (int64_t blk = 1; blk < blocks; blk++) {
        const double* p = part + blk * stride + from;
#pragma omp simd
        for (int64_t c = 0; c < w; c++) sum[c] += p[c];
      }
      for (int64_t c = 0; c < w; c++) out[from + c] = static_cast<float>(mean ? sum[c] / static_cast<double>(outer) : sum[c]);
    }
  }
}

template <typename X>
void reduceOuterOver(ReduceOp op, const X* x, float* out, int64_t outer, int64_t inner) {
  // out[j] = op over i < outer of x[i, j] (a row's columns widened first where x is bf16 values:
  // a bf16 run's bias gradient). Long sums by row blocks; otherwise columns split over the team,
  // rows streamed in order
  const bool sum = op == ReduceOp::Sum || op == ReduceOp::Mean;
  if (sum && outer >= 2 * kRowBlock && outer * inner > kParallel) {
    sumColumnsByBlocks(op == ReduceOp::Mean, x, out, outer, inner);
    return;
  }
#pragma omp parallel if (outer * inner > kParallel)
  {
    // whole 64-byte lines of each row per member: a member's columns sharing a line with its
    // neighbour's had both read (and the prefetcher fetch) the same lines of every row
    const auto [c0, c1] = myAlignedShare(inner, 64 / sizeof(float));
    if (c1 > c0) {
      const int64_t w = c1 - c0;
      std::vector<double> acc(w);
      std::vector<float> buf(kFloat<X> ? 0 : w);
      if (sum || outer == 0)
        for (int64_t c = 0; c < w; c++) acc[c] = sum ? 0.0 : (op == ReduceOp::Max ? -INFINITY : INFINITY);
      else {
        const float* first = load(x + c0, w, buf.data());
        for (int64_t c = 0; c < w; c++) acc[c] = first[c];
      }
      for (int64_t i = sum ? 0 : 1; i < outer; i++) {
        const float* row = load(x + i * inner + c0, w, buf.data());
        double* a = acc.data();
        if (sum) {
#pragma omp simd
          for (int64_t c = 0; c < w; c++) a[c] += row[c];
        } else if (op == ReduceOp::Max) {
          for (int64_t c = 0; c < w; c++) if (row[c] > a[c] || std::isnan(row[c])) a[c] = row[c];
        } else {
          for (int64_t c = 0; c < w; c++) if (row[c] < a[c] || std::isnan(row[c])) a[c] = row[c];
        }
      }
      for (int64_t c = c0; c < c1; c++) out[c] = static_cast<float>(op == ReduceOp::Mean ? acc[c - c0] / static_cast<double>(outer) : acc[c - c0]);
    }
  }
}

}  // namespace

void reduceOuter(ReduceOp op, const float* x, float* out, int64_t outer, int64_t inner) { reduceOuterOver(op, x, out, outer, inner); }

void reduceOuter(ReduceOp op, const Bf16Operand& x, float* out, int64_t outer, int64_t inner) {
  visit(x, [&](auto xs) { reduceOuterOver(op, xs, out, outer, inner); });
}

void transpose(const float* x, float* out, const std::vector<int64_t>& shape, const std::vector<int64_t>& perm) {
  const int rank = static_cast<int>(shape.size());
  const int64_t size = product(shape);
  if (size == 0) return;
  std::vector<int64_t> inStride(rank, 1);
  for (int d = rank - 2; d >= 0; d--) inStride[d] = inStride[d + 1] * shape[d + 1];
  std::vector<int64_t> outShape(rank), strideOfOut(rank);
  for (int d = 0; d < rank; d++) {
    outShape[d] = shape[perm[d]];
    strideOfOut[d] = inStride[perm[d]];
  }
  // swapping the last two axes of a batch of matrices: tiles keep reads and writes in cache
  if (rank >= 2 && perm[rank - 1] == rank - 2 && perm[rank - 2] == rank - 1) {
    bool leading = true;
    for (int d = 0; d < rank - 2; d++) leading = leading && perm[d] == d;
    if (leading) {
      const int64_t rows = shape[rank - 2], cols = shape[rank - 1], batch = size / (rows * cols);
      constexpr int64_t T = 32;
#pragma omp parallel for collapse(2) schedule(static) if (size > kParallel)
      for (int64_t bi = 0; bi < batch; bi++) {
        for (int64_t i0 = 0; i0 < rows; i0 += T) {
          const float* src = x + bi * rows * cols;
          float* dst = out + bi * rows * cols;
          for (int64_t j0 = 0; j0 < cols; j0 += T) {
            const int64_t i1 = std::min(rows, i0 + T), j1 = std::min(cols, j0 + T);
            for (int64_t i = i0; i < i1; i++)
              for (int64_t j = j0; j < j1; j++) dst[j * rows + i] = src[i * cols + j];
          }
        }
      }
      return;
    }
  }
  const int64_t inner = outShape[rank - 1];
  const int64_t innerStride = strideOfOut[rank - 1];
  const int64_t rowsOut = size / inner;
#pragma omp parallel for schedule(static) if (size > kParallel)
  for (int64_t r = 0; r < rowsOut; r++) {
    int64_t rest = r, off = 0;
    for (int d = rank - 2; d >= 0; d--) {
      off += (rest % outShape[d]) * strideOfOut[d];
      rest /= outShape[d];
    }
    float* o = out + r * inner;
    for (int64_t i = 0; i < inner; i++) o[i] = x[off + i * innerStride];
  }
}

void softmax(const float* x, float* out, int64_t rows, int64_t cols) {
#pragma omp parallel for schedule(static) if (rows * cols > kParallel && rows > 1)
  for (int64_t r = 0; r < rows; r++) {
    const float* in = x + r * cols;
    float* o = out + r * cols;
    float m = -INFINITY;
    for (int64_t i = 0; i < cols; i++) m = std::max(m, in[i]);
    double s = 0;
    for (int64_t i = 0; i < cols; i++) {
      o[i] = fastExp(in[i] - m);
      s += o[i];
    }
    const float inv = static_cast<float>(1.0 / s);
#pragma omp simd
    for (int64_t i = 0; i < cols; i++) o[i] *= inv;
  }
}

namespace {

// Row i of the causal softmax: o[0..i] = softmax(scale in[0..i]), o[i+1..t) = 0; o may be in.
// The max and the sum are vectorized reductions (the sum in double, as before).
inline void causalSoftmaxRow(const float* in, float* o, int64_t i, int64_t t, float scale) {
  float m = -INFINITY;
#pragma omp simd reduction(max : m)
  for (int64_t j = 0; j <= i; j++) m = std::max(m, in[j] * scale);
  double s = 0;
#pragma omp simd reduction(+ : s)
  for (int64_t j = 0; j <= i; j++) {
    const float e = fastExp(in[j] * scale - m);
    o[j] = e;
    s += e;
  }
  const float inv = static_cast<float>(1.0 / s);
#pragma omp simd
  for (int64_t j = 0; j <= i; j++) o[j] *= inv;
  for (int64_t j = i + 1; j < t; j++) o[j] = 0.f;
}

// Row i of the causal softmax's gradient: o[0..i] = scale y (dy - sum(dy y)) over columns 0..i,
// o[i+1..t) = 0 (y is 0 there, so the full row's formula gives 0 too; dy there is not read, so a
// caller need not compute it); o may be dy.
inline void causalSoftmaxGradRow(const float* yr, const float* dr, float* o, int64_t i, int64_t t, float scale) {
  double dot = 0;
#pragma omp simd reduction(+ : dot)
  for (int64_t j = 0; j <= i; j++) dot += static_cast<double>(dr[j]) * yr[j];
  const float d = static_cast<float>(dot);
#pragma omp simd
  for (int64_t j = 0; j <= i; j++) o[j] = scale * yr[j] * (dr[j] - d);
  for (int64_t j = i + 1; j < t; j++) o[j] = 0.f;
}

// The causal softmax into out (float or bf16), and its gradient from y (float or bf16) into dx
// (float or bf16), a row at a time: a bf16 row computed in a thread's float32 row (in L1), then
// rounded. dx may be dy (float) or y's memory (bf16: each row is read before it is written).
template <typename Out>
void causalSoftmaxOver(const float* x, Out* out, int64_t batch, int64_t t, float scale) {
#pragma omp parallel if (batch * t * t > kParallel && batch * t > 1)
  {
    std::vector<float> row(kFloat<Out> ? 0 : static_cast<size_t>(t));
#pragma omp for schedule(static)
    for (int64_t r = 0; r < batch * t; r++) {
      float* o = target(out + r * t, row.data());
      causalSoftmaxRow(x + r * t, o, r % t, t, scale);
      store(o, out + r * t, t);
    }
  }
}

template <typename Y, typename Out>
void causalSoftmaxGradOver(const Y* y, const float* dy, Out* dx, int64_t batch, int64_t t, float scale) {
#pragma omp parallel if (batch * t * t > kParallel && batch * t > 1)
  {
    std::vector<float> wide(kFloat<Y> ? 0 : static_cast<size_t>(t)), row(kFloat<Out> ? 0 : static_cast<size_t>(t));
#pragma omp for schedule(static)
    for (int64_t r = 0; r < batch * t; r++) {
      const int64_t i = r % t;
      const float* yr = load(y + r * t, i + 1, wide.data());  // columns 0..i: the rest are not read
      float* o = target(dx + r * t, row.data());
      causalSoftmaxGradRow(yr, dy + r * t, o, i, t, scale);
      store(o, dx + r * t, t);
    }
  }
}

}  // namespace

void causalSoftmax(const float* x, float* out, int64_t batch, int64_t t, float scale) { causalSoftmaxOver(x, out, batch, t, scale); }

void causalSoftmaxToBf16(const float* x, uint16_t* out, int64_t batch, int64_t t, float scale) { causalSoftmaxOver(x, out, batch, t, scale); }

void causalSoftmaxGrad(const float* y, const float* dy, float* dx, int64_t batch, int64_t t, float scale) {
  causalSoftmaxGradOver(y, dy, dx, batch, t, scale);
}

void causalSoftmaxGradToBf16(const Bf16Operand& y, const float* dy, uint16_t* dx, int64_t batch, int64_t t, float scale) {
  visit(y, [&](auto ys) { causalSoftmaxGradOver(ys, dy, dx, batch, t, scale); });
}

namespace {

// Rows [r0, r1) of data [n, inner], each added over columns [c0, c1) into its segment's row of
// out [segments, inner] (rows with an id outside [0, segments) skipped), in row order.
inline void addRowsToSegments(const float* data, const int32_t* ids, float* out, int64_t r0, int64_t r1, int64_t inner,
                              int64_t segments, int64_t c0, int64_t c1) {
  for (int64_t r = r0; r < r1; r++) {
    const int32_t s = ids[r];
    if (s < 0 || s >= segments) continue;
    const float* src = data + r * inner;
    float* dst = out + s * inner;
#pragma omp simd
    for (int64_t c = c0; c < c1; c++) dst[c] += src[c];
  }
}

}  // namespace

void segmentSum(const float* data, const int32_t* ids, float* out, int64_t n, int64_t inner, int64_t segments) {
  std::memset(out, 0, sizeof(float) * segments * inner);
  const int team = teamHere();
  if (team == 1 || n * inner <= kParallel) {
    // one thread: every row added in order
    addRowsToSegments(data, ids, out, 0, n, inner, segments, 0, inner);
    return;
  }
  const int64_t stride = lineStride<float>(segments * inner);
  if (static_cast<int64_t>(team) * segments <= n) {
    // few segments beside the rows (an embedding's gradient: 4096 tokens into 89 characters):
    // the rows split over the team, each member adding its rows in order into a partial output
    // of its own (member 0 into out), then the partials added into out in member order, the
    // elements split over the team. The columns split over the team had each member read its
    // part of every row, and the prefetcher the rest: 2.6x slower at 2 threads than at 1.
    thread_local ScratchOf<float> scratch;
    float* part = scratch.get(stride * (team - 1));
#pragma omp parallel
    {
      const int t = myMember();
      float* mine = t == 0 ? out : part + stride * (t - 1);
      if (t > 0) std::fill(mine, mine + segments * inner, 0.f);
      const auto [r0, r1] = myShare(n);
      addRowsToSegments(data, ids, mine, r0, r1, inner, segments, 0, inner);
#pragma omp barrier
      addMemberPartials(out, part, stride, segments * inner);
    }
    return;
  }
  // many segments (a partial output per member would outweigh the rows): columns are independent,
  // each member adds its whole 64-byte lines of every row, so no two members write one element
#pragma omp parallel
  {
    const auto [c0, c1] = myAlignedShare(inner, 64 / sizeof(float));
    if (c1 > c0) addRowsToSegments(data, ids, out, 0, n, inner, segments, c0, c1);
  }
}

void gather(const float* x, const int32_t* indices, float* out, int64_t outer, int64_t axisSize, int64_t inner, int64_t count) {
#pragma omp parallel for collapse(2) schedule(static) if (outer * count * inner > kParallel)
  for (int64_t o = 0; o < outer; o++) {
    for (int64_t j = 0; j < count; j++) {
      std::memcpy(out + (o * count + j) * inner, x + (o * axisSize + indices[j]) * inner, sizeof(float) * inner);
    }
  }
}

}  // namespace layerwise
