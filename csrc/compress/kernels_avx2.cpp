// AVX2/FMA/F16C codec kernels, built with -mavx2 -mfma -mf16c (see CMakeLists.txt) and only
// called when the CPU has them. Each follows its scalar twin in kernels_impl.h step for step
// (see kernels.h for the rules that make the encoded bytes identical). Work goes 8 elements at
// a time; the ragged end of the last chunk is staged through an 8-element buffer so that no
// load or store reaches past the caller's arrays.
#include <immintrin.h>

#include <algorithm>
#include <cmath>

#define RUMOR_KERNEL_NS avx2
#include "compress/kernels_impl.h"

// For the per-vector helpers and loop bodies: GCC's inliner gives up on some of their calls in
// these large loops, and a call per vector (with its register spills) cost a third of QSGD's
// encode time.
#define RUMOR_INLINE __attribute__((always_inline))

namespace rumor::compress::avx2 {

using namespace detail;

namespace {

template <DType D>
using Raw = typename Elem<D>::Raw;

// A function, not a constant: a namespace-scope vector would be built by AVX code at program
// start, before anyone has checked the CPU.
RUMOR_INLINE inline __m256 abs_mask() { return _mm256_castsi256_ps(_mm256_set1_epi32(0x7fffffff)); }

RUMOR_INLINE inline __m256 bf16x8_to_f32(__m128i h) {
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
}

// The vector form of f32_to_bf16: round to nearest even, NaN kept as a quiet NaN.
RUMOR_INLINE inline __m128i f32x8_to_bf16(__m256 f) {
  const __m256i u = _mm256_castps_si256(f);
  const __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(1));
  const __m256i rounded =
      _mm256_srli_epi32(_mm256_add_epi32(_mm256_add_epi32(u, _mm256_set1_epi32(0x7fff)), lsb), 16);
  const __m256i nan = _mm256_or_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(0x40));
  const __m256i is_nan = _mm256_castps_si256(_mm256_cmp_ps(f, f, _CMP_UNORD_Q));
  const __m256i r = _mm256_blendv_epi8(rounded, nan, is_nan);
  // Values fit 16 bits: pack (within 128-bit lanes) and gather the two halves.
  const __m256i p = _mm256_packus_epi32(r, r);
  return _mm256_castsi256_si128(_mm256_permute4x64_epi64(p, 0x08));
}

template <DType D>
RUMOR_INLINE inline __m256 load8(const void* p, size_t i) {
  const Raw<D>* s = static_cast<const Raw<D>*>(p) + i;
  if constexpr (D == DType::F32) {
    return _mm256_loadu_ps(s);
  } else if constexpr (D == DType::F64) {
    return _mm256_set_m128(_mm256_cvtpd_ps(_mm256_loadu_pd(s + 4)), _mm256_cvtpd_ps(_mm256_loadu_pd(s)));
  } else if constexpr (D == DType::F16) {
    return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(s)));
  } else {
    return bf16x8_to_f32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(s)));
  }
}

// out[i..i+8) = v, or += v with the same precision rules as detail::store.
template <DType D, bool Acc>
RUMOR_INLINE inline void store8(void* p, size_t i, __m256 v) {
  Raw<D>* d = static_cast<Raw<D>*>(p) + i;
  if constexpr (D == DType::F64) {
    __m256d lo = _mm256_cvtps_pd(_mm256_castps256_ps128(v));
    __m256d hi = _mm256_cvtps_pd(_mm256_extractf128_ps(v, 1));
    if constexpr (Acc) {
      lo = _mm256_add_pd(lo, _mm256_loadu_pd(d));
      hi = _mm256_add_pd(hi, _mm256_loadu_pd(d + 4));
    }
    _mm256_storeu_pd(d, lo);
    _mm256_storeu_pd(d + 4, hi);
  } else {
    if constexpr (Acc) v = _mm256_add_ps(load8<D>(p, i), v);
    if constexpr (D == DType::F32) {
      _mm256_storeu_ps(d, v);
    } else if constexpr (D == DType::F16) {
      _mm_storeu_si128(reinterpret_cast<__m128i*>(d), _mm256_cvtps_ph(v, _MM_FROUND_TO_NEAREST_INT));
    } else {
      _mm_storeu_si128(reinterpret_cast<__m128i*>(d), f32x8_to_bf16(v));
    }
  }
}

