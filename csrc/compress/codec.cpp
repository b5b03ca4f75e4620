// The codecs' wire format and its validation; the element work is in the kernel sets.
//
// Every encoding starts with a 32-byte little-endian header:
//   0  u32 magic "RMCZ"     4  u8 kind    5  u8 format version   6  u16 zero
//   8  u32 chunk (0 for the casts)        12 u32 levels (QSGD; 0 otherwise)
//   16 u64 element count    24 u64 zero
// followed by the per-chunk floats (MinMaxU8: min, max; QSGD: L2 norm; Sign: mean |x|) and then
// the per-element codes. The size is a function of (codec, count) alone.
#include "compress/codec.h"

#include <algorithm>
#include <bit>
#include <cstdlib>
#include <cstring>
#include <string_view>

#include "compress/kernels.h"
#include "core/isa_dispatch.h"

namespace rumor::compress {

static_assert(std::endian::native == std::endian::little, "the codec wire format is little endian");

namespace generic {
extern const KernelSet kKernels;
}
namespace avx2 {
extern const KernelSet kKernels;
}

namespace {

constexpr uint32_t kMagic = 0x5a434d52;  // "RMCZ"
constexpr uint8_t kVersion = 1;
constexpr size_t kHeaderBytes = 32;
constexpr uint32_t kDefaultChunk = 1024;
constexpr uint32_t kMaxChunk = 1u << 24;
// Far beyond any tensor, low enough that no size computation below can overflow.
constexpr uint64_t kMaxCount = uint64_t{1} << 48;

using Header = EncodingHeader;
static_assert(sizeof(Header) == kHeaderBytes);

uint64_t splitmix64(uint64_t x) {
  x += 0x9e3779b97f4a7c15ull;
  x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ull;
  x = (x ^ (x >> 27)) * 0x94d049bb133111ebull;
  return x ^ (x >> 31);
}

[[noreturn]] void fail(const std::string& who, const std::string& what) {
  throw Error(ErrorKind::kInvalidArgument, who + ": " + what);
}

class CodecBase : public Codec {
 public:
  CodecBase(Kind kind, uint32_t chunk, uint32_t levels) : kind_(kind), chunk_(chunk), levels_(levels) {}
  Kind kind() const override { return kind_; }
  uint32_t chunk() const { return chunk_; }
  void write_header(std::byte* out, size_t count) const {
    Header h{kMagic, static_cast<uint8_t>(kind_), kVersion, 0, chunk_, levels_, count, 0};
    std::memcpy(out, &h, sizeof(h));
  }

  size_t encoded_bytes(size_t count) const override {
    if (count > kMaxCount) fail(name(), "element count " + std::to_string(count) + " is too large");
    return kHeaderBytes + body_bytes(count);
  }

  void encode(const void* in, size_t count, DType dtype, std::byte* out, size_t out_bytes,
              uint64_t seed) const override {
    const std::string who = name() + " encode";
    check_dtype(who, dtype);
    const size_t want = encoded_bytes(count);
    if (out_bytes != want)
      fail(who, "output buffer is " + std::to_string(out_bytes) + " bytes, the encoding of " +
                    std::to_string(count) + " elements takes " + std::to_string(want));
    if (out == nullptr || (count > 0 && in == nullptr)) fail(who, "null buffer");
    write_header(out, count);
    if (count > 0) encode_body(active_kernels(), in, count, dtype, out + kHeaderBytes, seed);
  }

  void decode(const std::byte* in, size_t in_bytes, void* out, size_t count, DType dtype,
              bool accumulate) const override {
    const std::string who = name() + " decode";
    check_dtype(who, dtype);
    if (in_bytes < kHeaderBytes)
      fail(who, "buffer of " + std::to_string(in_bytes) + " bytes is shorter than the " +
                    std::to_string(kHeaderBytes) + "-byte header");
    if (in == nullptr || (count > 0 && out == nullptr)) fail(who, "null buffer");
    check_encoding(in, in_bytes, count, who);
    if (count > 0) decode_body(active_kernels(), in + kHeaderBytes, count, out, dtype, accumulate);
  }

