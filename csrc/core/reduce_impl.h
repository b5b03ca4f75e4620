// Kernel bodies for reduce.h, compiled once per instruction set (see reduce_generic.cpp and
// reduce_avx2.cpp). Plain loops over __restrict pointers: the compiler vectorizes them for the
// target each translation unit is built for, and runtime dispatch picks the unit.
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

template <typename T>
struct Sum {
  static T apply(T a, T b) { return a + b; }
};
template <typename T>
struct Prod {
  static T apply(T a, T b) { return a * b; }
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

// Half types are reduced in float and rounded once per hop.
template <template <typename> class Op>
void half(void* __restrict dst, const void* __restrict src, size_t n) {
  _Float16* __restrict d = static_cast<_Float16*>(dst);
  const _Float16* __restrict s = static_cast<const _Float16*>(src);
  for (size_t i = 0; i < n; ++i)
    d[i] = static_cast<_Float16>(Op<float>::apply(static_cast<float>(d[i]), static_cast<float>(s[i])));
}

template <template <typename> class Op>
void bfloat(void* __restrict dst, const void* __restrict src, size_t n) {
  uint16_t* __restrict d = static_cast<uint16_t*>(dst);
  const uint16_t* __restrict s = static_cast<const uint16_t*>(src);
  for (size_t i = 0; i < n; ++i) d[i] = f32_to_bf16(Op<float>::apply(bf16_to_f32(d[i]), bf16_to_f32(s[i])));
}

template <template <typename> class Op>
void by_dtype(void* dst, const void* src, size_t n, DType t) {
  switch (t) {
    case DType::F32:
      return native<float, Op>(dst, src, n);
    case DType::F64:
      return native<double, Op>(dst, src, n);
    case DType::I32:
      return native<int32_t, Op>(dst, src, n);
    case DType::I64:
      return native<int64_t, Op>(dst, src, n);
    case DType::U8:
      return native<uint8_t, Op>(dst, src, n);
    case DType::I8:
      return native<int8_t, Op>(dst, src, n);
    case DType::I16:
      return native<int16_t, Op>(dst, src, n);
    case DType::F16:
      return half<Op>(dst, src, n);
    case DType::BF16:
      return bfloat<Op>(dst, src, n);
  }
}

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
  switch (op) {
    case ReduceOp::SUM:
    case ReduceOp::AVG:
      return by_dtype<Sum>(dst, src, n, t);
    case ReduceOp::PROD:
      return by_dtype<Prod>(dst, src, n, t);
    case ReduceOp::MIN:
      return by_dtype<Min>(dst, src, n, t);
    case ReduceOp::MAX:
      return by_dtype<Max>(dst, src, n, t);
  }
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
