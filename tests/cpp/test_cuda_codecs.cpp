// CUDA codecs against the CPU codecs.
//
// CudaCodecOps (runs everywhere): the per-lane functions the CUDA kernels are made of
// (cuda/codec_ops.cuh) run here on the CPU, lane by lane with the warp's shuffles emulated, and
// must give the CPU codecs' bytes; the bit conversions are checked against the CPU's. This checks
// the kernels' arithmetic on machines without a GPU.
// CudaCodecs (needs a CUDA build and a GPU, skipped otherwise): the kernels themselves, byte for
// byte against the CPU codecs, decode and decode-accumulate against the scalar CPU kernels, and
// the decoder's validation.
#include <gtest/gtest.h>

#include <algorithm>
#include <cfloat>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <initializer_list>
#include <random>
#include <string>
#include <vector>

#include "compress/codec.h"
#include "compress/elem.h"
#include "compress/kernels.h"
#include "core/half.h"
#include "cuda/codec_ops.cuh"

#ifdef RUMOR_WITH_CUDA
#include <cuda_runtime.h>

#include "cuda/codec_cuda.h"
#endif

using namespace rumor;
using namespace rumor::compress;
namespace ops = rumor::cuda::detail;

namespace {

const DType kFloatTypes[] = {DType::F32, DType::F16, DType::BF16, DType::F64};

// Every codec with the parameters worth telling apart: chunk sizes (tiny, not a multiple of 32,
// the default) and QSGD's one- and two-byte codes.
std::vector<CodecParams> all_params() {
  std::vector<CodecParams> v;
  for (uint32_t chunk : {8u, 24u, 0u}) {
    v.push_back({Kind::kMinMaxU8, chunk, 16});
    v.push_back({Kind::kSign, chunk, 16});
    for (uint32_t levels : {2u, 16u, 127u, 128u, 256u}) v.push_back({Kind::kQSGD, chunk, levels});
  }
  v.push_back({Kind::kF16, 0, 16});
  v.push_back({Kind::kBF16, 0, 16});
  return v;
}

uint32_t chunk_of(const CodecParams& p) { return p.chunk == 0 ? 1024 : p.chunk; }

// count elements of dtype t, as raw bytes, from float64 values (rounded as the dtype rounds).
std::vector<std::byte> to_dtype(DType t, const std::vector<double>& v) {
  std::vector<std::byte> b(v.size() * dtype_size(t));
  for (size_t i = 0; i < v.size(); ++i) {
    const float f = static_cast<float>(v[i]);
    uint16_t h = 0;
    switch (t) {
      case DType::F32:
        std::memcpy(b.data() + 4 * i, &f, 4);
        break;
      case DType::F64:
        std::memcpy(b.data() + 8 * i, &v[i], 8);
        break;
      case DType::F16:
        h = half::f32_to_f16(f);
        std::memcpy(b.data() + 2 * i, &h, 2);
        break;
      default:
        h = half::f32_to_bf16(f);
        std::memcpy(b.data() + 2 * i, &h, 2);
    }
  }
  return b;
}

// Inputs that reach every branch of the kernels: normal values, constants, magnitudes near
// 1e-38 (MinMaxU8 in double, QSGD's double norm and division), a range overflowing float32,
// zeros of both signs, exact rounding ties of the MinMaxU8 grid.
std::vector<double> values(size_t n, int kind, uint32_t seed) {
  std::mt19937 rng(seed);
  std::normal_distribution<double> normal(0.0, 2.0);
  std::vector<double> v(n);
  for (auto& x : v) x = normal(rng);
  switch (kind) {
    case 0:
      break;
    case 1:
      for (auto& x : v) x = -3.25;
      break;
    case 2:
      for (auto& x : v) x *= 1e-38;
      break;
    case 3:
      if (n >= 5) {
        v[1] = 3.0e38;
        v[4] = -3.1e38;
      }
      break;
    default:
      for (size_t i = 0; i < n; ++i) {
        v[i] = std::round(v[i] * 4) / 4;
        if (i % 7 == 3) v[i] = (i % 2) ? -0.0 : 0.0;
      }
  }
  return v;
}
constexpr int kValueKinds = 5;

// Calls check(params, codec, dtype, n, kind, input) for every codec, dtype, size and kind of
// values (those beyond float16's range left out for it; sizes above 5000 with normal values only).
template <class F>
void for_each_input(std::initializer_list<size_t> sizes, F&& check) {
  for (const CodecParams& p : all_params()) {
    auto codec = make_codec(p);
    for (DType t : kFloatTypes) {
      for (size_t n : sizes) {
        for (int kind = 0; kind < kValueKinds; ++kind) {
          if (t == DType::F16 && (kind == 2 || kind == 3)) continue;
          if (n > 5000 && kind != 0) continue;
          check(p, *codec, t, n, kind, to_dtype(t, values(n, kind, static_cast<uint32_t>(n * 31 + kind))));
        }
      }
    }
  }
}

// Random bytes, for inputs of any bit pattern.
std::vector<std::byte> random_bytes(std::mt19937_64& rng, size_t n) {
  std::vector<std::byte> raw(n);
  for (auto& b : raw) b = static_cast<std::byte>(rng());
  return raw;
}

std::vector<std::byte> cpu_encode(const Codec& c, const std::vector<std::byte>& in, size_t n, DType t,
                                  uint64_t seed) {
  std::vector<std::byte> buf(c.encoded_bytes(n));
  c.encode(in.data(), n, t, buf.data(), buf.size(), seed);
  return buf;
}

// Decode with the scalar CPU kernels, which the CUDA decoders follow operation for operation (the
// AVX2 set fuses MinMaxU8's multiply-add and may be one rounding away).
void cpu_decode_scalar(const CodecParams& p, const std::vector<std::byte>& buf, size_t n, void* out, DType t,
                       bool acc) {
  const KernelSet& k = *kernel_set(Isa::kGeneric);
  const std::byte* body = buf.data() + 32;
  const uint32_t ch = chunk_of(p);
  const size_t nc = (n + ch - 1) / ch;
  switch (p.kind) {
    case Kind::kMinMaxU8:
      return k.minmax_decode(body, body + 8 * nc, n, ch, out, t, acc);
    case Kind::kQSGD:
      return k.qsgd_decode(body, body + 4 * nc, n, ch, p.levels, out, t, acc);
    case Kind::kSign:
      return k.sign_decode(body, body + 4 * nc, n, ch, out, t, acc);
    case Kind::kF16:
      return k.f16_decode(body, n, out, t, acc);
    case Kind::kBF16:
      return k.bf16_decode(body, n, out, t, acc);
  }
}

// The body (after the header) of the encoding by the scalar CPU kernels, the reference for inputs
// with NaNs (the AVX2 set takes min and max in another order, which only NaNs can tell apart).
std::vector<std::byte> cpu_encode_scalar(const CodecParams& p, const Codec& c,
                                         const std::vector<std::byte>& in, size_t n, DType t, uint64_t seed) {
  const KernelSet& k = *kernel_set(Isa::kGeneric);
  std::vector<std::byte> out(c.encoded_bytes(n) - 32);
  std::byte* b = out.data();
  const uint32_t ch = chunk_of(p);
  const size_t nc = (n + ch - 1) / ch;
  switch (p.kind) {
    case Kind::kMinMaxU8:
      k.minmax_encode(in.data(), t, n, ch, b, b + 8 * nc);
      break;
    case Kind::kQSGD:
      k.qsgd_encode(in.data(), t, n, ch, p.levels, seed, b, b + 4 * nc);
      break;
    case Kind::kSign:
      k.sign_encode(in.data(), t, n, ch, b, b + 4 * nc);
      break;
    case Kind::kF16:
      k.f16_encode(in.data(), t, n, b);
      break;
    case Kind::kBF16:
      k.bf16_encode(in.data(), t, n, b);
      break;
  }
  return out;
}

// --- The warp, emulated: lane l's value after the kernels' xor butterfly (offsets 1 .. 16).
template <class T, class Join>
void butterfly(T (&v)[ops::kWarp], Join join) {
  for (unsigned off = 1; off < ops::kWarp; off <<= 1) {
    T next[ops::kWarp];
    for (unsigned l = 0; l < ops::kWarp; ++l) next[l] = join(v[l], v[l ^ off]);
    std::copy(next, next + ops::kWarp, v);
  }
}

// The body of the encoding (after the header) as the encode kernels compute it, one chunk at a
// time, each step run for all 32 lanes before the next (as the warp does).
std::vector<std::byte> emulate_encode(const CodecParams& p, const Codec& c, const std::vector<std::byte>& in,
                                      size_t n, DType t, uint64_t seed) {
  std::vector<std::byte> out(c.encoded_bytes(n) - 32);
  std::byte* body = out.data();
  const uint32_t ch = chunk_of(p);
  const size_t nc = (n + ch - 1) / ch;
  compress::detail::by_float_dtype(t, [&]<DType D>() {
    if (p.kind == Kind::kF16 || p.kind == Kind::kBF16) {
      for (size_t i = 0; i < n; ++i) {
        if (p.kind == Kind::kF16) {
          ops::cast_encode_one<D, false>(in.data(), body, i);
        } else {
          ops::cast_encode_one<D, true>(in.data(), body, i);
        }
      }
      return;
    }
    for (size_t ci = 0; ci < nc; ++ci) {
      const ops::Chunk k{ci, ci * ch, std::min<size_t>(ch, n - ci * ch)};
      if (p.kind == Kind::kMinMaxU8) {
        const ops::MinMaxEncode<D> op{in.data(), body, body + 8 * nc};
        ops::MinMax r[ops::kWarp];
        for (unsigned l = 0; l < ops::kWarp; ++l) r[l] = op.lane_range(k, l);
        butterfly(r, ops::minmax_join);
        for (unsigned l = 0; l < ops::kWarp; ++l) op.quantize(k, l, r[l]);
      } else if (p.kind == Kind::kQSGD) {
        const ops::QsgdEncode<D> op{in.data(), body, body + 4 * nc, p.levels, qsgd_key(seed)};
        float f[ops::kWarp];
        double d[ops::kWarp];
        for (unsigned l = 0; l < ops::kWarp; ++l) f[l] = op.lane_sumsq_f32(k, l);
        butterfly(f, ops::fadd);
        const bool redo = !ops::sumsq_f32_ok(f[0]);
        if (redo) {
          for (unsigned l = 0; l < ops::kWarp; ++l) d[l] = op.lane_sumsq_f64(k, l);
          butterfly(d, ops::dadd);
        }
        for (unsigned l = 0; l < ops::kWarp; ++l) {
          // Every lane must take the same branch and quantize by the same norm (a NaN sum's
          // payload may differ between lanes here; the GPU has one NaN).
          if (!std::isnan(f[0])) {
            EXPECT_EQ(ops::f32_bits(f[l]), ops::f32_bits(f[0])) << "lanes disagree on the sum";
          }
          op.quantize(k, l, redo ? ops::narrow(ops::dsqrt(d[l])) : ops::fsqrt(f[l]));
        }
      } else {
        const ops::SignEncode<D> op{in.data(), body, body + 4 * nc};
        double s[ops::kWarp];
        for (unsigned l = 0; l < ops::kWarp; ++l) s[l] = op.lane_abs_sum(k, l);
        butterfly(s, ops::dadd);
        for (unsigned l = 0; l < ops::kWarp; ++l) op.pack(k, l, s[l]);
      }
    }
  });
  return out;
}

// Decoding as the decode kernels do, into `out` (count elements of t).
void emulate_decode(const CodecParams& p, const std::vector<std::byte>& buf, size_t n, void* out, DType t,
                    bool acc) {
  const std::byte* body = buf.data() + 32;
  const uint32_t ch = chunk_of(p);
  const size_t nc = (n + ch - 1) / ch;
  compress::detail::by_float_dtype(t, [&]<DType D>() {
    auto run = [&]<bool Acc>() {
      if (p.kind == Kind::kF16 || p.kind == Kind::kBF16) {
        // A grid of kGridThreads threads striding over the elements (or groups of eight), as the
        // cast kernel's loop (several strides per thread, so that its batches and their ragged
        // end are covered).
        constexpr size_t kGridThreads = 5;
        for (size_t thread = 0; thread < kGridThreads; ++thread) {
          if (p.kind == Kind::kF16) {
            ops::cast_decode_thread<D, Acc, false>(body, out, n, thread, kGridThreads);
          } else {
            ops::cast_decode_thread<D, Acc, true>(body, out, n, thread, kGridThreads);
          }
        }
        return;
      }
      for (size_t ci = 0; ci < nc; ++ci) {
        const ops::Chunk k{ci, ci * ch, std::min<size_t>(ch, n - ci * ch)};
        for (unsigned l = 0; l < ops::kWarp; ++l) {
          if (p.kind == Kind::kMinMaxU8) {
            ops::MinMaxDecode<D, Acc>{body, body + 8 * nc, out}.run(k, l);
          } else if (p.kind == Kind::kQSGD) {
            ops::QsgdDecode<D, Acc>{body, body + 4 * nc, out, p.levels}.run(k, l);
          } else {
            ops::SignDecode<D, Acc>{body, body + 4 * nc, out}.run(k, l);
          }
        }
      }
    };
    acc ? run.template operator()<true>() : run.template operator()<false>();
  });
}

// scripts/gpu_check.sh sets RUMOR_EXPECT_GPU=1: there a missing GPU or CUDA build is a failure,
// not a skip.
bool gpu_expected() {
  const char* v = std::getenv("RUMOR_EXPECT_GPU");
  return v != nullptr && std::string(v) == "1";
}

// An encoding body with every NaN among its per-chunk floats replaced by one NaN. Sums, and the
// + 0 that MinMaxU8 applies to its min and max, carry a NaN input's payload through on x86 (which
// operand's, depends on the order the compiler chose), where the GPU's arithmetic returns one
// canonical NaN; every code and every other byte must be the same.
std::vector<std::byte> nan_blind(const CodecParams& p, std::vector<std::byte> body, size_t n) {
  if (p.kind == Kind::kF16 || p.kind == Kind::kBF16) return body;
  const uint32_t ch = chunk_of(p);
  const size_t floats = (p.kind == Kind::kMinMaxU8 ? 2 : 1) * ((n + ch - 1) / ch);
  for (size_t i = 0; i < floats; ++i) {
    float f;
    std::memcpy(&f, body.data() + 4 * i, 4);
    if (std::isnan(f)) std::memcpy(body.data() + 4 * i, "\x00\x00\xc0\x7f", 4);
  }
  return body;
}

// --- core/half.h's NaN rule, written out here independently of the conversions it pins: a NaN
// converted to half or bfloat16 (or from half to a wider type) comes out quiet, with its sign and
// the top bits of its payload (the quiet bit set), as F16C does. bfloat16 -> float is a shift and
// keeps the bits as they are.

// Mantissa bits and the in-place exponent mask of each float dtype.
int man_bits(DType t) { return t == DType::F16 ? 10 : t == DType::BF16 ? 7 : t == DType::F32 ? 23 : 52; }
uint64_t exp_mask(DType t) {
  return t == DType::F16    ? 0x7c00u
         : t == DType::BF16 ? 0x7f80u
         : t == DType::F32  ? 0x7f800000u
                            : 0x7ff0000000000000ull;
}

// The NaN `bits` of dtype `from` becomes in dtype `to` by the rule.
uint64_t quiet_as(DType from, uint64_t bits, DType to) {
  const size_t wf = 8 * dtype_size(from), wt = 8 * dtype_size(to);
  const uint64_t sign = (bits >> (wf - 1)) & 1u;
  const int mf = man_bits(from), mt = man_bits(to);
  const uint64_t frac = (bits & ((uint64_t{1} << mf) - 1)) << (64 - mf);  // payload, left-aligned
  return sign << (wt - 1) | exp_mask(to) | frac >> (64 - mt) | uint64_t{1} << (mt - 1);
}

// NaNs of each dtype: signalling ones (quiet bit clear) with payloads in the top, middle and
// bottom bits, and one quiet NaN, repeated to 21 elements so that the AVX2 kernels run both
// their 8-wide loop and their tail.
std::vector<uint64_t> nans_of(DType t) {
  std::vector<uint64_t> v;
  switch (t) {
    case DType::F16:
      v = {0x7c01, 0xfd65, 0x7d00, 0x7dff, 0xfc20, 0xfe01};
      break;
    case DType::BF16:
      v = {0x7f81, 0xff95, 0x7fbf, 0xffa0, 0xffc1};
      break;
    case DType::F32:
      v = {0x7f800001, 0xff8abcde, 0x7fa00000, 0x7fbfffff, 0xffc12345};
      break;
    default:
      v = {0x7ff0000000000001, 0xfff4abcdef012345, 0x7ff7ffffffffffff, 0xfff0000020000000,
           0x7ff8000000000abc};
  }
  std::vector<uint64_t> r(21);
  for (size_t i = 0; i < r.size(); ++i) r[i] = v[i % v.size()];
  return r;
}

// Elements of dtype t from their bits, and back (little-endian).
std::vector<std::byte> pack_bits(DType t, const std::vector<uint64_t>& bits) {
  const size_t w = dtype_size(t);
  std::vector<std::byte> b(w * bits.size());
  for (size_t i = 0; i < bits.size(); ++i) {
    for (size_t k = 0; k < w; ++k) b[w * i + k] = static_cast<std::byte>(bits[i] >> (8 * k));
  }
  return b;
}
std::vector<uint64_t> unpack_bits(DType t, const std::byte* b, size_t n) {
  const size_t w = dtype_size(t);
  std::vector<uint64_t> bits(n, 0);
  for (size_t i = 0; i < n; ++i) {
    for (size_t k = 0; k < w; ++k) bits[i] |= static_cast<uint64_t>(b[w * i + k]) << (8 * k);
  }
  return bits;
}

// The codes (of dtype c: F16 or BF16) that the rule makes of the NaNs `in` of dtype t.
std::vector<uint64_t> rule_encode(DType t, const std::vector<uint64_t>& in, DType c) {
  std::vector<uint64_t> r;
  for (uint64_t x : in) r.push_back(quiet_as(t, x, c));
  return r;
}

// What the rule makes of NaN codes (of dtype c) decoded, without accumulating, into dtype t.
std::vector<uint64_t> rule_decode(DType c, const std::vector<uint64_t>& codes, DType t) {
  std::vector<uint64_t> r;
  for (uint64_t h : codes) r.push_back(c == DType::BF16 && t == DType::F32 ? h << 16 : quiet_as(c, h, t));
  return r;
}

TEST(CudaCodecOps, HalfToFloatMatchesCpuForEveryHalf) {
  for (uint32_t h = 0; h < 65536; ++h) {
    const auto u = static_cast<uint16_t>(h);
    ASSERT_EQ(ops::f32_bits(ops::f16_to_f32(u)), ops::f32_bits(half::f16_to_f32(u))) << std::hex << h;
    ASSERT_EQ(ops::f32_bits(ops::bf16_to_f32(u)), ops::f32_bits(half::bf16_to_f32(u))) << std::hex << h;
  }
}

TEST(CudaCodecOps, FloatToHalfMatchesCpu) {
  // Every top 16 bits of a float (signs, exponents, NaNs and infinities) with all 16 values of
  // bits 12..15 and three of bits 0..11: rounding decides on bit 12 and up for a normal half and
  // bit 13 and up for a subnormal one, so every tie and the values next to it are here.
  for (uint32_t top = 0; top < (1u << 16); ++top) {
    for (uint32_t mid = 0; mid < 16; ++mid) {
      for (uint32_t low : {0x000u, 0x001u, 0xfffu}) {
        const uint32_t u = top << 16 | mid << 12 | low;
        const float f = ops::bits_f32(u);
        ASSERT_EQ(ops::f32_to_f16(f), half::f32_to_f16(f)) << std::hex << u;
        ASSERT_EQ(ops::f32_to_bf16(f), half::f32_to_bf16(f)) << std::hex << u;
      }
    }
  }
}

TEST(CudaCodecOps, NarrowMatchesCpu) {
  const double edge = 0x1.ffffffp127;
  for (double v : {0.0, -0.0, 1.0 / 3, 1e-40, -1e-46, 1e-320, 3.4028234663852886e38, edge, -edge,
                   std::nextafter(edge, 0.0), std::nextafter(-edge, 0.0), 1e300, -1e300, double{INFINITY},
                   -double{INFINITY}}) {
    const float want =
        std::fabs(v) >= edge ? std::copysign(INFINITY, static_cast<float>(v)) : static_cast<float>(v);
    EXPECT_EQ(ops::f32_bits(ops::narrow(v)), ops::f32_bits(want)) << v;
  }
}

TEST(CudaCodecOps, EmulatedKernelsEncodeCpuBytes) {
  for_each_input({1, 3, 8, 13, 31, 33, 64, 999, 1024, 1025, 4133},
                 [](const CodecParams& p, const Codec& c, DType t, size_t n, int kind,
                    const std::vector<std::byte>& in) {
                   const uint64_t seed = n * 1000003 + static_cast<uint64_t>(kind);
                   auto cpu = cpu_encode(c, in, n, t, seed);
                   cpu.erase(cpu.begin(), cpu.begin() + 32);
                   ASSERT_EQ(emulate_encode(p, c, in, n, t, seed), cpu)
                       << c.name() << " " << dtype_name(t) << " n=" << n << " kind=" << kind;
                 });
}

// Arbitrary bit patterns, NaNs with any payload included: the scalar CPU kernels' bytes, with the
// same NaN handling (MinMaxU8's min and max skip a NaN unless it is the chunk's first element),
// up to NaN payloads in the chunk floats.
TEST(CudaCodecOps, EmulatedKernelsMatchScalarCpuOnAnyBits) {
  std::mt19937_64 rng(5);
  for (int round = 0; round < 12; ++round) {
    const size_t n = 1 + rng() % 3000;
    const auto raw = random_bytes(rng, 8 * n);
    for (DType t : kFloatTypes) {
      for (const CodecParams& p : {CodecParams{Kind::kMinMaxU8, 8, 16}, CodecParams{Kind::kQSGD, 24, 200},
                                   CodecParams{Kind::kSign, 0, 16}, CodecParams{Kind::kF16, 0, 16},
                                   CodecParams{Kind::kBF16, 0, 16}}) {
        auto codec = make_codec(p);
        ASSERT_EQ(nan_blind(p, emulate_encode(p, *codec, raw, n, t, 9), n),
                  nan_blind(p, cpu_encode_scalar(p, *codec, raw, n, t, 9), n))
            << codec->name() << " " << dtype_name(t) << " round " << round;
      }
    }
  }
}

// A signalling NaN through every path that converts to or from half or bfloat16 (the scalar and
// AVX2 CPU kernels and the emulated CUDA kernels, encoding from every dtype and decoding into
// every dtype) comes out as core/half.h's rule says, the same bits on every path whatever the
// compiler made of it. Before the rule was pinned, float16 into the Float16 codec kept a
// signalling NaN in the CUDA kernels and in optimised scalar builds (GCC folds half -> float ->
// half to a copy) and quieted it in unoptimised ones (libgcc) and with F16C. (Decoding with
// accumulation adds, and which NaN an add returns is the hardware's choice: see nan_blind.)
TEST(CudaCodecOps, SignallingNanComesOutQuietOnEveryPath) {
  // The case that showed it: float16 0xfd65 (sign set, payload 0x165, quiet bit clear).
  EXPECT_EQ(quiet_as(DType::F16, 0xfd65, DType::F16), 0xff65u);
  EXPECT_EQ(half::f32_to_f16(half::f16_to_f32(0xfd65)), 0xff65u);
  EXPECT_EQ(ops::f32_to_f16(ops::f16_to_f32(0xfd65)), 0xff65u);

  std::vector<const KernelSet*> sets = {kernel_set(Isa::kGeneric)};
  if (kernel_set(Isa::kAvx2) != nullptr) sets.push_back(kernel_set(Isa::kAvx2));
  for (DType c : {DType::F16, DType::BF16}) {
    const bool bf = c == DType::BF16;
    for (DType t : kFloatTypes) {
      // Encoding NaNs of dtype t into codes of dtype c.
      const auto in_bits = nans_of(t);
      const size_t n = in_bits.size();
      const auto in = pack_bits(t, in_bits);
      const auto want = rule_encode(t, in_bits, c);
      for (const KernelSet* k : sets) {
        std::vector<std::byte> codes(2 * n);
        (bf ? k->bf16_encode : k->f16_encode)(in.data(), t, n, codes.data());
        EXPECT_EQ(unpack_bits(c, codes.data(), n), want)
            << k->isa << " encode " << dtype_name(t) << " into " << dtype_name(c);
      }
      std::vector<std::byte> codes(2 * n);
      compress::detail::by_float_dtype(t, [&]<DType D>() {
        for (size_t i = 0; i < n; ++i) {
          if (bf) {
            ops::cast_encode_one<D, true>(in.data(), codes.data(), i);
          } else {
            ops::cast_encode_one<D, false>(in.data(), codes.data(), i);
          }
        }
      });
      EXPECT_EQ(unpack_bits(c, codes.data(), n), want)
          << "emulated CUDA encode " << dtype_name(t) << " into " << dtype_name(c);

      // Decoding NaN codes of dtype c (a peer's bytes: any bits) into dtype t.
      const auto code_bits = nans_of(c);
      const auto code_bytes = pack_bits(c, code_bits);
      const auto want_out = rule_decode(c, code_bits, t);
      for (const KernelSet* k : sets) {
        std::vector<std::byte> out(dtype_size(t) * n);
        (bf ? k->bf16_decode : k->f16_decode)(code_bytes.data(), n, out.data(), t, false);
        EXPECT_EQ(unpack_bits(t, out.data(), n), want_out)
            << k->isa << " decode " << dtype_name(c) << " into " << dtype_name(t);
      }
      std::vector<std::byte> out(dtype_size(t) * n);
      compress::detail::by_float_dtype(t, [&]<DType D>() {
        if (bf) {
          ops::cast_decode_strided<D, false, true>(code_bytes.data(), out.data(), 0, n, 1);
        } else {
          ops::cast_decode_strided<D, false, false>(code_bytes.data(), out.data(), 0, n, 1);
        }
      });
      EXPECT_EQ(unpack_bits(t, out.data(), n), want_out)
          << "emulated CUDA decode " << dtype_name(c) << " into " << dtype_name(t);
    }
  }
}

TEST(CudaCodecOps, EmulatedKernelsDecodeAsScalarCpu) {
  for (const CodecParams& p : all_params()) {
    auto codec = make_codec(p);
    const size_t n = 4133;
    const auto x = to_dtype(DType::F32, values(n, 0, 3));
    const auto buf = cpu_encode(*codec, x, n, DType::F32, 11);
    for (DType t : kFloatTypes) {
      for (bool acc : {false, true}) {
        const auto init = to_dtype(t, values(n, 0, 4));
        auto a = init, b = init;
        cpu_decode_scalar(p, buf, n, a.data(), t, acc);
        emulate_decode(p, buf, n, b.data(), t, acc);
        ASSERT_EQ(a, b) << codec->name() << " into " << dtype_name(t) << " acc=" << acc;
        // The output one element past a 16-byte boundary (aligned for its dtype, not for a
        // 16-byte store): the casts' element-by-element path (the aligned one, by groups of
        // eight, is the case above).
        std::vector<std::byte> shifted(init.size() + 32);
        std::byte* at =
            shifted.data() + (16 - reinterpret_cast<uintptr_t>(shifted.data()) % 16) % 16 + dtype_size(t);
        std::memcpy(at, init.data(), init.size());
        emulate_decode(p, buf, n, at, t, acc);
        ASSERT_EQ(0, std::memcmp(at, a.data(), a.size()))
            << codec->name() << " into " << dtype_name(t) << " acc=" << acc << ", output not 16-byte aligned";
      }
    }
  }
}

#ifdef RUMOR_WITH_CUDA

// Decoded values of dtype t with every NaN replaced by one quiet NaN. Where a chunk's scale
// overflows float32 the decode multiplies inf by 0, and the hardware picks the NaN: x86 its
// default NaN (sign set), the GPU its canonical one. A NaN must still meet a NaN.
std::vector<std::byte> values_nan_blind(DType t, std::vector<std::byte> v) {
  const size_t w = dtype_size(t);
  const uint64_t man = (uint64_t{1} << man_bits(t)) - 1;
  for (size_t i = 0; i + w <= v.size(); i += w) {
    uint64_t bits = 0;
    std::memcpy(&bits, v.data() + i, w);
    if ((bits & exp_mask(t)) == exp_mask(t) && (bits & man) != 0) {
      bits = exp_mask(t) | (uint64_t{1} << (man_bits(t) - 1));
      std::memcpy(v.data() + i, &bits, w);
    }
  }
  return v;
}

void check(cudaError_t e, const char* what) {
  if (e != cudaSuccess) FAIL() << what << ": " << cudaGetErrorString(e);
}

// Device memory for a test, freed at scope exit.
struct DeviceBuffer {
  explicit DeviceBuffer(size_t n) : bytes(n) { check(cudaMalloc(&ptr, n == 0 ? 1 : n), "cudaMalloc"); }
  ~DeviceBuffer() { cudaFree(ptr); }
  DeviceBuffer(const DeviceBuffer&) = delete;
  DeviceBuffer& operator=(const DeviceBuffer&) = delete;
  std::byte* data() const { return static_cast<std::byte*>(ptr); }
  void* ptr = nullptr;
  size_t bytes;
};

void upload(std::byte* dst, const std::vector<std::byte>& src) {
  check(cudaMemcpy(dst, src.data(), src.size(), cudaMemcpyHostToDevice), "upload");
}
std::vector<std::byte> download(const std::byte* src, size_t n) {
  std::vector<std::byte> v(n);
  check(cudaMemcpy(v.data(), src, n, cudaMemcpyDeviceToHost), "download");
  return v;
}

class CudaCodecs : public ::testing::Test {
 protected:
  void SetUp() override {
    if (cuda::cuda_device_count() == 0) {
      if (gpu_expected()) FAIL() << "RUMOR_EXPECT_GPU=1 but the CUDA runtime sees no device";
      GTEST_SKIP() << "no CUDA device";
    }
    check(cudaStreamCreate(&stream_), "cudaStreamCreate");
  }
  void TearDown() override {
    if (stream_ != nullptr) cudaStreamDestroy(stream_);
  }

