// Fused causal multi-head self-attention and fused softmax cross-entropy, forward and backward.
// Attention reads q, k and v in place from the qkv projection [B, T, 3, H, dh] (row stride 3D)
// and writes the context straight into [B, T, H, dh]: the transposes, unstack and packs of the
// composed version (model/layers.ts causalSelfAttention) disappear, and so do their copies.
// Each (batch, head) pair is a handful of row-major oneDNN sgemm calls with leading dimensions
// that step over the other heads; pairs are spread over the OpenMP team (one single-threaded
// sgemm per thread, nested regions are off), as in matmul.cc.
#include "kernels.h"
#include "signals.h"
#include <dnnl.h>
#include <omp.h>
#include <algorithm>
#include <cmath>
#include <vector>

namespace layerwise {

bool spreadPairs(int64_t pairs) {
  const int team = omp_get_max_threads();
  return team > 1 && pairs >= 2 * team;
}

int causalAttention(const float* qkv, float* ctx, float* p, int64_t batch, int64_t t, int64_t heads, int64_t dh, float scale) {
  const SignalGuard guard;  // sgemm: JIT GEMM kernels (signals.h)
  const int64_t d = heads * dh, ld = 3 * d, pairs = batch * heads;
  int status = 0;
#pragma omp parallel for schedule(static) if (spreadPairs(pairs))
  for (int64_t bh = 0; bh < pairs; bh++) {
    const int64_t b = bh / heads, h = bh % heads;
    const float* q = qkv + b * t * ld + h * dh;
    const float* k = q + d;
    const float* v = q + 2 * d;
    float* s = p + bh * t * t;
    float* c = ctx + b * t * d + h * dh;  // its head's columns of [B, T, D]
    int st = dnnl_success;
    // scores = q k^T [T, T], each block of query rows against the keys it sees; then the causal
    // softmax of scale * scores in place (it reads no masked score, and writes them 0)
    forCausalBlocks(t, [&](int64_t r0, int64_t r1) {
      if (st == dnnl_success) st = dnnl_sgemm('N', 'T', r1 - r0, r1, dh, 1.f, q + r0 * ld, ld, k, ld, 0.f, s + r0 * t, t);
    });
    causalSoftmax(s, s, 1, t, scale);
    // context = P v [T, dh]
    forCausalBlocks(t, [&](int64_t r0, int64_t r1) {
      if (st == dnnl_success) st = dnnl_sgemm('N', 'N', r1 - r0, dh, r1, 1.f, s + r0 * t, t, v, ld, 0.f, c + r0 * d, d);
    });
    if (st != dnnl_success) {
#pragma omp atomic write
      status = st;
    }
  }
  return status;
}

int causalAttentionGrad(const float* dctx, const float* qkv, const float* p, float* dqkv, int64_t batch, int64_t t, int64_t heads,
                        int64_t dh, float scale) {
  const SignalGuard guard;  // sgemm: JIT GEMM kernels (signals.h)
  const int64_t d = heads * dh, ld = 3 * d, pairs = batch * heads;
  int status = 0;
#pragma omp parallel if (spreadPairs(pairs))
  {
    std::vector<float> ds(static_cast<size_t>(t * t));  // this thread's dscores [T, T]
#pragma omp for schedule(static)
    for (int64_t bh = 0; bh < pairs; bh++) {
      const int64_t b = bh / heads, h = bh % heads;
      const float* q = qkv + b * t * ld + h * dh;
      const float* k = q + d;
      const float* v = q + 2 * d;
      const float* pb = p + bh * t * t;
      const float* dc = dctx + b * t * d + h * dh;
      float* dq = dqkv + b * t * ld + h * dh;
      float* dk = dq + d;
      float* dv = dq + 2 * d;
      float* g = ds.data();
      int st = dnnl_success;
      // dv = P^T dctx (keys [j0, j1) are seen by queries [j0, T) only); dP = dctx v^T over the
      // columns each block of queries sees (the causal softmax gradient reads no other)
      forCausalBlocks(t, [&](int64_t j0, int64_t j1) {
        if (st == dnnl_success) st = dnnl_sgemm('T', 'N', j1 - j0, dh, t - j0, 1.f, pb + j0 * t + j0, t, dc + j0 * d, d, 0.f, dv + j0 * ld, ld);
      });
      forCausalBlocks(t, [&](int64_t r0, int64_t r1) {
        if (st == dnnl_success) st = dnnl_sgemm('N', 'T', r1 - r0, r1, dh, 1.f, dc + r0 * d, d, v, ld, 0.f, g + r0 * t, t);
      });
      // dscores = scale P (dP - rowsum(dP P)), 0 where masked; dq = dscores k; dk = dscores^T q
      if (st == dnnl_success) causalSoftmaxGrad(pb, g, g, 1, t, scale);
      forCausalBlocks(t, [&](int64_t r0, int64_t r1) {
        if (st == dnnl_success) st = dnnl_sgemm('N', 'N', r1 - r0, dh, r1, 1.f, g + r0 * t, t, k, ld, 0.f, dq + r0 * ld, ld);
      });
      forCausalBlocks(t, [&](int64_t j0, int64_t j1) {
        if (st == dnnl_success) st = dnnl_sgemm('T', 'N', j1 - j0, dh, t - j0, 1.f, g + j0 * t + j0, t, q + j0 * ld, ld, 0.f, dk + j0 * ld, ld);
      });
      if (st != dnnl_success) {
#pragma omp atomic write
        status = st;
      }
    }
  }
  return status;
}

namespace {

// Logits widened at a time from bf16 (softmaxCrossEntropyOver): about 16 KiB of float32, in L1
constexpr int64_t kWidenFloats = 4096;

// Row r of logits as float32: in place for float32; for bf16 values, from the thread's buffer
// `buf`, which holds rows [from, to) widened (exactly): rows r on are widened into it, a run of
// them at a time, when r is not there. Each thread reads its rows in order (a static schedule).
struct LogitsRows {
  std::vector<float> buf;
  int64_t from = 0, to = 0;
};
inline const float* logitsRow(const float* x, int64_t r, int64_t, int64_t classes, LogitsRows&) { return x + r * classes; }
inline const float* logitsRow(const uint16_t* x, int64_t r, int64_t rows, int64_t classes, LogitsRows& w) {
  if (r < w.from || r >= w.to) {
    const int64_t run = std::max<int64_t>(1, kWidenFloats / std::max<int64_t>(classes, 1));
    w.from = r;
    w.to = std::min(rows, r + run);
    w.buf.resize(static_cast<size_t>((w.to - w.from) * classes));
    fromBf16Serial(x + w.from * classes, w.buf.data(), (w.to - w.from) * classes);
  }
  return w.buf.data() + (r - w.from) * classes;
}

template <typename X>
double softmaxCrossEntropyOver(const X* logits, const int32_t* labels, float* probs, int64_t rows, int64_t classes) {
  double total = 0;
#pragma omp parallel reduction(+ : total) if (rows * classes > (1 << 15) && rows > 1)
  {
    LogitsRows widened;
#pragma omp for schedule(static)
    for (int64_t r = 0; r < rows; r++) {
      const float* x = logitsRow(logits, r, rows, classes, widened);
      float* pr = probs + r * classes;
      float m = -INFINITY;
      for (int64_t j = 0; j < classes; j++) m = std::max(m, x[j]);
      double s = 0;
      for (int64_t j = 0; j < classes; j++) {
        pr[j] = std::exp(x[j] - m);
        s += pr[j];
      }
      const float inv = static_cast<float>(1.0 / s);
      for (int64_t j = 0; j < classes; j++) pr[j] *= inv;
      const int32_t y = labels[r];
      // -log softmax(x)[y] = logsumexp(x) - x[y]; a label outside [0, classes) has an all-zero one-hot: no loss
      if (y >= 0 && y < classes) total += std::log(s) + m - x[y];
    }
  }
  return rows > 0 ? total / static_cast<double>(rows) : NAN;
}

}  // namespace

double softmaxCrossEntropy(const float* logits, const int32_t* labels, float* probs, int64_t rows, int64_t classes) {
  return softmaxCrossEntropyOver(logits, labels, probs, rows, classes);
}

double softmaxCrossEntropy(const Bf16Operand& logits, const int32_t* labels, float* probs, int64_t rows, int64_t classes) {
  return logits.f32 != nullptr ? softmaxCrossEntropyOver(logits.f32, labels, probs, rows, classes)
                               : softmaxCrossEntropyOver(logits.bf16, labels, probs, rows, classes);
}

void softmaxCrossEntropyGrad(const float* probs, const int32_t* labels, float* dlogits, int64_t rows, int64_t classes, float dyOverRows) {
#pragma omp parallel for schedule(static) if (rows * classes > (1 << 15) && rows > 1)
  for (int64_t r = 0; r < rows; r++) {
    const float* pr = probs + r * classes;
    float* o = dlogits + r * classes;
#pragma omp simd
    for (int64_t j = 0; j < classes; j++) o[j] = pr[j] * dyOverRows;
    const int32_t y = labels[r];
    if (y >= 0 && y < classes) o[y] = (pr[y] - 1.f) * dyOverRows;
  }
}

}  // namespace layerwise