// The first m (< 8) elements at p + i, the other lanes filled with `pad`.
template <DType D>
inline __m256 load_part(const void* p, size_t i, size_t m, Raw<D> pad) {
  Raw<D> buf[8];
  std::fill(buf, buf + 8, pad);
  std::memcpy(buf, static_cast<const Raw<D>*>(p) + i, m * sizeof(Raw<D>));
  return load8<D>(buf, 0);
}

template <DType D, bool Acc>
inline void store_part(void* p, size_t i, size_t m, __m256 v) {
  Raw<D> buf[8] = {};
  Raw<D>* d = static_cast<Raw<D>*>(p) + i;
  if constexpr (Acc) std::memcpy(buf, d, m * sizeof(Raw<D>));
  store8<D, Acc>(buf, 0, v);
  std::memcpy(d, buf, m * sizeof(Raw<D>));
}

// Elements [c0 + j, c0 + j + 8) of a chunk of n; past the end, lanes repeat the chunk's first
// element (neutral for min and max; other users ignore those lanes or zero them).
template <DType D>
RUMOR_INLINE inline __m256 chunk_load(const void* in, size_t c0, size_t j, size_t n) {
  if (j + 8 <= n) return load8<D>(in, c0 + j);
  return load_part<D>(in, c0 + j, n - j, static_cast<const Raw<D>*>(in)[c0]);
}

template <DType D, bool Acc>
RUMOR_INLINE inline void chunk_store(void* out, size_t c0, size_t j, size_t n, __m256 v) {
  if (j + 8 <= n) return store8<D, Acc>(out, c0 + j, v);
  store_part<D, Acc>(out, c0 + j, n - j, v);
}

// Lanes [m, 8) zeroed; m = 8 keeps all.
RUMOR_INLINE inline __m256 keep_first(__m256 v, size_t m) {
  const __m256i idx = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
  const __m256i keep = _mm256_cmpgt_epi32(_mm256_set1_epi32(static_cast<int>(m)), idx);
  return _mm256_and_ps(v, _mm256_castsi256_ps(keep));
}

RUMOR_INLINE inline void add_lanes(__m256d& a0, __m256d& a1, __m256 v, bool square) {
  const __m256d lo = _mm256_cvtps_pd(_mm256_castps256_ps128(v));
  const __m256d hi = _mm256_cvtps_pd(_mm256_extractf128_ps(v, 1));
  if (square) {
    a0 = _mm256_fmadd_pd(lo, lo, a0);  // the product is exact in double: fma == mul + add
    a1 = _mm256_fmadd_pd(hi, hi, a1);
  } else {
    a0 = _mm256_add_pd(a0, lo);
    a1 = _mm256_add_pd(a1, hi);
  }
}

// Sum over a chunk of x * x (Square) or |x|, in the lanes and order of detail::combine_lanes:
// four accumulator pairs, vector k of the chunk going to pair k % 4. Named locals rather than
// an array keep the accumulators in registers.
template <DType D, bool Square>
double chunk_sum(const void* in, size_t c0, size_t n) {
  __m256d a0 = _mm256_setzero_pd(), a1 = a0, a2 = a0, a3 = a0, a4 = a0, a5 = a0, a6 = a0, a7 = a0;
  auto value = [&](size_t j) RUMOR_INLINE {
    const __m256 x = j + 8 <= n ? load8<D>(in, c0 + j) : keep_first(chunk_load<D>(in, c0, j, n), n - j);
    return Square ? x : _mm256_and_ps(x, abs_mask());
  };
  size_t j = 0;
  for (; j + 32 <= n; j += 32) {
    add_lanes(a0, a1, value(j), Square);
    add_lanes(a2, a3, value(j + 8), Square);
    add_lanes(a4, a5, value(j + 16), Square);
    add_lanes(a6, a7, value(j + 24), Square);
  }
  if (j < n) add_lanes(a0, a1, value(j), Square);
  if (j + 8 < n) add_lanes(a2, a3, value(j + 8), Square);
  if (j + 16 < n) add_lanes(a4, a5, value(j + 16), Square);
  if (j + 24 < n) add_lanes(a6, a7, value(j + 24), Square);
  alignas(32) double l[kSumLanes];
  _mm256_store_pd(l, a0);
  _mm256_store_pd(l + 4, a1);
  _mm256_store_pd(l + 8, a2);
  _mm256_store_pd(l + 12, a3);
  _mm256_store_pd(l + 16, a4);
  _mm256_store_pd(l + 20, a5);
  _mm256_store_pd(l + 24, a6);
  _mm256_store_pd(l + 28, a7);
  return combine_lanes(l);
}

