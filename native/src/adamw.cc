// The parameter server's host optimizer in native code: AdamW and SGD (with momentum) over
// float32 arrays, in one pass, vectorised (AVX2 and FMA intrinsics where the build targets
// them, else by the compiler) and split over the OpenMP team. The
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

// Element i of AdamW's update, each product-and-sum an explicit FMA: the scalar form of
// adamwVector8 below (the same operations in the same order), so that an element gets the same
// bits whichever of the two computes it, in the per-tensor and the multi-tensor kernels alike.
// These are the FMAs GCC formed itself from the plain expressions (m' = b1 m + a1 g,
// v' = b2 v + a2 g g, p' = p decay - k m' / (sqrt(v') s2 + eps)), so the bits are those of before.
inline void adamwElement(const AdamWConstants& c, float decay, const float* p, const float* g, const float* m, const float* v,
                         float* pOut, float* mOut, float* vOut, int64_t i) {
  const float gi = g[i] * c.scale;
  const float mi = std::fma(c.b1, m[i], c.a1 * gi);
  const float vi = std::fma(c.b2, v[i], (c.a2 * gi) * gi);
  const float q = (c.k * mi) / std::fma(std::sqrt(vi), c.s2, c.eps);
  mOut[i] = mi;
  vOut[i] = vi;
  pOut[i] = std::fma(p[i], decay, -q);
}

#if defined(__AVX2__) && defined(__FMA__)
// 8 elements of AdamW's update from i, as adamwElement, stored with streaming stores where the
// output is 32-byte aligned there (stream*), else plain ones
inline void adamwVector8(const AdamWConstants& c, float decay, const float* p, const float* g, const float* m, const float* v,
                         float* pOut, float* mOut, float* vOut, int64_t i, bool streamP, bool streamM, bool streamV) {
  const __m256 gi = _mm256_mul_ps(_mm256_loadu_ps(g + i), _mm256_set1_ps(c.scale));
  const __m256 mi = _mm256_fmadd_ps(_mm256_set1_ps(c.b1), _mm256_loadu_ps(m + i), _mm256_mul_ps(_mm256_set1_ps(c.a1), gi));
  const __m256 vi =
      _mm256_fmadd_ps(_mm256_set1_ps(c.b2), _mm256_loadu_ps(v + i), _mm256_mul_ps(_mm256_mul_ps(_mm256_set1_ps(c.a2), gi), gi));
  const __m256 q = _mm256_div_ps(_mm256_mul_ps(_mm256_set1_ps(c.k), mi),
                                 _mm256_fmadd_ps(_mm256_sqrt_ps(vi), _mm256_set1_ps(c.s2), _mm256_set1_ps(c.eps)));
  const __m256 pi = _mm256_fmsub_ps(_mm256_loadu_ps(p + i), _mm256_set1_ps(decay), q);
  if (streamP) _mm256_stream_ps(pOut + i, pi); else _mm256_storeu_ps(pOut + i, pi);
  if (streamM) _mm256_stream_ps(mOut + i, mi); else _mm256_storeu_ps(mOut + i, mi);
  if (streamV) _mm256_stream_ps(vOut + i, vi); else _mm256_storeu_ps(vOut + i, vi);
}
#endif

// Whether this build writes AdamW's outputs with streaming stores from the registers
#if defined(__AVX2__) && defined(__FMA__)
constexpr bool kStreamsFromRegisters = true;
#else
constexpr bool kStreamsFromRegisters = false;
#endif

bool aligned32(const float* x) { return (reinterpret_cast<uintptr_t>(x) & 31) == 0; }

// Elements per block of adamwSpan: the outputs not written straight from the registers are
// computed into the calling thread's buffers (up to 3 x 4 KiB, in L1) a block at a time
constexpr int64_t kAdamWBlock = 1024;

