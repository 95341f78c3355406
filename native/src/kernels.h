// layerwise native kernels: declarations shared by the N-API glue (addon.cc) and the kernels.
#pragma once
#include <cstdint>

namespace layerwise {

// Batched row-major matrix product C[i] = op(A[i]) op(B[i]) for i < batch, on oneDNN's sgemm.
// A[i] starts at a + i * aStride (aStride 0: broadcast one matrix), likewise B; C is dense
// [batch, m, n]. op(A) is [m, k] (A stored [k, m] when transA), op(B) is [k, n] (B stored [n, k]
// when transB). Returns 0 or oneDNN's status.
int matmul(const float* a, const float* b, float* c, int64_t batch, int64_t aStride, int64_t bStride,
           int64_t m, int64_t n, int64_t k, bool transA, bool transB);

// AdamW on n parameters in place (Loshchilov & Hutter, 2019), the device optimizer's math:
// g' = g * gradScale; m = b1 m + (1-b1) g'; v = b2 v + (1-b2) g'^2;
// p = p * (1 - lr wd) - lr * (m / (1 - b1^t)) / (sqrt(v / (1 - b2^t)) + eps).
void adamw(float* p, const float* g, float* m, float* v, int64_t n, double lr, double beta1, double beta2,
           double epsilon, double weightDecay, int64_t step, double gradScale);

// SGD on n parameters in place: v = mu v + (g * gradScale + wd p); p = p - lr v (velocity null:
// plain SGD, p = p - lr (g * gradScale + wd p)).
void sgd(float* p, const float* g, float* velocity, int64_t n, double lr, double momentum, double weightDecay,
         double gradScale);

// Threads of this thread's OpenMP team (each device worker thread has its own).
void setThreads(int n);
int threads();

}  // namespace layerwise
