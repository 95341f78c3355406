// The parameter server's host optimizer in native code: AdamW and SGD (with momentum) over
// float32 arrays, in one pass, vectorised by the compiler and split over the OpenMP team. The
// same update rule as src/param-server/host-optimizer.ts hostUpdate, in float32 arithmetic
// (the device optimizers' precision) with the per-step constants in double.
#include <cmath>
#include "kernels.h"

namespace layerwise {

namespace {
// Parameters from which an update is split over the OpenMP team: above 32K (128 KiB of each of
// p, g, m, v) the team's wake-up (microseconds) is small beside the pass. It was 64K, which left
// charlm-small's [256, 256] matrices (65,536 parameters) on one thread.
constexpr int64_t kParallelUpdate = int64_t{1} << 15;
}  // namespace

void adamw(const float* p, const float* g, const float* m, const float* v, float* pOut, float* mOut, float* vOut,
           int64_t n, double lr, double beta1, double beta2, double epsilon, double weightDecay, int64_t step,
           double gradScale) {
  const float b1 = static_cast<float>(beta1);
  const float b2 = static_cast<float>(beta2);
  const float a1 = static_cast<float>(1 - beta1);
  const float a2 = static_cast<float>(1 - beta2);
  const float k = static_cast<float>(lr / (1 - std::pow(beta1, static_cast<double>(step))));
  const float s2 = static_cast<float>(1 / std::sqrt(1 - std::pow(beta2, static_cast<double>(step))));
  const float decay = static_cast<float>(1 - lr * weightDecay);
  const float eps = static_cast<float>(epsilon);
  const float scale = static_cast<float>(gradScale);
#pragma omp parallel for simd schedule(static) if (n >= kParallelUpdate)
  for (int64_t i = 0; i < n; i++) {
    const float gi = g[i] * scale;
    const float mi = b1 * m[i] + a1 * gi;
    const float vi = b2 * v[i] + a2 * gi * gi;
    mOut[i] = mi;
    vOut[i] = vi;
    pOut[i] = p[i] * decay - (k * mi) / (std::sqrt(vi) * s2 + eps);
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
