// float <-> bfloat16 / IEEE half conversions shared by the reduction, codec and neighbor kernels.
#pragma once

#include <cstdint>
#include <cstring>

namespace rumor::half {
// Internal linkage on purpose: the kernels that include this are compiled once per instruction
// set, and the linker must not let one unit's (AVX2) copy serve another unit's callers.
namespace {

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

inline uint16_t f32_to_f16(float f) {
  _Float16 h = static_cast<_Float16>(f);
  uint16_t u;
  std::memcpy(&u, &h, 2);
  return u;
}

inline float f16_to_f32(uint16_t u) {
  _Float16 h;
  std::memcpy(&h, &u, 2);
  return static_cast<float>(h);
}

}  // namespace
}  // namespace rumor::half