  // The GPU's encoding of `in`, written `offset` bytes into a device buffer (encodings are packed
  // at odd offsets in practice), on this test's stream.
  std::vector<std::byte> gpu_encode(const Codec& c, const std::vector<std::byte>& in, size_t n, DType t,
                                    uint64_t seed, size_t offset) {
    DeviceBuffer din(in.size()), dout(c.encoded_bytes(n) + offset);
    upload(din.data(), in);
    cuda::encode(c, din.data(), n, t, dout.data() + offset, c.encoded_bytes(n), seed, stream_);
    check(cudaStreamSynchronize(stream_), "encode");
    return download(dout.data() + offset, c.encoded_bytes(n));
  }

  // Decodes `buf` on the GPU into a copy of `init` (count elements of t).
  std::vector<std::byte> gpu_decode(const Codec& c, const std::vector<std::byte>& buf, size_t n, DType t,
                                    bool acc, const std::vector<std::byte>& init, size_t offset) {
    DeviceBuffer din(buf.size() + offset), dout(init.size());
    upload(din.data() + offset, buf);
    upload(dout.data(), init);
    cuda::decode(c, din.data() + offset, buf.size(), dout.data(), n, t, acc, stream_);
    check(cudaStreamSynchronize(stream_), "decode");
    return download(dout.data(), init.size());
  }

