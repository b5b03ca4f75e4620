// Codec kernels: the per-element work behind codec.h, once per instruction set. codec.cpp owns
// the header and every length check and calls these only with buffers it has sized; the kernels
// themselves trust their arguments. Both sets must produce the same encoded bytes for the same
// input (tests compare them), so every floating-point step whose rounding could differ between a
// scalar and a vector loop is pinned down here:
//  - chunk sums (QSGD norm, sign scale) are taken over 32 interleaved lanes (element j of a
//    chunk goes to lane j % 32), combined in the fixed order of detail::combine_lanes: in
//    double, or for QSGD first in float with explicit fused multiply-adds (see sumsq_f32_ok);
//  - QSGD's stochastic rounding is floor(fma(|x|, s / norm, u)) (one fused rounding in both;
//    for a chunk whose norm is below 2^-100, where s / norm could overflow, it is
//    floor(fma(|x| / norm, s, u)));
//  - MinMaxU8 rounds (x - min) * (255 / (max - min)) to nearest even.
#pragma once

#include <cstddef>
#include <cstdint>

#include "core/cpu.h"
#include "core/hd.h"
#include "core/types.h"

namespace rumor::compress {

// One chunk's layout: every chunked codec stores its per-chunk floats first, then the elements.
struct KernelSet {
  const char* isa;
  // scales: 2 floats (min, max) per chunk; codes: count bytes.
  void (*minmax_encode)(const void* in, DType dtype, size_t count, uint32_t chunk, std::byte* scales,
                        std::byte* codes);
  void (*minmax_decode)(const std::byte* scales, const std::byte* codes, size_t count, uint32_t chunk,
                        void* out, DType dtype, bool accumulate);
  // scales: 1 float (L2 norm) per chunk; codes: 1 byte (levels <= 127) or 2 bytes per element.
  void (*qsgd_encode)(const void* in, DType dtype, size_t count, uint32_t chunk, uint32_t levels,
                      uint64_t seed, std::byte* scales, std::byte* codes);
  void (*qsgd_decode)(const std::byte* scales, const std::byte* codes, size_t count, uint32_t chunk,
                      uint32_t levels, void* out, DType dtype, bool accumulate);
  // scales: 1 float (mean |x|) per chunk; bits: ceil(count / 8) bytes, element i in bit i % 8 of
  // byte i / 8, set when x < 0.
  void (*sign_encode)(const void* in, DType dtype, size_t count, uint32_t chunk, std::byte* scales,
                      std::byte* bits);
  void (*sign_decode)(const std::byte* scales, const std::byte* bits, size_t count, uint32_t chunk, void* out,
                      DType dtype, bool accumulate);
  // codes: 2 bytes per element (IEEE half or bfloat16, little endian).
  void (*f16_encode)(const void* in, DType dtype, size_t count, std::byte* codes);
  void (*f16_decode)(const std::byte* codes, size_t count, void* out, DType dtype, bool accumulate);
  void (*bf16_encode)(const void* in, DType dtype, size_t count, std::byte* codes);
  void (*bf16_decode)(const std::byte* codes, size_t count, void* out, DType dtype, bool accumulate);
};

using rumor::Isa;

// The kernel set for `isa`, or nullptr where it is not compiled in or this CPU lacks it.
const KernelSet* kernel_set(Isa isa);

// The set the codecs use: AVX2 where available unless RUMOR_CODEC_ISA=generic (read once).
const KernelSet& active_kernels();

// The counter-based generator behind QSGD's stochastic rounding: a uniform float in [0, 1) for
// element `index`, a pure function of (seed, index) so any split of the work gives the same bits.
struct QsgdKey {
  uint32_t k0, k1;
};
QsgdKey qsgd_key(uint64_t seed);

// Internal linkage for the same reason as elem.h: each kernel unit gets its own copy.
namespace {

// Whether QSGD multiplies by s / norm (finite for such a norm) rather than divides by norm.
inline bool qsgd_multiply(float norm) { return norm >= 0x1p-100f; }

RUMOR_HD uint32_t mix32(uint32_t x) {
  // A 32-bit integer finalizer (two multiply-xorshift rounds); cheap to vectorize with AVX2's
  // 32-bit multiplies, unlike 64-bit mixers.
  x ^= x >> 16;
  x *= 0x7feb352du;
  x ^= x >> 15;
  x *= 0x846ca68bu;
  x ^= x >> 16;
  return x;
}

// One finalizer round over the keyed index: a bijection of the low index word for a given seed
// (no two of 2^32 consecutive elements share a draw), a different one per seed. One round
// rather than two halves QSGD's encode cost and is ample for choosing between two levels.
RUMOR_HD uint32_t qsgd_hash(QsgdKey k, uint64_t index) {
  const uint32_t hi = static_cast<uint32_t>(index >> 32) * 0x9e3779b9u;
  return mix32((static_cast<uint32_t>(index) + k.k1) ^ (k.k0 ^ hi));
}

// 24 random bits scaled into [0, 1): exactly representable, never 1.
RUMOR_HD float qsgd_uniform(QsgdKey k, uint64_t index) {
  return static_cast<float>(qsgd_hash(k, index) >> 8) * 0x1p-24f;
}

}  // namespace

}  // namespace rumor::compress
