// Batched matrix product on oneDNN's row-major sgemm (dnnl_sgemm). Many small matrices (the
// attention's per-head products) are spread over the OpenMP team, one sgemm per thread (nested
// regions are off, so each runs single-threaded); few large ones run one after another, each
// parallel inside oneDNN.
#include "kernels.h"
#include "signals.h"
#include <dnnl.h>
#include <omp.h>
#include <xmmintrin.h>
#include <ctime>
#include <vector>

namespace layerwise {

int matmul(const float* a, const float* b, float* c, int64_t batch, int64_t aStride, int64_t bStride,
           int64_t m, int64_t n, int64_t k, bool transA, bool transB) {
  const char ta = transA ? 'T' : 'N';
  const char tb = transB ? 'T' : 'N';
  const int64_t lda = transA ? m : k;
  const int64_t ldb = transB ? k : n;
  if (m == 0 || n == 0) return 0;
  if (k == 0) {
    for (int64_t i = 0; i < batch * m * n; i++) c[i] = 0.f;
    return 0;
  }
  const SignalGuard guard;  // oneDNN's JIT GEMM must not be interrupted by a signal (signals.h)
  const int team = omp_get_max_threads();
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
