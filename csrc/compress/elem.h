// Element access shared by both kernel sets: every input dtype is read as float (float64 is
// rounded to float32 first, the precision every codec works at) and written back from float.
#pragma once

#include <cmath>
#include <cstdint>
#include <cstring>

#include "core/half.h"
#include "core/types.h"

namespace rumor::compress::detail {
// Internal linkage: these are compiled with different instruction sets in different units, and
// one linked copy must not serve another unit's callers.
namespace {

using half::bf16_to_f32;
using half::f16_to_f32;
using half::f32_to_bf16;
using half::f32_to_f16;

// double -> float as IEEE rounds it: past FLT_MAX + half an ulp to infinity, where the C++
// conversion would be undefined.
inline float narrow(double v) {
  constexpr double kOverflow = 0x1.ffffffp127;
  if (v >= kOverflow) return INFINITY;
  if (v <= -kOverflow) return -INFINITY;
  return static_cast<float>(v);
}

template <DType D>
struct Elem;

template <>
struct Elem<DType::F32> {
  using Raw = float;
  static float load(const void* p, size_t i) { return static_cast<const float*>(p)[i]; }
  static void put(void* p, size_t i, float v) { static_cast<float*>(p)[i] = v; }
};
template <>
struct Elem<DType::F64> {
  using Raw = double;
  static float load(const void* p, size_t i) { return narrow(static_cast<const double*>(p)[i]); }
  // Accumulation into float64 output keeps float64 precision for the running value.
  static void add(void* p, size_t i, float v) { static_cast<double*>(p)[i] += static_cast<double>(v); }
  static void put(void* p, size_t i, float v) { static_cast<double*>(p)[i] = static_cast<double>(v); }
};
template <>
struct Elem<DType::F16> {
  using Raw = uint16_t;
  static float load(const void* p, size_t i) { return f16_to_f32(static_cast<const uint16_t*>(p)[i]); }
  static void put(void* p, size_t i, float v) { static_cast<uint16_t*>(p)[i] = f32_to_f16(v); }
};
template <>
struct Elem<DType::BF16> {
  using Raw = uint16_t;
  static float load(const void* p, size_t i) { return bf16_to_f32(static_cast<const uint16_t*>(p)[i]); }
  static void put(void* p, size_t i, float v) { static_cast<uint16_t*>(p)[i] = f32_to_bf16(v); }
};

// out[i] = v, or out[i] += v (in the output's own precision for float64, in float otherwise,
// rounded once per element for the half types).
template <DType D, bool Acc>
inline void store(void* out, size_t i, float v) {
  if constexpr (!Acc) {
    Elem<D>::put(out, i, v);
  } else if constexpr (D == DType::F64) {
    Elem<D>::add(out, i, v);
  } else {
    Elem<D>::put(out, i, Elem<D>::load(out, i) + v);
  }
}

inline float load_f32(const std::byte* p) {
  float f;
  std::memcpy(&f, p, 4);
  return f;
}
inline void store_f32(std::byte* p, float f) { std::memcpy(p, &f, 4); }

// Chunk sums run over kSumLanes interleaved double lanes (element j of a chunk in lane
// j % kSumLanes): enough independent chains to hide the vector add latency. This fixes the
// order in which they are combined.
constexpr size_t kSumLanes = 32;
inline double combine8(const double* l) {
  return ((l[0] + l[1]) + (l[2] + l[3])) + ((l[4] + l[5]) + (l[6] + l[7]));
}
inline double combine_lanes(const double* l) {
  return (combine8(l) + combine8(l + 8)) + (combine8(l + 16) + combine8(l + 24));
}
inline float combine8(const float* l) {
  return ((l[0] + l[1]) + (l[2] + l[3])) + ((l[4] + l[5]) + (l[6] + l[7]));
}
inline float combine_lanes(const float* l) {
  return (combine8(l) + combine8(l + 8)) + (combine8(l + 16) + combine8(l + 24));
}

// QSGD's sum of squares is first taken in float32 with fused multiply-adds (explicit in both
// kernel sets, so identical), which is a third of the cost of float64; it is redone in float64
// (exact squares) when the float32 sum is not safely normal: it overflowed (|x| beyond about
// 1e19), underflowed, or met a NaN. The float32 sum's relative error is below 40 * 2^-24.
inline bool sumsq_f32_ok(float s) { return s >= 0x1p-100f && s < INFINITY; }

// Calls f.template operator()<D>() for a float dtype D; the codecs reject other dtypes before
// any kernel runs.
template <typename F>
inline void by_float_dtype(DType t, F&& f) {
  switch (t) {
    case DType::F32:
      return f.template operator()<DType::F32>();
    case DType::F64:
      return f.template operator()<DType::F64>();
    case DType::F16:
      return f.template operator()<DType::F16>();
    case DType::BF16:
      return f.template operator()<DType::BF16>();
    default:
      throw Error(ErrorKind::kInvalidArgument, "codec kernels take float32, float16, bfloat16 or float64");
  }
}

}  // namespace
}  // namespace rumor::compress::detail