  void check_encoding(const std::byte* header, size_t in_bytes, size_t count,
                      const std::string& who) const override {
    Header h;
    std::memcpy(&h, header, sizeof(h));
    if (h.magic != kMagic) fail(who, "bad magic (not a rumor codec encoding, or corrupt)");
    if (h.kind != static_cast<uint8_t>(kind_))
      fail(who, "encoding is of codec kind " + std::to_string(h.kind) + ", expected " +
                    std::to_string(static_cast<int>(kind_)));
    if (h.version != kVersion)
      fail(who,
           "format version " + std::to_string(h.version) + ", this build reads " + std::to_string(kVersion));
    if (h.zero16 != 0 || h.zero64 != 0) fail(who, "reserved header fields are not zero (corrupt header)");
    if (h.chunk != chunk_)
      fail(who,
           "encoding has chunk " + std::to_string(h.chunk) + ", this codec uses " + std::to_string(chunk_));
    if (h.levels != levels_)
      fail(who, "encoding has levels " + std::to_string(h.levels) + ", this codec uses " +
                    std::to_string(levels_));
    if (h.count != count)
      fail(who, "encoding holds " + std::to_string(h.count) + " elements, expected " + std::to_string(count));
    const size_t want = encoded_bytes(count);
    if (in_bytes != want)
      fail(who, "buffer is " + std::to_string(in_bytes) + " bytes, the encoding of " + std::to_string(count) +
                    " elements takes " + std::to_string(want));
  }

 protected:
  size_t chunks(size_t count) const { return (count + chunk_ - 1) / chunk_; }
  virtual size_t body_bytes(size_t count) const = 0;
  virtual void encode_body(const KernelSet& k, const void* in, size_t count, DType dtype, std::byte* body,
                           uint64_t seed) const = 0;
  virtual void decode_body(const KernelSet& k, const std::byte* body, size_t count, void* out, DType dtype,
                           bool accumulate) const = 0;

  Kind kind_;
  uint32_t chunk_;
  uint32_t levels_;

 private:
  static void check_dtype(const std::string& who, DType dtype) {
    if (dtype != DType::F32 && dtype != DType::F16 && dtype != DType::BF16 && dtype != DType::F64)
      fail(who, "unsupported dtype " + std::string(dtype_name(dtype)) +
                    "; expected float32, float16, bfloat16 or float64");
  }
};

class MinMaxU8 final : public CodecBase {
 public:
  explicit MinMaxU8(uint32_t chunk) : CodecBase(Kind::kMinMaxU8, chunk, 0) {}
  std::string name() const override { return "MinMaxU8(chunk=" + std::to_string(chunk_) + ")"; }

 protected:
  size_t body_bytes(size_t count) const override { return 8 * chunks(count) + count; }
  void encode_body(const KernelSet& k, const void* in, size_t count, DType dtype, std::byte* body,
                   uint64_t) const override {
    k.minmax_encode(in, dtype, count, chunk_, body, body + 8 * chunks(count));
  }
  void decode_body(const KernelSet& k, const std::byte* body, size_t count, void* out, DType dtype,
                   bool accumulate) const override {
    k.minmax_decode(body, body + 8 * chunks(count), count, chunk_, out, dtype, accumulate);
  }
};

class Qsgd final : public CodecBase {
 public:
  Qsgd(uint32_t chunk, uint32_t levels) : CodecBase(Kind::kQSGD, chunk, levels) {}
  std::string name() const override {
    return "QSGD(levels=" + std::to_string(levels_) + ", chunk=" + std::to_string(chunk_) + ")";
  }

 protected:
  size_t code_bytes() const { return levels_ > 127 ? 2 : 1; }
  size_t body_bytes(size_t count) const override { return 4 * chunks(count) + code_bytes() * count; }
  void encode_body(const KernelSet& k, const void* in, size_t count, DType dtype, std::byte* body,
                   uint64_t seed) const override {
    k.qsgd_encode(in, dtype, count, chunk_, levels_, seed, body, body + 4 * chunks(count));
  }
  void decode_body(const KernelSet& k, const std::byte* body, size_t count, void* out, DType dtype,
                   bool accumulate) const override {
    k.qsgd_decode(body, body + 4 * chunks(count), count, chunk_, levels_, out, dtype, accumulate);
  }
};

class SignScale final : public CodecBase {
 public:
  explicit SignScale(uint32_t chunk) : CodecBase(Kind::kSign, chunk, 0) {}
  std::string name() const override { return "SignScale(chunk=" + std::to_string(chunk_) + ")"; }

 protected:
  size_t body_bytes(size_t count) const override { return 4 * chunks(count) + (count + 7) / 8; }
  void encode_body(const KernelSet& k, const void* in, size_t count, DType dtype, std::byte* body,
                   uint64_t) const override {
    k.sign_encode(in, dtype, count, chunk_, body, body + 4 * chunks(count));
  }
  void decode_body(const KernelSet& k, const std::byte* body, size_t count, void* out, DType dtype,
                   bool accumulate) const override {
    k.sign_decode(body, body + 4 * chunks(count), count, chunk_, out, dtype, accumulate);
  }
};

class Cast final : public CodecBase {
 public:
  explicit Cast(Kind kind) : CodecBase(kind, 0, 0) {}
  std::string name() const override { return kind_ == Kind::kF16 ? "Float16" : "BFloat16"; }

