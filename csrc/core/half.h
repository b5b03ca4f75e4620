// float <-> bfloat16 / IEEE half conversions shared by the reduction, codec and neighbor kernels.
#pragma once

#include <cstdint>
#include <cstring>

namespace rumor::half {
// Internal linkage on purpose: the kernels that include this are compiled once per instruction
// set, and the linker must not let one unit's (AVX2) copy serve another unit's callers.
namespace {

// The NaN rule of every conversion to or from half and bfloat16, in every path (these scalar
// kernels, the AVX2 kernels, the CUDA kernels and their host emulation, cuda/codec_ops.cuh): a
// NaN coming out of a narrowing (float -> half or bfloat16) or out of half -> float is quiet, with
// the input's sign and the top bits of its payload, i.e. the quiet bit is set. It is what F16C's
// vcvtph2ps and vcvtps2ph do, so the AVX2 kernels need no fixup. GPU and CPU ranks exchange
// encodings, which must therefore be the same bits on every path and with every compiler.
// bfloat16 -> float is a plain shift everywhere (no hardware has another), so it keeps a
// signalling NaN; any conversion to a 16-bit type after it quiets the NaN.

inline float bf16_to_f32(uint16_t h) {
  uint32_t u = static_cast<uint32_t>(h) << 16;
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

inline uint16_t f32_to_bf16(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  // Round to nearest even; a NaN stays a quiet NaN of the same sign instead of rounding to inf.
  uint32_t rounded = (u + 0x7fffu + ((u >> 16) & 1u)) >> 16;
  uint32_t nan = (u >> 16) | 0x40u;
  bool is_nan = (u & 0x7fffffffu) > 0x7f800000u;
  return static_cast<uint16_t>(is_nan ? nan : rounded);
}

// Numbers go through the compiler's _Float16 conversion (exact IEEE rounding, F16C where
// enabled), NaNs are built on the bits: a _Float16 cast leaves the NaN rule to the compiler.
// Unoptimised, libgcc's soft-float conversion quiets a signalling NaN; optimised, GCC folds
// f32_to_f16(f16_to_f32(h)) into a plain copy that keeps it, so float16 through the Float16
// codec encoded differently in Debug and Release builds.
inline uint16_t f32_to_f16(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  if ((u & 0x7fffffffu) > 0x7f800000u) {
    return static_cast<uint16_t>(((u >> 16) & 0x8000u) | 0x7e00u | ((u >> 13) & 0x3ffu));
  }
  _Float16 h = static_cast<_Float16>(f);
  uint16_t r;
  std::memcpy(&r, &h, 2);
  return r;
}

inline float f16_to_f32(uint16_t u) {
  if ((u & 0x7fffu) > 0x7c00u) {
    const uint32_t q =
        (static_cast<uint32_t>(u & 0x8000u) << 16) | 0x7fc00000u | (static_cast<uint32_t>(u & 0x3ffu) << 13);
    float f;
    std::memcpy(&f, &q, 4);
    return f;
  }
  _Float16 h;
  std::memcpy(&h, &u, 2);
  return static_cast<float>(h);
}

}  // namespace
}  // namespace rumor::half
