// Batched matrix product on oneDNN's row-major sgemm (dnnl_sgemm). Many small matrices (the
// attention's per-head products) are spread over the OpenMP team, one sgemm per thread (nested
// regions are off, so each runs single-threaded); few large ones run one after another, each
// parallel inside oneDNN, except a weight gradient with a small output (splitsReduction), whose
// long reduction is split over the team instead (splitReduction; also bf16.cc's products), a
// long product, whose rows are split over the team (splitRows; also bf16.cc's), and an input
// gradient dy W^T, whose shared weight is transposed first (transposesWeight).
#include "kernels.h"
#include "signals.h"
#include <dnnl.h>
#include <omp.h>
#include <xmmintrin.h>
#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <ctime>
#include <functional>
#include <utility>
#include <vector>

namespace layerwise {

namespace {

// A weight gradient's output up to this many elements (4 MiB of floats: a scratch of that much
// per member but the first, kept) is computed by splitReduction at 2+ threads. oneDNN splits such
// a product's output over the team and each thread packs the whole of its long A (charlm-small's
// [4096, 256]^T [4096, 256]: 30% more CPU time at 2 threads than at 1, 1.4-1.5x; [4096, 256]^T
// [4096, 89] 1.1-1.2x); split over k instead they took 1.7-1.8x and 1.4-1.6x on the threads' CPU
// clocks (bf16; fp32 1.9x both, oneDNN 1.9x and 1.7x). Up to 2^16 elements on a Zen 4, where
// oneDNN's own split of larger outputs scaled 1.9x. On a Zen 5 (2 cores of different CCDs,
// 240 ns a one-way cache-line transfer) it does not: alternated in one process, median of 36
// calls at 2 threads, oneDNN's split -> split over k, ms:
//   fp32 [4096, 256]^T [4096, 1024]: 7.33 / 7.63 -> 6.31 / 6.16 (1 thread 12.3 / 11.6);
//   fp32 [4096, 256]^T [4096, 768] 4.85 / 4.94 -> 4.59 / 4.60; [4096, 1024]^T [4096, 256] alike;
//   bf16 [4096, 256]^T [4096, 1024] 4.84 / 4.63 -> 3.88 / 3.68; [4096, 1024]^T [4096, 256]
//   4.43 / 4.32 -> 3.88 / 3.71; [4096, 256]^T [4096, 768] 3.51 / 3.55 -> 2.79 / 2.88;
//   [8192, 1024]^T [8192, 1024] fp32 49.4 -> 48.0, bf16 34.0 -> 30.9; [8192, 512]^T [8192, 2048]
//   fp32 56.9 -> 52.0, bf16 33.1 -> 30.7.
// Split over k was never the slower of the two, so outputs up to 2^20 elements take it. Larger
// teams cut a small output into smaller blocks still, each of which reads the whole of k.
constexpr int64_t kSplitReductionOutput = int64_t{1} << 20;

// The environment variable `name` as a non-negative integer, else `fallback` (unset or empty; a
// malformed value is reported on stderr and `fallback` kept): the bounds below for A/B runs on
// other machines (bench/device-session.sh cpu).
int64_t envCount(const char* name, int64_t fallback) {
  const char* e = std::getenv(name);
  if (e == nullptr || *e == '\0') return fallback;
  char* end = nullptr;
  const long long v = std::strtoll(e, &end, 10);
  if (*end != '\0' || v < 0) {
    std::fprintf(stderr, "layerwise: %s=%s is not a non-negative integer; using %lld\n", name, e, static_cast<long long>(fallback));
    return fallback;
  }
  return static_cast<int64_t>(v);
}

// kSplitReductionOutput, or LAYERWISE_SPLIT_REDUCTION_MAX (elements; 0: never split), read once
int64_t splitReductionMax() {
  static const int64_t bound = envCount("LAYERWISE_SPLIT_REDUCTION_MAX", kSplitReductionOutput);
  return bound;
}

// op(b) = b^T, b a shared [n, k] weight (a dense layer's input gradient, dy W^T): oneDNN 2.6.3's
// sgemm runs 'N','T' at 2 threads no faster than 'N','N' at 1 where n <= k. In charlm-small's
// step (`bench kernels --shapes --threads 1,2`), [4096, 1024] x [256, 1024]^T took 51 -> 40 ms a
// step (1.28x) and [4096, 768] x [256, 768]^T 37 -> 26 ms (1.42x); with b transposed first and
// 'N','N', 49 -> 26 ms (1.91x) and 34 -> 19 ms (1.83x). Where n > k the two layouts run alike
// ([4096, 256] x [1024, 256]^T 5.5 ms either way). The transpose is a pass over n k floats, so
// only where the product is at least kTransposeRows rows long and b holds kTransposeMin to
// kTransposeMax floats ([4096, 89] x [256, 89]^T's 23 K floats went 0.53 -> 0.70 ms: the
// transpose's OpenMP region costs more than it saves). bf16.cc's primitive runs either layout
// at one speed.
constexpr int64_t kTransposeRows = 512;
constexpr int64_t kTransposeMin = int64_t{1} << 16;
constexpr int64_t kTransposeMax = int64_t{1} << 22;

bool transposesWeight(int64_t batch, int64_t bStride, int64_t m, int64_t n, int64_t k, bool transA, bool transB) {
  return transB && !transA && (batch == 1 || bStride == 0) && n <= k && m >= kTransposeRows &&
         n * k >= kTransposeMin && n * k <= kTransposeMax;
}

// out [k, n] = b^T for b [n, k] row-major, in 32 x 32 blocks over the team.
void transposeInto(const float* b, int64_t n, int64_t k, float* out) {
  constexpr int64_t kBlock = 32;
  const int64_t blocksN = (n + kBlock - 1) / kBlock, blocksK = (k + kBlock - 1) / kBlock;
#pragma omp parallel for schedule(static)
  for (int64_t blk = 0; blk < blocksN * blocksK; blk++) {
    const int64_t j0 = (blk / blocksK) * kBlock, k0 = (blk % blocksK) * kBlock;
    const int64_t j1 = std::min(n, j0 + kBlock), k1 = std::min(k, k0 + kBlock);
    for (int64_t kk = k0; kk < k1; kk++)
      for (int64_t j = j0; j < j1; j++) out[kk * n + j] = b[j * k + kk];
  }
}

// A product of at least kRowsSplitMin rows per member, and no wider than long (m >= n), at 2+
// threads: each member multiplies its own contiguous block of whole 64-row blocks of op(A) on
// one thread (splitRows), instead of oneDNN's own split. The blocks fall where the element-wise
// kernels' static schedules put their halves, so each member reads the rows it wrote last (on a
// Zen 5 whose 2 cores sit on different CCDs, 240 ns a one-way cache-line transfer). Alone, median of 40
// calls at 1 thread -> oneDNN at 2 -> split rows at 2, ms: [4096, 256] x [256, 1024] 10.60 ->
// 5.54 (1.91x) -> 5.33 (1.99x); [4096, 256] x [256, 768] 7.87 -> 4.18 (1.88x) -> 3.95 (1.99x);
// [4096, 1024] x [1024, 256] 12.55 -> 6.24 (2.01x) -> 6.05 (2.08x); [4096, 256] x [1024, 256]^T
// 10.51 -> 5.46 -> 5.27. In charlm-small's step (`bench kernels --threads 1,2`, two runs each,
// speedup at 2 threads, oneDNN's split -> split rows): fp32 LayerwiseDense 1.75-1.81x ->
// 1.91-1.94x; bf16 LayerwiseDense 1.56-1.65x -> 1.92-2.00x, BatchMatMul 1.62-1.79x -> 1.70-1.97x,
// the whole step 1.55-1.71x -> 1.71-1.93x. Each member packs the whole of op(B) (at most a few
// MiB here). Not yet measured at 16 threads: LAYERWISE_SPLIT_ROWS_MIN (rows a member; 0: never
// split) sets the bound for A/B runs, read once.
constexpr int64_t kRowsSplitMin = 256;

int64_t splitRowsMin() {
  static const int64_t bound = envCount("LAYERWISE_SPLIT_ROWS_MIN", kRowsSplitMin);
  return bound;
}

// Member t of nt's share [from, to) of n elements, in whole 64-element blocks (the last one
// short), so that members' slices start on 64-row boundaries of a matrix.
std::pair<int64_t, int64_t> memberBlocks(int64_t n, int t, int nt) {
  constexpr int64_t kAlign = 64;
  const int64_t blocks = (n + kAlign - 1) / kAlign;
  return {std::min(n, blocks * t / nt * kAlign), std::min(n, blocks * (t + 1) / nt * kAlign)};
}

// Inside a parallel region of `team`: runs `fn` on the calling member alone (its oneDNN calls
// built for one thread) and records a non-zero status it returns in `status`.
void runAlone(int team, int& status, const std::function<int()>& fn) {
  omp_set_num_threads(1);
  const int s = fn();
  omp_set_num_threads(team);
  if (s != 0) {
#pragma omp atomic write
    status = s;
  }
}

}  // namespace

bool splitsReduction(int team, int64_t batch, int64_t m, int64_t n, int64_t k, bool transA, bool transB) {
  return team > 1 && batch == 1 && transA && !transB && m * n <= splitReductionMax() && k >= 4 * std::max(m, n);
}

int splitReduction(int64_t m, int64_t n, int64_t k, float* c, const std::function<int(int64_t, int64_t, float*)>& slice) {
  const int team = omp_get_max_threads();
  // members 1.. team-1's [m, n] partial sums, each in whole 64-byte lines of a kept scratch
  thread_local ScratchOf<float> partials;
  const int64_t mn = m * n, stride = lineStride<float>(mn);
  float* part = partials.get((team - 1) * stride);
  int status = 0;
#pragma omp parallel num_threads(team)
  {
    const int t = omp_get_thread_num();
    const auto [k0, k1] = memberBlocks(k, t, omp_get_num_threads());  // whole 64-row blocks of A and B
    float* out = t == 0 ? c : part + (t - 1) * stride;
    runAlone(team, status, [&] { return k1 > k0 ? slice(k0, k1, out) : (std::fill(out, out + mn, 0.f), 0); });
#pragma omp barrier
    addMemberPartials(c, part, stride, mn);  // into C in member order, C split over the team
  }
  return status;
}

bool splitsRows(int team, int64_t batch, int64_t m, int64_t n) {
  const int64_t min = splitRowsMin();
  return team > 1 && batch == 1 && min > 0 && m >= min * team && m >= n;
}

// C [m, n] = op(A) op(B) by blocks of rows over the team (see kRowsSplitMin); `slice(m0, m1)`
// multiplies rows m0 to m1 on the calling member alone. Returns 0 or the first failing status.
int splitRows(int64_t m, const std::function<int(int64_t, int64_t)>& slice) {
  const int team = omp_get_max_threads();
  int status = 0;
#pragma omp parallel num_threads(team)
  {
    const auto [m0, m1] = memberBlocks(m, omp_get_thread_num(), omp_get_num_threads());
    runAlone(team, status, [&] { return m1 > m0 ? slice(m0, m1) : 0; });
  }
  return status;
}

int matmul(const float* a, const float* b, float* c, int64_t batch, int64_t aStride, int64_t bStride,
           int64_t m, int64_t n, int64_t k, bool transA, bool transB) {
  const char ta = transA ? 'T' : 'N';
  const int64_t lda = transA ? m : k;
  if (m == 0 || n == 0) return 0;
  if (k == 0) {
    for (int64_t i = 0; i < batch * m * n; i++) c[i] = 0.f;
    return 0;
  }
  const SignalGuard guard;  // oneDNN's JIT GEMM must not be interrupted by a signal (signals.h)
  const int team = omp_get_max_threads();
  if (splitsReduction(team, batch, m, n, k, transA, transB))
    return splitReduction(m, n, k, c, [&](int64_t k0, int64_t k1, float* out) {
      return static_cast<int>(dnnl_sgemm('T', 'N', m, n, k1 - k0, 1.f, a + k0 * m, m, b + k0 * n, n, 0.f, out, n));
    });
  // a shared weight used transposed is transposed first where that is faster (transposesWeight):
  // the products below then read it as stored 'N'
  const bool transposed = transposesWeight(batch, bStride, m, n, k, transA, transB);
  if (transposed) {
    thread_local ScratchOf<float> scratch;
    float* bt = scratch.get(n * k);
    transposeInto(b, n, k, bt);
    b = bt;
  }
  const char tb = transB && !transposed ? 'T' : 'N';
  const int64_t ldb = tb == 'T' ? k : n;
  if (splitsRows(team, batch, m, n))
    return splitRows(m, [&](int64_t m0, int64_t m1) {
      return static_cast<int>(dnnl_sgemm(ta, tb, m1 - m0, n, k, 1.f, a + (transA ? m0 : m0 * k), lda, b, ldb, 0.f, c + m0 * n, n));
    });
  if (batch >= 2 * team && team > 1) {
    int status = 0;
#pragma omp parallel for schedule(static)
    for (int64_t i = 0; i < batch; i++) {
      int s = dnnl_sgemm(ta, tb, m, n, k, 1.f, a + i * aStride, lda, b + i * bStride, ldb, 0.f, c + i * m * n, n);
      if (s != dnnl_success) {
#pragma omp atomic write
        status = s;
      }
    }
    return status;
  }
  for (int64_t i = 0; i < batch; i++) {
    int s = dnnl_sgemm(ta, tb, m, n, k, 1.f, a + i * aStride, lda, b + i * bStride, ldb, 0.f, c + i * m * n, n);
    if (s != dnnl_success) return s;
  }
  return 0;
}

void flushDenormals() {
  // FTZ and DAZ on the calling thread and every thread of its team: denormal floats (the
  // softmax's near-zero probabilities times small gradients) cost a microcode assist per
  // operation and slowed whole products several-fold; flushed, they are zeros
  _mm_setcsr(_mm_getcsr() | 0x8040);
  // the team's workers also block asynchronous signals for good (signals.h); this region
  // starts every worker the team can have (omp_get_max_threads), so none escapes it
#pragma omp parallel
  {
    _mm_setcsr(_mm_getcsr() | 0x8040);
    if (omp_get_thread_num() != 0) blockAsyncSignalsForever();
  }
}

void flushDenormalsHere() { _mm_setcsr(_mm_getcsr() | 0x8040); }

void setThreads(int n) {
  omp_set_num_threads(n);
  flushDenormals();
}

int threads() { return omp_get_max_threads(); }

std::vector<double> teamCpuSeconds() {
  std::vector<double> s(static_cast<size_t>(omp_get_max_threads()), 0.0);
  // one region of the team: libgomp gives member i the same pool thread in every region the
  // calling thread starts, so member i's clock is the thread that did member i's share
#pragma omp parallel
  {
    timespec ts{};
    clock_gettime(CLOCK_THREAD_CPUTIME_ID, &ts);
    s[static_cast<size_t>(omp_get_thread_num())] = static_cast<double>(ts.tv_sec) + 1e-9 * static_cast<double>(ts.tv_nsec);
  }
  return s;
}

}  // namespace layerwise
