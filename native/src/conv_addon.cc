// N-API glue of the convolution and pooling kernels (conv.cc), registered by addon.cc's Init.
// Every function takes Float32Arrays and a geometry: an array of 17 integers in ConvGeometry's
// order (kernels.h), and checks that the arrays hold their shapes (RangeError otherwise).
#include <napi.h>
#include <string>
#include "kernels.h"

namespace layerwise {

namespace {

float* Arr(const Napi::CallbackInfo& info, size_t i, const char* what, int64_t need) {
  if (!info[i].IsTypedArray() || info[i].As<Napi::TypedArray>().TypedArrayType() != napi_float32_array) {
    throw Napi::TypeError::New(info.Env(), std::string(what) + " must be a Float32Array");
  }
  auto a = info[i].As<Napi::Float32Array>();
  if (static_cast<int64_t>(a.ElementLength()) < need) throw Napi::RangeError::New(info.Env(), std::string(what) + " is shorter than its shape");
  return a.Data();
}

ConvGeometry Geometry(const Napi::CallbackInfo& info, size_t i, bool pool) {
  if (!info[i].IsArray() || info[i].As<Napi::Array>().Length() != 17) {
    throw Napi::TypeError::New(info.Env(), "a convolution geometry must be an array of 17 integers");
  }
  Napi::Array a = info[i].As<Napi::Array>();
  int64_t v[17];
  for (uint32_t d = 0; d < 17; d++) v[d] = a.Get(d).As<Napi::Number>().Int64Value();
  ConvGeometry g{v[0], v[1], v[2], v[3], v[4], v[5], v[6], v[7], v[8], v[9], v[10], v[11], v[12], v[13], v[14], v[15], v[16]};
  for (int d = 0; d < 13; d++) {
    if (v[d] < 1) throw Napi::RangeError::New(info.Env(), "a convolution geometry's sizes, strides and dilations must be >= 1");
  }
  for (int d = 13; d < 17; d++) {
    if (v[d] < 0) throw Napi::RangeError::New(info.Env(), "a convolution geometry's pads must be >= 0");
  }
  if (pool && (g.outChannels != g.inChannels || g.dilationHeight != 1 || g.dilationWidth != 1)) {
    throw Napi::RangeError::New(info.Env(), "pooling keeps the channels and has no dilation");
  }
  return g;
}

int64_t InSize(const ConvGeometry& g) { return g.batch * g.inHeight * g.inWidth * g.inChannels; }
int64_t OutSize(const ConvGeometry& g) { return g.batch * g.outHeight * g.outWidth * g.outChannels; }
int64_t FilterSize(const ConvGeometry& g) { return g.filterHeight * g.filterWidth * g.inChannels * g.outChannels; }

// A kernel's optional last argument: bf16 compute (default false).
bool Bf16(const Napi::CallbackInfo& info, size_t i) { return info.Length() > i && info[i].ToBoolean().Value(); }

// conv2d(x, w, bias | null, y, geometry, relu[, bf16]): 0 or oneDNN's status
Napi::Value Conv2d(const Napi::CallbackInfo& info) {
  const ConvGeometry g = Geometry(info, 4, false);
  const float* bias = info[2].IsNull() || info[2].IsUndefined() ? nullptr : Arr(info, 2, "bias", g.outChannels);
  const int s = conv2d(Arr(info, 0, "x", InSize(g)), Arr(info, 1, "w", FilterSize(g)), bias, Arr(info, 3, "y", OutSize(g)), g,
                       info[5].ToBoolean().Value(), Bf16(info, 6));
  return Napi::Number::New(info.Env(), s);
}

// conv2dBackpropInput(dy, w, dx, geometry[, bf16]): 0 or oneDNN's status
Napi::Value Conv2dBackpropInput(const Napi::CallbackInfo& info) {
  const ConvGeometry g = Geometry(info, 3, false);
  const int s = conv2dBackpropInput(Arr(info, 0, "dy", OutSize(g)), Arr(info, 1, "w", FilterSize(g)), Arr(info, 2, "dx", InSize(g)), g, Bf16(info, 4));
  return Napi::Number::New(info.Env(), s);
}

// conv2dBackpropFilter(x, dy, dw, geometry[, bf16]): 0 or oneDNN's status
Napi::Value Conv2dBackpropFilter(const Napi::CallbackInfo& info) {
  const ConvGeometry g = Geometry(info, 3, false);
  const int s = conv2dBackpropFilter(Arr(info, 0, "x", InSize(g)), Arr(info, 1, "dy", OutSize(g)), Arr(info, 2, "dw", FilterSize(g)), g, Bf16(info, 4));
  return Napi::Number::New(info.Env(), s);
}

// maxPool(x, y, geometry), avgPool(x, y, geometry)
template <void (*F)(const float*, float*, const ConvGeometry&)>
Napi::Value Pool(const Napi::CallbackInfo& info) {
  const ConvGeometry g = Geometry(info, 2, true);
  F(Arr(info, 0, "x", InSize(g)), Arr(info, 1, "y", OutSize(g)), g);
  return info.Env().Undefined();
}

// maxPoolGrad(x, dy, dx, geometry)
Napi::Value MaxPoolGrad(const Napi::CallbackInfo& info) {
  const ConvGeometry g = Geometry(info, 3, true);
  maxPoolGrad(Arr(info, 0, "x", InSize(g)), Arr(info, 1, "dy", OutSize(g)), Arr(info, 2, "dx", InSize(g)), g);
  return info.Env().Undefined();
}

// avgPoolGrad(dy, dx, geometry)
Napi::Value AvgPoolGrad(const Napi::CallbackInfo& info) {
  const ConvGeometry g = Geometry(info, 2, true);
  avgPoolGrad(Arr(info, 0, "dy", OutSize(g)), Arr(info, 1, "dx", InSize(g)), g);
  return info.Env().Undefined();
}

}  // namespace

void registerConv(Napi::Env env, Napi::Object exports) {
  exports.Set("conv2d", Napi::Function::New(env, Conv2d));
  exports.Set("conv2dBackpropInput", Napi::Function::New(env, Conv2dBackpropInput));
  exports.Set("conv2dBackpropFilter", Napi::Function::New(env, Conv2dBackpropFilter));
  exports.Set("maxPool", Napi::Function::New(env, Pool<maxPool>));
  exports.Set("maxPoolGrad", Napi::Function::New(env, MaxPoolGrad));
  exports.Set("avgPool", Napi::Function::New(env, Pool<avgPool>));
  exports.Set("avgPoolGrad", Napi::Function::New(env, AvgPoolGrad));
}

}  // namespace layerwise