  cudaStream_t stream_ = nullptr;
};

TEST_F(CudaCodecs, EncodeIsByteIdenticalToCpu) {
  for_each_input(
      {0, 1, 3, 8, 13, 33, 999, 1025, 4133, (1u << 20) + 5},
      [&](const CodecParams&, const Codec& c, DType t, size_t n, int kind, const std::vector<std::byte>& in) {
        const uint64_t seed = 0xabcdef ^ n ^ static_cast<uint64_t>(kind);
        // Odd output offsets: encodings are packed back to back in practice.
        ASSERT_EQ(gpu_encode(c, in, n, t, seed, n % 3), cpu_encode(c, in, n, t, seed))
            << c.name() << " " << dtype_name(t) << " n=" << n << " kind=" << kind;
      });
}

// Any bit pattern: the scalar CPU kernels' bytes, NaNs included (up to NaN payloads in the chunk
// floats). Not float64: the GPU rounds a float64 NaN to its canonical float32 NaN, which then
// also reaches the codes of the casts, where x86 keeps the top payload bits.
TEST_F(CudaCodecs, EncodeAnyBitsAsScalarCpu) {
  std::mt19937_64 rng(8);
  for (int round = 0; round < 8; ++round) {
    const size_t n = 1 + rng() % 5000;
    const auto raw = random_bytes(rng, 4 * n);
    for (DType t : {DType::F32, DType::F16, DType::BF16}) {
      for (const CodecParams& p : all_params()) {
        auto codec = make_codec(p);
        auto got = gpu_encode(*codec, raw, n, t, 3, 1);
        got.erase(got.begin(), got.begin() + 32);
        ASSERT_EQ(nan_blind(p, got, n), nan_blind(p, cpu_encode_scalar(p, *codec, raw, n, t, 3), n))
            << codec->name() << " " << dtype_name(t) << " round " << round;
      }
    }
  }
}

// core/half.h's NaN rule on the GPU (CudaCodecOps.SignallingNanComesOutQuietOnEveryPath runs the
// same functions on the host). Not float64 in or out: the GPU's conversions between float and
// double may return its canonical NaN (see EncodeAnyBitsAsScalarCpu).
TEST_F(CudaCodecs, SignallingNanComesOutQuiet) {
  for (const CodecParams& p : {CodecParams{Kind::kF16, 0, 16}, CodecParams{Kind::kBF16, 0, 16}}) {
    auto codec = make_codec(p);
    const DType c = p.kind == Kind::kBF16 ? DType::BF16 : DType::F16;
    for (DType t : {DType::F16, DType::BF16, DType::F32}) {
      const auto in_bits = nans_of(t);
      const size_t n = in_bits.size();
      const auto got = gpu_encode(*codec, pack_bits(t, in_bits), n, t, 0, 1);
      EXPECT_EQ(unpack_bits(c, got.data() + 32, n), rule_encode(t, in_bits, c))
          << codec->name() << " encode " << dtype_name(t);
      // NaN codes as a peer could send them: a valid header, any body.
      const auto code_bits = nans_of(c);
      auto buf = cpu_encode(*codec, std::vector<std::byte>(4 * n), n, DType::F32, 0);
      const auto body = pack_bits(c, code_bits);
      std::copy(body.begin(), body.end(), buf.begin() + 32);
      const auto out = gpu_decode(*codec, buf, n, t, false, std::vector<std::byte>(dtype_size(t) * n), 1);
      EXPECT_EQ(unpack_bits(t, out.data(), n), rule_decode(c, code_bits, t))
          << codec->name() << " decode into " << dtype_name(t);
    }
  }
}

TEST_F(CudaCodecs, DecodeAndAccumulateAsScalarCpu) {
  for (const CodecParams& p : all_params()) {
    auto codec = make_codec(p);
    for (size_t n : {size_t{1}, size_t{13}, size_t{1025}, size_t{4133}, size_t{(1u << 20) + 3}}) {
      // A chunk with a float32-overflowing range takes MinMaxU8's double path.
      const auto x = to_dtype(DType::F64, values(n, n == 13 ? 3 : 0, 21));
      const auto buf = cpu_encode(*codec, x, n, DType::F64, 5);
      for (DType t : kFloatTypes) {
        for (bool acc : {false, true}) {
          const auto init = to_dtype(t, values(n, 0, 22));
          auto want = init;
          cpu_decode_scalar(p, buf, n, want.data(), t, acc);
          ASSERT_EQ(values_nan_blind(t, gpu_decode(*codec, buf, n, t, acc, init, n % 2)),
                    values_nan_blind(t, want))
              << codec->name() << " into " << dtype_name(t) << " n=" << n << " acc=" << acc;
        }
      }
    }
  }
}

// Decoding what the GPU encoded, on the GPU, equals the CPU's decode of the CPU's encoding.
TEST_F(CudaCodecs, RoundTripOnDevice) {
  const size_t n = 100003;
  for (const CodecParams& p : all_params()) {
    auto codec = make_codec(p);
    const auto x = to_dtype(DType::F32, values(n, 0, 9));
    DeviceBuffer din(x.size()), denc(codec->encoded_bytes(n)), dout(4 * n);
    upload(din.data(), x);
    cuda::encode(*codec, din.data(), n, DType::F32, denc.data(), denc.bytes, 77, stream_);
    cuda::decode(*codec, denc.data(), denc.bytes, dout.data(), n, DType::F32, false, stream_);
    check(cudaStreamSynchronize(stream_), "round trip");
    std::vector<std::byte> want(4 * n);
    cpu_decode_scalar(p, cpu_encode(*codec, x, n, DType::F32, 77), n, want.data(), DType::F32, false);
    ASSERT_EQ(download(dout.data(), 4 * n), want) << codec->name();
  }
}

void expect_invalid(const std::function<void()>& f, const std::string& words) {
  try {
    f();
    ADD_FAILURE() << "no error; expected one saying " << words;
  } catch (const Error& e) {
    EXPECT_EQ(e.kind(), ErrorKind::kInvalidArgument) << e.what();
    EXPECT_NE(std::string(e.what()).find(words), std::string::npos) << e.what();
    EXPECT_NE(std::string(e.what()).find("(CUDA)"), std::string::npos) << e.what();
  }
}

TEST_F(CudaCodecs, DecoderRejectsCorruptAndTruncatedHeaders) {
  auto codec = make_codec({Kind::kQSGD, 64, 16});
  const size_t n = 1000;
  const auto x = to_dtype(DType::F32, values(n, 0, 1));
  const auto good = cpu_encode(*codec, x, n, DType::F32, 1);
  DeviceBuffer din(good.size()), dout(4 * n);
  auto decode_bytes = [&](const std::vector<std::byte>& b, size_t len, size_t count) {
    upload(din.data(), b);
    cuda::decode(*codec, din.data(), len, dout.data(), count, DType::F32, false, stream_);
  };
  struct Case {
    size_t offset;
    std::byte value;
    const char* words;
  };
  for (const Case& c : {Case{0, std::byte{0}, "bad magic"}, Case{4, std::byte{1}, "codec kind"},
                        Case{5, std::byte{9}, "format version"}, Case{6, std::byte{1}, "reserved"},
                        Case{8, std::byte{65}, "chunk"}, Case{12, std::byte{17}, "levels"},
                        Case{16, std::byte{0xe7}, "elements"}, Case{30, std::byte{1}, "reserved"}}) {
    auto bad = good;
    bad[c.offset] = c.value;
    expect_invalid([&] { decode_bytes(bad, bad.size(), n); }, c.words);
  }
  expect_invalid([&] { decode_bytes(good, good.size() - 1, n); }, "bytes, the encoding of");
  expect_invalid([&] { decode_bytes(good, 31, n); }, "shorter than the 32-byte header");
  expect_invalid([&] { decode_bytes(good, good.size(), n - 1); }, "elements, expected");
  // The good buffer still decodes after all that.
  decode_bytes(good, good.size(), n);
  check(cudaStreamSynchronize(stream_), "decode");
}

TEST_F(CudaCodecs, RejectsBadArguments) {
  auto codec = make_codec({Kind::kMinMaxU8, 0, 16});
  const size_t n = 100;
  DeviceBuffer din(8 * n), dout(codec->encoded_bytes(n));
  std::vector<float> host(n);
  std::vector<std::byte> host_out(codec->encoded_bytes(n));
  expect_invalid(
      [&] { cuda::encode(*codec, din.data(), n, DType::F32, dout.data(), dout.bytes - 1, 0, stream_); },
      "output buffer is");
  expect_invalid(
      [&] { cuda::encode(*codec, din.data(), n, DType::I32, dout.data(), dout.bytes, 0, stream_); },
      "unsupported dtype");
  expect_invalid(
      [&] { cuda::encode(*codec, host.data(), n, DType::F32, dout.data(), dout.bytes, 0, stream_); },
      "input is host memory");
  expect_invalid(
      [&] { cuda::encode(*codec, din.data(), n, DType::F32, host_out.data(), host_out.size(), 0, stream_); },
      "output is host memory");
  expect_invalid(
      [&] { cuda::encode(*codec, din.data() + 2, n, DType::F32, dout.data(), dout.bytes, 0, stream_); },
      "not aligned");
  expect_invalid([&] { cuda::encode(*codec, nullptr, n, DType::F32, dout.data(), dout.bytes, 0, stream_); },
                 "null buffer");
  expect_invalid(
      [&] { cuda::decode(*codec, dout.data(), dout.bytes, host.data(), n, DType::F32, false, stream_); },
      "output is host memory");
  // An empty tensor encodes to a bare header, which decodes to nothing (on the default stream).
  cuda::encode(*codec, nullptr, 0, DType::F32, dout.data(), 32, 0, nullptr);
  cuda::decode(*codec, dout.data(), 32, nullptr, 0, DType::F32, true, nullptr);
  check(cudaDeviceSynchronize(), "empty");
  const std::vector<std::byte> cpu_header = cpu_encode(*codec, {}, 0, DType::F32, 0);
  EXPECT_EQ(download(dout.data(), 32), cpu_header);
}

#else

TEST(CudaCodecs, NotBuilt) {
  if (gpu_expected()) FAIL() << "RUMOR_EXPECT_GPU=1 but this build has no CUDA kernels";
  GTEST_SKIP() << "built without CUDA (nvcc not found or RUMOR_CUDA=OFF)";
}

#endif

}  // namespace
