// Codec tests: error bounds per codec and dtype, exact constants, scalar vs AVX2 byte identity,
// QSGD reproducibility and unbiasedness, and a mutation fuzz of the decoder (run under
// ASan+UBSan in CI: any out-of-bounds access or undefined conversion fails the build).
#include <gtest/gtest.h>

#include <cfloat>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <ctime>
#include <random>
#include <vector>

#include "compress/codec.h"
#include "compress/kernels.h"

using namespace rumor;
using namespace rumor::compress;

namespace {

const DType kFloatTypes[] = {DType::F32, DType::F16, DType::BF16, DType::F64};

float bf16_to_f32(uint16_t h) {
  uint32_t u = static_cast<uint32_t>(h) << 16;
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

// Independent reference for bfloat16 rounding (nearest even via double arithmetic).
uint16_t ref_f32_to_bf16(float f) {
  if (std::isnan(f)) {
    uint32_t u;
    std::memcpy(&u, &f, 4);
    return static_cast<uint16_t>((u >> 16) | 0x40u);
  }
  uint32_t u;
  std::memcpy(&u, &f, 4);
  uint16_t lo = static_cast<uint16_t>(u >> 16);
  if ((u & 0xffffu) == 0) return lo;
  // Candidates: truncation toward zero and the next bfloat16 away from zero.
  uint16_t hi = static_cast<uint16_t>(lo + 1);
  double d = f, a = bf16_to_f32(lo), b = bf16_to_f32(hi);
  double da = std::fabs(d - a), db = std::fabs(b - d);
  if (da < db) return lo;
  if (db < da) return hi;
  return (lo & 1u) ? hi : lo;
}

uint16_t ref_f32_to_f16(float f) {
  _Float16 h = static_cast<_Float16>(f);
  uint16_t u;
  std::memcpy(&u, &h, 2);
  return u;
}

float f16_to_f32(uint16_t u) {
  _Float16 h;
  std::memcpy(&h, &u, 2);
  return static_cast<float>(h);
}

// A tensor of one float dtype, and the float32 values the codecs see when reading it.
struct Tensor {
  DType dtype;
  std::vector<std::byte> bytes;
  std::vector<float> seen;  // float(x) per element
  size_t size() const { return seen.size(); }
  const void* data() const { return bytes.data(); }
};

Tensor make_tensor(DType t, const std::vector<double>& v) {
  Tensor out{t, std::vector<std::byte>(v.size() * dtype_size(t)), {}};
  for (size_t i = 0; i < v.size(); ++i) {
    float seen = 0;
    switch (t) {
      case DType::F32: {
        float f = static_cast<float>(v[i]);
        std::memcpy(out.bytes.data() + 4 * i, &f, 4);
        seen = f;
        break;
      }
      case DType::F64: {
        std::memcpy(out.bytes.data() + 8 * i, &v[i], 8);
        seen = static_cast<float>(v[i]);
        break;
      }
      case DType::F16: {
        uint16_t h = ref_f32_to_f16(static_cast<float>(v[i]));
        std::memcpy(out.bytes.data() + 2 * i, &h, 2);
        seen = f16_to_f32(h);
        break;
      }
      case DType::BF16: {
        uint16_t h = ref_f32_to_bf16(static_cast<float>(v[i]));
        std::memcpy(out.bytes.data() + 2 * i, &h, 2);
        seen = bf16_to_f32(h);
        break;
      }
      default:
        ADD_FAILURE();
    }
    out.seen.push_back(seen);
  }
  return out;
}

std::vector<std::byte> encode(const Codec& c, const Tensor& t, uint64_t seed = 0) {
  std::vector<std::byte> buf(c.encoded_bytes(t.size()));
  c.encode(t.data(), t.size(), t.dtype, buf.data(), buf.size(), seed);
  return buf;
}

std::vector<float> decode_f32(const Codec& c, const std::vector<std::byte>& buf, size_t n) {
  std::vector<float> out(n, -12345.f);
  c.decode(buf.data(), buf.size(), out.data(), n, DType::F32);
  return out;
}

std::vector<double> random_values(size_t n, double scale, uint32_t seed) {
  std::mt19937 g(seed);
  std::normal_distribution<double> d(0.0, scale);
  std::vector<double> v(n);
  for (auto& x : v) x = d(g);
  return v;
}

// Input families the round-trip tests sweep: sizes cover empty, tiny, exactly one chunk, a
// partial last chunk and several chunks.
struct Case {
  const char* what;
  std::vector<double> values;
};

std::vector<Case> cases(DType t) {
  const double huge = t == DType::F16 ? 6.0e4 : 1.0e30;  // f16 overflows beyond 65504
  std::vector<Case> out;
  for (size_t n : {0, 1, 3, 7, 8, 9, 100, 1024, 1025, 3000}) {
    out.push_back({"random", random_values(n, 1.0, static_cast<uint32_t>(n))});
  }
  out.push_back({"constant", std::vector<double>(2500, 0.375)});
  out.push_back({"constant negative", std::vector<double>(1030, -7.5)});
  out.push_back({"zeros", std::vector<double>(1100, 0.0)});
  std::vector<double> h = random_values(2100, 1.0, 7);
  for (size_t i = 0; i < h.size(); ++i) h[i] = (i % 3 == 0 ? -huge : huge) * (0.5 + std::fabs(h[i]) / 8);
  out.push_back({"huge mixed signs", h});
  if (t != DType::F16) {
    // Finite values whose range overflows float32: MinMaxU8 falls back to double for the chunk.
    std::vector<double> e = random_values(1100, 1.0, 9);
    for (size_t i = 0; i < e.size(); ++i)
      e[i] = (i % 2 ? 3.0e38 : -3.0e38) * std::min(1.0, 0.9 + std::fabs(e[i]) / 10);
    out.push_back({"extreme range", e});
  }
  if (t != DType::F16) {
    // Ranges below 255 / FLT_MAX, where 255 / (max - min) overflows float32 (subnormals
    // included): MinMaxU8 again falls back to double.
    out.push_back({"denormal range", random_values(1100, 1e-38, 10)});
  }
  std::vector<double> tiny = random_values(1500, 1e-30, 8);
  out.push_back({"tiny magnitudes", tiny});
  return out;
}

// Per chunk min, max, L2 norm and mean |x| of the values a codec sees.
struct ChunkStats {
  float lo, hi;
  double norm, mean_abs;
};
ChunkStats stats(const std::vector<float>& x, size_t c0, size_t n) {
  ChunkStats s{x[c0], x[c0], 0, 0};
  for (size_t j = 0; j < n; ++j) {
    float v = x[c0 + j];
    s.lo = std::min(s.lo, v);
    s.hi = std::max(s.hi, v);
    s.norm += static_cast<double>(v) * v;
    s.mean_abs += std::fabs(static_cast<double>(v));
  }
  s.norm = std::sqrt(s.norm);
  s.mean_abs /= static_cast<double>(n);
  return s;
}

constexpr double kEps = FLT_EPSILON;  // 2^-23

void check_minmax(const Tensor& t, const std::vector<float>& dec, uint32_t chunk, const char* what) {
  for (size_t c0 = 0; c0 < t.size(); c0 += chunk) {
    size_t n = std::min<size_t>(chunk, t.size() - c0);
    ChunkStats s = stats(t.seen, c0, n);
    double range = static_cast<double>(s.hi) - s.lo;
    // Quantization error range/510 plus a few roundings of float arithmetic at the chunk's scale
    // (the scaled value, the step, the product and the sum each round once).
    double mag =
        std::max({std::fabs(static_cast<double>(s.lo)), std::fabs(static_cast<double>(s.hi)), range});
    double bound = range / 510 + 4 * kEps * mag;
    for (size_t j = 0; j < n; ++j) {
      double x = t.seen[c0 + j], d = dec[c0 + j];
      if (range == 0) {
        ASSERT_EQ(d, x) << what << " constant chunk must decode exactly, element " << c0 + j;
      } else {
        ASSERT_LE(std::fabs(d - x), bound) << what << " element " << c0 + j << " x=" << x << " decoded " << d;
      }
    }
  }
}

void check_qsgd(const Tensor& t, const std::vector<float>& dec, uint32_t chunk, uint32_t levels,
                const char* what) {
  for (size_t c0 = 0; c0 < t.size(); c0 += chunk) {
    size_t n = std::min<size_t>(chunk, t.size() - c0);
    ChunkStats s = stats(t.seen, c0, n);
    // One level apart at most (levels are norm'/s apart for the stored norm', whose float32
    // sum of squares is within 40 ulp, so norm' within 20 ulp of the norm), plus float rounding
    // of the step and the product. A subnormal step (norm below about 1e-36) rounds in absolute terms: at
    // most 2^-150, times up to `levels` in the product.
    double bound = s.norm / levels * (1 + 20 * kEps / 2) + 4 * kEps * s.norm + levels * 0x1p-149;
    for (size_t j = 0; j < n; ++j) {
      double x = t.seen[c0 + j], d = dec[c0 + j];
      ASSERT_LE(std::fabs(d - x), bound) << what << " element " << c0 + j << " x=" << x << " decoded " << d;
      if (d != 0) {
        ASSERT_EQ(std::signbit(d), std::signbit(x)) << what << " element " << c0 + j;
      }
    }
  }
}

void check_sign(const Tensor& t, const std::vector<float>& dec, uint32_t chunk, const char* what) {
  for (size_t c0 = 0; c0 < t.size(); c0 += chunk) {
    size_t n = std::min<size_t>(chunk, t.size() - c0);
    ChunkStats s = stats(t.seen, c0, n);
    for (size_t j = 0; j < n; ++j) {
      double x = t.seen[c0 + j], d = dec[c0 + j];
      // The scale is mean |x| summed in double and rounded once to float (half an ulp, or
      // 2^-150 where that float is subnormal), doubled for the reference sum's own rounding.
      ASSERT_NEAR(std::fabs(d), s.mean_abs, kEps * s.mean_abs + 0x1p-149) << what << " element " << c0 + j;
      bool neg = x < 0;
      ASSERT_EQ(d < 0, neg && s.mean_abs > 0) << what << " element " << c0 + j << " x=" << x;
    }
  }
}

void check_cast(Kind kind, const Tensor& t, const std::vector<float>& dec, const char* what) {
  for (size_t i = 0; i < t.size(); ++i) {
    float want =
        kind == Kind::kF16 ? f16_to_f32(ref_f32_to_f16(t.seen[i])) : bf16_to_f32(ref_f32_to_bf16(t.seen[i]));
    ASSERT_EQ(std::memcmp(&want, &dec[i], 4), 0) << what << " element " << i << " x=" << t.seen[i];
  }
}

std::vector<CodecParams> all_params() {
  return {
      {Kind::kMinMaxU8, 0, 16}, {Kind::kMinMaxU8, 64, 16}, {Kind::kQSGD, 0, 16},   {Kind::kQSGD, 8, 2},
      {Kind::kQSGD, 0, 127},    {Kind::kQSGD, 0, 128},     {Kind::kQSGD, 40, 256}, {Kind::kSign, 0, 16},
      {Kind::kSign, 24, 16},    {Kind::kF16, 0, 16},       {Kind::kBF16, 0, 16},
  };
}

uint32_t chunk_of(const CodecParams& p) { return p.chunk == 0 ? 1024 : p.chunk; }

void check_round_trip(const CodecParams& p, const Tensor& t, const std::vector<float>& dec,
                      const char* what) {
  switch (p.kind) {
    case Kind::kMinMaxU8:
      return check_minmax(t, dec, chunk_of(p), what);
    case Kind::kQSGD:
      return check_qsgd(t, dec, chunk_of(p), p.levels, what);
    case Kind::kSign:
      return check_sign(t, dec, chunk_of(p), what);
    case Kind::kF16:
    case Kind::kBF16:
      return check_cast(p.kind, t, dec, what);
  }
}

}  // namespace

TEST(CodecFormat, EncodedBytesAndNames) {
  EXPECT_EQ(make_codec({Kind::kMinMaxU8, 0, 16})->encoded_bytes(0), 32u);
  EXPECT_EQ(make_codec({Kind::kMinMaxU8, 0, 16})->encoded_bytes(1025), 32u + 2 * 8 + 1025);
  EXPECT_EQ(make_codec({Kind::kQSGD, 0, 127})->encoded_bytes(1025), 32u + 2 * 4 + 1025);
  EXPECT_EQ(make_codec({Kind::kQSGD, 0, 128})->encoded_bytes(1025), 32u + 2 * 4 + 2 * 1025);
  EXPECT_EQ(make_codec({Kind::kSign, 0, 16})->encoded_bytes(1025), 32u + 2 * 4 + 129);
  EXPECT_EQ(make_codec({Kind::kF16, 0, 16})->encoded_bytes(1025), 32u + 2 * 1025);
  EXPECT_EQ(make_codec({Kind::kBF16, 0, 16})->encoded_bytes(3), 32u + 6);
  EXPECT_EQ(make_codec({Kind::kQSGD, 64, 4})->name(), "QSGD(levels=4, chunk=64)");
  EXPECT_STREQ(codec_isa(), active_kernels().isa);
}

TEST(CodecFormat, EncodingsAtAnyByteOffset) {
  // Callers pack encodings back to back, so one may start at an odd address: every read and
  // write of the header, scales and codes must be unaligned-safe (UBSan checks alignment).
  Tensor x = make_tensor(DType::F32, random_values(1037, 1.0, 13));
  for (const CodecParams& p : all_params()) {
    auto c = make_codec(p);
    auto ref = encode(*c, x, 3);
    for (size_t off : {1, 2, 3, 5}) {
      std::vector<std::byte> buf(c->encoded_bytes(x.size()) + off);
      c->encode(x.data(), x.size(), DType::F32, buf.data() + off, buf.size() - off, 3);
      ASSERT_TRUE(std::equal(ref.begin(), ref.end(), buf.begin() + static_cast<std::ptrdiff_t>(off)));
      std::vector<float> out(x.size());
      c->decode(buf.data() + off, buf.size() - off, out.data(), x.size(), DType::F32);
      EXPECT_EQ(out, decode_f32(*c, ref, x.size())) << c->name() << " offset " << off;
    }
  }
}

TEST(CodecFormat, RejectsBadParameters) {
  for (uint32_t levels : {0u, 1u, 257u, 1000u}) {
    try {
      make_codec({Kind::kQSGD, 0, levels});
      FAIL() << "levels " << levels << " accepted";
    } catch (const Error& e) {
      EXPECT_EQ(e.kind(), ErrorKind::kInvalidArgument);
      EXPECT_NE(std::string(e.what()).find("QSGD"), std::string::npos) << e.what();
    }
  }
  for (uint32_t chunk : {1u, 7u, 100u, (1u << 24) + 8})
    EXPECT_THROW(make_codec({Kind::kSign, chunk, 16}), Error);
  EXPECT_THROW(make_codec({static_cast<Kind>(9), 0, 16}), Error);
  auto c = make_codec({Kind::kMinMaxU8, 0, 16});
  std::vector<std::byte> buf(c->encoded_bytes(4));
  int32_t ints[4] = {};
  EXPECT_THROW(c->encode(ints, 4, DType::I32, buf.data(), buf.size()), Error);
  float f[4] = {};
  EXPECT_THROW(c->encode(f, 4, DType::F32, buf.data(), buf.size() - 1), Error);
  EXPECT_THROW(c->encode(f, 4, DType::F32, buf.data(), buf.size() + 1), Error);
}

TEST(CodecRoundTrip, EveryCodecDtypeAndShape) {
  for (const CodecParams& p : all_params()) {
    auto codec = make_codec(p);
    for (DType t : kFloatTypes) {
      for (const Case& c : cases(t)) {
        // QSGD needs a finite chunk norm in float32, which values near the float32 limit lack.
        if (p.kind == Kind::kQSGD && std::string(c.what) == "extreme range") continue;
        Tensor x = make_tensor(t, c.values);
        std::string what = codec->name() + " " + std::string(dtype_name(t)) + " " + c.what +
                           " n=" + std::to_string(c.values.size());
        auto buf = encode(*codec, x, 42);
        auto dec = decode_f32(*codec, buf, x.size());
        check_round_trip(p, x, dec, what.c_str());
        if (HasFatalFailure()) return;
      }
    }
  }
}

TEST(CodecRoundTrip, DecodeIntoEveryDtypeAndAccumulate) {
  for (const CodecParams& p : all_params()) {
    auto codec = make_codec(p);
    Tensor x = make_tensor(DType::F32, random_values(2500, 3.0, 11));
    auto buf = encode(*codec, x, 5);
    auto dec = decode_f32(*codec, buf, x.size());
    std::vector<double> base = random_values(x.size(), 1.0, 12);
    for (DType t : kFloatTypes) {
      for (bool acc : {false, true}) {
        Tensor out = make_tensor(t, base);
        const Tensor prior = out;
        codec->decode(buf.data(), buf.size(), out.bytes.data(), x.size(), t, acc);
        for (size_t i = 0; i < x.size(); ++i) {
          // The expected value: the float32 decode, added to the prior value (in float64 for
          // float64 output, in float otherwise) and rounded once into the output dtype.
          double got, want;
          switch (t) {
            case DType::F64: {
              std::memcpy(&got, out.bytes.data() + 8 * i, 8);
              want = acc ? base[i] + static_cast<double>(dec[i]) : dec[i];
              break;
            }
            case DType::F32: {
              float g;
              std::memcpy(&g, out.bytes.data() + 4 * i, 4);
              got = g;
              want = acc ? static_cast<float>(base[i]) + dec[i] : dec[i];
              break;
            }
            case DType::F16: {
              uint16_t h;
              std::memcpy(&h, out.bytes.data() + 2 * i, 2);
              got = f16_to_f32(h);
              want = f16_to_f32(ref_f32_to_f16(acc ? prior.seen[i] + dec[i] : dec[i]));
              break;
            }
            default: {
              uint16_t h;
              std::memcpy(&h, out.bytes.data() + 2 * i, 2);
              got = bf16_to_f32(h);
              want = bf16_to_f32(ref_f32_to_bf16(acc ? prior.seen[i] + dec[i] : dec[i]));
              break;
            }
          }
          ASSERT_EQ(got, want) << codec->name() << " into " << dtype_name(t) << " acc=" << acc << " element "
                               << i;
        }
      }
    }
  }
}

TEST(CodecRoundTrip, NonFiniteInputsAreSafe) {
  // Garbage in, garbage out, but never undefined behaviour (UBSan checks the float-to-int
  // conversions) and finite chunks elsewhere in the tensor are unaffected.
  std::vector<double> v = random_values(3000, 1.0, 3);
  v[5] = INFINITY;
  v[6] = -INFINITY;
  v[7] = NAN;
  v[1500] = NAN;
  for (const CodecParams& p : all_params()) {
    auto codec = make_codec(p);
    for (DType t : kFloatTypes) {
      Tensor x = make_tensor(t, v);
      auto buf = encode(*codec, x, 1);
      auto dec = decode_f32(*codec, buf, x.size());
      if (p.kind == Kind::kF16 || p.kind == Kind::kBF16) {
        EXPECT_TRUE(std::isnan(dec[7]));
        EXPECT_EQ(dec[5], INFINITY);
        EXPECT_EQ(dec[6], -INFINITY);
      }
      // The third chunk (elements 2048..2999 for chunk 1024) holds only finite values.
      if (chunk_of(p) == 1024) {
        Tensor tail = make_tensor(t, std::vector<double>(v.begin() + 2048, v.end()));
        std::vector<float> dtail(dec.begin() + 2048, dec.end());
        CodecParams q = p;
        check_round_trip(q, tail, dtail, (codec->name() + " finite tail").c_str());
      }
    }
  }
}

TEST(CodecRoundTrip, Float64BeyondFloat32Range) {
  // Rounded to float32 as IEEE does (to infinity past FLT_MAX + half an ulp, to FLT_MAX below),
  // without the undefined C++ conversion (UBSan's float-cast-overflow would flag it).
  const double just_above = static_cast<double>(FLT_MAX) + 0x1p102;
  const double in[] = {1e300, -1e300, just_above, FLT_MAX, 0x1.ffffffp127};
  for (Kind kind : {Kind::kMinMaxU8, Kind::kF16, Kind::kBF16}) {
    auto c = make_codec({kind, 8, 16});
    std::vector<std::byte> buf(c->encoded_bytes(5));
    c->encode(in, 5, DType::F64, buf.data(), buf.size());
    float out[5];
    c->decode(buf.data(), buf.size(), out, 5, DType::F32);
    if (kind != Kind::kMinMaxU8) {
      EXPECT_EQ(out[0], INFINITY);
      EXPECT_EQ(out[1], -INFINITY);
      EXPECT_EQ(out[4], INFINITY);
    }
  }
  for (const KernelSet* k : {kernel_set(Isa::kGeneric), kernel_set(Isa::kAvx2)}) {
    if (k == nullptr) continue;
    // A chunk of {just_above, FLT_MAX} is constant in float32 and decodes exactly.
    const double pair[] = {just_above, FLT_MAX};
    std::byte sc[8], co[2];
    k->minmax_encode(pair, DType::F64, 2, 8, sc, co);
    float out[2];
    k->minmax_decode(sc, co, 2, 8, out, DType::F32, false);
    EXPECT_EQ(out[0], FLT_MAX) << k->isa;
    EXPECT_EQ(out[1], FLT_MAX) << k->isa;
  }
}

TEST(CodecKernels, ScalarAndAvx2EncodeIdenticalBytes) {
  const KernelSet* g = kernel_set(Isa::kGeneric);
  const KernelSet* v = kernel_set(Isa::kAvx2);
  ASSERT_NE(g, nullptr);
  if (v == nullptr) GTEST_SKIP() << "no AVX2 on this CPU";
  std::mt19937 rng(99);
  for (DType t : kFloatTypes) {
    for (size_t n : {1, 3, 8, 13, 31, 64, 999, 1000, 1024, 4131, 4133}) {
      for (uint32_t chunk : {8u, 24u, 1024u}) {
        std::vector<double> vals = random_values(n, 2.0, static_cast<uint32_t>(n * 7 + chunk));
        // Sizes divisible by 5: magnitudes around 1e-38, where MinMaxU8 quantizes in double and
        // QSGD redoes its sum of squares in double and divides by the norm.
        if (n % 5 == 0 && t != DType::F16) {
          for (auto& v : vals) v *= 1e-38;
        }
        // Sizes divisible by 3: non-negative values and zeros of both signs, -0 first in element
        // order but +0 first in lane order, which then decide MinMaxU8's min.
        if (n % 3 == 0) {
          for (size_t i = 0; i < n; ++i) {
            vals[i] = std::fabs(vals[i]);
            if (i % 8 == 4) vals[i] = -0.0;
            if (i % 8 == 1 && i > 8) vals[i] = 0.0;
          }
        }
        // Values on exact rounding ties of the minmax grid, zeros and negative zeros.
        for (size_t i = 0; i < n; i += 5) vals[i] = std::round(vals[i] * 4) / 4;
        for (size_t i = 2; i < n; i += 11) vals[i] = (i % 2) ? -0.0 : 0.0;
        // A first chunk whose range overflows float32 (MinMaxU8's double fallback, QSGD's
        // infinite norm), beyond float16's range.
        if (n >= 13 && t != DType::F16) {
          vals[1] = 3.0e38;
          vals[4] = -3.1e38;
        }
        Tensor x = make_tensor(t, vals);
        size_t nc = (n + chunk - 1) / chunk;
        auto run = [&](const KernelSet* k, auto&& fn) {
          std::vector<std::byte> sc(8 * nc, std::byte{0xAA}), co(2 * n + 1, std::byte{0xAA});
          fn(k, sc.data(), co.data());
          sc.insert(sc.end(), co.begin(), co.end());
          return sc;
        };
        auto mm = [&](const KernelSet* k, std::byte* s, std::byte* c) {
          k->minmax_encode(x.data(), t, n, chunk, s, c);
        };
        EXPECT_EQ(run(g, mm), run(v, mm)) << "minmax " << dtype_name(t) << " n=" << n << " chunk=" << chunk;
        for (uint32_t levels : {2u, 16u, 127u, 128u, 256u}) {
          for (uint64_t seed : {0ull, 1ull, 0xdeadbeefcafeull}) {
            auto q = [&](const KernelSet* k, std::byte* s, std::byte* c) {
              k->qsgd_encode(x.data(), t, n, chunk, levels, seed, s, c);
            };
            EXPECT_EQ(run(g, q), run(v, q)) << "qsgd " << dtype_name(t) << " n=" << n << " levels=" << levels;
          }
        }
        auto sg = [&](const KernelSet* k, std::byte* s, std::byte* c) {
          k->sign_encode(x.data(), t, n, chunk, s, c);
        };
        EXPECT_EQ(run(g, sg), run(v, sg)) << "sign " << dtype_name(t) << " n=" << n << " chunk=" << chunk;
        auto f16 = [&](const KernelSet* k, std::byte*, std::byte* c) { k->f16_encode(x.data(), t, n, c); };
        EXPECT_EQ(run(g, f16), run(v, f16)) << "f16 " << dtype_name(t) << " n=" << n;
        auto bf16 = [&](const KernelSet* k, std::byte*, std::byte* c) { k->bf16_encode(x.data(), t, n, c); };
        EXPECT_EQ(run(g, bf16), run(v, bf16)) << "bf16 " << dtype_name(t) << " n=" << n;
      }
    }
  }
}

TEST(CodecKernels, RandomBitPatterns) {
  // Arbitrary bit patterns (subnormals, infinities, NaNs with any payload) through every codec
  // and both kernel sets: no sanitizer report, and identical bytes wherever no NaN is involved.
  std::mt19937_64 rng(77);
  for (int round = 0; round < 40; ++round) {
    const size_t n = 1 + rng() % 3000;
    const bool allow_nan = round % 2 == 1;
    std::vector<uint32_t> bits32(n);
    std::vector<uint64_t> bits64(n);
    std::vector<uint16_t> bits16(n);
    for (size_t i = 0; i < n; ++i) {
      // Without NaN rounds, an all-ones exponent keeps only sign and exponent: an infinity.
      uint32_t b = static_cast<uint32_t>(rng());
      if (!allow_nan && (b & 0x7f800000u) == 0x7f800000u) b &= 0xff800000u;
      bits32[i] = b;
      uint64_t d = rng();
      if (!allow_nan && (d & 0x7ff0000000000000ull) == 0x7ff0000000000000ull) d &= 0xfff0000000000000ull;
      bits64[i] = d;
      bits16[i] = static_cast<uint16_t>(rng());
    }
    for (DType t : kFloatTypes) {
      const void* in = t == DType::F32   ? static_cast<const void*>(bits32.data())
                       : t == DType::F64 ? static_cast<const void*>(bits64.data())
                                         : static_cast<const void*>(bits16.data());
      std::vector<uint16_t> h16 = bits16;
      if (!allow_nan && (t == DType::F16 || t == DType::BF16)) {
        const uint16_t exp = t == DType::F16 ? 0x7c00 : 0x7f80;
        for (auto& h : h16)
          if ((h & exp) == exp) h = static_cast<uint16_t>(h & (0x8000 | exp));
        in = h16.data();
      }
      for (uint32_t chunk : {8u, 1024u}) {
        std::vector<std::vector<std::byte>> outs;
        for (const KernelSet* k : {kernel_set(Isa::kGeneric), kernel_set(Isa::kAvx2)}) {
          if (k == nullptr) continue;
          const size_t nc = (n + chunk - 1) / chunk;
          std::vector<std::byte> b(8 * nc + 2 * n + 4 * nc + 2 * n + 4 * nc + n + 2 * n + 2 * n);
          std::byte* p = b.data();
          k->minmax_encode(in, t, n, chunk, p, p + 8 * nc);
          p += 8 * nc + n;
          k->qsgd_encode(in, t, n, chunk, 200, 5, p, p + 4 * nc);
          p += 4 * nc + 2 * n;
          k->sign_encode(in, t, n, chunk, p, p + 4 * nc);
          p += 4 * nc + n;
          k->f16_encode(in, t, n, p);
          p += 2 * n;
          k->bf16_encode(in, t, n, p);
          // Decoding anything back must also be safe.
          std::vector<float> out(n);
          k->minmax_decode(b.data(), b.data() + 8 * nc, n, chunk, out.data(), DType::F32, true);
          outs.push_back(std::move(b));
        }
        if (outs.size() == 2 && !allow_nan) {
          EXPECT_EQ(outs[0], outs[1]) << dtype_name(t) << " n=" << n << " chunk=" << chunk;
        }
      }
    }
  }
}

TEST(CodecKernels, ScalarAndAvx2DecodeAgree) {
  const KernelSet* g = kernel_set(Isa::kGeneric);
  const KernelSet* v = kernel_set(Isa::kAvx2);
  if (v == nullptr) GTEST_SKIP() << "no AVX2 on this CPU";
  for (const CodecParams& p : all_params()) {
    auto codec = make_codec(p);
    Tensor x = make_tensor(DType::F32, random_values(4133, 1.5, 4));
    auto buf = encode(*codec, x, 9);
    for (DType t : kFloatTypes) {
      for (bool acc : {false, true}) {
        Tensor a = make_tensor(t, random_values(x.size(), 1.0, 5)), b = a;
        const std::byte* body = buf.data() + 32;
        size_t n = x.size();
        uint32_t ch = chunk_of(p);
        size_t nc = (n + ch - 1) / ch;
        for (auto [k, out] : {std::pair{g, &a}, std::pair{v, &b}}) {
          void* o = out->bytes.data();
          switch (p.kind) {
            case Kind::kMinMaxU8:
              k->minmax_decode(body, body + 8 * nc, n, ch, o, t, acc);
              break;
            case Kind::kQSGD:
              k->qsgd_decode(body, body + 4 * nc, n, ch, p.levels, o, t, acc);
              break;
            case Kind::kSign:
              k->sign_decode(body, body + 4 * nc, n, ch, o, t, acc);
              break;
            case Kind::kF16:
              k->f16_decode(body, n, o, t, acc);
              break;
            case Kind::kBF16:
              k->bf16_decode(body, n, o, t, acc);
              break;
          }
        }
        // Decoding may fuse a multiply-add on AVX2, so values may differ by one rounding of the
        // decoded value; the casts and sign decode involve no arithmetic and must match exactly.
        Tensor da = a, db = b;
        da.seen.clear();
        for (size_t i = 0; i < n; ++i) {
          float fa, fb;
          switch (t) {
            case DType::F32:
              std::memcpy(&fa, a.bytes.data() + 4 * i, 4);
              std::memcpy(&fb, b.bytes.data() + 4 * i, 4);
              break;
            case DType::F64: {
              double x1, x2;
              std::memcpy(&x1, a.bytes.data() + 8 * i, 8);
              std::memcpy(&x2, b.bytes.data() + 8 * i, 8);
              fa = static_cast<float>(x1);
              fb = static_cast<float>(x2);
              break;
            }
            default: {
              uint16_t h1, h2;
              std::memcpy(&h1, a.bytes.data() + 2 * i, 2);
              std::memcpy(&h2, b.bytes.data() + 2 * i, 2);
              fa = t == DType::F16 ? f16_to_f32(h1) : bf16_to_f32(h1);
              fb = t == DType::F16 ? f16_to_f32(h2) : bf16_to_f32(h2);
            }
          }
          double tol = (p.kind == Kind::kMinMaxU8 || p.kind == Kind::kQSGD)
                           ? 2 * std::fabs(static_cast<double>(fa)) *
                                     (t == DType::BF16  ? 1.0 / 128
                                      : t == DType::F16 ? 1.0 / 1024
                                                        : kEps) +
                                 1e-6
                           : 0.0;
          ASSERT_LE(std::fabs(static_cast<double>(fa) - fb), tol)
              << codec->name() << " into " << dtype_name(t) << " acc=" << acc << " element " << i;
        }
      }
    }
  }
}

TEST(CodecQsgd, ReproduciblePerSeed) {
  auto codec = make_codec({Kind::kQSGD, 0, 8});
  Tensor x = make_tensor(DType::F32, random_values(5000, 1.0, 21));
  EXPECT_EQ(encode(*codec, x, 7), encode(*codec, x, 7));
  EXPECT_NE(encode(*codec, x, 7), encode(*codec, x, 8));
}

TEST(CodecQsgd, UnbiasedOverSeeds) {
  // Each decode of element x lies on one of the two levels around x (spacing norm/s) and equals
  // x in expectation, so by Hoeffding the mean of N independent decodes is within
  // t = (norm/s) * sqrt(ln(2n/delta) / (2N)) of x for all n elements with probability
  // 1 - delta. The seeds are fixed, so this is deterministic; delta = 1e-6 makes a correct
  // implementation fail it only for a pathological generator.
  const uint32_t levels = 4, n = 512;
  const int N = 2000;
  auto codec = make_codec({Kind::kQSGD, n, levels});
  Tensor x = make_tensor(DType::F32, random_values(n, 1.0, 31));
  std::vector<double> mean(n, 0.0);
  for (int s = 0; s < N; ++s) {
    auto dec = decode_f32(*codec, encode(*codec, x, static_cast<uint64_t>(s) * 7919 + 3), n);
    for (uint32_t i = 0; i < n; ++i) mean[i] += dec[i] / N;
  }
  ChunkStats st = stats(x.seen, 0, n);
  const double step = st.norm / levels;
  const double t = step * std::sqrt(std::log(2.0 * n / 1e-6) / (2.0 * N)) + 8 * kEps * st.norm;
  double worst = 0;
  for (uint32_t i = 0; i < n; ++i) worst = std::max(worst, std::fabs(mean[i] - x.seen[i]));
  EXPECT_LE(worst, t) << "step " << step;
  // The same seeds also exercise every level choice: the decode is not deterministic rounding.
  EXPECT_GT(worst, 0.0);
}

namespace {

void expect_rejected(const Codec& c, const std::vector<std::byte>& buf, size_t len, size_t n,
                     const char* what) {
  std::vector<float> out(n + 1);
  try {
    c.decode(buf.data(), len, out.data(), n, DType::F32);
    ADD_FAILURE() << c.name() << " accepted " << what << " (length " << len << ")";
  } catch (const Error& e) {
    EXPECT_EQ(e.kind(), ErrorKind::kInvalidArgument);
    EXPECT_NE(std::string(e.what()).find(c.name()), std::string::npos) << e.what();
  }
}

}  // namespace

TEST(CodecFuzz, RejectsMismatchedEncodings) {
  auto mm = make_codec({Kind::kMinMaxU8, 0, 16});
  auto mm64 = make_codec({Kind::kMinMaxU8, 64, 16});
  auto q16 = make_codec({Kind::kQSGD, 0, 16});
  auto q8 = make_codec({Kind::kQSGD, 0, 8});
  auto f16 = make_codec({Kind::kF16, 0, 16});
  Tensor x = make_tensor(DType::F32, random_values(300, 1.0, 1));
  auto b = encode(*mm, x);
  expect_rejected(*mm, b, b.size(), 299, "a count mismatch");
  expect_rejected(*mm64, b, b.size(), 300, "a chunk mismatch");
  expect_rejected(*q16, b, b.size(), 300, "another codec's encoding");
  auto bq = encode(*q16, x);
  expect_rejected(*q8, bq, bq.size(), 300, "a levels mismatch");
  expect_rejected(*f16, bq, bq.size(), 300, "another codec's encoding");
  b.push_back(std::byte{0});
  expect_rejected(*mm, b, b.size(), 300, "a trailing byte");
}

TEST(CodecFuzz, TruncationAndByteFlips) {
  // RUMOR_CODEC_FUZZ_ITERATIONS raises the flips per encoding for a deeper run (and a seed).
  const char* env = std::getenv("RUMOR_CODEC_FUZZ_ITERATIONS");
  const int iterations = env != nullptr ? std::atoi(env) : 400;
  std::mt19937_64 rng(env != nullptr ? static_cast<uint64_t>(std::time(nullptr)) : 2024);
  size_t accepted = 0, rejected = 0;
  for (const CodecParams& p : all_params()) {
    auto codec = make_codec(p);
    for (size_t n : {0, 1, 3, 9, 100, 1030}) {
      Tensor x = make_tensor(DType::F32, random_values(n, 1.0, static_cast<uint32_t>(n)));
      const auto good = encode(*codec, x, 3);
      // Every length short of the full one (the decoder reads from a copy of exactly that many
      // bytes, so ASan sees any read past the end).
      for (size_t len = 0; len < good.size(); ++len) {
        std::vector<std::byte> cut(good.begin(), good.begin() + static_cast<std::ptrdiff_t>(len));
        expect_rejected(*codec, cut, len, n, "a truncated buffer");
      }
      // Random byte flips anywhere, more often in the header where every byte matters.
      for (int it = 0; it < iterations; ++it) {
        std::vector<std::byte> bad = good;
        int flips = 1 + static_cast<int>(rng() % 4);
        for (int f = 0; f < flips; ++f) {
          size_t pos = (rng() % 2 == 0) ? rng() % 32 : rng() % bad.size();
          bad[pos] ^= static_cast<std::byte>(1 + rng() % 255);
        }
        for (DType t : kFloatTypes) {
          std::vector<std::byte> out(std::max<size_t>(n, 1) * dtype_size(t));
          try {
            codec->decode(bad.data(), bad.size(), out.data(), n, t, rng() % 2 == 0);
            ++accepted;
          } catch (const Error& e) {
            ASSERT_EQ(e.kind(), ErrorKind::kInvalidArgument) << e.what();
            ++rejected;
          }
        }
      }
    }
  }
  // Both outcomes occur: body flips decode to other values, header flips are caught.
  EXPECT_GT(accepted, 0u);
  EXPECT_GT(rejected, 0u);
}
