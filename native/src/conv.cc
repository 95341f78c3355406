// 2-D convolution (forward, backward data, backward weights) on oneDNN's convolution primitives,
// and max / average pooling with their gradients as direct OpenMP loops. NHWC activations and
// HWIO filters, as TF.js stores them: activations are read and written in place; the filter (small)
// is reordered to the layout oneDNN's jit kernels choose (brgconv / jit:avx512_core here: 5-15x
// faster than the gemm-based kernels it takes for a fixed HWIO filter). Primitives are created once
// per geometry and kept in a per-thread cache with the thread's CPU engine and stream: each device
// worker thread has its own. Errors: oneDNN's status is returned, never thrown. With bf16, the
// three kernels read bf16 copies of their inputs (oneDNN's bf16 convolution, f32 accumulation and
// f32 outputs).
#include "kernels.h"
#include "signals.h"
#include <dnnl.hpp>
#include <algorithm>
#include <limits>
#include <map>
#include <unordered_map>
#include <vector>

namespace layerwise {

namespace {

using dnnl::memory;
using tag = memory::format_tag;
using dt = memory::data_type;

// One cached primitive. The filter is HWIO in TF.js's storage; the primitive's own weights layout
// is its choice (format `any`: oneDNN's jit kernels want blocked weights), reordered from (or, for
// the weights gradient, to) HWIO at each call when they differ: a small copy of the filter.
struct Entry {
  dnnl::primitive prim;
  bool reorder = false;
  dnnl::primitive weiReorder;  // HWIO -> the primitive's layout (forward, backward data); back (backward weights)
  memory wei;                  // the primitive's weights, when reordered
};

struct Ctx {
  dnnl::engine engine{dnnl::engine::kind::cpu, 0};
  dnnl::stream stream{engine};
  // key: kind, the team size, the geometry's 17 numbers, and the kind's flags
  std::map<std::vector<int64_t>, Entry> cache;
};

Ctx& ctx() {
  thread_local Ctx c;
  return c;
}

struct Descs {
  memory::desc src, wei, anyWei, dst, bias;
  memory::dims strides, dilates, padL, padR;
};

// The descriptors of a geometry; the data types of the activations (src), the filter (wei) and
// the output side (dst): all f32, or for bf16 compute the bf16 inputs and f32 outputs of a kind.
Descs descs(const ConvGeometry& g, dt src = dt::f32, dt wei = dt::f32, dt dst = dt::f32) {
  const memory::dims w{g.outChannels, g.inChannels, g.filterHeight, g.filterWidth};
  return {
      memory::desc({g.batch, g.inChannels, g.inHeight, g.inWidth}, src, tag::nhwc),
      memory::desc(w, wei, tag::hwio),
      memory::desc(w, wei, tag::any),
      memory::desc({g.batch, g.outChannels, g.outHeight, g.outWidth}, dst, tag::nhwc),
      memory::desc({g.outChannels}, dt::f32, tag::x),
      {g.strideHeight, g.strideWidth},
      {g.dilationHeight - 1, g.dilationWidth - 1},  // oneDNN counts the gaps: TF's 1 is its 0
      {g.padTop, g.padLeft},
      {g.padBottom, g.padRight},
  };
}

// The cache key: kind, geometry, flags and the team size (oneDNN fixes a primitive's thread
// count when it is built, so one built before setThreads changes it is built again)
std::vector<int64_t> key(int kind, const ConvGeometry& g, int64_t flags) {
  return {kind, threads(), g.batch, g.inHeight, g.inWidth, g.inChannels, g.filterHeight, g.filterWidth, g.outChannels,
          g.outHeight, g.outWidth, g.strideHeight, g.strideWidth, g.dilationHeight, g.dilationWidth, g.padTop,
          g.padLeft, g.padBottom, g.padRight, flags};
}

dnnl::convolution_forward::primitive_desc forwardPd(const Ctx& c, const Descs& d, bool bias, bool relu) {
  using namespace dnnl;
  auto desc = bias ? convolution_forward::desc(prop_kind::forward_training, algorithm::convolution_direct, d.src, d.anyWei, d.bias,
                                               d.dst, d.strides, d.dilates, d.padL, d.padR)
                   : convolution_forward::desc(prop_kind::forward_training, algorithm::convolution_direct, d.src, d.anyWei, d.dst,
                                               d.strides, d.dilates, d.padL, d.padR);
  primitive_attr attr;
  if (relu) {
    post_ops ops;
    ops.append_eltwise(1.f, algorithm::eltwise_relu, 0.f, 0.f);
    attr.set_post_ops(ops);
  }
  return convolution_forward::primitive_desc(desc, attr, c.engine);
}

// The entry's weights in the layout `chosen`: a reorder between it and HWIO (toPrimitive: HWIO ->
// chosen) and a buffer, unless they are the same layout.
void weightsLayout(const Ctx& c, const Descs& d, const memory::desc& chosen, bool toPrimitive, Entry& e) {
  e.reorder = chosen != d.wei;
  if (!e.reorder) return;
  e.wei = memory(chosen, c.engine);
  e.weiReorder = toPrimitive ? dnnl::reorder(dnnl::reorder::primitive_desc(c.engine, d.wei, c.engine, chosen))
                             : dnnl::reorder(dnnl::reorder::primitive_desc(c.engine, chosen, c.engine, d.wei));
}

// The weights the primitive reads: the user's HWIO filter, or its reordered copy.
memory weightsIn(Ctx& c, const Descs& d, Entry& e, const void* w) {
  memory user(d.wei, c.engine, const_cast<void*>(w));
  if (!e.reorder) return user;
  e.weiReorder.execute(c.stream, {{DNNL_ARG_FROM, user}, {DNNL_ARG_TO, e.wei}});
  return e.wei;
}

void* mut(const void* p) { return const_cast<void*>(p); }

// bf16 operands of the bf16 kernels: converted into this thread's scratch slots. Where the CPU
// has no bf16 instructions (oneDNN 2.6.3 has no bf16 convolution on AVX2), the operands are
// rounded to bf16 and widened back, and the f32 kernels run on them: the same numbers.
struct Bf16Scratch {
  std::vector<uint16_t> h[2];
  std::vector<float> f[2];
};
Bf16Scratch& bf16Scratch() {
  thread_local Bf16Scratch s;
  return s;
}
const uint16_t* asBf16(int slot, const float* x, int64_t n) {
  auto& v = bf16Scratch().h[slot];
  if (static_cast<int64_t>(v.size()) < n) v.resize(static_cast<size_t>(n));
  toBf16(x, v.data(), n);
  return v.data();
}
const float* roundedToBf16(int slot, const float* x, int64_t n) {
  const uint16_t* h = asBf16(slot, x, n);
  auto& v = bf16Scratch().f[slot];
  if (static_cast<int64_t>(v.size()) < n) v.resize(static_cast<size_t>(n));
  fromBf16(h, v.data(), n);
  return v.data();
}
int64_t inSize(const ConvGeometry& g) { return g.batch * g.inHeight * g.inWidth * g.inChannels; }
int64_t outSize(const ConvGeometry& g) { return g.batch * g.outHeight * g.outWidth * g.outChannels; }
int64_t filterSize(const ConvGeometry& g) { return g.filterHeight * g.filterWidth * g.inChannels * g.outChannels; }

int status(const dnnl::error& e) { return e.status == 0 ? -1 : static_cast<int>(e.status); }

// Runs `run` (oneDNN calls) with asynchronous signals held off, as oneDNN's JIT GEMM kernels
// need (signals.h); returns 0, or oneDNN's status of the error it threw.
template <typename Run>
int guarded(Run&& run) {
  const SignalGuard guard;
  try {
    run();
    return 0;
  } catch (const dnnl::error& e) {
    return status(e);
  }
}

// This thread's cached primitive for key k; `make` builds its Entry the first time.
template <typename Make>
Entry& cached(Ctx& c, std::vector<int64_t> k, Make&& make) {
  auto it = c.cache.find(k);
  if (it == c.cache.end()) it = c.cache.emplace(std::move(k), make()).first;
  return it->second;
}

}  // namespace

int conv2d(const float* x, const float* w, const float* bias, float* y, const ConvGeometry& g, bool relu, bool bf16) {
  if (bf16 && !nativeBf16())
    return conv2d(roundedToBf16(0, x, inSize(g)), roundedToBf16(1, w, filterSize(g)), bias, y, g, relu, false);
  return guarded([&] {
    Ctx& c = ctx();
    const Descs d = bf16 ? descs(g, dt::bf16, dt::bf16, dt::f32) : descs(g);
    const void* xs = bf16 ? static_cast<const void*>(asBf16(0, x, inSize(g))) : x;
    const void* ws = bf16 ? static_cast<const void*>(asBf16(1, w, filterSize(g))) : w;
    Entry& e = cached(c, key(0, g, (bias != nullptr ? 1 : 0) | (relu ? 2 : 0) | (bf16 ? 4 : 0)), [&] {
      auto pd = forwardPd(c, d, bias != nullptr, relu);
      Entry n;
      n.prim = dnnl::convolution_forward(pd);
      weightsLayout(c, d, pd.weights_desc(), true, n);
      return n;
    });
    std::unordered_map<int, memory> args{
        {DNNL_ARG_SRC, memory(d.src, c.engine, mut(xs))},
        {DNNL_ARG_WEIGHTS, weightsIn(c, d, e, ws)},
        {DNNL_ARG_DST, memory(d.dst, c.engine, y)},
    };
    if (bias != nullptr) args.emplace(DNNL_ARG_BIAS, memory(d.bias, c.engine, mut(bias)));
    e.prim.execute(c.stream, args);
    c.stream.wait();
  });
}

int conv2dBackpropInput(const float* dy, const float* w, float* dx, const ConvGeometry& g, bool bf16) {
  if (bf16 && !nativeBf16())
    return conv2dBackpropInput(roundedToBf16(0, dy, outSize(g)), roundedToBf16(1, w, filterSize(g)), dx, g, false);
  return guarded([&] {
    using namespace dnnl;
    Ctx& c = ctx();
    // bf16: diff_dst and weights bf16, diff_src f32
    const Descs d = bf16 ? descs(g, dt::f32, dt::bf16, dt::bf16) : descs(g);
    const void* dys = bf16 ? static_cast<const void*>(asBf16(0, dy, outSize(g))) : dy;
    const void* ws = bf16 ? static_cast<const void*>(asBf16(1, w, filterSize(g))) : w;
    Entry& e = cached(c, key(1, g, bf16 ? 4 : 0), [&] {
      auto hint = forwardPd(c, bf16 ? descs(g, dt::bf16, dt::bf16, dt::bf16) : d, false, false);
      convolution_backward_data::desc desc(algorithm::convolution_direct, d.src, d.anyWei, d.dst, d.strides, d.dilates, d.padL, d.padR);
      convolution_backward_data::primitive_desc pd(desc, c.engine, hint);
      Entry n;
      n.prim = convolution_backward_data(pd);
      weightsLayout(c, d, pd.weights_desc(), true, n);
      return n;
    });
    e.prim.execute(c.stream, {
                                 {DNNL_ARG_DIFF_DST, memory(d.dst, c.engine, mut(dys))},
                                 {DNNL_ARG_WEIGHTS, weightsIn(c, d, e, ws)},
                                 {DNNL_ARG_DIFF_SRC, memory(d.src, c.engine, dx)},
                             });
    c.stream.wait();
  });
}

int conv2dBackpropFilter(const float* x, const float* dy, float* dw, const ConvGeometry& g, bool bf16) {
  if (bf16 && !nativeBf16())
    return conv2dBackpropFilter(roundedToBf16(0, x, inSize(g)), roundedToBf16(1, dy, outSize(g)), dw, g, false);
  return guarded([&] {
    using namespace dnnl;
    Ctx& c = ctx();
    // bf16: src and diff_dst bf16, diff_weights f32
    const Descs d = bf16 ? descs(g, dt::bf16, dt::f32, dt::bf16) : descs(g);
    const void* xs = bf16 ? static_cast<const void*>(asBf16(0, x, inSize(g))) : x;
    const void* dys = bf16 ? static_cast<const void*>(asBf16(1, dy, outSize(g))) : dy;
    Entry& e = cached(c, key(2, g, bf16 ? 4 : 0), [&] {
      auto hint = forwardPd(c, bf16 ? descs(g, dt::bf16, dt::bf16, dt::bf16) : d, false, false);
      convolution_backward_weights::desc desc(algorithm::convolution_direct, d.src, d.anyWei, d.dst, d.strides, d.dilates, d.padL, d.padR);
      convolution_backward_weights::primitive_desc pd(desc, c.engine, hint);
      Entry n;
      n.prim = convolution_backward_weights(pd);
      weightsLayout(c, d, pd.diff_weights_desc(), false, n);
      return n;
    });
    memory user(d.wei, c.engine, dw);
    e.prim.execute(c.stream, {
                                 {DNNL_ARG_SRC, memory(d.src, c.engine, mut(xs))},
                                 {DNNL_ARG_DIFF_DST, memory(d.dst, c.engine, mut(dys))},
                                 {DNNL_ARG_DIFF_WEIGHTS, e.reorder ? e.wei : user},
                             });
    if (e.reorder) e.weiReorder.execute(c.stream, {{DNNL_ARG_FROM, e.wei}, {DNNL_ARG_TO, user}});
    c.stream.wait();
  });
}

// Pooling: the window of output (oy, ox) starts at input (oy * sH - padTop, ox * sW - padLeft) and
// covers filterHeight x filterWidth positions (dilation 1), clamped to the input.

namespace {
struct Window {
  int64_t r0, r1, c0, c1;  // input rows [r0, r1), columns [c0, c1)
};
inline Window window(const ConvGeometry& g, int64_t oy, int64_t ox) {
  const int64_t r = oy * g.strideHeight - g.padTop, col = ox * g.strideWidth - g.padLeft;
  return {std::max<int64_t>(r, 0), std::min(g.inHeight, r + g.filterHeight), std::max<int64_t>(col, 0),
          std::min(g.inWidth, col + g.filterWidth)};
}
}  // namespace

void maxPool(const float* x, float* y, const ConvGeometry& g) {
  const int64_t C = g.inChannels;
#pragma omp parallel for collapse(2) schedule(static)
  for (int64_t b = 0; b < g.batch; b++) {
    for (int64_t oy = 0; oy < g.outHeight; oy++) {
      const float* xb = x + b * g.inHeight * g.inWidth * C;
      for (int64_t ox = 0; ox < g.outWidth; ox++) {
        float* out = y + ((b * g.outHeight + oy) * g.outWidth + ox) * C;
        for (int64_t ch = 0; ch < C; ch++) out[ch] = -std::numeric_limits<float>::infinity();
        const Window w = window(g, oy, ox);
        for (int64_t r = w.r0; r < w.r1; r++) {
          for (int64_t col = w.c0; col < w.c1; col++) {
            const float* px = xb + (r * g.inWidth + col) * C;
            for (int64_t ch = 0; ch < C; ch++) out[ch] = px[ch] > out[ch] ? px[ch] : out[ch];  // NaN never wins, as in TF.js cpu
          }
        }
      }
    }
  }
}

void maxPoolGrad(const float* x, const float* dy, float* dx, const ConvGeometry& g) {
  const int64_t C = g.inChannels;
  const int64_t inSize = g.inHeight * g.inWidth * C;
#pragma omp parallel
  {
    std::vector<float> best(C);
    std::vector<int64_t> at(C);
#pragma omp for schedule(static)
    for (int64_t b = 0; b < g.batch; b++) {
      const float* xb = x + b * inSize;
      float* dxb = dx + b * inSize;
      std::fill(dxb, dxb + inSize, 0.f);
      for (int64_t oy = 0; oy < g.outHeight; oy++) {
        for (int64_t ox = 0; ox < g.outWidth; ox++) {
          const Window w = window(g, oy, ox);
          std::fill(best.begin(), best.end(), -std::numeric_limits<float>::infinity());
          std::fill(at.begin(), at.end(), int64_t{-1});
          for (int64_t r = w.r0; r < w.r1; r++) {
            for (int64_t col = w.c0; col < w.c1; col++) {
              const int64_t off = (r * g.inWidth + col) * C;
              for (int64_t ch = 0; ch < C; ch++) {
                if (xb[off + ch] > best[ch]) {  // the first maximum in row-major window order
                  best[ch] = xb[off + ch];
                  at[ch] = off + ch;
                }
              }
            }
          }
          const float* d = dy + ((b * g.outHeight + oy) * g.outWidth + ox) * C;
          for (int64_t ch = 0; ch < C; ch++) {
            if (at[ch] >= 0) dxb[at[ch]] += d[ch];
          }
        }
      }
    }
  }
}

void avgPool(const float* x, float* y, const ConvGeometry& g) {
  const int64_t C = g.inChannels;
#pragma omp parallel for collapse(2) schedule(static)
  for (int64_t b = 0; b < g.batch; b++) {
    for (int64_t oy = 0; oy < g.outHeight; oy++) {
      const float* xb = x + b * g.inHeight * g.inWidth * C;
      for (int64_t ox = 0; ox < g.outWidth; ox++) {
        float* out = y + ((b * g.outHeight + oy) * g.outWidth + ox) * C;
        for (int64_t ch = 0; ch < C; ch++) out[ch] = 0.f;
        const Window w = window(g, oy, ox);
        for (int64_t r = w.r0; r < w.r1; r++) {
          for (int64_t col = w.c0; col < w.c1; col++) {
            const float* px = xb + (r * g.inWidth + col) * C;
            for (int64_t ch = 0; ch < C; ch++) out[ch] += px[ch];
          }
        }
        // the mean of the positions inside the input (padding not counted), as TF.js cpu
        const float inv = 1.f / static_cast<float>((w.r1 - w.r0) * (w.c1 - w.c0));
        for (int64_t ch = 0; ch < C; ch++) out[ch] *= inv;
      }
    }
  }
}

void avgPoolGrad(const float* dy, float* dx, const ConvGeometry& g) {
  const int64_t C = g.inChannels;
  const int64_t inSize = g.inHeight * g.inWidth * C;
  // every window's share is dy / (filterHeight * filterWidth), padding or not, as TF.js cpu's AvgPoolGrad
  const float inv = 1.f / static_cast<float>(g.filterHeight * g.filterWidth);
#pragma omp parallel for schedule(static)
  for (int64_t b = 0; b < g.batch; b++) {
    float* dxb = dx + b * inSize;
    std::fill(dxb, dxb + inSize, 0.f);
    for (int64_t oy = 0; oy < g.outHeight; oy++) {
      for (int64_t ox = 0; ox < g.outWidth; ox++) {
        const Window w = window(g, oy, ox);
        const float* d = dy + ((b * g.outHeight + oy) * g.outWidth + ox) * C;
        for (int64_t r = w.r0; r < w.r1; r++) {
          for (int64_t col = w.c0; col < w.c1; col++) {
            float* px = dxb + (r * g.inWidth + col) * C;
            for (int64_t ch = 0; ch < C; ch++) px[ch] += d[ch] * inv;
          }
        }
      }
    }
  }
}

}  // namespace layerwise
