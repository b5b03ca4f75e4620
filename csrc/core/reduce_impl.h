// Kernel bodies for reduce.h, compiled once per instruction set (see reduce_generic.cpp and
// reduce_avx2.cpp). Plain loops the compiler vectorizes for the target each translation unit is
// built for (the AVX2 unit adds vector code for the half types), and runtime dispatch picks the unit.
#pragma once

#include <cstdint>
#include <cstring>
#include <type_traits>

#include "core/half.h"
#include "core/types.h"

#ifndef RUMOR_KERNEL_NS
#error "define RUMOR_KERNEL_NS before including reduce_impl.h"
#endif

namespace rumor::RUMOR_KERNEL_NS {

namespace {

using half::bf16_to_f32;
using half::f32_to_bf16;

// Integers wrap (as torch's do), computed unsigned so that an overflow is not undefined: at
// least `unsigned` wide, since two uint16 would multiply as (signed) int.
template <typename T>
using Wrap = std::conditional_t<(sizeof(T) < sizeof(unsigned)), unsigned, std::make_unsigned_t<T>>;

template <typename T>
struct Sum {
  static T apply(T a, T b) {
    if constexpr (std::is_integral_v<T>) {
      return static_cast<T>(static_cast<Wrap<T>>(a) + static_cast<Wrap<T>>(b));
    } else {
      return a + b;
    }
  }
};
template <typename T>
struct Prod {
  static T apply(T a, T b) {
    if constexpr (std::is_integral_v<T>) {
      return static_cast<T>(static_cast<Wrap<T>>(a) * static_cast<Wrap<T>>(b));
    } else {
      return a * b;
    }
  }
};
template <typename T>
struct Min {
  static T apply(T a, T b) { return b < a ? b : a; }
};
template <typename T>
struct Max {
  static T apply(T a, T b) { return a < b ? b : a; }
};

template <typename T, template <typename> class Op>
void native(void* __restrict dst, const void* __restrict src, size_t n) {
  T* __restrict d = static_cast<T*>(dst);
  const T* __restrict s = static_cast<const T*>(src);
  for (size_t i = 0; i < n; ++i) d[i] = Op<T>::apply(d[i], s[i]);
}

// How an element type is stored and in which type it is reduced. The half types go through
// core/half.h in every path, so that a NaN comes out as the same bits whatever the compiler.
template <typename T>
struct Plain {
  using Raw = T;
  using Acc = T;
  static T widen(T x) { return x; }
  static T narrow(T x) { return x; }
};
struct F16 {
  using Raw = uint16_t;
  using Acc = float;
  static float widen(uint16_t x) { return half::f16_to_f32(x); }
  static uint16_t narrow(float x) { return half::f32_to_f16(x); }
};
struct BF16 {
  using Raw = uint16_t;
  using Acc = float;
  static float widen(uint16_t x) { return bf16_to_f32(x); }
  static uint16_t narrow(float x) { return f32_to_bf16(x); }
};

// Folds elements [i, i + m) of all k sources into dst, one element at a time: the generic path
// of the half types and the ragged end of every fold. dst may be one of the sources: every source
// is read for the block before dst is written.
template <class E, template <typename> class Op>
void fold_block(void* dst, const void* const* srcs, size_t k, size_t i, size_t m) {
  using Raw = typename E::Raw;
  using Acc = typename E::Acc;
  constexpr size_t kMax = 64;
  Acc acc[kMax];
  for (size_t t0 = 0; t0 < m; t0 += kMax) {
    const size_t mt = m - t0 < kMax ? m - t0 : kMax;
    const Raw* s = static_cast<const Raw*>(srcs[0]) + i + t0;
    for (size_t t = 0; t < mt; ++t) acc[t] = E::widen(s[t]);
    for (size_t j = 1; j < k; ++j) {
      s = static_cast<const Raw*>(srcs[j]) + i + t0;
      for (size_t t = 0; t < mt; ++t) acc[t] = Op<Acc>::apply(acc[t], E::widen(s[t]));
    }
    Raw* d = static_cast<Raw*>(dst) + i + t0;
    for (size_t t = 0; t < mt; ++t) d[t] = E::narrow(acc[t]);
  }
}

// A kernel set may replace the fold for a type with vector code: below for the native types,
// reduce_avx2_halves.h for the half types, whose conversions the compiler does not vectorize.
template <class E, template <typename> class Op>
struct Fold {
  static void run(void* dst, const void* const* srcs, size_t k, size_t n) {
    fold_block<E, Op>(dst, srcs, k, 0, n);
  }
};

// The native types through GCC vector types, 4 registers of accumulator per block: written as a
// scalar block loop, GCC keeps the accumulator in memory and unrolls over the sources instead.
// Vector +, * and the comparisons of Min/Max act lane by lane exactly as on scalars (integers wrap).
#ifdef __AVX2__
constexpr size_t kVectorBytes = 32;
#else
constexpr size_t kVectorBytes = 16;
#endif

template <typename T, template <typename> class Op>
struct Fold<Plain<T>, Op> {
  typedef T Vec __attribute__((vector_size(kVectorBytes)));
  static constexpr size_t kLanes = kVectorBytes / sizeof(T);