// Sum over a chunk of x * x in float32 with fused multiply-adds, lanes as in chunk_sum.
template <DType D>
float chunk_sumsq_f32(const void* in, size_t c0, size_t n) {
  __m256 s0 = _mm256_setzero_ps(), s1 = s0, s2 = s0, s3 = s0;
  auto value = [&](size_t j) RUMOR_INLINE {
    return j + 8 <= n ? load8<D>(in, c0 + j) : keep_first(chunk_load<D>(in, c0, j, n), n - j);
  };
  size_t j = 0;
  for (; j + 32 <= n; j += 32) {
    const __m256 a = value(j), b = value(j + 8), c = value(j + 16), d = value(j + 24);
    s0 = _mm256_fmadd_ps(a, a, s0);
    s1 = _mm256_fmadd_ps(b, b, s1);
    s2 = _mm256_fmadd_ps(c, c, s2);
    s3 = _mm256_fmadd_ps(d, d, s3);
  }
  if (j < n) {
    const __m256 a = value(j);
    s0 = _mm256_fmadd_ps(a, a, s0);
  }
  if (j + 8 < n) {
    const __m256 b = value(j + 8);
    s1 = _mm256_fmadd_ps(b, b, s1);
  }
  if (j + 16 < n) {
    const __m256 c = value(j + 16);
    s2 = _mm256_fmadd_ps(c, c, s2);
  }
  if (j + 24 < n) {
    const __m256 d = value(j + 24);
    s3 = _mm256_fmadd_ps(d, d, s3);
  }
  alignas(32) float l[kSumLanes];
  _mm256_store_ps(l, s0);
  _mm256_store_ps(l + 8, s1);
  _mm256_store_ps(l + 16, s2);
  _mm256_store_ps(l + 24, s3);
  return combine_lanes(l);
}

// Low byte of each 32-bit lane (values 0..255), in order. Two 128-bit halves rather than a
// cross-lane permute, which is slow on some cores.
RUMOR_INLINE inline uint64_t pack_bytes(__m256i v) {
  const __m256i p = _mm256_packus_epi16(_mm256_packus_epi32(v, v), v);
  const auto lo = static_cast<uint32_t>(_mm_cvtsi128_si32(_mm256_castsi256_si128(p)));
  const auto hi = static_cast<uint32_t>(_mm_cvtsi128_si32(_mm256_extracti128_si256(p, 1)));
  return static_cast<uint64_t>(hi) << 32 | lo;
}

// Low 16 bits of each 32-bit lane (values 0..65535), in order.
RUMOR_INLINE inline __m128i pack_words(__m256i v) {
  return _mm256_castsi256_si128(_mm256_permute4x64_epi64(_mm256_packus_epi32(v, v), 0x08));
}

// dst[j] = low byte of lane j % 8 of f(j - j % 8), for j in [0, n): 32 bytes per store where
// possible, 8 (or the last few) otherwise.
template <typename F>
RUMOR_INLINE inline void emit_bytes(std::byte* dst, size_t n, F&& f) {
  const __m256i order = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7);
  size_t j = 0;
  for (; j + 32 <= n; j += 32) {
    const __m256i ab = _mm256_packus_epi32(f(j), f(j + 8));
    const __m256i cd = _mm256_packus_epi32(f(j + 16), f(j + 24));
    const __m256i p = _mm256_permutevar8x32_epi32(_mm256_packus_epi16(ab, cd), order);
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst + j), p);
  }
  for (; j < n; j += 8) {
    const uint64_t b = pack_bytes(f(j));
    if (j + 8 <= n) {
      std::memcpy(dst + j, &b, 8);
    } else {
      std::memcpy(dst + j, &b, n - j);
    }
  }
}

