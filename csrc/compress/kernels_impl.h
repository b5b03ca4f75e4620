// Scalar codec kernels, compiled once per instruction set like core/reduce_impl.h: as
// kernels_generic.cpp they are the reference and the fallback on CPUs without AVX2 (or with
// RUMOR_CODEC_ISA=generic); kernels_avx2.cpp has an intrinsics twin of every kernel and shares
// the rare-path helpers below. Both must give the same encoded bytes (see kernels.h).
#pragma once

#include <algorithm>
#include <cmath>

#include "compress/elem.h"
#include "compress/kernels.h"

#ifndef RUMOR_KERNEL_NS
#error "define RUMOR_KERNEL_NS before including kernels_impl.h"
#endif

namespace rumor::compress::RUMOR_KERNEL_NS {

using namespace detail;

namespace {

// Round to nearest even for 0 <= v < 2^22 by pushing the fraction out of the mantissa; the same
// result as the vector convert instruction in its default rounding mode, without a libm call.
inline float round_even(float v) { return (v + 0x1.8p23f) - 0x1.8p23f; }

// A chunk of finite values whose max - min overflows float32 (values of both signs near the
// float32 limit), or is so small (below 255 / FLT_MAX, about 7.5e-37) that 255 / (max - min)
// overflows. Such chunks are quantized and decoded in double, where both are finite, by these
// per-element loops, which both kernel sets share: (a - b) * c leaves a compiler no
// multiply-add to fuse, so the bytes match whatever instruction set compiles them.
inline bool minmax_wide(float lo, float hi) {
  if (!std::isfinite(lo) || !std::isfinite(hi)) return false;
  const float range = hi - lo;
  return std::isinf(range) || (range > 0.f && std::isinf(255.f / range));
}

template <DType D>
void minmax_encode_wide(const void* in, size_t c0, size_t n, float lo, float hi, std::byte* codes) {
  const double dlo = lo, inv = 255.0 / (static_cast<double>(hi) - dlo);
  for (size_t j = 0; j < n; ++j) {
    double v = (static_cast<double>(Elem<D>::load(in, c0 + j)) - dlo) * inv;
    v = v > 0.0 ? v : 0.0;
    v = v < 255.0 ? v : 255.0;
    codes[c0 + j] = static_cast<std::byte>(static_cast<int>(std::nearbyint(v)));
  }
}

template <DType D, bool Acc>
void minmax_decode_wide(const std::byte* codes, size_t c0, size_t n, float lo, float hi, void* out) {
  const double dlo = lo, step = (static_cast<double>(hi) - dlo) / 255.0;
  for (size_t j = 0; j < n; ++j) {
    const double q = static_cast<double>(static_cast<uint8_t>(codes[c0 + j]));
    store<D, Acc>(out, c0 + j, narrow(dlo + q * step));
  }
}

template <DType D>
void minmax_encode_t(const void* in, size_t count, uint32_t chunk, std::byte* scales, std::byte* codes) {
  for (size_t c0 = 0, ci = 0; c0 < count; c0 += chunk, ++ci) {
    const size_t n = std::min<size_t>(chunk, count - c0);
    float lo = Elem<D>::load(in, c0), hi = lo;
    for (size_t j = 1; j < n; ++j) {
      float x = Elem<D>::load(in, c0 + j);
      lo = x < lo ? x : lo;
      hi = hi < x ? x : hi;
    }
    // Which zero wins a min or max of +0 and -0 depends on the order of comparison, which the
    // vector code does not share: adding +0 turns either into +0.
    lo += 0.f;
    hi += 0.f;
    store_f32(scales + 8 * ci, lo);
    store_f32(scales + 8 * ci + 4, hi);
    if (minmax_wide(lo, hi)) {
      minmax_encode_wide<D>(in, c0, n, lo, hi, codes);
      continue;
    }
    const float range = hi - lo;
    // A constant chunk (range 0) encodes every element as 0 and decodes exactly to min; an
    // infinite or NaN range (non-finite input) also gives 0 rather than feeding NaN into the
    // integer conversion.
    const float inv = range > 0.f && range < INFINITY ? 255.f / range : 0.f;
    for (size_t j = 0; j < n; ++j) {
      float v = (Elem<D>::load(in, c0 + j) - lo) * inv;
      v = v > 0.f ? v : 0.f;  // also maps NaN to 0
      v = v < 255.f ? v : 255.f;
      codes[c0 + j] = static_cast<std::byte>(static_cast<int>(round_even(v)));
    }
  }
}

template <DType D, bool Acc>
void minmax_decode_t(const std::byte* scales, const std::byte* codes, size_t count, uint32_t chunk,
                     void* out) {
  for (size_t c0 = 0, ci = 0; c0 < count; c0 += chunk, ++ci) {
    const size_t n = std::min<size_t>(chunk, count - c0);
    const float lo = load_f32(scales + 8 * ci), hi = load_f32(scales + 8 * ci + 4);
    if (minmax_wide(lo, hi)) {
      minmax_decode_wide<D, Acc>(codes, c0, n, lo, hi, out);
      continue;
    }
    const float step = (hi - lo) / 255.f;
    for (size_t j = 0; j < n; ++j)
      store<D, Acc>(out, c0 + j, lo + static_cast<float>(static_cast<uint8_t>(codes[c0 + j])) * step);
  }
}

template <DType D>
void qsgd_encode_t(const void* in, size_t count, uint32_t chunk, uint32_t levels, uint64_t seed,
                   std::byte* scales, std::byte* codes) {
  const QsgdKey key = qsgd_key(seed);
  const float s = static_cast<float>(levels);
  const bool wide = levels > 127;
  for (size_t c0 = 0, ci = 0; c0 < count; c0 += chunk, ++ci) {
    const size_t n = std::min<size_t>(chunk, count - c0);
    float flanes[kSumLanes] = {};
    for (size_t j = 0; j < n; ++j) {
      const float x = Elem<D>::load(in, c0 + j);
      flanes[j % kSumLanes] = std::fma(x, x, flanes[j % kSumLanes]);
    }
    const float fsum = combine_lanes(flanes);
    float norm = std::sqrt(fsum);
    if (!sumsq_f32_ok(fsum)) {
      double lanes[kSumLanes] = {};
      for (size_t j = 0; j < n; ++j) {
        const double x = Elem<D>::load(in, c0 + j);
        lanes[j % kSumLanes] += x * x;  // exact in double for a float x, so fusing cannot change it
      }
      norm = narrow(std::sqrt(combine_lanes(lanes)));
    }
    store_f32(scales + 4 * ci, norm);
    const bool fast = qsgd_multiply(norm);
    const float scale = s / norm;
    for (size_t j = 0; j < n; ++j) {
      const size_t i = c0 + j;
      const float x = Elem<D>::load(in, i);
      const float u = qsgd_uniform(key, i);
      float v = fast ? std::fma(std::fabs(x), scale, u) : std::fma(std::fabs(x) / norm, s, u);
      v = v > 0.f ? v : 0.f;
      v = v < s ? v : s;
      const uint32_t level = static_cast<uint32_t>(v);  // v >= 0: truncation is floor
      const uint32_t neg = x < 0.f ? 1u : 0u;
      if (wide) {
        const uint16_t c = static_cast<uint16_t>(neg << 15 | level);
        std::memcpy(codes + 2 * i, &c, 2);
      } else {
        codes[i] = static_cast<std::byte>(neg << 7 | level);
      }
    }
  }
}

template <DType D, bool Acc>
void qsgd_decode_t(const std::byte* scales, const std::byte* codes, size_t count, uint32_t chunk,
                   uint32_t levels, void* out) {
  const bool wide = levels > 127;
  for (size_t c0 = 0, ci = 0; c0 < count; c0 += chunk, ++ci) {
    const size_t n = std::min<size_t>(chunk, count - c0);
    const float step = load_f32(scales + 4 * ci) / static_cast<float>(levels);
    for (size_t j = 0; j < n; ++j) {
      const size_t i = c0 + j;
      float v;
      if (wide) {
        uint16_t c;
        std::memcpy(&c, codes + 2 * i, 2);
        v = static_cast<float>(c & 0x7fffu) * step;
        v = (c & 0x8000u) ? -v : v;
      } else {
        const auto c = static_cast<uint8_t>(codes[i]);
        v = static_cast<float>(c & 0x7fu) * step;
        v = (c & 0x80u) ? -v : v;
      }
      store<D, Acc>(out, i, v);
    }
  }
}

template <DType D>
void sign_encode_t(const void* in, size_t count, uint32_t chunk, std::byte* scales, std::byte* bits) {
  for (size_t c0 = 0, ci = 0; c0 < count; c0 += chunk, ++ci) {
    const size_t n = std::min<size_t>(chunk, count - c0);
    double lanes[kSumLanes] = {};
    for (size_t j = 0; j < n; ++j)
      lanes[j % kSumLanes] += std::fabs(static_cast<double>(Elem<D>::load(in, c0 + j)));
    store_f32(scales + 4 * ci, narrow(combine_lanes(lanes) / static_cast<double>(n)));
    // chunk is a multiple of 8, so every chunk starts on a byte of its own.
    for (size_t j = 0; j < n; j += 8) {
      unsigned byte = 0;
      for (size_t b = 0; b < 8 && j + b < n; ++b)
        byte |= (Elem<D>::load(in, c0 + j + b) < 0.f ? 1u : 0u) << b;
      bits[(c0 + j) / 8] = static_cast<std::byte>(byte);
    }
  }
}

template <DType D, bool Acc>
void sign_decode_t(const std::byte* scales, const std::byte* bits, size_t count, uint32_t chunk, void* out) {
  for (size_t c0 = 0, ci = 0; c0 < count; c0 += chunk, ++ci) {
    const size_t n = std::min<size_t>(chunk, count - c0);
    const float scale = load_f32(scales + 4 * ci);
    for (size_t j = 0; j < n; ++j) {
      const size_t i = c0 + j;
      const bool neg = (static_cast<unsigned>(bits[i / 8]) >> (i % 8)) & 1u;
      store<D, Acc>(out, i, neg ? -scale : scale);
    }
  }
}

template <bool Bf>
void cast_encode(const void* in, DType dtype, size_t count, std::byte* codes) {
  by_float_dtype(dtype, [&]<DType D>() {
    for (size_t i = 0; i < count; ++i) {
      const float x = Elem<D>::load(in, i);
      const uint16_t c = Bf ? f32_to_bf16(x) : f32_to_f16(x);
      std::memcpy(codes + 2 * i, &c, 2);
    }
  });
}

template <bool Bf>
void cast_decode(const std::byte* codes, size_t count, void* out, DType dtype, bool accumulate) {
  by_float_dtype(dtype, [&]<DType D>() {
    auto run = [&]<bool Acc>() {
      for (size_t i = 0; i < count; ++i) {
        uint16_t c;
        std::memcpy(&c, codes + 2 * i, 2);
        store<D, Acc>(out, i, Bf ? bf16_to_f32(c) : f16_to_f32(c));
      }
    };
    accumulate ? run.template operator()<true>() : run.template operator()<false>();
  });
}

inline void minmax_encode(const void* in, DType dtype, size_t count, uint32_t chunk, std::byte* scales,
                          std::byte* codes) {
  by_float_dtype(dtype, [&]<DType D>() { minmax_encode_t<D>(in, count, chunk, scales, codes); });
}
inline void minmax_decode(const std::byte* scales, const std::byte* codes, size_t count, uint32_t chunk,
                          void* out, DType dtype, bool accumulate) {
  by_float_dtype(dtype, [&]<DType D>() {
    accumulate ? minmax_decode_t<D, true>(scales, codes, count, chunk, out)
               : minmax_decode_t<D, false>(scales, codes, count, chunk, out);
  });
}
inline void qsgd_encode(const void* in, DType dtype, size_t count, uint32_t chunk, uint32_t levels,
                        uint64_t seed, std::byte* scales, std::byte* codes) {
  by_float_dtype(dtype, [&]<DType D>() { qsgd_encode_t<D>(in, count, chunk, levels, seed, scales, codes); });
}
inline void qsgd_decode(const std::byte* scales, const std::byte* codes, size_t count, uint32_t chunk,
                        uint32_t levels, void* out, DType dtype, bool accumulate) {
  by_float_dtype(dtype, [&]<DType D>() {
    accumulate ? qsgd_decode_t<D, true>(scales, codes, count, chunk, levels, out)
               : qsgd_decode_t<D, false>(scales, codes, count, chunk, levels, out);
  });
}
inline void sign_encode(const void* in, DType dtype, size_t count, uint32_t chunk, std::byte* scales,
                        std::byte* bits) {
  by_float_dtype(dtype, [&]<DType D>() { sign_encode_t<D>(in, count, chunk, scales, bits); });
}
inline void sign_decode(const std::byte* scales, const std::byte* bits, size_t count, uint32_t chunk,
                        void* out, DType dtype, bool accumulate) {
  by_float_dtype(dtype, [&]<DType D>() {
    accumulate ? sign_decode_t<D, true>(scales, bits, count, chunk, out)
               : sign_decode_t<D, false>(scales, bits, count, chunk, out);
  });
}

}  // namespace

}  // namespace rumor::compress::RUMOR_KERNEL_NS