  static Vec load(const T* p) {
    Vec v;
    std::memcpy(&v, p, sizeof v);
    return v;
  }

  // Integer lanes wrap through their unsigned twin, as Sum and Prod do on scalars.
  typedef std::make_unsigned_t<std::conditional_t<std::is_integral_v<T>, T, int>> U;
  typedef U UVec __attribute__((vector_size(kVectorBytes)));

  // Op<Vec> would not do: GCC drops the vector attribute of a template argument.
  static Vec apply(Vec a, Vec b) {
    if constexpr (std::is_same_v<Op<T>, Sum<T>>) {
      if constexpr (std::is_integral_v<T>) {
        return (Vec)((UVec)a + (UVec)b);
      } else {
        return a + b;
      }
    } else if constexpr (std::is_same_v<Op<T>, Prod<T>>) {
      if constexpr (std::is_integral_v<T>) {
        return (Vec)((UVec)a * (UVec)b);
      } else {
        return a * b;
      }
    } else if constexpr (std::is_same_v<Op<T>, Min<T>>) {
      return b < a ? b : a;
    } else {
      static_assert(std::is_same_v<Op<T>, Max<T>>);
      return a < b ? b : a;
    }
  }

  static void run(void* dst, const void* const* srcs, size_t k, size_t n) {
    T* d = static_cast<T*>(dst);
    size_t i = 0;
    for (; i + 4 * kLanes <= n; i += 4 * kLanes) {
      const T* s = static_cast<const T*>(srcs[0]) + i;
      Vec a0 = load(s), a1 = load(s + kLanes), a2 = load(s + 2 * kLanes), a3 = load(s + 3 * kLanes);
      for (size_t j = 1; j < k; ++j) {
        s = static_cast<const T*>(srcs[j]) + i;
        a0 = apply(a0, load(s));
        a1 = apply(a1, load(s + kLanes));
        a2 = apply(a2, load(s + 2 * kLanes));
        a3 = apply(a3, load(s + 3 * kLanes));
      }
      std::memcpy(d + i, &a0, sizeof a0);
      std::memcpy(d + i + kLanes, &a1, sizeof a1);
      std::memcpy(d + i + 2 * kLanes, &a2, sizeof a2);
      std::memcpy(d + i + 3 * kLanes, &a3, sizeof a3);
    }
    if (i < n) fold_block<Plain<T>, Op>(dst, srcs, k, i, n - i);
  }
};

}  // namespace
}  // namespace rumor::RUMOR_KERNEL_NS

#ifdef RUMOR_REDUCE_AVX2_HALVES
#include "core/reduce_avx2_halves.h"
#endif