// As emit_bytes with 16-bit codes (little endian), 2 * n bytes.
template <typename F>
RUMOR_INLINE inline void emit_words(std::byte* dst, size_t n, F&& f) {
  size_t j = 0;
  for (; j + 16 <= n; j += 16) {
    const __m256i p = _mm256_permute4x64_epi64(_mm256_packus_epi32(f(j), f(j + 8)), 0xd8);
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst + 2 * j), p);
  }
  for (; j < n; j += 8) {
    const __m128i w = pack_words(f(j));
    if (j + 8 <= n) {
      _mm_storeu_si128(reinterpret_cast<__m128i*>(dst + 2 * j), w);
    } else {
      alignas(16) uint16_t buf[8];
      _mm_store_si128(reinterpret_cast<__m128i*>(buf), w);
      std::memcpy(dst + 2 * j, buf, 2 * (n - j));
    }
  }
}

// 8 bytes at p (fewer at the ragged end), widened to 32-bit lanes.
RUMOR_INLINE inline __m256i load_bytes(const std::byte* p, size_t m) {
  uint64_t b = 0;
  // A fixed-size copy compiles to one load; a variable one would be a library call.
  if (m == 8) {
    std::memcpy(&b, p, 8);
  } else {
    std::memcpy(&b, p, m);
  }
  return _mm256_cvtepu8_epi32(_mm_cvtsi64_si128(static_cast<long long>(b)));
}

RUMOR_INLINE inline __m256i load_words(const std::byte* p, size_t m) {
  if (m == 8) return _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  alignas(16) uint16_t w[8] = {};
  std::memcpy(w, p, 2 * m);
  return _mm256_cvtepu16_epi32(_mm_load_si128(reinterpret_cast<const __m128i*>(w)));
}

RUMOR_INLINE inline __m256i mix32x8(__m256i x) {
  x = _mm256_xor_si256(x, _mm256_srli_epi32(x, 16));
  x = _mm256_mullo_epi32(x, _mm256_set1_epi32(0x7feb352d));
  x = _mm256_xor_si256(x, _mm256_srli_epi32(x, 15));
  x = _mm256_mullo_epi32(x, _mm256_set1_epi32(static_cast<int>(0x846ca68bu)));
  return _mm256_xor_si256(x, _mm256_srli_epi32(x, 16));
}

// qsgd_uniform for elements index .. index + 7 (index a multiple of 8, so the high word is
// the same for all eight).
RUMOR_INLINE inline __m256 uniform8(QsgdKey k, uint64_t index) {
  const __m256i lo =
      _mm256_add_epi32(_mm256_set1_epi32(static_cast<int>(static_cast<uint32_t>(index) + k.k1)),
                       _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
  const uint32_t hi = static_cast<uint32_t>(index >> 32) * 0x9e3779b9u;
  const __m256i h = mix32x8(_mm256_xor_si256(lo, _mm256_set1_epi32(static_cast<int>(k.k0 ^ hi))));
  return _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_srli_epi32(h, 8)), _mm256_set1_ps(0x1p-24f));
}