 protected:
  size_t body_bytes(size_t count) const override { return 2 * count; }
  void encode_body(const KernelSet& k, const void* in, size_t count, DType dtype, std::byte* body,
                   uint64_t) const override {
    (kind_ == Kind::kF16 ? k.f16_encode : k.bf16_encode)(in, dtype, count, body);
  }
  void decode_body(const KernelSet& k, const std::byte* body, size_t count, void* out, DType dtype,
                   bool accumulate) const override {
    (kind_ == Kind::kF16 ? k.f16_decode : k.bf16_decode)(body, count, out, dtype, accumulate);
  }
};

uint32_t checked_chunk(const char* codec, uint32_t chunk) {
  if (chunk == 0) return kDefaultChunk;
  // Whole bytes of sign bits and whole vectors per chunk keep both kernel sets simple.
  if (chunk % 8 != 0 || chunk > kMaxChunk)
    fail(codec, "chunk must be a multiple of 8 in [8, " + std::to_string(kMaxChunk) + "], got " +
                    std::to_string(chunk));
  return chunk;
}

}  // namespace

QsgdKey qsgd_key(uint64_t seed) {
  const uint64_t k = splitmix64(seed);
  return QsgdKey{static_cast<uint32_t>(k), static_cast<uint32_t>(k >> 32)};
}

constexpr IsaDispatch<KernelSet> kDispatch{&generic::kKernels, RUMOR_AVX2_SET(avx2::kKernels),
                                           "RUMOR_CODEC_ISA"};

const KernelSet* kernel_set(Isa isa) { return kDispatch.set(isa); }

const KernelSet& active_kernels() { return active_set<kDispatch>(); }

const char* codec_isa() { return active_kernels().isa; }

SignTileEncoder::SignTileEncoder(const Codec& sign_codec, size_t count, std::byte* out, size_t out_bytes)
    : count_(count) {
  const auto* sign = dynamic_cast<const SignScale*>(&sign_codec);
  if (sign == nullptr) fail("SignTileEncoder", sign_codec.name() + " is not the sign codec");
  const size_t want = sign->encoded_bytes(count);
  if (out == nullptr || out_bytes != want)
    fail(sign->name() + " tile encoder", "output buffer is " + std::to_string(out_bytes) +
                                             " bytes, the encoding of " + std::to_string(count) +
                                             " elements takes " + std::to_string(want));
  chunk_ = sign->chunk();
  // 64 KiB of float32 per tile (x and err then sit in L2 together), whole chunks.
  tile_ = std::max<size_t>(1, (size_t{16} * 1024) / chunk_) * chunk_;
  sign->write_header(out, count);
  scales_ = out + kHeaderBytes;
  bits_ = scales_ + 4 * ((count + chunk_ - 1) / chunk_);
}

void SignTileEncoder::encode_tile(size_t begin, const float* x, size_t n, float* err) const {
  if (begin % tile_ != 0 || begin > count_ || n > count_ - begin || (n != tile_ && begin + n != count_))
    fail("SignTileEncoder", "tile [" + std::to_string(begin) + ", " + std::to_string(begin + n) +
                                ") does not match tiles of " + std::to_string(tile_) + " in " +
                                std::to_string(count_) + " elements");
  if (n == 0) return;
  const KernelSet& k = active_kernels();
  // Chunks are independent and a multiple of 8 elements, so a tile's scales and bits are
  // whole slices of the encoding.
  std::byte* scales = scales_ + 4 * (begin / chunk_);
  std::byte* bits = bits_ + begin / 8;
  k.sign_encode(x, DType::F32, n, chunk_, scales, bits);
  k.sign_decode(scales, bits, n, chunk_, err, DType::F32, false);
  for (size_t i = 0; i < n; ++i) err[i] = x[i] - err[i];
}

std::unique_ptr<Codec> make_codec(const CodecParams& p) {
  switch (p.kind) {
    case Kind::kMinMaxU8:
      return std::make_unique<MinMaxU8>(checked_chunk("MinMaxU8", p.chunk));
    case Kind::kQSGD:
      if (p.levels < 2 || p.levels > 256)
        fail("QSGD", "levels must be in 2..256, got " + std::to_string(p.levels));
      return std::make_unique<Qsgd>(checked_chunk("QSGD", p.chunk), p.levels);
    case Kind::kSign:
      return std::make_unique<SignScale>(checked_chunk("SignScale", p.chunk));
    case Kind::kF16:
    case Kind::kBF16:
      return std::make_unique<Cast>(p.kind);
  }
  fail("make_codec", "unknown codec kind " + std::to_string(static_cast<int>(p.kind)));
}

}  // namespace rumor::compress