namespace rumor::RUMOR_KERNEL_NS {
namespace {

// Calls f.template operator()<Op, E>() with the Op of `op` and the element traits E of `t`: the
// one place that maps the runtime enums onto kernel instantiations.
template <template <typename> class Op, class F>
void with_dtype(DType t, F&& f) {
  switch (t) {
    case DType::F32:
      return f.template operator()<Op, Plain<float>>();
    case DType::F64:
      return f.template operator()<Op, Plain<double>>();
    case DType::I32:
      return f.template operator()<Op, Plain<int32_t>>();
    case DType::I64:
      return f.template operator()<Op, Plain<int64_t>>();
    case DType::U8:
      return f.template operator()<Op, Plain<uint8_t>>();
    case DType::I8:
      return f.template operator()<Op, Plain<int8_t>>();
    case DType::I16:
      return f.template operator()<Op, Plain<int16_t>>();
    case DType::F16:
      return f.template operator()<Op, F16>();
    case DType::BF16:
      return f.template operator()<Op, BF16>();
  }
}

template <class F>
void with_kernel(ReduceOp op, DType t, F&& f) {
  switch (op) {
    case ReduceOp::SUM:
    case ReduceOp::AVG:
      return with_dtype<Sum>(t, f);
    case ReduceOp::PROD:
      return with_dtype<Prod>(t, f);
    case ReduceOp::MIN:
      return with_dtype<Min>(t, f);
    case ReduceOp::MAX:
      return with_dtype<Max>(t, f);
  }
}

template <class E>
constexpr bool kNative = std::is_same_v<typename E::Raw, typename E::Acc>;

template <typename T>
void divide(void* buf, size_t n, size_t divisor) {
  T* d = static_cast<T*>(buf);
  if constexpr (std::is_integral_v<T> && sizeof(T) < sizeof(int64_t)) {
    // A group larger than the type's range (int8 past 127 ranks) must not wrap the divisor.
    const int64_t div = static_cast<int64_t>(divisor);
    for (size_t i = 0; i < n; ++i) d[i] = static_cast<T>(static_cast<int64_t>(d[i]) / div);
  } else {
    const T div = static_cast<T>(divisor);
    for (size_t i = 0; i < n; ++i) d[i] = static_cast<T>(d[i] / div);
  }
}

}  // namespace

void reduce_into(void* dst, const void* src, size_t n, DType t, ReduceOp op) {
  with_kernel(op, t, [&]<template <typename> class Op, class E>() {
    if constexpr (kNative<E>) {
      native<typename E::Raw, Op>(dst, src, n);
    } else {
      // Half types are reduced in float and rounded once per hop: a fold of (dst, src).
      const void* both[2] = {dst, src};
      Fold<E, Op>::run(dst, both, 2, n);
    }
  });
}

void reduce_many(void* dst, const void* const* srcs, size_t k, size_t n, DType t, ReduceOp op) {
  with_kernel(op, t, [&]<template <typename> class Op, class E>() { Fold<E, Op>::run(dst, srcs, k, n); });
}

void finish_average(void* buf, size_t n, DType t, size_t divisor) {
  switch (t) {
    case DType::F32:
      return divide<float>(buf, n, divisor);
    case DType::F64:
      return divide<double>(buf, n, divisor);
    case DType::I32:
      return divide<int32_t>(buf, n, divisor);
    case DType::I64:
      return divide<int64_t>(buf, n, divisor);
    case DType::U8:
      return divide<uint8_t>(buf, n, divisor);
    case DType::I8:
      return divide<int8_t>(buf, n, divisor);
    case DType::I16:
      return divide<int16_t>(buf, n, divisor);
    case DType::F16: {
      _Float16* d = static_cast<_Float16*>(buf);
      const float div = static_cast<float>(divisor);
      for (size_t i = 0; i < n; ++i) d[i] = static_cast<_Float16>(static_cast<float>(d[i]) / div);
      return;
    }
    case DType::BF16: {
      uint16_t* d = static_cast<uint16_t*>(buf);
      const float div = static_cast<float>(divisor);
      for (size_t i = 0; i < n; ++i) d[i] = f32_to_bf16(bf16_to_f32(d[i]) / div);
      return;
    }
  }
}

}  // namespace rumor::RUMOR_KERNEL_NS
