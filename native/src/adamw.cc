// The parameter server's host optimizer in native code: AdamW and SGD (with momentum) over
// float32 arrays, in one pass, vectorised by the compiler and split over the OpenMP team. The
// same update rule as src/param-server/host-optimizer.ts hostUpdate, in float32 arithmetic
// (the device optimizers' precision) with the per-step constants in double.
#include <algorithm>
#include <cmath>
#include <utility>
#include <vector>
#include "kernels.h"

namespace layerwise {

namespace {
// Parameters from which an update is split over the OpenMP team: above 32K (128 KiB of each of
// p, g, m, v) the team's wake-up (microseconds) is small beside the pass. It was 64K, which left
// charlm-small's [256, 256] matrices (65,536 parameters) on one thread.
constexpr int64_t kParallelUpdate = int64_t{1} << 15;

// AdamW's per-step constants in float32, from the hyper-parameters in double
struct AdamWConstants {
  float b1, b2, a1, a2, k, s2, eps, scale;
};

AdamWConstants adamwConstants(double lr, double beta1, double beta2, double epsilon, int64_t step, double gradScale) {
  return {static_cast<float>(beta1),
          static_cast<float>(beta2),
          static_cast<float>(1 - beta1),
          static_cast<float>(1 - beta2),
          static_cast<float>(lr / (1 - std::pow(beta1, static_cast<double>(step)))),
          static_cast<float>(1 / std::sqrt(1 - std::pow(beta2, static_cast<double>(step)))),
          static_cast<float>(epsilon),
          static_cast<float>(gradScale)};
}

// The decay factor 1 - lr wd in float32 (exactly 1 for wd 0)
float adamwDecay(double lr, double weightDecay) { return static_cast<float>(1 - lr * weightDecay); }

// Element i of AdamW's update: one expression for the per-tensor and the multi-tensor kernels,
// so that both give the same bits
inline void adamwElement(const AdamWConstants& c, float decay, const float* p, const float* g, const float* m, const float* v,
                         float* pOut, float* mOut, float* vOut, int64_t i) {
  const float gi = g[i] * c.scale;
  const float mi = c.b1 * m[i] + c.a1 * gi;
  const float vi = c.b2 * v[i] + c.a2 * gi * gi;
  mOut[i] = mi;
  vOut[i] = vi;
  pOut[i] = p[i] * decay - (c.k * mi) / (std::sqrt(vi) * c.s2 + c.eps);
}

// Elements per block of adamwSpan: its new p, m, v computed into the calling thread's buffers
// (3 x 4 KiB, in L1), then streamed out (streamCopy)
constexpr int64_t kAdamWBlock = 1024;

// AdamW on elements [from, to) of one tensor, on the calling thread (vectorised), a block at a
// time: computed into L1 buffers, then written with streaming stores (nothing reads the new
// values before the next step's forward, by when they have left the caches). The caller calls
// streamFence() before its region ends.
void adamwSpan(const AdamWConstants& c, float decay, const AdamWTensor& t, int64_t from, int64_t to) {
  alignas(64) float bp[kAdamWBlock], bm[kAdamWBlock], bv[kAdamWBlock];
  for (int64_t b0 = from; b0 < to; b0 += kAdamWBlock) {
    const int64_t len = std::min(kAdamWBlock, to - b0);
    const float *p = t.p + b0, *g = t.g + b0, *m = t.m + b0, *v = t.v + b0;
#pragma omp simd
    for (int64_t i = 0; i < len; i++) adamwElement(c, decay, p, g, m, v, bp, bm, bv, i);
    streamCopy(t.pOut + b0, bp, len);
    if (t.pBf16 != nullptr) toBf16Serial(bp, t.pBf16 + b0, len);
    streamCopy(t.mOut + b0, bm, len);
    streamCopy(t.vOut + b0, bv, len);
  }
}

// Calls span(j, from, to) for every piece [from, to) of tensor j in [lo, hi) of all tensors laid
// end to end (start: each tensor's first index, then the total)
template <typename Span>
void forPiecesOf(const std::vector<int64_t>& start, int64_t lo, int64_t hi, Span span) {
  size_t j = static_cast<size_t>(std::upper_bound(start.begin(), start.end(), lo) - start.begin()) - 1;
  for (; j + 1 < start.size() && start[j] < hi; j++) {
    const int64_t from = std::max(lo, start[j]) - start[j], to = std::min(hi, start[j + 1]) - start[j];
    if (from < to) span(j, from, to);
  }
}

// Calls span(j, from, to) for every piece [from, to) of tensor j that falls in this thread's even
// share of the elements of all tensors laid end to end (start: each tensor's first index, then the total)
template <typename Span>
void forMyPieces(const std::vector<int64_t>& start, Span span) {
  const auto [lo, hi] = myShare(start.back());
  forPiecesOf(start, lo, hi, span);
}

// Elements per chunk that a team member takes at a time in adamwMulti (128 KiB of each of p, g,
// m, v): handed out in turn rather than as fixed halves, so that a member whose tensors are
// colder in cache (the update reads gradients the backward wrote in reverse layer order, and
// parameters and moments last touched a step ago) or that the OS paused does not hold the team
// at the barrier. On 2 cores, inside charlm-small's training step, that took the update at 2
// threads from 4.40 to 4.14 ms a step (fp32); it is still only about 1.5x its 1-thread time there,
// where the same pass on its own, cache flushed, runs 2.0x: not understood yet.
constexpr int64_t kAdamWChunk = int64_t{1} << 15;

// Each tensor's first index in all of them laid end to end, then their total
template <typename T, typename Size>
std::vector<int64_t> startsOf(const std::vector<T>& tensors, Size size) {
  std::vector<int64_t> start(tensors.size() + 1, 0);
  for (size_t j = 0; j < tensors.size(); j++) start[j + 1] = start[j] + size(tensors[j]);
  return start;
}
}  // namespace

void adamw(const float* p, const float* g, const float* m, const float* v, float* pOut, float* mOut, float* vOut,
           int64_t n, double lr, double beta1, double beta2, double epsilon, double weightDecay, int64_t step,
           double gradScale) {
  const AdamWConstants c = adamwConstants(lr, beta1, beta2, epsilon, step, gradScale);
  const float decay = adamwDecay(lr, weightDecay);
#pragma omp parallel for simd schedule(static) if (n >= kParallelUpdate)
  for (int64_t i = 0; i < n; i++) adamwElement(c, decay, p, g, m, v, pOut, mOut, vOut, i);
}

void adamwMulti(const std::vector<AdamWTensor>& tensors, int64_t decayed, double lr, double beta1, double beta2, double epsilon,
                double weightDecay, int64_t step, double gradScale) {
  const AdamWConstants c = adamwConstants(lr, beta1, beta2, epsilon, step, gradScale);
  const float decays[2] = {adamwDecay(lr, 0), adamwDecay(lr, weightDecay)};
  const std::vector<int64_t> start = startsOf(tensors, [](const AdamWTensor& t) { return t.n; });
  const int64_t total = start.back(), chunks = (total + kAdamWChunk - 1) / kAdamWChunk;
#pragma omp parallel if (total >= kParallelUpdate)
  {
#pragma omp for schedule(dynamic, 1) nowait
    for (int64_t k = 0; k < chunks; k++)
      forPiecesOf(start, k * kAdamWChunk, std::min(total, (k + 1) * kAdamWChunk), [&](size_t j, int64_t from, int64_t to) {
        adamwSpan(c, decays[static_cast<int64_t>(j) < decayed ? 1 : 0], tensors[j], from, to);
      });
    streamFence();
  }
}

void sumSquaresMulti(const std::vector<const float*>& xs, const std::vector<int64_t>& sizes, float* out) {
  const std::vector<int64_t> start = startsOf(sizes, [](int64_t n) { return n; });
  // each team member's sums of its pieces, added in member order below
  std::vector<std::vector<double>> parts(static_cast<size_t>(std::max(1, threads())));
#pragma omp parallel if (start.back() >= kParallelUpdate)
  {
    std::vector<double>& part = parts[static_cast<size_t>(myMember())];
    part.assign(xs.size(), 0.0);
    forMyPieces(start, [&](size_t j, int64_t from, int64_t to) {
      const float* x = xs[j];
      double s = 0;
#pragma omp simd reduction(+ : s)
      for (int64_t i = from; i < to; i++) s += x[i] * x[i];  // each square in float32, as Square then Sum
      part[j] = s;
    });
  }
  for (size_t j = 0; j < xs.size(); j++) {
    double s = 0;
    for (const std::vector<double>& part : parts) s += part.empty() ? 0.0 : part[j];
    out[j] = static_cast<float>(s);
  }
}

void sgd(const float* p, const float* g, const float* velocity, float* pOut, float* velOut, int64_t n, double lr,
         double momentum, double weightDecay, double gradScale) {
  const float mu = static_cast<float>(momentum);
  const float wd = static_cast<float>(weightDecay);
  const float rate = static_cast<float>(lr);
  const float scale = static_cast<float>(gradScale);
  if (velocity) {
#pragma omp parallel for simd schedule(static) if (n >= kParallelUpdate)
    for (int64_t i = 0; i < n; i++) {
      const float vi = mu * velocity[i] + (g[i] * scale + wd * p[i]);
      velOut[i] = vi;
      pOut[i] = p[i] - rate * vi;
    }
  } else {
#pragma omp parallel for simd schedule(static) if (n >= kParallelUpdate)
    for (int64_t i = 0; i < n; i++) pOut[i] = p[i] - rate * (g[i] * scale + wd * p[i]);
  }
}

}  // namespace layerwise