template <DType D>
void minmax_encode_v(const void* in, size_t count, uint32_t chunk, std::byte* scales, std::byte* codes) {
  for (size_t c0 = 0, ci = 0; c0 < count; c0 += chunk, ++ci) {
    const size_t n = std::min<size_t>(chunk, count - c0);
    __m256 vlo = chunk_load<D>(in, c0, 0, n), vhi = vlo;
    for (size_t j = 8; j < n; j += 8) {
      const __m256 x = chunk_load<D>(in, c0, j, n);
      vlo = _mm256_min_ps(x, vlo);  // x < lo ? x : lo, as the scalar loop
      vhi = _mm256_max_ps(x, vhi);
    }
    alignas(32) float l[8], h[8];
    _mm256_store_ps(l, vlo);
    _mm256_store_ps(h, vhi);
    float lo = l[0], hi = h[0];
    for (int k = 1; k < 8; ++k) {
      lo = l[k] < lo ? l[k] : lo;
      hi = hi < h[k] ? h[k] : hi;
    }
    lo += 0.f;  // -0 -> +0, as in the scalar code
    hi += 0.f;
    store_f32(scales + 8 * ci, lo);
    store_f32(scales + 8 * ci + 4, hi);
    if (minmax_wide(lo, hi)) {
      minmax_encode_wide<D>(in, c0, n, lo, hi, codes);
      continue;
    }
    const float range = hi - lo;
    const float inv = range > 0.f && range < INFINITY ? 255.f / range : 0.f;
    const __m256 vl = _mm256_set1_ps(lo), vinv = _mm256_set1_ps(inv);
    const __m256 zero = _mm256_setzero_ps(), top = _mm256_set1_ps(255.f);
    emit_bytes(codes + c0, n, [&](size_t j) RUMOR_INLINE {
      __m256 v = _mm256_mul_ps(_mm256_sub_ps(chunk_load<D>(in, c0, j, n), vl), vinv);
      v = _mm256_max_ps(v, zero);  // NaN -> 0
      v = _mm256_min_ps(v, top);
      return _mm256_cvtps_epi32(v);
    });
  }
}

template <DType D, bool Acc>
void minmax_decode_v(const std::byte* scales, const std::byte* codes, size_t count, uint32_t chunk,
                     void* out) {
  for (size_t c0 = 0, ci = 0; c0 < count; c0 += chunk, ++ci) {
    const size_t n = std::min<size_t>(chunk, count - c0);
    const float lo = load_f32(scales + 8 * ci), hi = load_f32(scales + 8 * ci + 4);
    if (minmax_wide(lo, hi)) {
      minmax_decode_wide<D, Acc>(codes, c0, n, lo, hi, out);
      continue;
    }
    const float step = (hi - lo) / 255.f;
    const __m256 vl = _mm256_set1_ps(lo), vs = _mm256_set1_ps(step);
    for (size_t j = 0; j < n; j += 8) {
      const __m256 q = _mm256_cvtepi32_ps(load_bytes(codes + c0 + j, std::min<size_t>(8, n - j)));
      chunk_store<D, Acc>(out, c0, j, n, _mm256_fmadd_ps(q, vs, vl));
    }
  }
}

template <DType D>
void qsgd_encode_v(const void* in, size_t count, uint32_t chunk, uint32_t levels, uint64_t seed,
                   std::byte* scales, std::byte* codes) {
  const QsgdKey key = qsgd_key(seed);
  const float s = static_cast<float>(levels);
  const bool wide = levels > 127;
  const __m256i sign_bit = _mm256_set1_epi32(wide ? 0x8000 : 0x80);
  const __m256 zero = _mm256_setzero_ps(), vs = _mm256_set1_ps(s);
  for (size_t c0 = 0, ci = 0; c0 < count; c0 += chunk, ++ci) {
    const size_t n = std::min<size_t>(chunk, count - c0);
    const float fsum = chunk_sumsq_f32<D>(in, c0, n);
    const float norm =
        sumsq_f32_ok(fsum) ? std::sqrt(fsum) : narrow(std::sqrt(chunk_sum<D, true>(in, c0, n)));
    store_f32(scales + 4 * ci, norm);
    const __m256 vscale = _mm256_set1_ps(s / norm), vnorm = _mm256_set1_ps(norm);
    // One loop per formula rather than a per-vector select, so the common one has no division.
    auto run = [&]<bool Fast>() {
      auto code = [&](size_t j) RUMOR_INLINE {
        const __m256 x = chunk_load<D>(in, c0, j, n);
        const __m256 ax = _mm256_and_ps(x, abs_mask());
        const __m256 u = uniform8(key, c0 + j);
        __m256 v = Fast ? _mm256_fmadd_ps(ax, vscale, u) : _mm256_fmadd_ps(_mm256_div_ps(ax, vnorm), vs, u);
        v = _mm256_min_ps(_mm256_max_ps(v, zero), vs);
        const __m256i neg = _mm256_castps_si256(_mm256_cmp_ps(x, zero, _CMP_LT_OQ));
        return _mm256_or_si256(_mm256_cvttps_epi32(v), _mm256_and_si256(neg, sign_bit));
      };
      if (wide) {
        emit_words(codes + 2 * c0, n, code);
      } else {
        emit_bytes(codes + c0, n, code);
      }
    };
    if (qsgd_multiply(norm)) {
      run.template operator()<true>();
    } else {
      run.template operator()<false>();
    }
  }
}

