// reduce_many (k-source fold) and the vector half-type kernels of reduce_into, against references
// computed here: the sequential reduce_into chain and a scalar fold for the native types, a
// float64 sum rounded once for float16/bfloat16, and core/half.h's scalar conversions (compiled in
// this unit without F16C) for every 16-bit pattern.
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <limits>
#include <random>
#include <string>
#include <type_traits>
#include <vector>

#include "core/half.h"
#include "core/reduce.h"

namespace rumor {

// The portable kernel set, called directly so that the dispatched (AVX2) kernels can be compared
// with it on this machine; reduce.cpp declares them the same way.
namespace generic {
void reduce_into(void* dst, const void* src, size_t n, DType t, ReduceOp op);
void reduce_many(void* dst, const void* const* srcs, size_t k, size_t n, DType t, ReduceOp op);
}  // namespace generic

namespace {

constexpr ReduceOp kOps[] = {ReduceOp::SUM, ReduceOp::AVG, ReduceOp::PROD, ReduceOp::MIN, ReduceOp::MAX};
// Lengths around the vector widths (8 to 128 elements a block) and their ragged ends.
constexpr size_t kLengths[] = {1, 7, 31, 33, 64, 129, 1000, 4099};

template <typename A>
A fold_op(A acc, A x, ReduceOp op) {
  switch (op) {
    case ReduceOp::SUM:
    case ReduceOp::AVG:
      return static_cast<A>(acc + x);
    case ReduceOp::PROD:
      return static_cast<A>(acc * x);
    case ReduceOp::MIN:
      return x < acc ? x : acc;
    case ReduceOp::MAX:
      return acc < x ? x : acc;
  }
  return acc;
}

std::string where(DType t, ReduceOp op, size_t k, size_t n) {
  return std::string(dtype_name(t)) + " " + std::string(op_name(op)) + " k=" + std::to_string(k) +
         " n=" + std::to_string(n);
}

std::vector<const void*> pointers(const std::vector<std::vector<uint8_t>>& srcs) {
  std::vector<const void*> p;
  for (const auto& s : srcs) p.push_back(s.data());
  return p;
}

// k random sources of n elements of T: small integers (no overflow in k steps, so the scalar
// reference is defined), and for floats also fractions, -0, infinities and one NaN pattern (a
// single pattern: which of two NaN payloads a sum keeps is the hardware's choice, not ours).
template <typename T>
std::vector<std::vector<uint8_t>> native_sources(size_t k, size_t n, std::mt19937& rng) {
  std::vector<std::vector<uint8_t>> srcs(k, std::vector<uint8_t>(n * sizeof(T)));
  for (auto& s : srcs) {
    for (size_t i = 0; i < n; ++i) {
      T v;
      if constexpr (std::is_floating_point_v<T>) {
        const uint32_t r = rng() % 64;
        if (r == 0) {
          v = std::numeric_limits<T>::quiet_NaN();
        } else if (r == 1) {
          v = -std::numeric_limits<T>::infinity();
        } else if (r == 2) {
          v = std::numeric_limits<T>::infinity();
        } else if (r == 3) {
          v = static_cast<T>(-0.0);
        } else {
          v = static_cast<T>(static_cast<int>(rng() % 2001) - 1000) / static_cast<T>(7);
        }
      } else if constexpr (std::is_signed_v<T>) {
        v = static_cast<T>(static_cast<int>(rng() % 7) - 3);
      } else {
        v = static_cast<T>(rng() % 4);
      }
      std::memcpy(s.data() + i * sizeof(T), &v, sizeof(T));
    }
  }
  return srcs;
}

// Bit for bit, except that where a sum or product meets two different NaNs (inf - inf and
// 0 * inf make the negative default NaN, the sources hold the positive one) either may come out.
template <typename T>
bool same_values(const std::vector<uint8_t>& a, const std::vector<uint8_t>& b, ReduceOp op) {
  if (a == b) return true;
  if (!std::is_floating_point_v<T> || op == ReduceOp::MIN || op == ReduceOp::MAX || a.size() != b.size())
    return false;
  for (size_t i = 0; i < a.size(); i += sizeof(T)) {
    T x, y;
    std::memcpy(&x, &a[i], sizeof(T));
    std::memcpy(&y, &b[i], sizeof(T));
    if (std::memcmp(&x, &y, sizeof(T)) != 0 && !(std::isnan(x) && std::isnan(y))) return false;
  }
  return true;
}

template <typename T>
void check_native_many(DType t) {
  std::mt19937 rng(7);
  for (ReduceOp op : kOps) {
    for (size_t k = 1; k <= 8; ++k) {
      for (size_t n : kLengths) {
        const auto srcs = native_sources<T>(k, n, rng);
        const auto ptrs = pointers(srcs);
        // Reference 1: the chain the collective ran before, copy + (k-1) reduce_into.
        std::vector<uint8_t> chain = srcs[0];
        for (size_t j = 1; j < k; ++j) reduce_into(chain.data(), srcs[j].data(), n, t, op);
        // Reference 2: a scalar left fold written here.
        std::vector<uint8_t> scalar(n * sizeof(T));
        for (size_t i = 0; i < n; ++i) {
          T acc, x;
          std::memcpy(&acc, srcs[0].data() + i * sizeof(T), sizeof(T));
          for (size_t j = 1; j < k; ++j) {
            std::memcpy(&x, srcs[j].data() + i * sizeof(T), sizeof(T));
            acc = fold_op(acc, x, op);
          }
          std::memcpy(scalar.data() + i * sizeof(T), &acc, sizeof(T));
        }
        std::vector<uint8_t> got(n * sizeof(T), 0xab), portable(n * sizeof(T), 0xcd);
        reduce_many(got.data(), ptrs.data(), k, n, t, op);
        generic::reduce_many(portable.data(), ptrs.data(), k, n, t, op);
        ASSERT_TRUE(same_values<T>(got, chain, op)) << where(t, op, k, n);
        ASSERT_TRUE(same_values<T>(got, scalar, op)) << where(t, op, k, n);
        ASSERT_TRUE(same_values<T>(portable, scalar, op)) << "generic " << where(t, op, k, n);
      }
    }
  }
}

TEST(ReduceMany, NativeTypesEqualTheReduceIntoChainBitForBit) {
  check_native_many<float>(DType::F32);
  check_native_many<double>(DType::F64);
  check_native_many<int32_t>(DType::I32);
  check_native_many<int64_t>(DType::I64);
  check_native_many<uint8_t>(DType::U8);
  check_native_many<int8_t>(DType::I8);
  check_native_many<int16_t>(DType::I16);
}

template <typename T>
void check_wraps(DType t, T sum_term, T prod_factor, T sum_want, T prod_want) {
  for (ReduceOp op : {ReduceOp::SUM, ReduceOp::PROD}) {
    const size_t n = 77, k = 8;
    const T v = op == ReduceOp::SUM ? sum_term : prod_factor;
    std::vector<std::vector<T>> srcs(k, std::vector<T>(n, v));
    std::vector<const void*> ptrs;
    for (const auto& s : srcs) ptrs.push_back(s.data());
    std::vector<T> chain = srcs[0], got(n);
    for (size_t j = 1; j < k; ++j) reduce_into(chain.data(), srcs[j].data(), n, t, op);
    reduce_many(got.data(), ptrs.data(), k, n, t, op);
    EXPECT_EQ(got, chain) << where(t, op, k, n);
    EXPECT_EQ(got, std::vector<T>(n, op == ReduceOp::SUM ? sum_want : prod_want)) << where(t, op, k, n);
  }
}

TEST(ReduceMany, IntegersWrapAsTheChainDoes) {
  // Overflow wraps modulo 2^bits in every path (under UBSan too: no signed overflow is evaluated).
  check_wraps<int8_t>(DType::I8, 100, 3, static_cast<int8_t>(800 - 3 * 256),
                      static_cast<int8_t>(6561 % 256 - 256));
  check_wraps<int16_t>(DType::I16, 20000, 7, static_cast<int16_t>(160000 - 2 * 65536),
                       static_cast<int16_t>(5764801 % 65536 - 65536));
  check_wraps<int32_t>(DType::I32, 0x40000000, 0x10000, 0, 0);
  check_wraps<int64_t>(DType::I64, int64_t{1} << 62, int64_t{1} << 10, 0, 0);
}

TEST(ReduceMany, DestinationMayBeAnySource) {
  std::mt19937 rng(11);
  for (DType t : {DType::F32, DType::F64, DType::I32, DType::I8, DType::F16, DType::BF16}) {
    const size_t n = 1037, k = 5, es = dtype_size(t);
    std::vector<std::vector<uint8_t>> srcs(k, std::vector<uint8_t>(n * es));
    for (auto& s : srcs)
      for (size_t i = 0; i < s.size(); i += es) {
        // Small values of every type's own encoding, nothing that overflows or is a NaN.
        const float f = static_cast<float>(static_cast<int>(rng() % 9) - 4);
        if (t == DType::F32) std::memcpy(&s[i], &f, 4);
        if (t == DType::F64) {
          const double d = f;
          std::memcpy(&s[i], &d, 8);
        }
        if (t == DType::I32) {
          const int32_t v = static_cast<int32_t>(f);
          std::memcpy(&s[i], &v, 4);
        }
        if (t == DType::I8) s[i] = static_cast<uint8_t>(static_cast<int8_t>(f));
        if (t == DType::F16 || t == DType::BF16) {
          const uint16_t h = t == DType::F16 ? half::f32_to_f16(f) : half::f32_to_bf16(f);
          std::memcpy(&s[i], &h, 2);
        }
      }
    for (ReduceOp op : kOps) {
      std::vector<uint8_t> want(n * es);
      const auto ptrs = pointers(srcs);
      reduce_many(want.data(), ptrs.data(), k, n, t, op);
      for (size_t d = 0; d < k; ++d) {
        auto copy = srcs;
        auto p = pointers(copy);
        reduce_many(copy[d].data(), p.data(), k, n, t, op);
        EXPECT_EQ(copy[d], want) << where(t, op, k, n) << " dst=srcs[" << d << "]";
      }
    }
  }
}

TEST(ReduceMany, RejectsNoSources) {
  float x = 1.0f;
  EXPECT_THROW(reduce_many(&x, nullptr, 0, 1, DType::F32, ReduceOp::SUM), Error);
  reduce_many(&x, nullptr, 0, 0, DType::F32, ReduceOp::SUM);  // nothing to do, nothing read
  EXPECT_EQ(x, 1.0f);
}

// --- float16 / bfloat16 ---------------------------------------------------------------------

struct HalfType {
  DType dtype;
  float (*widen)(uint16_t);
  uint16_t (*narrow)(float);
  // |m| below this, m / 256 is exactly representable (11 significant bits for float16, 8 for bfloat16).
  int exact_below;
};

const HalfType kHalves[] = {{DType::F16, half::f16_to_f32, half::f32_to_f16, 2048},
                            {DType::BF16, half::bf16_to_f32, half::f32_to_bf16, 256}};

bool is_nan16(DType t, uint16_t h) {
  return t == DType::F16 ? (h & 0x7fffu) > 0x7c00u : (h & 0x7fffu) > 0x7f80u;
}

// The scalar definition: widen every source, fold in float, round once. Where two or more of the
// k inputs of an element are NaNs, a sum or product may keep either's payload (x86 keeps its
// first operand's, and a compiler may swap the operands of a commutative operation), so there the
// result only has to be a quiet NaN.
void expect_half_fold(const HalfType& h, ReduceOp op, const std::vector<std::vector<uint16_t>>& srcs,
                      const std::vector<uint16_t>& got, const std::string& what) {
  const size_t n = got.size();
  size_t bad = 0;
  for (size_t i = 0; i < n && bad < 5; ++i) {
    float acc = h.widen(srcs[0][i]);
    int nans = is_nan16(h.dtype, srcs[0][i]);
    for (size_t j = 1; j < srcs.size(); ++j) {
      acc = fold_op(acc, h.widen(srcs[j][i]), op);
      nans += is_nan16(h.dtype, srcs[j][i]);
    }
    const uint16_t want = h.narrow(acc);
    const bool either_nan = nans > 1 && (op == ReduceOp::SUM || op == ReduceOp::AVG || op == ReduceOp::PROD);
    const bool ok = either_nan ? is_nan16(h.dtype, got[i]) && is_nan16(h.dtype, want) : got[i] == want;
    if (!ok) {
      ++bad;
      ADD_FAILURE() << what << " i=" << i << " got 0x" << std::hex << got[i] << " want 0x" << want
                    << " inputs 0x" << srcs[0][i] << (srcs.size() > 1 ? " 0x" : "")
                    << (srcs.size() > 1 ? srcs[1][i] : 0);
    }
  }
}

TEST(ReduceHalf, EveryPatternAgainstScalarConversions) {
  // All 65536 patterns (NaNs signalling and quiet, infinities, denormals, -0) against partners
  // that exercise each rounding path; k=1 is the bare widen-narrow round trip.
  std::vector<uint16_t> all(65536);
  for (size_t i = 0; i < all.size(); ++i) all[i] = static_cast<uint16_t>(i);
  for (const HalfType& h : kHalves) {
    const uint16_t partners[] = {0x0000,
                                 0x8000,
                                 h.narrow(1.0f),
                                 h.narrow(-1.5f),
                                 h.narrow(3.0f),
                                 0x0001,
                                 0x8001,
                                 h.narrow(1e-3f),
                                 h.narrow(65504.0f),
                                 static_cast<uint16_t>(h.dtype == DType::F16 ? 0x7c00 : 0x7f80),
                                 static_cast<uint16_t>(h.dtype == DType::F16 ? 0xfc01 : 0xff81)};  // -sNaN
    {
      std::vector<uint16_t> got(all.size());
      const void* one[1] = {all.data()};
      reduce_many(got.data(), one, 1, all.size(), h.dtype, ReduceOp::SUM);
      expect_half_fold(h, ReduceOp::SUM, {all}, got, std::string(dtype_name(h.dtype)) + " round trip");
    }
    for (ReduceOp op : kOps) {
      for (uint16_t p : partners) {
        const std::vector<uint16_t> other(all.size(), p);
        std::vector<uint16_t> into = all;
        reduce_into(into.data(), other.data(), all.size(), h.dtype, op);
        const std::string what =
            std::string(dtype_name(h.dtype)) + " " + std::string(op_name(op)) + " partner ";
        expect_half_fold(h, op, {all, other}, into, what + std::to_string(p) + " reduce_into");
        // The partner first: the accumulator is then the constant, the NaN rules see the other side.
        std::vector<uint16_t> many(all.size());
        const void* two[2] = {other.data(), all.data()};
        reduce_many(many.data(), two, 2, all.size(), h.dtype, op);
        expect_half_fold(h, op, {other, all}, many, what + std::to_string(p) + " reduce_many");
      }
    }
  }
}

TEST(ReduceHalf, RandomPatternsVectorEqualsScalar) {
  // Random bits: every class of value turns up, in every lane, at lengths with ragged ends.
  std::mt19937 rng(3);
  for (const HalfType& h : kHalves) {
    for (ReduceOp op : kOps) {
      for (size_t k = 1; k <= 8; ++k) {
        for (size_t n : kLengths) {
          std::vector<std::vector<uint16_t>> srcs(k, std::vector<uint16_t>(n));
          for (auto& s : srcs)
            for (auto& v : s) v = static_cast<uint16_t>(rng());
          std::vector<const void*> ptrs;
          for (const auto& s : srcs) ptrs.push_back(s.data());
          std::vector<uint16_t> got(n), portable(n);
          reduce_many(got.data(), ptrs.data(), k, n, h.dtype, op);
          generic::reduce_many(portable.data(), ptrs.data(), k, n, h.dtype, op);
          expect_half_fold(h, op, srcs, got, where(h.dtype, op, k, n));
          expect_half_fold(h, op, srcs, portable, "generic " + where(h.dtype, op, k, n));
          if (k == 2) {
            std::vector<uint16_t> into = srcs[0], into_generic = srcs[0];
            reduce_into(into.data(), srcs[1].data(), n, h.dtype, op);
            generic::reduce_into(into_generic.data(), srcs[1].data(), n, h.dtype, op);
            expect_half_fold(h, op, srcs, into, "reduce_into " + where(h.dtype, op, k, n));
            expect_half_fold(h, op, srcs, into_generic, "generic reduce_into " + where(h.dtype, op, k, n));
          }
        }
      }
    }
  }
}

TEST(ReduceHalf, SumRoundsOnceLikeFloat64) {
  // Sources m/256 with |m| small enough to be exact in the half type; a sum of 8 of them is exact
  // in float32 too, so accumulating in float32 and rounding once must equal the float64 sum
  // rounded once. The chain of reduce_into rounds at each hop and must differ somewhere.
  std::mt19937 rng(5);
  for (const HalfType& h : kHalves) {
    for (size_t k = 2; k <= 8; ++k) {
      const size_t n = 4099;
      std::vector<std::vector<uint16_t>> srcs(k, std::vector<uint16_t>(n));
      for (auto& s : srcs)
        for (auto& v : s) {
          const int m = static_cast<int>(rng() % (2 * h.exact_below - 1)) - (h.exact_below - 1);
          v = h.narrow(static_cast<float>(m) / 256.0f);
          ASSERT_EQ(h.widen(v) * 256.0f, static_cast<float>(m));
        }
      std::vector<const void*> ptrs;
      for (const auto& s : srcs) ptrs.push_back(s.data());
      std::vector<uint16_t> got(n), chain = srcs[0];
      reduce_many(got.data(), ptrs.data(), k, n, h.dtype, ReduceOp::SUM);
      for (size_t j = 1; j < k; ++j) reduce_into(chain.data(), srcs[j].data(), n, h.dtype, ReduceOp::SUM);
      size_t differs = 0;
      for (size_t i = 0; i < n; ++i) {
        double sum = 0;
        for (size_t j = 0; j < k; ++j) sum += static_cast<double>(h.widen(srcs[j][i]));
        // Exact in float, so this is the one rounding of the float64 sum.
        const uint16_t want = h.narrow(static_cast<float>(sum));
        ASSERT_EQ(got[i], want) << dtype_name(h.dtype) << " k=" << k << " i=" << i << " sum=" << sum;
        differs += chain[i] != got[i];
      }
      if (k >= 3) {
        EXPECT_GT(differs, 0u) << dtype_name(h.dtype) << " k=" << k << ": the chain never rounded twice";
      }
    }
  }
}

}  // namespace
}  // namespace rumor
