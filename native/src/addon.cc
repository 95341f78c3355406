// N-API glue of layerwise's native kernels (node-addon-api). Every function takes typed arrays
// and writes into the output arrays it is given, so tensors stay in the cpu backend's storage:
// no copies cross the boundary. Context-aware: each worker thread (device) loads it.
#include <napi.h>
#include <malloc.h>
#include <string>
#include <vector>
#include "kernels.h"

namespace layerwise {
void registerConv(Napi::Env env, Napi::Object exports);  // conv_addon.cc: convolution and pooling
void registerAffinity(Napi::Env env, Napi::Object exports);  // affinity.cc: pinTeam, teamAffinity
}

namespace {

using namespace layerwise;

float* F32(const Napi::CallbackInfo& info, size_t i, const char* what) {
  if (!info[i].IsTypedArray() || info[i].As<Napi::TypedArray>().TypedArrayType() != napi_float32_array) {
    throw Napi::TypeError::New(info.Env(), std::string(what) + " must be a Float32Array");
  }
  return info[i].As<Napi::Float32Array>().Data();
}

size_t Len(const Napi::CallbackInfo& info, size_t i) { return info[i].As<Napi::TypedArray>().ElementLength(); }

int64_t I64(const Napi::CallbackInfo& info, size_t i) { return info[i].As<Napi::Number>().Int64Value(); }

double F64(const Napi::CallbackInfo& info, size_t i) { return info[i].As<Napi::Number>().DoubleValue(); }

// matmul(a, b, c, batch, aStride, bStride, m, n, k, transA, transB)
Napi::Value MatMul(const Napi::CallbackInfo& info) {
  if (info.Length() != 11) throw Napi::TypeError::New(info.Env(), "matmul takes 11 arguments");
  const float* a = F32(info, 0, "a");
  const float* b = F32(info, 1, "b");
  float* c = F32(info, 2, "c");
  const int64_t batch = I64(info, 3), aStride = I64(info, 4), bStride = I64(info, 5);
  const int64_t m = I64(info, 6), n = I64(info, 7), k = I64(info, 8);
  const bool transA = info[9].As<Napi::Boolean>().Value(), transB = info[10].As<Napi::Boolean>().Value();
  if (batch < 1 || m < 0 || n < 0 || k < 0) throw Napi::RangeError::New(info.Env(), "matmul: bad sizes");
  if (static_cast<int64_t>(Len(info, 0)) < (batch - 1) * aStride + m * k ||
      static_cast<int64_t>(Len(info, 1)) < (batch - 1) * bStride + k * n ||
      static_cast<int64_t>(Len(info, 2)) < batch * m * n) {
    throw Napi::RangeError::New(info.Env(), "matmul: an array is shorter than its matrices");
  }
  const int s = matmul(a, b, c, batch, aStride, bStride, m, n, k, transA, transB);
  if (s != 0) throw Napi::Error::New(info.Env(), "oneDNN sgemm failed with status " + std::to_string(s));
  return info.Env().Undefined();
}

// adamw(p, g, m, v, lr, beta1, beta2, epsilon, weightDecay, step, gradScale[, pOut, mOut, vOut]):
// in place, or into the three output arrays when given.
Napi::Value AdamW(const Napi::CallbackInfo& info) {
  if (info.Length() != 11 && info.Length() != 14) throw Napi::TypeError::New(info.Env(), "adamw takes 11 or 14 arguments");
  float* p = F32(info, 0, "p");
  const size_t n = Len(info, 0);
  for (size_t i = 1; i < 4; i++) {
    F32(info, i, "g, m and v");
    if (Len(info, i) != n) throw Napi::RangeError::New(info.Env(), "adamw: g, m and v must have the parameter's length");
  }
  float* m = F32(info, 2, "m");
  float* v = F32(info, 3, "v");
  float *pOut = p, *mOut = m, *vOut = v;
  if (info.Length() == 14) {
    for (size_t i = 11; i < 14; i++) {
      F32(info, i, "pOut, mOut and vOut");
      if (Len(info, i) != n) throw Napi::RangeError::New(info.Env(), "adamw: pOut, mOut and vOut must have the parameter's length");
    }
    pOut = F32(info, 11, "pOut");
    mOut = F32(info, 12, "mOut");
    vOut = F32(info, 13, "vOut");
  }
  adamw(p, F32(info, 1, "g"), m, v, pOut, mOut, vOut, static_cast<int64_t>(n), F64(info, 4), F64(info, 5), F64(info, 6),
        F64(info, 7), F64(info, 8), I64(info, 9), F64(info, 10));
  return info.Env().Undefined();
}

// The Float32Arrays of the JS array info[i], each checked ("what" names them in errors)
std::vector<float*> F32List(const Napi::CallbackInfo& info, size_t i, const char* what, std::vector<size_t>* lengths) {
  if (!info[i].IsArray()) throw Napi::TypeError::New(info.Env(), std::string(what) + " must be an array of Float32Arrays");
  Napi::Array arr = info[i].As<Napi::Array>();
  std::vector<float*> out(arr.Length());
  if (lengths) lengths->resize(arr.Length());
  for (uint32_t j = 0; j < arr.Length(); j++) {
    Napi::Value v = arr.Get(j);
    if (!v.IsTypedArray() || v.As<Napi::TypedArray>().TypedArrayType() != napi_float32_array)
      throw Napi::TypeError::New(info.Env(), std::string(what) + " must be an array of Float32Arrays");
    out[j] = v.As<Napi::Float32Array>().Data();
    if (lengths) (*lengths)[j] = v.As<Napi::TypedArray>().ElementLength();
  }
  return out;
}

// adamwMulti([p], [g], [m], [v], [pOut], [mOut], [vOut], lr, beta1, beta2, epsilon, weightDecay,
// decayed, step, gradScale): adamw over each quadruple into its outputs (which may be the inputs)
Napi::Value AdamWMulti(const Napi::CallbackInfo& info) {
  if (info.Length() != 15 && info.Length() != 16) throw Napi::TypeError::New(info.Env(), "adamwMulti takes 15 or 16 arguments");
  static const char* names[7] = {"p", "g", "m", "v", "pOut", "mOut", "vOut"};
  std::vector<size_t> n, len;
  std::vector<std::vector<float*>> a(7);
  for (size_t k = 0; k < 7; k++) {
    a[k] = F32List(info, k, names[k], k == 0 ? &n : &len);
    if (a[k].size() != a[0].size() || (k > 0 && len != n))
      throw Napi::RangeError::New(info.Env(), std::string("adamwMulti: ") + names[k] +
                                                  " must have as many arrays as p, each of its parameter's length");
  }
  std::vector<AdamWTensor> tensors(n.size());
  for (size_t j = 0; j < n.size(); j++)
    tensors[j] = {a[0][j], a[1][j], a[2][j], a[3][j], a[4][j], a[5][j], a[6][j], static_cast<int64_t>(n[j])};
  if (info.Length() == 16 && !info[15].IsUndefined()) {
    // pBf16: an array of Uint16Array (each of its parameter's length) or null, one per parameter
    if (!info[15].IsArray() || info[15].As<Napi::Array>().Length() != n.size())
      throw Napi::TypeError::New(info.Env(), "adamwMulti: pBf16 must be an array with one Uint16Array or null per parameter");
    Napi::Array list = info[15].As<Napi::Array>();
    for (uint32_t j = 0; j < list.Length(); j++) {
      Napi::Value v = list.Get(j);
      if (v.IsNull() || v.IsUndefined()) continue;
      if (!v.IsTypedArray() || v.As<Napi::TypedArray>().TypedArrayType() != napi_uint16_array ||
          v.As<Napi::TypedArray>().ElementLength() != n[j])
        throw Napi::TypeError::New(info.Env(), "adamwMulti: pBf16 must be an array with one Uint16Array or null per parameter");
      tensors[j].pBf16 = v.As<Napi::Uint16Array>().Data();
    }
  }
  adamwMulti(tensors, I64(info, 12), F64(info, 7), F64(info, 8), F64(info, 9), F64(info, 10), F64(info, 11), I64(info, 13),
             F64(info, 14));
  return info.Env().Undefined();
}

// sumSquaresMulti([x], out): out[j] = sum of x[j]'s squares (out: Float32Array of x's count)
Napi::Value SumSquaresMulti(const Napi::CallbackInfo& info) {
  if (info.Length() != 2) throw Napi::TypeError::New(info.Env(), "sumSquaresMulti takes 2 arguments");
  std::vector<size_t> len;
  const std::vector<float*> xs = F32List(info, 0, "x", &len);
  float* out = F32(info, 1, "out");
  if (Len(info, 1) != xs.size()) throw Napi::RangeError::New(info.Env(), "sumSquaresMulti: out must have one element per array");
  sumSquaresMulti(std::vector<const float*>(xs.begin(), xs.end()), std::vector<int64_t>(len.begin(), len.end()), out);
  return info.Env().Undefined();
}

// sgd(p, g, velocity | null, lr, momentum, weightDecay, gradScale[, pOut, velocityOut | null]):
// in place, or into the output arrays when given.
Napi::Value Sgd(const Napi::CallbackInfo& info) {
  if (info.Length() != 7 && info.Length() != 9) throw Napi::TypeError::New(info.Env(), "sgd takes 7 or 9 arguments");
  float* p = F32(info, 0, "p");
  const size_t n = Len(info, 0);
  F32(info, 1, "g");
  if (Len(info, 1) != n) throw Napi::RangeError::New(info.Env(), "sgd: g must have the parameter's length");
  auto optional = [&](size_t i, const char* what) -> float* {
    if (info[i].IsNull() || info[i].IsUndefined()) return nullptr;
    float* a = F32(info, i, what);
    if (Len(info, i) != n) throw Napi::RangeError::New(info.Env(), std::string("sgd: ") + what + " must have the parameter's length");
    return a;
  };
  float* vel = optional(2, "velocity");
  float* pOut = p;
  float* velOut = vel;
  if (info.Length() == 9) {
    pOut = optional(7, "pOut");
    velOut = optional(8, "velocityOut");
    if (pOut == nullptr || (vel != nullptr) != (velOut != nullptr)) {
      throw Napi::TypeError::New(info.Env(), "sgd: pOut is required, and velocityOut exactly when velocity is given");
    }
  }
  sgd(p, F32(info, 1, "g"), vel, pOut, velOut, static_cast<int64_t>(n), F64(info, 3), F64(info, 4), F64(info, 5), F64(info, 6));
  return info.Env().Undefined();
}

std::vector<int64_t> Shape(const Napi::CallbackInfo& info, size_t i) {
  if (!info[i].IsArray()) throw Napi::TypeError::New(info.Env(), "a shape must be an array of integers");
  Napi::Array arr = info[i].As<Napi::Array>();
  std::vector<int64_t> s(arr.Length());
  for (uint32_t d = 0; d < arr.Length(); d++) {
    s[d] = arr.Get(d).As<Napi::Number>().Int64Value();
    if (s[d] < 0) throw Napi::RangeError::New(info.Env(), "a shape has a negative size");
  }
  return s;
}

int32_t* I32(const Napi::CallbackInfo& info, size_t i, const char* what) {
  if (!info[i].IsTypedArray() || info[i].As<Napi::TypedArray>().TypedArrayType() != napi_int32_array) {
    throw Napi::TypeError::New(info.Env(), std::string(what) + " must be an Int32Array");
  }
  return info[i].As<Napi::Int32Array>().Data();
}

void Need(const Napi::CallbackInfo& info, size_t i, int64_t n, const char* what) {
  if (static_cast<int64_t>(Len(info, i)) < n) throw Napi::RangeError::New(info.Env(), std::string(what) + " is shorter than its shape");
}

// binary(op, a, aShape, b, bShape, out, outShape)
Napi::Value Binary(const Napi::CallbackInfo& info) {
  const int op = static_cast<int>(I64(info, 0));
  const auto aShape = Shape(info, 2), bShape = Shape(info, 4), outShape = Shape(info, 6);
  Need(info, 1, product(aShape), "a");
  Need(info, 3, product(bShape), "b");
  Need(info, 5, product(outShape), "out");
  if (!binary(static_cast<BinaryOp>(op), F32(info, 1, "a"), F32(info, 3, "b"), F32(info, 5, "out"), aShape, bShape, outShape)) {
    throw Napi::RangeError::New(info.Env(), "unknown binary op");
  }
  return info.Env().Undefined();
}

// unary(op, x, out[, param]): param is Step's alpha
Napi::Value Unary(const Napi::CallbackInfo& info) {
  const int64_t n = static_cast<int64_t>(Len(info, 1));
  Need(info, 2, n, "out");
  const float param = info.Length() > 3 ? info[3].As<Napi::Number>().FloatValue() : 0.f;
  if (!unary(static_cast<UnaryOp>(I64(info, 0)), F32(info, 1, "x"), F32(info, 2, "out"), n, param)) throw Napi::RangeError::New(info.Env(), "unknown unary op");
  return info.Env().Undefined();
}

uint16_t* U16(const Napi::CallbackInfo& info, size_t i, const char* what);
// gelu(x, out)
Napi::Value Gelu(const Napi::CallbackInfo& info) {
  const int64_t n = static_cast<int64_t>(Len(info, 0));
  Need(info, 1, n, "out");
  gelu(F32(info, 0, "x"), F32(info, 1, "out"), n);
  return info.Env().Undefined();
}

// geluGrad(x, dy, dx)
Napi::Value GeluGrad(const Napi::CallbackInfo& info) {
  const int64_t n = static_cast<int64_t>(Len(info, 0));
  Need(info, 1, n, "dy");
  Need(info, 2, n, "dx");
  geluGrad(F32(info, 0, "x"), F32(info, 1, "dy"), F32(info, 2, "dx"), n);
  return info.Env().Undefined();
}

Bf16Operand Operand(const Napi::CallbackInfo& info, size_t i, const char* what);
// Argument i: a Float32Array or a Uint16Array (bf16 values) of exactly n elements.
Bf16Operand AnyOperand(const Napi::CallbackInfo& info, size_t i, int64_t n, const char* what) {
  if (static_cast<int64_t>(Len(info, i)) != n) throw Napi::RangeError::New(info.Env(), std::string(what) + " has the wrong length");
  return Operand(info, i, what);
}

// geluToBf16(x: Float32Array | Uint16Array, out: Uint16Array)
Napi::Value GeluToBf16(const Napi::CallbackInfo& info) {
  const int64_t n = static_cast<int64_t>(Len(info, 1));
  geluToBf16(AnyOperand(info, 0, n, "geluToBf16: x"), U16(info, 1, "geluToBf16: out"), n);
  return info.Env().Undefined();
}

// geluGradToBf16(x, dy: Float32Array | Uint16Array, dx: Uint16Array)
Napi::Value GeluGradToBf16(const Napi::CallbackInfo& info) {
  const int64_t n = static_cast<int64_t>(Len(info, 2));
  geluGradToBf16(AnyOperand(info, 0, n, "geluGradToBf16: x"), AnyOperand(info, 1, n, "geluGradToBf16: dy"),
                 U16(info, 2, "geluGradToBf16: dx"), n);
  return info.Env().Undefined();
}

// binarySameShape(op, a, b: Float32Array | Uint16Array, out: Float32Array): out = a op b, all of one length
Napi::Value BinarySameShape(const Napi::CallbackInfo& info) {
  const int64_t n = static_cast<int64_t>(Len(info, 3));
  if (!binarySameShape(static_cast<BinaryOp>(I64(info, 0)), AnyOperand(info, 1, n, "a"), AnyOperand(info, 2, n, "b"), F32(info, 3, "out"), n))
    throw Napi::RangeError::New(info.Env(), "unknown binary op");
  return info.Env().Undefined();
}

// layerNormToBf16(x: Float32Array | Uint16Array, g, b, yBf: Uint16Array, xhatBf: Uint16Array, rstd, rows, cols, epsilon)
Napi::Value LayerNormToBf16(const Napi::CallbackInfo& info) {
  const int64_t rows = I64(info, 6), cols = I64(info, 7);
  Need(info, 1, cols, "g");
  Need(info, 2, cols, "b");
  Need(info, 3, rows * cols, "yBf");
  Need(info, 4, rows * cols, "xhatBf");
  Need(info, 5, rows, "rstd");
  layerNormToBf16(AnyOperand(info, 0, rows * cols, "x"), F32(info, 1, "g"), F32(info, 2, "b"), U16(info, 3, "yBf"), U16(info, 4, "xhatBf"),
                  F32(info, 5, "rstd"), rows, cols, static_cast<float>(F64(info, 8)));
  return info.Env().Undefined();
}

// layerNormGradAny(dy, xhat: Float32Array | Uint16Array, rstd, g, dx, dg, db, rows, cols)
Napi::Value LayerNormGradAny(const Napi::CallbackInfo& info) {
  const int64_t rows = I64(info, 7), cols = I64(info, 8);
  Need(info, 2, rows, "rstd");
  Need(info, 3, cols, "g");
  Need(info, 4, rows * cols, "dx");
  Need(info, 5, cols, "dg");
  Need(info, 6, cols, "db");
  layerNormGrad(AnyOperand(info, 0, rows * cols, "dy"), AnyOperand(info, 1, rows * cols, "xhat"), F32(info, 2, "rstd"), F32(info, 3, "g"),
                F32(info, 4, "dx"), F32(info, 5, "dg"), F32(info, 6, "db"), rows, cols);
  return info.Env().Undefined();
}

// layerNorm(x, g, b, y, xhat, rstd, rows, cols, epsilon)
Napi::Value LayerNorm(const Napi::CallbackInfo& info) {
  const int64_t rows = I64(info, 6), cols = I64(info, 7);
  for (size_t i : {0, 3, 4}) Need(info, i, rows * cols, "x, y and xhat");
  Need(info, 1, cols, "g");
  Need(info, 2, cols, "b");
  Need(info, 5, rows, "rstd");
  layerNorm(F32(info, 0, "x"), F32(info, 1, "g"), F32(info, 2, "b"), F32(info, 3, "y"), F32(info, 4, "xhat"), F32(info, 5, "rstd"), rows, cols,
            static_cast<float>(F64(info, 8)));
  return info.Env().Undefined();
}

// layerNormGrad(dy, xhat, rstd, g, dx, dg, db, rows, cols)
Napi::Value LayerNormGrad(const Napi::CallbackInfo& info) {
  const int64_t rows = I64(info, 7), cols = I64(info, 8);
  for (size_t i : {0, 1, 4}) Need(info, i, rows * cols, "dy, xhat and dx");
  Need(info, 2, rows, "rstd");
  for (size_t i : {3, 5, 6}) Need(info, i, cols, "g, dg and db");
  layerNormGrad(F32(info, 0, "dy"), F32(info, 1, "xhat"), F32(info, 2, "rstd"), F32(info, 3, "g"), F32(info, 4, "dx"), F32(info, 5, "dg"),
                F32(info, 6, "db"), rows, cols);
  return info.Env().Undefined();
}

// reduce(op, x, out, outer, inner): over the inner axis of x [outer, inner]
Napi::Value Reduce(const Napi::CallbackInfo& info) {
  const int64_t outer = I64(info, 3), inner = I64(info, 4);
  Need(info, 1, outer * inner, "x");
  Need(info, 2, outer, "out");
  reduce(static_cast<ReduceOp>(I64(info, 0)), F32(info, 1, "x"), F32(info, 2, "out"), outer, inner);
  return info.Env().Undefined();
}

// reduceOuter(op, x, out, outer, inner): over the outer axis of x [outer, inner] (x float32 or bf16 values)
Napi::Value ReduceOuter(const Napi::CallbackInfo& info) {
  const int64_t outer = I64(info, 3), inner = I64(info, 4);
  Need(info, 1, outer * inner, "x");
  Need(info, 2, inner, "out");
  reduceOuter(static_cast<ReduceOp>(I64(info, 0)), Operand(info, 1, "x"), F32(info, 2, "out"), outer, inner);
  return info.Env().Undefined();
}

// transpose(x, shape, perm, out)
Napi::Value Transpose(const Napi::CallbackInfo& info) {
  const auto shape = Shape(info, 1), perm = Shape(info, 2);
  if (perm.size() != shape.size() || shape.empty()) throw Napi::RangeError::New(info.Env(), "transpose: perm must match the rank");
  Need(info, 0, product(shape), "x");
  Need(info, 3, product(shape), "out");
  transpose(F32(info, 0, "x"), F32(info, 3, "out"), shape, perm);
  return info.Env().Undefined();
}

// softmax(x, out, rows, cols)
Napi::Value Softmax(const Napi::CallbackInfo& info) {
  const int64_t rows = I64(info, 2), cols = I64(info, 3);
  Need(info, 0, rows * cols, "x");
  Need(info, 1, rows * cols, "out");
  softmax(F32(info, 0, "x"), F32(info, 1, "out"), rows, cols);
  return info.Env().Undefined();
}

// causalSoftmax(x, out, batch, t, scale)
Napi::Value CausalSoftmax(const Napi::CallbackInfo& info) {
  const int64_t batch = I64(info, 2), t = I64(info, 3);
  Need(info, 0, batch * t * t, "x");
  Need(info, 1, batch * t * t, "out");
  causalSoftmax(F32(info, 0, "x"), F32(info, 1, "out"), batch, t, static_cast<float>(F64(info, 4)));
  return info.Env().Undefined();
}

// causalSoftmaxGrad(y, dy, dx, batch, t, scale)
Napi::Value CausalSoftmaxGrad(const Napi::CallbackInfo& info) {
  const int64_t batch = I64(info, 3), t = I64(info, 4);
  for (size_t i : {0, 1, 2}) Need(info, i, batch * t * t, "y, dy and dx");
  causalSoftmaxGrad(F32(info, 0, "y"), F32(info, 1, "dy"), F32(info, 2, "dx"), batch, t, static_cast<float>(F64(info, 5)));
  return info.Env().Undefined();
}

// segmentSum(data, ids, out, n, inner, segments)
Napi::Value SegmentSum(const Napi::CallbackInfo& info) {
  const int64_t n = I64(info, 3), inner = I64(info, 4), segments = I64(info, 5);
  Need(info, 0, n * inner, "data");
  Need(info, 1, n, "ids");
  Need(info, 2, segments * inner, "out");
  segmentSum(F32(info, 0, "data"), I32(info, 1, "ids"), F32(info, 2, "out"), n, inner, segments);
  return info.Env().Undefined();
}

// gather(x, indices, out, outer, axisSize, inner)
Napi::Value Gather(const Napi::CallbackInfo& info) {
  const int64_t outer = I64(info, 3), axisSize = I64(info, 4), inner = I64(info, 5);
  const int64_t count = static_cast<int64_t>(Len(info, 1));
  const int32_t* idx = I32(info, 1, "indices");
  for (int64_t j = 0; j < count; j++) {
    if (idx[j] < 0 || idx[j] >= axisSize) throw Napi::RangeError::New(info.Env(), "gather: an index is out of range");
  }
  Need(info, 0, outer * axisSize * inner, "x");
  Need(info, 2, outer * count * inner, "out");
  gather(F32(info, 0, "x"), idx, F32(info, 2, "out"), outer, axisSize, inner, count);
  return info.Env().Undefined();
}

// causalAttention(qkv, ctx, p, batch, t, heads, dh, scale)
Napi::Value CausalAttention(const Napi::CallbackInfo& info) {
  const int64_t batch = I64(info, 3), t = I64(info, 4), heads = I64(info, 5), dh = I64(info, 6);
  Need(info, 0, batch * t * 3 * heads * dh, "qkv");
  Need(info, 1, batch * t * heads * dh, "ctx");
  Need(info, 2, batch * heads * t * t, "p");
  const int s = causalAttention(F32(info, 0, "qkv"), F32(info, 1, "ctx"), F32(info, 2, "p"), batch, t, heads, dh, static_cast<float>(F64(info, 7)));
  if (s != 0) throw Napi::Error::New(info.Env(), "oneDNN sgemm failed with status " + std::to_string(s));
  return info.Env().Undefined();
}

// causalAttentionToBf16(qkv: Float32Array | Uint16Array, pBf: Uint16Array, batch, t, heads, dh, scale, ctxBf: Uint16Array):
// the bf16 path writing the probabilities and the context only as their bf16 roundings
Napi::Value CausalAttentionToBf16(const Napi::CallbackInfo& info) {
  const int64_t batch = I64(info, 2), t = I64(info, 3), heads = I64(info, 4), dh = I64(info, 5);
  Need(info, 1, batch * heads * t * t, "pBf");
  Need(info, 7, batch * t * heads * dh, "ctxBf");
  const int s = causalAttentionBf16(AnyOperand(info, 0, batch * t * 3 * heads * dh, "qkv"), U16(info, 7, "ctxBf"), U16(info, 1, "pBf"), batch, t,
                                    heads, dh, static_cast<float>(F64(info, 6)));
  if (s != 0) throw Napi::Error::New(info.Env(), "oneDNN sgemm failed with status " + std::to_string(s));
  return info.Env().Undefined();
}

// causalAttentionGradToBf16(dctx, qkv, p: Float32Array | Uint16Array, batch, t, heads, dh, scale, dqkvBf: Uint16Array)
Napi::Value CausalAttentionGradToBf16(const Napi::CallbackInfo& info) {
  const int64_t batch = I64(info, 3), t = I64(info, 4), heads = I64(info, 5), dh = I64(info, 6);
  Need(info, 8, batch * t * 3 * heads * dh, "dqkvBf");
  const int s = causalAttentionGradBf16(AnyOperand(info, 0, batch * t * heads * dh, "dctx"), AnyOperand(info, 1, batch * t * 3 * heads * dh, "qkv"),
                                        AnyOperand(info, 2, batch * heads * t * t, "p"), U16(info, 8, "dqkvBf"), batch, t, heads, dh,
                                        static_cast<float>(F64(info, 7)));
  if (s != 0) throw Napi::Error::New(info.Env(), "oneDNN sgemm failed with status " + std::to_string(s));
  return info.Env().Undefined();
}

// causalAttentionGrad(dctx, qkv, p, dqkv, batch, t, heads, dh, scale)
Napi::Value CausalAttentionGrad(const Napi::CallbackInfo& info) {
  const int64_t batch = I64(info, 4), t = I64(info, 5), heads = I64(info, 6), dh = I64(info, 7);
  Need(info, 0, batch * t * heads * dh, "dctx");
  Need(info, 1, batch * t * 3 * heads * dh, "qkv");
  Need(info, 2, batch * heads * t * t, "p");
  Need(info, 3, batch * t * 3 * heads * dh, "dqkv");
  const int s = causalAttentionGrad(F32(info, 0, "dctx"), F32(info, 1, "qkv"), F32(info, 2, "p"), F32(info, 3, "dqkv"), batch, t, heads, dh,
                                    static_cast<float>(F64(info, 8)));
  if (s != 0) throw Napi::Error::New(info.Env(), "oneDNN sgemm failed with status " + std::to_string(s));
  return info.Env().Undefined();
}

// softmaxCrossEntropy(logits: Float32Array | Uint16Array, labels, probs, rows, classes) -> mean loss
Napi::Value SoftmaxCrossEntropy(const Napi::CallbackInfo& info) {
  const int64_t rows = I64(info, 3), classes = I64(info, 4);
  Need(info, 0, rows * classes, "logits");
  Need(info, 1, rows, "labels");
  Need(info, 2, rows * classes, "probs");
  const Bf16Operand logits = Operand(info, 0, "logits");
  const double loss = softmaxCrossEntropy(logits, I32(info, 1, "labels"), F32(info, 2, "probs"), rows, classes);
  return Napi::Number::New(info.Env(), loss);
}

// softmaxCrossEntropyGrad(probs, labels, dlogits, rows, classes, dyOverRows)
Napi::Value SoftmaxCrossEntropyGrad(const Napi::CallbackInfo& info) {
  const int64_t rows = I64(info, 3), classes = I64(info, 4);
  Need(info, 0, rows * classes, "probs");
  Need(info, 1, rows, "labels");
  Need(info, 2, rows * classes, "dlogits");
  softmaxCrossEntropyGrad(F32(info, 0, "probs"), I32(info, 1, "labels"), F32(info, 2, "dlogits"), rows, classes, static_cast<float>(F64(info, 5)));
  return info.Env().Undefined();
}

uint16_t* U16(const Napi::CallbackInfo& info, size_t i, const char* what) {
  if (!info[i].IsTypedArray() || info[i].As<Napi::TypedArray>().TypedArrayType() != napi_uint16_array) {
    throw Napi::TypeError::New(info.Env(), std::string(what) + " must be a Uint16Array (bf16)");
  }
  return info[i].As<Napi::Uint16Array>().Data();
}

// toBf16(src: Float32Array, dst: Uint16Array)
Napi::Value ToBf16(const Napi::CallbackInfo& info) {
  const float* src = F32(info, 0, "src");
  uint16_t* dst = U16(info, 1, "dst");
  if (Len(info, 1) < Len(info, 0)) throw Napi::RangeError::New(info.Env(), "toBf16: dst is shorter than src");
  toBf16(src, dst, static_cast<int64_t>(Len(info, 0)));
  return info.Env().Undefined();
}

// fromBf16(src: Uint16Array, dst: Float32Array)
Napi::Value FromBf16(const Napi::CallbackInfo& info) {
  const uint16_t* src = U16(info, 0, "src");
  float* dst = F32(info, 1, "dst");
  if (Len(info, 1) < Len(info, 0)) throw Napi::RangeError::New(info.Env(), "fromBf16: dst is shorter than src");
  fromBf16(src, dst, static_cast<int64_t>(Len(info, 0)));
  return info.Env().Undefined();
}

// A bf16 operand: a Uint16Array of bf16 values, or a Float32Array converted by the product.
Bf16Operand Operand(const Napi::CallbackInfo& info, size_t i, const char* what) {
  Bf16Operand o;
  if (info[i].IsTypedArray() && info[i].As<Napi::TypedArray>().TypedArrayType() == napi_uint16_array) {
    o.bf16 = info[i].As<Napi::Uint16Array>().Data();
  } else {
    o.f32 = F32(info, i, what);
  }
  return o;
}

// A bf16 product's arguments: a and b (arguments 0 and 1, Float32Array or Uint16Array), C
// (argument 2) and, from argument `at`, batch, aStride, bStride, m, n, k, transA, transB; the
// sizes checked (k at least minK) and the arrays' lengths against them. Throws RangeError naming
// `name`.
struct ProductArgs {
  Bf16Operand a, b;
  int64_t batch, aStride, bStride, m, n, k;
  bool transA, transB;
};

ProductArgs ReadProduct(const Napi::CallbackInfo& info, size_t at, int64_t minK, const std::string& name) {
  ProductArgs p{Operand(info, 0, "a"), Operand(info, 1, "b"), I64(info, at), I64(info, at + 1), I64(info, at + 2), I64(info, at + 3),
                I64(info, at + 4), I64(info, at + 5), info[at + 6].As<Napi::Boolean>().Value(), info[at + 7].As<Napi::Boolean>().Value()};
  if (p.batch < 1 || p.m < 0 || p.n < 0 || p.k < minK) throw Napi::RangeError::New(info.Env(), name + ": bad sizes");
  if ((p.aStride != 0 && p.aStride != p.m * p.k) || (p.bStride != 0 && p.bStride != p.k * p.n)) {
    throw Napi::RangeError::New(info.Env(), name + ": aStride must be 0 or m*k, bStride 0 or k*n");
  }
  if (static_cast<int64_t>(Len(info, 0)) < (p.batch - 1) * p.aStride + p.m * p.k ||
      static_cast<int64_t>(Len(info, 1)) < (p.batch - 1) * p.bStride + p.k * p.n ||
      static_cast<int64_t>(Len(info, 2)) < p.batch * p.m * p.n) {
    throw Napi::RangeError::New(info.Env(), name + ": an array is shorter than its matrices");
  }
  return p;
}

// matmulBf16To(a, b, cBf: Uint16Array, bias: Float32Array | undefined, batch, aStride, bStride, m, n, k, transA, transB):
// as matmulBf16, C written only as its bf16 rounding, bias [n] added to every row first
Napi::Value MatMulBf16To(const Napi::CallbackInfo& info) {
  if (info.Length() != 12) throw Napi::TypeError::New(info.Env(), "matmulBf16To takes 12 arguments");
  uint16_t* c = U16(info, 2, "cBf");
  const ProductArgs p = ReadProduct(info, 4, 1, "matmulBf16To");
  const float* bias = nullptr;
  if (!info[3].IsUndefined()) {
    Need(info, 3, p.n, "bias");
    bias = F32(info, 3, "bias");
  }
  const int s = matmulBf16To(p.a, p.b, c, bias, p.batch, p.aStride, p.bStride, p.m, p.n, p.k, p.transA, p.transB);
  if (s != 0) throw Napi::Error::New(info.Env(), "oneDNN bf16 matmul failed with status " + std::to_string(s));
  return info.Env().Undefined();
}

// matmulBf16(a, b, c, batch, aStride, bStride, m, n, k, transA, transB) -> implementation name;
// a and b each a Float32Array or a Uint16Array of bf16 values, c a Float32Array
Napi::Value MatMulBf16(const Napi::CallbackInfo& info) {
  if (info.Length() != 11) throw Napi::TypeError::New(info.Env(), "matmulBf16 takes 11 arguments");
  float* c = F32(info, 2, "c");
  const ProductArgs p = ReadProduct(info, 3, 0, "matmulBf16");
  std::string impl;
  const int s = matmulBf16(p.a, p.b, c, p.batch, p.aStride, p.bStride, p.m, p.n, p.k, p.transA, p.transB, &impl);
  if (s != 0) throw Napi::Error::New(info.Env(), "oneDNN bf16 matmul failed with status " + std::to_string(s));
  return Napi::String::New(info.Env(), impl);
}

// bf16Info() -> { isa, nativeBf16, conversion }
Napi::Value Bf16Info(const Napi::CallbackInfo& info) {
  Napi::Object o = Napi::Object::New(info.Env());
  o.Set("isa", cpuIsa());
  o.Set("nativeBf16", nativeBf16());
  o.Set("conversion", bf16Conversion());
  return o;
}

Napi::Value SetThreads(const Napi::CallbackInfo& info) {
  const int64_t n = I64(info, 0);
  if (n < 1) throw Napi::RangeError::New(info.Env(), "threads must be >= 1");
  setThreads(static_cast<int>(n));
  return info.Env().Undefined();
}

Napi::Value Threads(const Napi::CallbackInfo& info) { return Napi::Number::New(info.Env(), threads()); }

// teamCpuSeconds() -> number[]: CPU seconds of each member of this thread's team, the caller first
Napi::Value TeamCpuSeconds(const Napi::CallbackInfo& info) {
  const std::vector<double> s = teamCpuSeconds();
  Napi::Array a = Napi::Array::New(info.Env(), s.size());
  for (uint32_t i = 0; i < s.size(); i++) a.Set(i, s[i]);
  return a;
}

Napi::Object Init(Napi::Env env, Napi::Object exports) {
  // large tensors from the heap, whose pages are already mapped, not fresh mmap'ed pages each
  // (every page's first touch faults: that cost more than many element-wise kernels); freed
  // memory stays with the process up to 1 GiB instead of going back at each free
  static bool tuned = [] {
    mallopt(M_MMAP_THRESHOLD, 256 << 20);
    mallopt(M_TRIM_THRESHOLD, 1 << 30);
    return true;
  }();
  (void)tuned;
  // FTZ on each thread that loads the addon, but no OpenMP team: a thread that only asks the
  // addon (the coordinator's main thread: bf16 support, names) must not own idle team threads,
  // which libgomp counts as busy: with more managed threads than CPUs it throttles every team's
  // spin-wait to a few hundred iterations, so the device's team slept and woke at each barrier
  // (about 4,000 more context switches a second, a thread device's step 4% slower than a
  // process device's on 2 cores). Teams start in setThreads (initBackend('native') calls it).
  flushDenormalsHere();
  exports.Set("matmul", Napi::Function::New(env, MatMul));
  exports.Set("adamw", Napi::Function::New(env, AdamW));
  exports.Set("sgd", Napi::Function::New(env, Sgd));
  exports.Set("adamwMulti", Napi::Function::New(env, AdamWMulti));
  exports.Set("sumSquaresMulti", Napi::Function::New(env, SumSquaresMulti));
  exports.Set("binary", Napi::Function::New(env, Binary));
  exports.Set("unary", Napi::Function::New(env, Unary));
  exports.Set("reduce", Napi::Function::New(env, Reduce));
  exports.Set("gelu", Napi::Function::New(env, Gelu));
  exports.Set("geluGrad", Napi::Function::New(env, GeluGrad));
  exports.Set("geluToBf16", Napi::Function::New(env, GeluToBf16));
  exports.Set("binarySameShape", Napi::Function::New(env, BinarySameShape));
  exports.Set("layerNormToBf16", Napi::Function::New(env, LayerNormToBf16));
  exports.Set("layerNormGradAny", Napi::Function::New(env, LayerNormGradAny));
  exports.Set("causalAttentionToBf16", Napi::Function::New(env, CausalAttentionToBf16));
  exports.Set("causalAttentionGradToBf16", Napi::Function::New(env, CausalAttentionGradToBf16));
  exports.Set("geluGradToBf16", Napi::Function::New(env, GeluGradToBf16));
  exports.Set("layerNorm", Napi::Function::New(env, LayerNorm));
  exports.Set("layerNormGrad", Napi::Function::New(env, LayerNormGrad));
  exports.Set("reduceOuter", Napi::Function::New(env, ReduceOuter));
  exports.Set("transpose", Napi::Function::New(env, Transpose));
  exports.Set("softmax", Napi::Function::New(env, Softmax));
  exports.Set("causalSoftmax", Napi::Function::New(env, CausalSoftmax));
  exports.Set("causalSoftmaxGrad", Napi::Function::New(env, CausalSoftmaxGrad));
  exports.Set("segmentSum", Napi::Function::New(env, SegmentSum));
  exports.Set("gather", Napi::Function::New(env, Gather));
  exports.Set("causalAttention", Napi::Function::New(env, CausalAttention));
  exports.Set("causalAttentionGrad", Napi::Function::New(env, CausalAttentionGrad));
  exports.Set("softmaxCrossEntropy", Napi::Function::New(env, SoftmaxCrossEntropy));
  exports.Set("softmaxCrossEntropyGrad", Napi::Function::New(env, SoftmaxCrossEntropyGrad));
  exports.Set("toBf16", Napi::Function::New(env, ToBf16));
  exports.Set("fromBf16", Napi::Function::New(env, FromBf16));
  exports.Set("matmulBf16", Napi::Function::New(env, MatMulBf16));
  exports.Set("matmulBf16To", Napi::Function::New(env, MatMulBf16To));
  exports.Set("bf16Info", Napi::Function::New(env, Bf16Info));
  exports.Set("setThreads", Napi::Function::New(env, SetThreads));
  exports.Set("threads", Napi::Function::New(env, Threads));
  exports.Set("teamCpuSeconds", Napi::Function::New(env, TeamCpuSeconds));
  layerwise::registerConv(env, exports);
  layerwise::registerAffinity(env, exports);
  return exports;
}

}  // namespace

NODE_API_MODULE(layerwise_native, Init)
