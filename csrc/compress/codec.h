// Gradient codecs: fewer bytes on the wire for a bounded loss of precision. Every encoding is
// self-describing (a header names the codec, the element count and the chunking) and its size
// depends only on the element count and the codec's parameters, so ranks can post receives of
// the right length without a size exchange. Decoders validate the header and every length
// before touching memory: a truncated or corrupt buffer is an Error(kInvalidArgument), never an
// out-of-bounds read or write.
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>

#include "core/types.h"

namespace rumor::compress {

enum class Kind : uint8_t {
  kMinMaxU8 = 1,  // per chunk: min, max, one uint8 per element
  kQSGD = 2,      // per chunk: L2 norm, sign + stochastic level in [0, levels]
  kSign = 3,      // per chunk: one scale (mean |x|), one bit per element
  kF16 = 4,       // IEEE half, round to nearest even
  kBF16 = 5,      // bfloat16, round to nearest even
};

struct CodecParams {
  Kind kind = Kind::kMinMaxU8;
  uint32_t chunk = 0;    // elements per chunk; 0 = the codec's default
  uint32_t levels = 16;  // QSGD only: quantization levels s, 2..256
};

// The 32-byte header every encoding starts with (little-endian, as laid out in memory here).
struct EncodingHeader {
  uint32_t magic;
  uint8_t kind;
  uint8_t version;
  uint16_t zero16;
  uint32_t chunk;
  uint32_t levels;
  uint64_t count;
  uint64_t zero64;
};
static_assert(sizeof(EncodingHeader) == 32);

class Codec {
 public:
  virtual ~Codec() = default;
  virtual Kind kind() const = 0;
  virtual std::string name() const = 0;
  // Bytes that the encoding of `count` elements takes, header included.
  virtual size_t encoded_bytes(size_t count) const = 0;
  // Encodes count elements of `in` (dtype F32, F16, BF16 or F64) into out (exactly
  // encoded_bytes(count) bytes). `seed` drives stochastic rounding (QSGD); the same seed and input
  // give the same bytes.
  virtual void encode(const void* in, size_t count, DType dtype, std::byte* out, size_t out_bytes,
                      uint64_t seed = 0) const = 0;
  // Decodes `in` (in_bytes long) into count elements of out. With accumulate, adds the decoded
  // values into out instead of overwriting it. Throws Error(kInvalidArgument) when the header
  // or the length does not match count / this codec.
  virtual void decode(const std::byte* in, size_t in_bytes, void* out, size_t count, DType dtype,
                      bool accumulate = false) const = 0;
  // decode()'s checks of an encoding in_bytes long whose header is `header` (32 readable bytes,
  // e.g. a host copy of a device buffer's): throws Error(kInvalidArgument), its message starting
  // with `who`, unless it is this codec's encoding of count elements.
  virtual void check_encoding(const std::byte* header, size_t in_bytes, size_t count,
                              const std::string& who) const = 0;
};

// The sign codec written tile by tile, with its compression error: for 1-bit error feedback,
// where the input is computed on the fly (1-bit Adam's momentum update) and the error
// e = x - decode(encode(x)) is needed as well. Each tile is produced, encoded and its error taken
// while it is in cache: one pass over memory instead of four. The bytes equal encode()'s.
class SignTileEncoder {
 public:
  // sign_codec must be a Kind::kSign codec; writes the header of the encoding of `count`
  // float32 elements into out (exactly sign_codec.encoded_bytes(count) bytes).
  SignTileEncoder(const Codec& sign_codec, size_t count, std::byte* out, size_t out_bytes);
  // Elements per tile: a multiple of the chunk, small enough to stay in L2.
  size_t tile() const { return tile_; }
  // Encodes elements [begin, begin + n) of the buffer, given in x (float32), and writes
  // err[i] = x[i] - decoded[i]. begin must be a multiple of tile(), n == tile() except for the
  // last tile; x and err may not overlap.
  void encode_tile(size_t begin, const float* x, size_t n, float* err) const;

 private:
  size_t count_;
  uint32_t chunk_;
  size_t tile_;
  std::byte* scales_;
  std::byte* bits_;
};

// Throws Error(kInvalidArgument) for bad parameters (e.g. levels outside 2..256).
std::unique_ptr<Codec> make_codec(const CodecParams& params);

// Which kernel set the codecs dispatch to on this CPU ("avx2" or "generic").
const char* codec_isa();

}  // namespace rumor::compress