// How many elements from `out` on put the most of the three outputs on a 32-byte boundary (p's
// on a tie), so that those can be written with aligned streaming stores from there on
int64_t alignmentHead(float* const out[3]) {
  int64_t votes[8] = {0}, best = -1;
  for (int o = 0; o < 3; o++) {
    const uintptr_t at = reinterpret_cast<uintptr_t>(out[o]);
    if ((at & 3) == 0) votes[((32 - (at & 31)) & 31) / 4] += o == 0 ? 2 : 1;  // p's vote breaks a tie
  }
  for (int64_t h = 0; h < 8; h++)
    if (best < 0 || votes[h] > votes[best]) best = h;
  return best;
}

// AdamW on elements [from, to) of one tensor, on the calling thread. Each output that is 32-byte
// aligned (after a head of up to 7 elements that aligns the most of them) is written straight from
// the registers with streaming stores: nothing reads the new values before the next step's
// forward, by when they would have left the caches anyway, so they skip the read for ownership.
// Each other output, and p where its bf16 rounding is wanted too, goes through an L1 buffer a
// block at a time and is streamed out from there (streamCopy aligns its own stores). Measured on
// charlm-small's 3.2M parameters, caches flushed, 1 / 2 threads (2-core Xeon): every output
// through the buffers (as this kernel was) 5.8 / 3.1 ms; all straight, aligned 4.6 / 2.5 ms; m
// and v misaligned to p, through the buffers 5.5-5.9 / 3.0 ms, stored plainly 7.4 / 3.9 ms. The
// caller calls streamFence() before its region ends.
void adamwSpan(const AdamWConstants& c, float decay, const AdamWTensor& t, int64_t from, int64_t to) {
  const float *p = t.p + from, *g = t.g + from, *m = t.m + from, *v = t.v + from;
  float* const out[3] = {t.pOut + from, t.mOut + from, t.vOut + from};
  uint16_t* const bf = t.pBf16 == nullptr ? nullptr : t.pBf16 + from;
  const int64_t n = to - from;
  const int64_t head = kStreamsFromRegisters ? std::min(n, alignmentHead(out)) : 0;
  for (int64_t i = 0; i < head; i++) adamwElement(c, decay, p, g, m, v, out[0], out[1], out[2], i);
  if (bf != nullptr) toBf16Serial(out[0], bf, head);
  bool direct[3];
  for (int o = 0; o < 3; o++) direct[o] = !kStreamsFromRegisters || (aligned32(out[o] + head) && (o > 0 || bf == nullptr));
  alignas(64) float buffers[3][kAdamWBlock];
  for (int64_t b0 = head; b0 < n; b0 += kAdamWBlock) {
    const int64_t len = std::min(kAdamWBlock, n - b0);
    float* dst[3];
    for (int o = 0; o < 3; o++) dst[o] = direct[o] ? out[o] + b0 : buffers[o];
    int64_t i = 0;
#if defined(__AVX2__) && defined(__FMA__)
    for (; i + 8 <= len; i += 8)
      adamwVector8(c, decay, p + b0, g + b0, m + b0, v + b0, dst[0], dst[1], dst[2], i, direct[0], direct[1], direct[2]);
#endif
#pragma omp simd
    for (int64_t k = i; k < len; k++) adamwElement(c, decay, p + b0, g + b0, m + b0, v + b0, dst[0], dst[1], dst[2], k);
    for (int o = 0; o < 3; o++)
      if (!direct[o]) streamCopy(out[o] + b0, buffers[o], len);
    if (bf != nullptr) toBf16Serial(dst[0], bf + b0, len);
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
// threads from 4.40 to 4.14 ms a step (fp32). With the stores of adamwSpan and one call a step
// (backend/native.ts elementsPerCall), the update takes 5.1-5.3 ms at 1 thread and 2.8-3.1 ms
// at 2 inside the step (bench kernels), where the same pass on its own, caches flushed, runs
// 1.84x (outputs aligned) to 1.93x (m and v misaligned to p, as the flat moments' views mostly
// are in a step).
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
  // one tensor through adamwMulti's path: the same element code, so the same bits
  adamwMulti({AdamWTensor{p, g, m, v, pOut, mOut, vOut, n}}, 1, lr, beta1, beta2, epsilon, weightDecay, step, gradScale);
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
