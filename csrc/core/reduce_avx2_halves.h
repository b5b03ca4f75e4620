// Vector folds for float16 and bfloat16, included by reduce_impl.h into the AVX2 kernel set only
// (reduce_avx2.cpp, built with -mavx2 -mfma -mf16c). They replace the generic Fold for the half
// types, whose scalar conversions the compiler does not vectorize, and must give the same bits as
// that Fold: the same conversions (core/half.h), the same float operations in the same order.
#pragma once

#include <immintrin.h>

#include <type_traits>

namespace rumor::RUMOR_KERNEL_NS {
namespace {

// Forced inline: a call per vector, with its spills, would cost more than the work it does.
#define RUMOR_REDUCE_INLINE inline __attribute__((always_inline))

// The vector form of Op<float>::apply(acc, x). MINPS/MAXPS return their second operand when the
// comparison is false or unordered, which is the scalar `b < a ? b : a` with the operands swapped.
template <template <typename> class Op>
RUMOR_REDUCE_INLINE __m256 apply8(__m256 acc, __m256 x) {
  if constexpr (std::is_same_v<Op<float>, Sum<float>>) {
    return _mm256_add_ps(acc, x);
  } else if constexpr (std::is_same_v<Op<float>, Prod<float>>) {
    return _mm256_mul_ps(acc, x);
  } else if constexpr (std::is_same_v<Op<float>, Min<float>>) {
    return _mm256_min_ps(x, acc);
  } else {
    static_assert(std::is_same_v<Op<float>, Max<float>>);
    return _mm256_max_ps(x, acc);
  }
}

// Widens p[0..16) into lo and hi. float16: lo holds elements 0-7, hi 8-15. bfloat16 is the top
// half of a float, so interleaving with zeros widens it (cheaper than zero-extend and shift); the
// interleave works per 128-bit lane, leaving lo = elements 0-3 and 8-11, hi = 4-7 and 12-15, the
// order narrow16's pack restores. Everything between is lane by lane, so the order is free.
template <class E>
RUMOR_REDUCE_INLINE void widen16(const uint16_t* p, __m256& lo, __m256& hi) {
  if constexpr (std::is_same_v<E, F16>) {
    lo = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
    hi = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p + 8)));
  } else {
    const __m256i x = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
    lo = _mm256_castsi256_ps(_mm256_unpacklo_epi16(_mm256_setzero_si256(), x));
    hi = _mm256_castsi256_ps(_mm256_unpackhi_epi16(_mm256_setzero_si256(), x));
  }
}

// f32_to_bf16 on 8 lanes, each result in the low 16 bits of its 32-bit lane.
RUMOR_REDUCE_INLINE __m256i bf16_bits8(__m256 f) {
  const __m256i u = _mm256_castps_si256(f);
  const __m256i odd = _mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(1));
  const __m256i even =
      _mm256_srli_epi32(_mm256_add_epi32(u, _mm256_add_epi32(_mm256_set1_epi32(0x7fff), odd)), 16);
  const __m256i quiet = _mm256_or_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(0x40));
  const __m256i magnitude = _mm256_and_si256(u, _mm256_set1_epi32(0x7fffffff));
  const __m256i nan = _mm256_cmpgt_epi32(magnitude, _mm256_set1_epi32(0x7f800000));
  return _mm256_blendv_epi8(even, quiet, nan);
}

// Rounds the 16 floats of widen16's lo and hi (in its order) to p[0..16).
template <class E>
RUMOR_REDUCE_INLINE void narrow16(uint16_t* p, __m256 lo, __m256 hi) {
  if constexpr (std::is_same_v<E, F16>) {
    const __m256i both = _mm256_set_m128i(_mm256_cvtps_ph(hi, _MM_FROUND_TO_NEAREST_INT),
                                          _mm256_cvtps_ph(lo, _MM_FROUND_TO_NEAREST_INT));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), both);
  } else {
    // packus takes 4 values from lo, then 4 from hi, in each 128-bit lane: elements 0-3, 4-7 |
    // 8-11, 12-15. No value exceeds 0xffff, so nothing saturates.
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), _mm256_packus_epi32(bf16_bits8(lo), bf16_bits8(hi)));
  }
}

template <class E, template <typename> class Op>
struct HalfFold {
  static constexpr size_t kBlock = 32;

  static void run(void* dst, const void* const* srcs, size_t k, size_t n) {
    uint16_t* d = static_cast<uint16_t*>(dst);
    size_t i = 0;
    for (; i + kBlock <= n; i += kBlock) {
      const uint16_t* s = static_cast<const uint16_t*>(srcs[0]) + i;
      __m256 a0, a1, a2, a3;
      widen16<E>(s, a0, a1);
      widen16<E>(s + 16, a2, a3);
      for (size_t j = 1; j < k; ++j) {
        s = static_cast<const uint16_t*>(srcs[j]) + i;
        __m256 x0, x1, x2, x3;
        widen16<E>(s, x0, x1);
        widen16<E>(s + 16, x2, x3);
        a0 = apply8<Op>(a0, x0);
        a1 = apply8<Op>(a1, x1);
        a2 = apply8<Op>(a2, x2);
        a3 = apply8<Op>(a3, x3);
      }
      narrow16<E>(d + i, a0, a1);
      narrow16<E>(d + i + 16, a2, a3);
    }
    // The ragged end (under 32 elements) through the scalar fold, which rounds alike.
    if (i < n) fold_block<E, Op>(dst, srcs, k, i, n - i);
  }
};

template <template <typename> class Op>
struct Fold<F16, Op> : HalfFold<F16, Op> {};
template <template <typename> class Op>
struct Fold<BF16, Op> : HalfFold<BF16, Op> {};

#undef RUMOR_REDUCE_INLINE

}  // namespace
}  // namespace rumor::RUMOR_KERNEL_NS
