// The sign codec written tile by tile (SignTileEncoder) and the fused 1-bit momentum op built on
// it: the tiles must give exactly the bytes of a whole-buffer encode and exactly the error
// x - decode(encode(x)), and the fused op must match the unfused 1-bit allreduce bit for bit.
#include <gtest/gtest.h>

#include <random>
#include <vector>

#include "compress/codec.h"
#include "ops/onebit_allreduce.h"
#include "ranks.h"

namespace rumor {
namespace {

using namespace testing;

using compress::CodecParams;
using compress::Kind;
using compress::SignTileEncoder;

std::vector<float> random_floats(size_t n, uint32_t seed) {
  std::mt19937 gen(seed);
  std::normal_distribution<float> d(0.0f, 3.0f);
  std::vector<float> v(n);
  for (float& x : v) x = d(gen);
  return v;
}

TEST(SignTiles, SameBytesAndExactError) {
  for (uint32_t chunk : {8u, 1024u}) {
    auto codec = compress::make_codec(CodecParams{Kind::kSign, chunk, 16});
    for (size_t count : {size_t{0}, size_t{1}, size_t{7}, size_t{1023}, size_t{1024}, size_t{16384},
                         size_t{3 * 16384 + 13}}) {
      SCOPED_TRACE("chunk " + std::to_string(chunk) + " count " + std::to_string(count));
      auto x = random_floats(count, static_cast<uint32_t>(count + chunk));
      const size_t bytes = codec->encoded_bytes(count);
      std::vector<std::byte> whole(bytes), tiled(bytes);
      codec->encode(x.data(), count, DType::F32, whole.data(), bytes);
      std::vector<float> decoded(count), err(count, -1.0f);
      codec->decode(whole.data(), bytes, decoded.data(), count, DType::F32);

      SignTileEncoder tiles(*codec, count, tiled.data(), bytes);
      ASSERT_EQ(tiles.tile() % chunk, 0u);
      for (size_t t = 0; t < count; t += tiles.tile()) {
        const size_t n = std::min(tiles.tile(), count - t);
        tiles.encode_tile(t, x.data() + t, n, err.data() + t);
      }
      EXPECT_EQ(tiled, whole);
      for (size_t i = 0; i < count; ++i) ASSERT_EQ(err[i], x[i] - decoded[i]) << i;
    }
  }
}

TEST(SignTiles, RejectsBadArguments) {
  auto sign = compress::make_codec(CodecParams{Kind::kSign, 8, 16});
  auto minmax = compress::make_codec(CodecParams{Kind::kMinMaxU8, 8, 16});
  const size_t count = 40000;
  std::vector<std::byte> out(sign->encoded_bytes(count));
  EXPECT_THROW(SignTileEncoder(*minmax, count, out.data(), out.size()), Error);
  EXPECT_THROW(SignTileEncoder(*sign, count, out.data(), out.size() - 1), Error);
  SignTileEncoder tiles(*sign, count, out.data(), out.size());
  std::vector<float> x(count, 1.0f), err(count);
  EXPECT_THROW(tiles.encode_tile(8, x.data(), tiles.tile(), err.data()), Error);      // misaligned
  EXPECT_THROW(tiles.encode_tile(0, x.data(), tiles.tile() - 8, err.data()), Error);  // short, not last
  EXPECT_THROW(tiles.encode_tile(count - 8, x.data(), 16, err.data()), Error);        // past the end
}

// The fused momentum op (update computed tile by tile inside the 1-bit allreduce, with and
// without the preconditioner) against the unfused pipeline: update the momentum in a separate
// pass, then OneBitAllreduce::run with the same error buffers. Same bits, same errors.
TEST(SignTiles, FusedMomentumOpMatchesUnfused) {
  const uint32_t size = 3;
  const size_t count = 2 * 16384 + 777;
  for (bool precondition : {false, true}) {
    SCOPED_TRACE(precondition ? "preconditioned" : "plain");
    auto w = make_world(one_host(size), quick_options(true));
    auto errs = run_ranks(w, [&](Communicator& c, uint32_t r) {
      auto u0 = random_floats(count, 10 + r), g = random_floats(count, 20 + r);
      auto inv = random_floats(count, 30);
      for (float& v : inv) v = std::fabs(v) + 0.1f;
      const float b = 0.9f, a = 1.0f - b;  // as the op computes it

      // fused, two steps so that the carried errors matter
      std::vector<float> m = u0, we(count, 0.0f), se(count, 0.0f);
      ops::OneBitMomentumBucketOp op(m.data(), we.data(), se.data(), count, b, 0);
      op.set_compressing(true);
      if (precondition) op.set_preconditioner(inv.data());
      // unfused reference on its own buffers
      std::vector<float> rm = u0, rwe(count, 0.0f), rse(count, 0.0f);
      ops::OneBitAllreduce ref;
      for (int step = 0; step < 2; ++step) {
        std::vector<float> grad = g;
        op.run(c, grad.data(), count, DType::F32);
        for (size_t i = 0; i < count; ++i) rm[i] = b * rm[i] + a * g[i] * (precondition ? inv[i] : 1.0f);
        ref.run(c, rm.data(), count, rwe, rse);
        for (size_t i = 0; i < count; ++i) {
          ASSERT_EQ(m[i], rm[i]) << "momentum, step " << step << " element " << i;
          ASSERT_EQ(we[i], rwe[i]) << "worker error, step " << step << " element " << i;
          ASSERT_EQ(se[i], rse[i]) << "server error, step " << step << " element " << i;
        }
      }
    });
    expect_all_ok(errs);
  }
}

}  // namespace
}  // namespace rumor