template <DType D, bool Acc>
void qsgd_decode_v(const std::byte* scales, const std::byte* codes, size_t count, uint32_t chunk,
                   uint32_t levels, void* out) {
  const bool wide = levels > 127;
  const __m256i lmask = _mm256_set1_epi32(wide ? 0x7fff : 0x7f);
  const int sign_shift = wide ? 16 : 24;  // moves the code's sign bit to the float's
  for (size_t c0 = 0, ci = 0; c0 < count; c0 += chunk, ++ci) {
    const size_t n = std::min<size_t>(chunk, count - c0);
    const __m256 step = _mm256_set1_ps(load_f32(scales + 4 * ci) / static_cast<float>(levels));
    for (size_t j = 0; j < n; j += 8) {
      const size_t m = std::min<size_t>(8, n - j);
      const __m256i c = wide ? load_words(codes + 2 * (c0 + j), m) : load_bytes(codes + c0 + j, m);
      const __m256 mag = _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_and_si256(c, lmask)), step);
      const __m256i sign = _mm256_sll_epi32(_mm256_andnot_si256(lmask, c), _mm_cvtsi32_si128(sign_shift));
      chunk_store<D, Acc>(out, c0, j, n, _mm256_xor_ps(mag, _mm256_castsi256_ps(sign)));
    }
  }
}

template <DType D>
void sign_encode_v(const void* in, size_t count, uint32_t chunk, std::byte* scales, std::byte* bits) {
  const __m256 zero = _mm256_setzero_ps();
  for (size_t c0 = 0, ci = 0; c0 < count; c0 += chunk, ++ci) {
    const size_t n = std::min<size_t>(chunk, count - c0);
    for (size_t j = 0; j < n; j += 8) {
      const __m256 x = chunk_load<D>(in, c0, j, n);
      const unsigned mask = static_cast<unsigned>(_mm256_movemask_ps(_mm256_cmp_ps(x, zero, _CMP_LT_OQ)));
      bits[(c0 + j) / 8] = static_cast<std::byte>(mask & ((1u << std::min<size_t>(8, n - j)) - 1u));
    }
    store_f32(scales + 4 * ci, narrow(chunk_sum<D, false>(in, c0, n) / static_cast<double>(n)));
  }
}

template <DType D, bool Acc>
void sign_decode_v(const std::byte* scales, const std::byte* bits, size_t count, uint32_t chunk, void* out) {
  const __m256i bit = _mm256_setr_epi32(1, 2, 4, 8, 16, 32, 64, 128);
  const __m256i sign = _mm256_set1_epi32(static_cast<int>(0x80000000u));
  for (size_t c0 = 0, ci = 0; c0 < count; c0 += chunk, ++ci) {
    const size_t n = std::min<size_t>(chunk, count - c0);
    const __m256 scale = _mm256_set1_ps(load_f32(scales + 4 * ci));
    for (size_t j = 0; j < n; j += 8) {
      const __m256i b = _mm256_set1_epi32(static_cast<int>(bits[(c0 + j) / 8]));
      const __m256i set = _mm256_cmpeq_epi32(_mm256_and_si256(b, bit), bit);
      const __m256 v = _mm256_xor_ps(scale, _mm256_castsi256_ps(_mm256_and_si256(set, sign)));
      chunk_store<D, Acc>(out, c0, j, n, v);
    }
  }
}

