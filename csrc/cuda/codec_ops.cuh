// The per-lane work of the CUDA codec kernels, written once for the device and the host.
//
// The CUDA codecs must produce the CPU codecs' bytes exactly (csrc/compress/kernels_impl.h is the
// reference), so that GPU and CPU ranks interoperate. Everything here is plain C++ that nvcc
// compiles for the device and any C++ compiler compiles for the host: codec_kernels.cu runs it one
// warp per chunk, and tests/cpp/test_cuda_codecs.cpp runs the same functions lane by lane on the
// CPU (emulating the warp's shuffles) and compares the bytes with the CPU codecs, so the
// arithmetic is checked even where no GPU is present.
//
// A warp handles one chunk. Lane l takes elements l, l + 32, l + 64, ... of it, which is exactly
// the CPU's lane assignment for chunk sums (element j in lane j % 32, each lane summed in element
// order); the 32 lane sums are then combined by an xor butterfly with offsets 1, 2, 4, 8, 16,
// which adds adjacent lanes first and so is the CPU's detail::combine_lanes tree, and leaves the
// result in every lane. Floating-point steps use the explicitly rounded forms below (never a
// contracted multiply-add, IEEE division and square root), and a fused multiply-add exactly
// where the CPU code has one.
#pragma once

#include <math.h>

#include <cstddef>
#include <cstdint>
#include <cstring>
#include <type_traits>

#include "compress/kernels.h"
#include "core/hd.h"
#include "core/types.h"

