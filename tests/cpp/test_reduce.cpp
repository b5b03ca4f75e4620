#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <random>
#include <vector>

#include "core/reduce.h"

namespace rumor {
namespace {

float bf16_to_float(uint16_t h) {
  uint32_t u = static_cast<uint32_t>(h) << 16;
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

template <typename T>
T apply(T a, T b, ReduceOp op) {
  switch (op) {
    case ReduceOp::SUM:
    case ReduceOp::AVG:
      return static_cast<T>(a + b);
    case ReduceOp::PROD:
      return static_cast<T>(a * b);
    case ReduceOp::MIN:
      return std::min(a, b);
    case ReduceOp::MAX:
      return std::max(a, b);
  }
  return a;
}

template <typename T>
void check_native(DType dt) {
  std::mt19937 rng(42);
  for (ReduceOp op : {ReduceOp::SUM, ReduceOp::AVG, ReduceOp::MIN, ReduceOp::MAX, ReduceOp::PROD}) {
    for (size_t n : {0u, 1u, 7u, 64u, 1001u}) {
      std::vector<T> a(n), b(n), want(n);
      for (size_t i = 0; i < n; ++i) {
        a[i] = static_cast<T>(rng() % 11);
        b[i] = static_cast<T>(rng() % 11);
        want[i] = apply(a[i], b[i], op);
      }
      reduce_into(a.data(), b.data(), n, dt, op);
      EXPECT_EQ(a, want) << dtype_name(dt) << " " << op_name(op) << " n=" << n;
    }
  }
}

TEST(Reduce, NativeTypesExact) {
  check_native<float>(DType::F32);
  check_native<double>(DType::F64);
  check_native<int32_t>(DType::I32);
  check_native<int64_t>(DType::I64);
  check_native<uint8_t>(DType::U8);
  check_native<int8_t>(DType::I8);
  check_native<int16_t>(DType::I16);
}

TEST(Reduce, SmallIntegerAverageTakesLargeDivisors) {
  // 200 ranks do not fit in int8: the divisor must not wrap.
  std::vector<int8_t> a = {100, -100, 7};
  finish_average(a.data(), a.size(), DType::I8, 200);
  EXPECT_EQ(a, (std::vector<int8_t>{0, 0, 0}));
  std::vector<int8_t> b = {-128, 127, -7};
  finish_average(b.data(), b.size(), DType::I8, 2);
  EXPECT_EQ(b, (std::vector<int8_t>{-64, 63, -3}));
  std::vector<int16_t> c = {-30000, 30001};
  finish_average(c.data(), c.size(), DType::I16, 70000);
  EXPECT_EQ(c, (std::vector<int16_t>{0, 0}));
  EXPECT_EQ(dtype_size(DType::I8), 1u);
  EXPECT_EQ(dtype_size(DType::I16), 2u);
  EXPECT_EQ(dtype_name(DType::I16), "int16");
}

TEST(Reduce, Float16RoundsOncePerHop) {
  auto h = [](float f) { return static_cast<_Float16>(f); };
  std::vector<_Float16> a = {h(1.0f), h(2.5f), h(-3.0f), h(65504.0f)},
                        b = {h(0.5f), h(0.25f), h(3.0f), h(1.0f)};
  reduce_into(a.data(), b.data(), a.size(), DType::F16, ReduceOp::SUM);
  EXPECT_EQ(static_cast<float>(a[0]), 1.5f);
  EXPECT_EQ(static_cast<float>(a[1]), 2.75f);
  EXPECT_EQ(static_cast<float>(a[2]), 0.0f);
  EXPECT_EQ(static_cast<float>(a[3]), 65504.0f);  // 65505 rounds back to the largest finite half
}

TEST(Reduce, BFloat16RoundNearestEvenAndNaN) {
  // 1 + 2^-8 is exactly halfway between two bf16 values around 1: ties go to even (1.0).
  uint16_t one = 0x3f80, tiny = 0x3b80;  // 1.0 and 2^-8
  std::vector<uint16_t> a = {one, 0x7fc0 /* NaN */, 0x4000 /* 2 */}, b = {tiny, one, 0x4040 /* 3 */};
  reduce_into(a.data(), b.data(), a.size(), DType::BF16, ReduceOp::SUM);
  EXPECT_EQ(bf16_to_float(a[0]), 1.0f);
  EXPECT_TRUE(std::isnan(bf16_to_float(a[1])));
  EXPECT_EQ(bf16_to_float(a[2]), 5.0f);
}

TEST(Reduce, FinishAverage) {
  std::vector<float> f = {3.0f, 6.0f, -9.0f};
  finish_average(f.data(), f.size(), DType::F32, 3);
  EXPECT_EQ(f, (std::vector<float>{1.0f, 2.0f, -3.0f}));
  std::vector<int32_t> i = {7, -7, 9};
  finish_average(i.data(), i.size(), DType::I32, 2);
  EXPECT_EQ(i, (std::vector<int32_t>{3, -3, 4}));  // truncation toward zero
  std::vector<uint16_t> h = {0x4040};              // bf16 3.0
  finish_average(h.data(), 1, DType::BF16, 2);
  EXPECT_EQ(bf16_to_float(h[0]), 1.5f);
}

TEST(Reduce, LongBuffersMatchScalarLoop) {
  // Long enough to exercise the vector body and the tail of the AVX2 kernels.
  const size_t n = 100003;
  std::vector<float> a(n), b(n), want(n);
  for (size_t i = 0; i < n; ++i) {
    a[i] = static_cast<float>(i % 97) * 0.5f;
    b[i] = static_cast<float>(i % 89) * 0.25f;
    want[i] = std::max(a[i], b[i]);
  }
  reduce_into(a.data(), b.data(), n, DType::F32, ReduceOp::MAX);
  EXPECT_EQ(a, want);
  EXPECT_STRNE(reduce_isa(), "");
}

}  // namespace
}  // namespace rumor