template <bool Bf>
void cast_encode_v(const void* in, DType dtype, size_t count, std::byte* codes) {
  by_float_dtype(dtype, [&]<DType D>() {
    for (size_t i = 0; i < count; i += 8) {
      const size_t m = std::min<size_t>(8, count - i);
      const __m256 x = m == 8 ? load8<D>(in, i) : load_part<D>(in, i, m, Raw<D>{});
      const __m128i h = Bf ? f32x8_to_bf16(x) : _mm256_cvtps_ph(x, _MM_FROUND_TO_NEAREST_INT);
      if (m == 8) {
        _mm_storeu_si128(reinterpret_cast<__m128i*>(codes + 2 * i), h);
      } else {
        alignas(16) uint16_t buf[8];
        _mm_store_si128(reinterpret_cast<__m128i*>(buf), h);
        std::memcpy(codes + 2 * i, buf, 2 * m);
      }
    }
  });
}

template <bool Bf>
void cast_decode_v(const std::byte* codes, size_t count, void* out, DType dtype, bool accumulate) {
  by_float_dtype(dtype, [&]<DType D>() {
    auto run = [&]<bool Acc>() {
      for (size_t i = 0; i < count; i += 8) {
        const size_t m = std::min<size_t>(8, count - i);
        const __m256i w = load_words(codes + 2 * i, m);
        const __m256 v = Bf ? _mm256_castsi256_ps(_mm256_slli_epi32(w, 16)) : _mm256_cvtph_ps(pack_words(w));
        chunk_store<D, Acc>(out, i, 0, m, v);
      }
    };
    accumulate ? run.template operator()<true>() : run.template operator()<false>();
  });
}

void minmax_encode_a(const void* in, DType dtype, size_t count, uint32_t chunk, std::byte* scales,
                     std::byte* codes) {
  by_float_dtype(dtype, [&]<DType D>() { minmax_encode_v<D>(in, count, chunk, scales, codes); });
}
void minmax_decode_a(const std::byte* scales, const std::byte* codes, size_t count, uint32_t chunk, void* out,
                     DType dtype, bool accumulate) {
  by_float_dtype(dtype, [&]<DType D>() {
    accumulate ? minmax_decode_v<D, true>(scales, codes, count, chunk, out)
               : minmax_decode_v<D, false>(scales, codes, count, chunk, out);
  });
}
void qsgd_encode_a(const void* in, DType dtype, size_t count, uint32_t chunk, uint32_t levels, uint64_t seed,
                   std::byte* scales, std::byte* codes) {
  by_float_dtype(dtype, [&]<DType D>() { qsgd_encode_v<D>(in, count, chunk, levels, seed, scales, codes); });
}
void qsgd_decode_a(const std::byte* scales, const std::byte* codes, size_t count, uint32_t chunk,
                   uint32_t levels, void* out, DType dtype, bool accumulate) {
  by_float_dtype(dtype, [&]<DType D>() {
    accumulate ? qsgd_decode_v<D, true>(scales, codes, count, chunk, levels, out)
               : qsgd_decode_v<D, false>(scales, codes, count, chunk, levels, out);
  });
}
void sign_encode_a(const void* in, DType dtype, size_t count, uint32_t chunk, std::byte* scales,
                   std::byte* bits) {
  by_float_dtype(dtype, [&]<DType D>() { sign_encode_v<D>(in, count, chunk, scales, bits); });
}
void sign_decode_a(const std::byte* scales, const std::byte* bits, size_t count, uint32_t chunk, void* out,
                   DType dtype, bool accumulate) {
  by_float_dtype(dtype, [&]<DType D>() {
    accumulate ? sign_decode_v<D, true>(scales, bits, count, chunk, out)
               : sign_decode_v<D, false>(scales, bits, count, chunk, out);
  });
}

}  // namespace

extern const KernelSet kKernels;
const KernelSet kKernels = {
    "avx2",
    minmax_encode_a,
    minmax_decode_a,
    qsgd_encode_a,
    qsgd_decode_a,
    sign_encode_a,
    sign_decode_a,
    cast_encode_v<false>,
    cast_decode_v<false>,
    cast_encode_v<true>,
    cast_decode_v<true>,
};

}  // namespace rumor::compress::avx2