namespace rumor::cuda::detail {

constexpr unsigned kWarp = 32;

// --- Rounding made explicit. nvcc contracts a * b + c into one fma by default and the CPU build
// does not; the _rn intrinsics are never contracted. (codec_kernels.cu is also compiled with
// -fmad=false -prec-div=true -prec-sqrt=true, but correctness does not depend on those flags.)
#ifdef __CUDA_ARCH__
#define RUMOR_ROUNDED(name, T, op, intrinsic) \
  RUMOR_HD T name(T a, T b) { return intrinsic(a, b); }
#define RUMOR_ROUNDED_SQRT(name, T, host, intrinsic) \
  RUMOR_HD T name(T a) { return intrinsic(a); }
#else
#define RUMOR_ROUNDED(name, T, op, intrinsic) \
  RUMOR_HD T name(T a, T b) { return a op b; }
#define RUMOR_ROUNDED_SQRT(name, T, host, intrinsic) \
  RUMOR_HD T name(T a) { return host(a); }
#endif
RUMOR_ROUNDED(fadd, float, +, __fadd_rn)
RUMOR_ROUNDED(fsub, float, -, __fsub_rn)
RUMOR_ROUNDED(fmul, float, *, __fmul_rn)
RUMOR_ROUNDED(fdiv, float, /, __fdiv_rn)
RUMOR_ROUNDED(dadd, double, +, __dadd_rn)
RUMOR_ROUNDED(dsub, double, -, __dsub_rn)
RUMOR_ROUNDED(dmul, double, *, __dmul_rn)
RUMOR_ROUNDED(ddiv, double, /, __ddiv_rn)
RUMOR_ROUNDED_SQRT(fsqrt, float, sqrtf, __fsqrt_rn)
RUMOR_ROUNDED_SQRT(dsqrt, double, sqrt, __dsqrt_rn)
#undef RUMOR_ROUNDED
#undef RUMOR_ROUNDED_SQRT

// A 4-byte memcpy is a register move on either side.
RUMOR_HD uint32_t f32_bits(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  return u;
}
RUMOR_HD float bits_f32(uint32_t u) {
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

// --- Conversions, as the CPU does them (core/half.h, compress/elem.h). Written on the bits
// rather than with cuda_fp16's intrinsics so that NaNs follow core/half.h's rule (quiet bit set,
// sign and top payload bits kept, as F16C does; the GPU would return one canonical NaN), and so
// that the host test can check them against the CPU exhaustively.

// double -> float, overflowing to infinity past FLT_MAX + half an ulp (compress::detail::narrow).
RUMOR_HD float narrow(double v) {
  if (v >= 0x1.ffffffp127) return bits_f32(0x7f800000u);
  if (v <= -0x1.ffffffp127) return bits_f32(0xff800000u);
  return static_cast<float>(v);
}

RUMOR_HD float bf16_to_f32(uint16_t h) { return bits_f32(static_cast<uint32_t>(h) << 16); }

// Round to nearest even; a NaN stays a quiet NaN of the same sign (half::f32_to_bf16).
RUMOR_HD uint16_t f32_to_bf16(float f) {
  const uint32_t u = f32_bits(f);
  if ((u & 0x7fffffffu) > 0x7f800000u) return static_cast<uint16_t>((u >> 16) | 0x40u);
  return static_cast<uint16_t>((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
}

RUMOR_HD float f16_to_f32(uint16_t h) {
  const uint32_t sign = static_cast<uint32_t>(h & 0x8000u) << 16;
  const uint32_t exp = (h >> 10) & 0x1fu, man = h & 0x3ffu;
  if (exp == 0x1f) return bits_f32(sign | 0x7f800000u | (man << 13) | (man != 0 ? 0x400000u : 0u));
  if (exp != 0) return bits_f32(sign | ((exp + 112) << 23) | (man << 13));
  // Zero or subnormal: man * 2^-24, exact in float.
  return bits_f32(sign | f32_bits(fmul(static_cast<float>(man), 0x1p-24f)));
}

// IEEE half, round to nearest even, overflow to infinity.
RUMOR_HD uint16_t f32_to_f16(float f) {
  const uint32_t u = f32_bits(f);
  const uint32_t sign = (u >> 16) & 0x8000u, a = u & 0x7fffffffu;
  if (a > 0x7f800000u) return static_cast<uint16_t>(sign | 0x7e00u | ((a >> 13) & 0x3ffu));  // NaN
  if (a >= 0x477ff000u) return static_cast<uint16_t>(sign | 0x7c00u);  // >= 65520 rounds to inf
  if (a >= 0x38800000u) {
    // A normal half: rebias the exponent (127 -> 15) and round away 13 mantissa bits; a carry
    // into the exponent is the correct rounding up to the next binade.
    const uint32_t m = a - 0x38000000u;
    return static_cast<uint16_t>(sign | ((m + 0xfffu + ((m >> 13) & 1u)) >> 13));
  }
  if (a <= 0x33000000u) return static_cast<uint16_t>(sign);  // <= 2^-25: ties to even 0
  // A subnormal half: the 24-bit significand shifted to units of 2^-24, rounded to even.
  const uint32_t e = a >> 23, sig = (a & 0x7fffffu) | 0x800000u;
  const uint32_t shift = 126 - e;  // 14 (just below 2^-14) .. 24 (just above 2^-25)
  uint32_t q = sig >> shift;
  const uint32_t rem = sig & ((1u << shift) - 1u), half = 1u << (shift - 1);
  if (rem > half || (rem == half && (q & 1u) != 0)) ++q;
  return static_cast<uint16_t>(sign | q);
}

// --- Elements of each dtype, read as float and written back from float (compress/elem.h).
template <DType D>
struct Elem;
template <>
struct Elem<DType::F32> {
  RUMOR_HD static float load(const void* p, size_t i) { return static_cast<const float*>(p)[i]; }
  RUMOR_HD static void put(void* p, size_t i, float v) { static_cast<float*>(p)[i] = v; }
};
template <>
struct Elem<DType::F64> {
  RUMOR_HD static float load(const void* p, size_t i) { return narrow(static_cast<const double*>(p)[i]); }
  RUMOR_HD static void put(void* p, size_t i, float v) {
    static_cast<double*>(p)[i] = static_cast<double>(v);
  }
};
template <>
struct Elem<DType::F16> {
  RUMOR_HD static float load(const void* p, size_t i) {
    return f16_to_f32(static_cast<const uint16_t*>(p)[i]);
  }
  RUMOR_HD static void put(void* p, size_t i, float v) { static_cast<uint16_t*>(p)[i] = f32_to_f16(v); }
};
template <>
struct Elem<DType::BF16> {
  RUMOR_HD static float load(const void* p, size_t i) {
    return bf16_to_f32(static_cast<const uint16_t*>(p)[i]);
  }
  RUMOR_HD static void put(void* p, size_t i, float v) { static_cast<uint16_t*>(p)[i] = f32_to_bf16(v); }
};

// out[i] = v, or out[i] += v: in double for float64 output, in float (rounded once for the half
// types) otherwise, as compress::detail::store. Split in two so that a loop can read the values
// it adds to ahead of its writes: Old<D> is what an accumulating store adds to, old_value reads
// it, store_onto writes v (onto old when accumulating).
template <DType D>
using Old = std::conditional_t<D == DType::F64, double, float>;
template <DType D>
RUMOR_HD Old<D> old_value(const void* out, size_t i) {
  if constexpr (D == DType::F64) {
    return static_cast<const double*>(out)[i];
  } else {
    return Elem<D>::load(out, i);
  }
}
template <DType D, bool Acc>
RUMOR_HD void store_onto(void* out, size_t i, Old<D> old, float v) {
  if constexpr (!Acc) {
    Elem<D>::put(out, i, v);
  } else if constexpr (D == DType::F64) {
    static_cast<double*>(out)[i] = dadd(old, static_cast<double>(v));
  } else {
    Elem<D>::put(out, i, fadd(old, v));
  }
}
template <DType D, bool Acc>
RUMOR_HD void store(void* out, size_t i, float v) {
  store_onto<D, Acc>(out, i, Acc ? old_value<D>(out, i) : Old<D>{0}, v);
}

// --- The encoded buffer. Encodings are byte strings that callers pack back to back at any
// offset (the compressed collectives do), so their floats and 16-bit codes are accessed a byte
// at a time: no alignment is assumed.
RUMOR_HD void put_u8(std::byte* p, uint32_t v) { *p = static_cast<std::byte>(v); }
RUMOR_HD void put_u16(std::byte* p, uint32_t v) {
  p[0] = static_cast<std::byte>(v);
  p[1] = static_cast<std::byte>(v >> 8);
}
RUMOR_HD uint32_t get_u16(const std::byte* p) {
  return static_cast<uint32_t>(p[0]) | static_cast<uint32_t>(p[1]) << 8;
}
RUMOR_HD void put_f32(std::byte* p, float f) {
  const uint32_t u = f32_bits(f);
  put_u16(p, u & 0xffffu);
  put_u16(p + 2, u >> 16);
}
RUMOR_HD float get_f32(const std::byte* p) { return bits_f32(get_u16(p) | get_u16(p + 2) << 16); }

// The 32-byte header, built on the host (by the CPU codec, so it cannot drift from the CPU's)
// and written by the first 32 threads of an encode kernel.
struct Header {
  unsigned char bytes[32];
};

// One chunk: its index, first element and length.
struct Chunk {
  size_t index, begin, size;
};

// --- Decoding is element by element. Lane l still takes elements l, l + 32, ... of its chunk,
// but it reads kDecodeBatch codes (and, accumulating, the outputs they add to) before it writes
// any: the codes are bytes, which the compiler must assume may alias the output, so a plain
// loop issues one read, waits for it, writes, and only then reads again. One read in flight per
// lane left the decodes bound by memory latency (0.70 of a device copy on an H200 while they
// move fewer bytes). code(i) reads element i's code, value(code) is its float value; the
// output gets it as store<D, Acc> gives it.
constexpr unsigned kDecodeBatch = 8;
#ifdef __CUDA_ARCH__
#define RUMOR_UNROLL _Pragma("unroll")
#else
#define RUMOR_UNROLL  // host passes (the tests' emulation) need no hint, and g++ warns on nvcc's
#endif
template <DType D, bool Acc, class Code, class Value>
RUMOR_HD void decode_batched(void* out, size_t first, size_t end, size_t stride, Code&& code, Value&& value) {
  for (size_t i0 = first; i0 < end; i0 += stride * kDecodeBatch) {
    uint32_t q[kDecodeBatch];
    Old<D> old[kDecodeBatch];
    RUMOR_UNROLL
    for (unsigned k = 0; k < kDecodeBatch; ++k) {
      const size_t i = i0 + k * stride;
      q[k] = i < end ? code(i) : 0u;
      old[k] = Acc && i < end ? old_value<D>(out, i) : Old<D>{0};
    }
    RUMOR_UNROLL
    for (unsigned k = 0; k < kDecodeBatch; ++k) {
      const size_t i = i0 + k * stride;
      if (i < end) store_onto<D, Acc>(out, i, old[k], value(q[k]));
    }
  }
}

// --- A chunk into float32 by groups of four consecutive elements per lane: one 4-byte (or two)
// read of codes, a 16-byte read of the outputs it adds to, a 16-byte store. With a lane per
// element a warp reads 32 (or 64) bytes of codes per instruction and the accumulating decodes
// stayed at 0.51-0.73 of a device copy on an H200, as the casts' did before they went by groups.
RUMOR_HD void load4(const float* p, float (&o)[4]) {
#ifdef __CUDA_ARCH__
  const float4 a = *reinterpret_cast<const float4*>(p);
  o[0] = a.x, o[1] = a.y, o[2] = a.z, o[3] = a.w;
#else
  std::memcpy(o, p, sizeof(o));
#endif
}
RUMOR_HD void store4(float* p, const float (&v)[4]) {
#ifdef __CUDA_ARCH__
  *reinterpret_cast<float4*>(p) = make_float4(v[0], v[1], v[2], v[3]);
#else
  std::memcpy(p, v, sizeof(v));
#endif
}
// Four little-endian code bytes (the order get_u16 reads), from a 4-byte aligned address.
RUMOR_HD uint32_t load_u32(const std::byte* p) {
#ifdef __CUDA_ARCH__
  return *reinterpret_cast<const uint32_t*>(p);
#else
  uint32_t w;
  std::memcpy(&w, p, sizeof(w));
  return w;
#endif
}

// Four one-byte codes of elements i .. i + 3.
struct Bytes4 {
  const std::byte* codes;
  RUMOR_HD void operator()(size_t i, uint32_t (&q)[4]) const {
    const uint32_t w = load_u32(codes + i);
    for (unsigned k = 0; k < 4; ++k) q[k] = (w >> (8 * k)) & 0xffu;
  }
};

// Whether chunk c goes by groups of four: a float32 output 16-byte aligned at the chunk's first
// element, which is itself a multiple of four (Sign's bits are numbered from the buffer's
// start), and its codes 4-byte aligned. Decided per chunk, so a whole warp takes one path.
template <DType D>
RUMOR_HD bool chunk_by4(const void* out, size_t begin, const std::byte* codes_at_begin) {
  return D == DType::F32 && begin % 4 == 0 &&
         reinterpret_cast<uintptr_t>(static_cast<const float*>(out) + begin) % 16 == 0 &&
         reinterpret_cast<uintptr_t>(codes_at_begin) % 4 == 0;
}

// Lane `lane`'s part of chunk c: codes4(i, q) reads the codes of elements i .. i + 3 (i a
// multiple of four) into q, code(i) one element's, value(code) its float value. Each element
// as decode_batched gives it (for float32, store<F32, Acc> is a store or one fadd).
template <DType D, bool Acc, class Code, class Codes4, class Value>
RUMOR_HD void decode_chunk(void* out, Chunk c, unsigned lane, [[maybe_unused]] bool by4, Code&& code,
                           [[maybe_unused]] Codes4&& codes4, Value&& value) {
  size_t first = c.begin + lane;
  if constexpr (D == DType::F32) {
    if (by4) {
      constexpr unsigned kGroups = kDecodeBatch / 2;  // 16 elements in flight per lane
      float* o = static_cast<float*>(out);
      const size_t groups = c.size / 4;
      for (size_t g0 = lane; g0 < groups; g0 += size_t{kWarp} * kGroups) {
        uint32_t q[kGroups][4];
        float old[kGroups][4];
        RUMOR_UNROLL
        for (unsigned b = 0; b < kGroups; ++b) {
          const size_t g = g0 + size_t{b} * kWarp;
          if (g < groups) {
            codes4(c.begin + 4 * g, q[b]);
            if constexpr (Acc) load4(o + c.begin + 4 * g, old[b]);
          }
        }
        RUMOR_UNROLL
        for (unsigned b = 0; b < kGroups; ++b) {
          const size_t g = g0 + size_t{b} * kWarp;
          if (g < groups) {
            float v[4];
            for (unsigned k = 0; k < 4; ++k) v[k] = Acc ? fadd(old[b][k], value(q[b][k])) : value(q[b][k]);
            store4(o + c.begin + 4 * g, v);
          }
        }
      }
      first = c.begin + 4 * groups + lane;  // the chunk's last size % 4 elements
    }
  }
  decode_batched<D, Acc>(out, first, c.begin + c.size, kWarp, code, value);
}
#undef RUMOR_UNROLL

// --- MinMaxU8 (kernels_impl.h: minmax_encode_t / minmax_decode_t).
struct MinMax {
  float lo, hi;
};
// x < lo ? x : lo, as the CPU: starting every lane from the chunk's first element gives the
// CPU's result for any input, NaN included (a NaN first element makes every lane NaN; a later NaN
// never replaces a number), and the -0 / +0 ties are erased by the + 0 below.
RUMOR_HD MinMax minmax_join(MinMax a, MinMax b) {
  return {b.lo < a.lo ? b.lo : a.lo, a.hi < b.hi ? b.hi : a.hi};
}

// Finite lo and hi whose range or 255 / range overflow float: quantized in double.
RUMOR_HD bool minmax_wide(float lo, float hi) {
  if (!isfinite(lo) || !isfinite(hi)) return false;
  const float range = fsub(hi, lo);
  return isinf(range) || (range > 0.f && isinf(fdiv(255.f, range)));
}

template <DType D>
struct MinMaxEncode {
  const void* in;
  std::byte* scales;  // 2 floats per chunk
  std::byte* codes;   // 1 byte per element

  RUMOR_HD MinMax lane_range(Chunk c, unsigned lane) const {
    const float x0 = Elem<D>::load(in, c.begin);
    MinMax r{x0, x0};
    for (size_t j = lane; j < c.size; j += kWarp) {
      const float x = Elem<D>::load(in, c.begin + j);
      r = minmax_join(r, MinMax{x, x});
    }
    return r;
  }

  // r: the chunk's range (every lane's, joined).
  RUMOR_HD void quantize(Chunk c, unsigned lane, MinMax r) const {
    const float lo = fadd(r.lo, 0.f), hi = fadd(r.hi, 0.f);  // -0 -> +0
    if (lane == 0) {
      put_f32(scales + 8 * c.index, lo);
      put_f32(scales + 8 * c.index + 4, hi);
    }
    if (minmax_wide(lo, hi)) {
      const double dlo = lo, inv = ddiv(255.0, dsub(static_cast<double>(hi), dlo));
      for (size_t j = lane; j < c.size; j += kWarp) {
        double v = dmul(dsub(static_cast<double>(Elem<D>::load(in, c.begin + j)), dlo), inv);
        v = v > 0.0 ? v : 0.0;
        v = v < 255.0 ? v : 255.0;
        put_u8(codes + c.begin + j, static_cast<uint32_t>(rint(v)));  // nearest even
      }
      return;
    }
    const float range = fsub(hi, lo);
    // Constant chunks (range 0) and non-finite ranges encode as 0, as on the CPU.
    const float inv = range > 0.f && range < bits_f32(0x7f800000u) ? fdiv(255.f, range) : 0.f;
    for (size_t j = lane; j < c.size; j += kWarp) {
      float v = fmul(fsub(Elem<D>::load(in, c.begin + j), lo), inv);
      v = v > 0.f ? v : 0.f;  // also maps NaN to 0
      v = v < 255.f ? v : 255.f;
      // The CPU's round_even: push the fraction out of the mantissa and back.
      put_u8(codes + c.begin + j, static_cast<uint32_t>(fsub(fadd(v, 0x1.8p23f), 0x1.8p23f)));
    }
  }
};

template <DType D, bool Acc>
struct MinMaxDecode {
  const std::byte* scales;
  const std::byte* codes;
  void* out;

  RUMOR_HD void run(Chunk c, unsigned lane) const {
    const float lo = get_f32(scales + 8 * c.index), hi = get_f32(scales + 8 * c.index + 4);
    if (minmax_wide(lo, hi)) {
      const double dlo = lo, step = ddiv(dsub(static_cast<double>(hi), dlo), 255.0);
      for (size_t j = lane; j < c.size; j += kWarp) {
        const double q = static_cast<double>(static_cast<uint8_t>(codes[c.begin + j]));
        store<D, Acc>(out, c.begin + j, narrow(dadd(dlo, dmul(q, step))));
      }
      return;
    }
    // lo + q * step unfused, as the scalar CPU kernels (the AVX2 ones fuse it: one rounding apart).
    const float step = fdiv(fsub(hi, lo), 255.f);
    decode_chunk<D, Acc>(
        out, c, lane, chunk_by4<D>(out, c.begin, codes + c.begin),
        [&](size_t i) { return static_cast<uint32_t>(codes[i]); }, Bytes4{codes},
        [&](uint32_t q) { return fadd(lo, fmul(static_cast<float>(q), step)); });
  }
};

// --- QSGD (kernels_impl.h: qsgd_encode_t / qsgd_decode_t). The generator is kernels.h's own
// qsgd_uniform, compiled for the device too; the key comes from compress::qsgd_key on the host.
using compress::qsgd_uniform;
using compress::QsgdKey;

// The float32 sum of squares is trusted when safely normal; otherwise it is redone in double.
RUMOR_HD bool sumsq_f32_ok(float s) { return s >= 0x1p-100f && s < bits_f32(0x7f800000u); }

template <DType D>
struct QsgdEncode {
  const void* in;
  std::byte* scales;  // 1 float (L2 norm) per chunk
  std::byte* codes;   // 1 byte per element (levels <= 127) or 2
  uint32_t levels;
  QsgdKey key;

  RUMOR_HD float lane_sumsq_f32(Chunk c, unsigned lane) const {
    float acc = 0.f;
    for (size_t j = lane; j < c.size; j += kWarp) {
      const float x = Elem<D>::load(in, c.begin + j);
      acc = fmaf(x, x, acc);  // fused, as the CPU's std::fma
    }
    return acc;
  }
  RUMOR_HD double lane_sumsq_f64(Chunk c, unsigned lane) const {
    double acc = 0.0;
    for (size_t j = lane; j < c.size; j += kWarp) {
      const double x = Elem<D>::load(in, c.begin + j);
      acc = dadd(acc, dmul(x, x));  // the square is exact in double
    }
    return acc;
  }

  RUMOR_HD void quantize(Chunk c, unsigned lane, float norm) const {
    if (lane == 0) put_f32(scales + 4 * c.index, norm);
    const float s = static_cast<float>(levels);
    const bool wide = levels > 127;
    // s / norm is finite for norms from 2^-100 on; below, divide by the norm per element.
    const bool multiply = norm >= 0x1p-100f;
    const float scale = fdiv(s, norm);
    for (size_t j = lane; j < c.size; j += kWarp) {
      const size_t i = c.begin + j;
      const float x = Elem<D>::load(in, i);
      const float u = qsgd_uniform(key, i);
      float v = multiply ? fmaf(fabsf(x), scale, u) : fmaf(fdiv(fabsf(x), norm), s, u);
      v = v > 0.f ? v : 0.f;
      v = v < s ? v : s;
      const uint32_t level = static_cast<uint32_t>(v);  // v >= 0: truncation is floor
      const uint32_t neg = x < 0.f ? 1u : 0u;
      if (wide) {
        put_u16(codes + 2 * i, neg << 15 | level);
      } else {
        put_u8(codes + i, neg << 7 | level);
      }
    }
  }
};

template <DType D, bool Acc>
struct QsgdDecode {
  const std::byte* scales;
  const std::byte* codes;
  void* out;
  uint32_t levels;

  RUMOR_HD void run(Chunk c, unsigned lane) const {
    const float step = fdiv(get_f32(scales + 4 * c.index), static_cast<float>(levels));
    if (levels > 127) {
      decode_chunk<D, Acc>(
          out, c, lane, chunk_by4<D>(out, c.begin, codes + 2 * c.begin),
          [&](size_t i) { return get_u16(codes + 2 * i); },
          [&](size_t i, uint32_t (&q)[4]) {
            const uint32_t a = load_u32(codes + 2 * i), b = load_u32(codes + 2 * i + 4);
            q[0] = a & 0xffffu, q[1] = a >> 16, q[2] = b & 0xffffu, q[3] = b >> 16;
          },
          [&](uint32_t code) {
            const float v = fmul(static_cast<float>(code & 0x7fffu), step);
            return (code & 0x8000u) ? -v : v;
          });
    } else {
      decode_chunk<D, Acc>(
          out, c, lane, chunk_by4<D>(out, c.begin, codes + c.begin),
          [&](size_t i) { return static_cast<uint32_t>(static_cast<uint8_t>(codes[i])); }, Bytes4{codes},
          [&](uint32_t code) {
            const float v = fmul(static_cast<float>(code & 0x7fu), step);
            return (code & 0x80u) ? -v : v;
          });
    }
  }
};

// --- Sign + scale (kernels_impl.h: sign_encode_t / sign_decode_t).
template <DType D>
struct SignEncode {
  const void* in;
  std::byte* scales;  // 1 float (mean |x|) per chunk
  std::byte* bits;    // element i in bit i % 8 of byte i / 8, set when x < 0

  RUMOR_HD double lane_abs_sum(Chunk c, unsigned lane) const {
    double acc = 0.0;
    for (size_t j = lane; j < c.size; j += kWarp)
      acc = dadd(acc, fabs(static_cast<double>(Elem<D>::load(in, c.begin + j))));
    return acc;
  }

  // sum: the chunk's sum of |x| (every lane's, joined). Chunks are a multiple of 8 elements, so
  // each starts on a byte of its own; lane l packs bytes l, l + 32, ... of the chunk.
  RUMOR_HD void pack(Chunk c, unsigned lane, double sum) const {
    if (lane == 0) put_f32(scales + 4 * c.index, narrow(ddiv(sum, static_cast<double>(c.size))));
    for (size_t j = 8 * static_cast<size_t>(lane); j < c.size; j += 8 * kWarp) {
      uint32_t byte = 0;
      for (size_t b = 0; b < 8 && j + b < c.size; ++b)
        byte |= (Elem<D>::load(in, c.begin + j + b) < 0.f ? 1u : 0u) << b;
      put_u8(bits + (c.begin + j) / 8, byte);
    }
  }
};

template <DType D, bool Acc>
struct SignDecode {
  const std::byte* scales;
  const std::byte* bits;
  void* out;

  RUMOR_HD void run(Chunk c, unsigned lane) const {
    const float scale = get_f32(scales + 4 * c.index);
    decode_chunk<D, Acc>(
        out, c, lane, chunk_by4<D>(out, c.begin, nullptr),  // bits are read a byte at a time
        [&](size_t i) { return (static_cast<uint32_t>(bits[i / 8]) >> (i % 8)) & 1u; },
        [&](size_t i, uint32_t (&q)[4]) {
          const uint32_t nibble = static_cast<uint32_t>(bits[i / 8]) >> (i % 8);  // i % 8 is 0 or 4
          for (unsigned k = 0; k < 4; ++k) q[k] = (nibble >> k) & 1u;
        },
        [&](uint32_t neg) { return neg != 0 ? -scale : scale; });
  }
};

// --- The casts: element by element, no chunks. float16 into the Float16 codec (and back out) is
// not a copy: half -> float -> half is the identity except that it quiets a signalling NaN, which
// core/half.h's rule (and F16C, on the AVX2 path) requires of every path.
template <DType D, bool Bf>
RUMOR_HD void cast_encode_one(const void* in, std::byte* codes, size_t i) {
  const float x = Elem<D>::load(in, i);
  put_u16(codes + 2 * i, Bf ? f32_to_bf16(x) : f32_to_f16(x));
}

template <bool Bf>
RUMOR_HD float cast_value(uint32_t code) {
  const auto h = static_cast<uint16_t>(code);
  return Bf ? bf16_to_f32(h) : f16_to_f32(h);
}

// Elements first, first + stride, ... below count (one thread of a grid-stride loop), codes read
// kDecodeBatch at a time.
template <DType D, bool Acc, bool Bf>
RUMOR_HD void cast_decode_strided(const std::byte* codes, void* out, size_t first, size_t count,
                                  size_t stride) {
  decode_batched<D, Acc>(
      out, first, count, stride, [&](size_t i) { return get_u16(codes + 2 * i); },
      [](uint32_t code) { return cast_value<Bf>(code); });
}

// Eight float32 outputs from one 16-byte read of codes (and, accumulating, two of the outputs),
// written with two 16-byte stores: the group g of elements 8g .. 8g + 7. A 2-byte read per lane
// issues eight times the memory instructions of a device copy for the same bytes, which held
// the float16 decode under 0.8 of one on an H200. Each element as cast_decode_strided gives it.
template <bool Acc, bool Bf>
RUMOR_HD void cast_decode_group8(const std::byte* codes, float* out, size_t g) {
  uint32_t w[4];
  float o[8];
#ifdef __CUDA_ARCH__
  const uint4 c = reinterpret_cast<const uint4*>(codes)[g];
  w[0] = c.x, w[1] = c.y, w[2] = c.z, w[3] = c.w;
  if constexpr (Acc) {
    const float4 a = reinterpret_cast<const float4*>(out)[2 * g],
                 b = reinterpret_cast<const float4*>(out)[2 * g + 1];
    o[0] = a.x, o[1] = a.y, o[2] = a.z, o[3] = a.w, o[4] = b.x, o[5] = b.y, o[6] = b.z, o[7] = b.w;
  }
#else
  std::memcpy(w, codes + 16 * g, sizeof(w));
  if constexpr (Acc) std::memcpy(o, out + 8 * g, sizeof(o));
#endif
  for (unsigned k = 0; k < 8; ++k) {
    // Little-endian, as get_u16 reads them: the low half of each word is the earlier element.
    const float v = cast_value<Bf>(k % 2 == 0 ? w[k / 2] & 0xffffu : w[k / 2] >> 16);
    o[k] = Acc ? fadd(o[k], v) : v;
  }
#ifdef __CUDA_ARCH__
  reinterpret_cast<float4*>(out)[2 * g] = make_float4(o[0], o[1], o[2], o[3]);
  reinterpret_cast<float4*>(out)[2 * g + 1] = make_float4(o[4], o[5], o[6], o[7]);
#else
  std::memcpy(out + 8 * g, o, sizeof(o));
#endif
}

// Whether a cast decode goes by groups of eight: a float32 output, and codes and output 16-byte
// aligned (an encoding at the start of its buffer; packed encodings may sit at any offset). The
// kernel's threads and the launch's grid must agree on it.
template <DType D>
RUMOR_HD bool cast_decode_by8(const void* codes, const void* out) {
  return D == DType::F32 && reinterpret_cast<uintptr_t>(codes) % 16 == 0 &&
         reinterpret_cast<uintptr_t>(out) % 16 == 0;
}

// Thread `thread` of `threads` decoding count casts: by groups of eight where cast_decode_by8
// says so, then the tail, or everything otherwise, element by element.
template <DType D, bool Acc, bool Bf>
RUMOR_HD void cast_decode_thread(const std::byte* codes, void* out, size_t count, size_t thread,
                                 size_t threads) {
  if constexpr (D == DType::F32) {
    if (cast_decode_by8<D>(codes, out)) {
      const size_t groups = count / 8;
      for (size_t g = thread; g < groups; g += threads)
        cast_decode_group8<Acc, Bf>(codes, static_cast<float*>(out), g);
      cast_decode_strided<D, Acc, Bf>(codes, out, 8 * groups + thread, count, threads);
      return;
    }
  }
  cast_decode_strided<D, Acc, Bf>(codes, out, thread, count, threads);
}

}  // namespace rumor::cuda::detail
