// The weighted-sum kernel of the neighbor ops, compiled once per instruction set
// (neighbor_kernels.cpp and neighbor_kernels_avx2.cpp); runtime dispatch in neighbor.cpp.
// Plain loops over small blocks: the compiler vectorizes them for each target.
#pragma once

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <cstring>

#include "core/half.h"
#include "core/types.h"

#ifndef RUMOR_KERNEL_NS
#error "define RUMOR_KERNEL_NS before including neighbor_kernels.h"
#endif

namespace rumor::RUMOR_KERNEL_NS {

namespace {

// Accumulating a block at a time keeps the running sum in L1 while every source streams past
// it once, and lets `in` alias `out` (a block is read completely before it is written).
constexpr size_t kBlock = 512;

struct F32 {
  using T = float;
  using Acc = float;
  static Acc load(T v) { return v; }
  static T store(Acc v) { return v; }
};
struct F64 {
  using T = double;
  using Acc = double;
  static Acc load(T v) { return v; }
  static T store(Acc v) { return v; }
};
struct F16 {
  using T = _Float16;
  using Acc = float;
  static Acc load(T v) { return static_cast<float>(v); }
  static T store(Acc v) { return static_cast<_Float16>(v); }
};
struct BF16 {
  using T = uint16_t;
  using Acc = float;
  static Acc load(T h) { return half::bf16_to_f32(h); }
  static T store(Acc f) { return half::f32_to_bf16(f); }
};

template <typename K>
void weighted(void* out, const void* in, double self_weight, const void* const* srcs, const double* weights,
              size_t nsrc, size_t n) {
  using T = typename K::T;
  using Acc = typename K::Acc;
  Acc acc[kBlock];
  const Acc sw = static_cast<Acc>(self_weight);
  for (size_t base = 0; base < n; base += kBlock) {
    const size_t m = std::min(kBlock, n - base);
    const T* x = static_cast<const T*>(in) + base;
    for (size_t i = 0; i < m; ++i) acc[i] = sw * K::load(x[i]);
    for (size_t k = 0; k < nsrc; ++k) {
      const T* __restrict s = static_cast<const T*>(srcs[k]) + base;
      const Acc w = static_cast<Acc>(weights[k]);
      for (size_t i = 0; i < m; ++i) acc[i] += w * K::load(s[i]);
    }
    T* o = static_cast<T*>(out) + base;
    for (size_t i = 0; i < m; ++i) o[i] = K::store(acc[i]);
  }
}

// The uniform case (self and every source weighted alike): sum first, then one division or
// scale, so integer-valued inputs come out exact where per-term scaling rounds every term.
template <typename K>
void uniform(void* out, const void* in, const void* const* srcs, size_t nsrc, size_t n, double factor,
             bool divide) {
  using T = typename K::T;
  using Acc = typename K::Acc;
  Acc acc[kBlock];
  const Acc f = static_cast<Acc>(factor);
  for (size_t base = 0; base < n; base += kBlock) {
    const size_t m = std::min(kBlock, n - base);
    const T* x = static_cast<const T*>(in) + base;
    for (size_t i = 0; i < m; ++i) acc[i] = K::load(x[i]);
    for (size_t k = 0; k < nsrc; ++k) {
      const T* __restrict s = static_cast<const T*>(srcs[k]) + base;
      for (size_t i = 0; i < m; ++i) acc[i] += K::load(s[i]);
    }
    T* o = static_cast<T*>(out) + base;
    if (divide)
      for (size_t i = 0; i < m; ++i) o[i] = K::store(acc[i] / f);
    else
      for (size_t i = 0; i < m; ++i) o[i] = K::store(acc[i] * f);
  }
}

}  // namespace

// out = (in + sum srcs) / factor (divide) or * factor; false for dtypes without it (integers).
bool uniform_sum(void* out, const void* in, const void* const* srcs, size_t nsrc, size_t n, double factor,
                 bool divide, DType dtype) {
  switch (dtype) {
    case DType::F32:
      uniform<F32>(out, in, srcs, nsrc, n, factor, divide);
      return true;
    case DType::F64:
      uniform<F64>(out, in, srcs, nsrc, n, factor, divide);
      return true;
    case DType::F16:
      uniform<F16>(out, in, srcs, nsrc, n, factor, divide);
      return true;
    case DType::BF16:
      uniform<BF16>(out, in, srcs, nsrc, n, factor, divide);
      return true;
    default:
      return false;
  }
}

// Returns false for dtypes without a weighted sum (integers).
bool weighted_sum(void* out, const void* in, double self_weight, const void* const* srcs,
                  const double* weights, size_t nsrc, size_t n, DType dtype) {
  switch (dtype) {
    case DType::F32:
      weighted<F32>(out, in, self_weight, srcs, weights, nsrc, n);
      return true;
    case DType::F64:
      weighted<F64>(out, in, self_weight, srcs, weights, nsrc, n);
      return true;
    case DType::F16:
      weighted<F16>(out, in, self_weight, srcs, weights, nsrc, n);
      return true;
    case DType::BF16:
      weighted<BF16>(out, in, self_weight, srcs, weights, nsrc, n);
      return true;
    default:
      return false;
  }
}

}  // namespace rumor::RUMOR_KERNEL_NS
