// Compressed allreduce and 1-bit allreduce with error feedback on 1..4 ranks (threads), against
// references that the test computes itself from the same codec calls: the pipeline is
// deterministic (seeds included), so results must match bit for bit, and be identical on every
// rank. Accuracy against the true average is checked with bounds that follow from each codec.
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <tuple>

#include "compress/codec.h"
#include "ops/compressed_allreduce.h"
#include "ops/onebit_allreduce.h"
#include "ranks.h"

namespace rumor {
namespace {

using compress::CodecParams;
using compress::Kind;
using testing::expect_all_ok;
using testing::make_world;
using testing::one_host;
using testing::quick_options;
using testing::run_ranks;
using Bytes = std::vector<std::byte>;

// Deterministic values in [-scale, scale], with scale varying along the buffer so that chunks
// see different ranges.
float value(uint32_t rank, size_t i, uint64_t salt) {
  uint64_t h = ops::encode_seed(salt, i, rank, 0, 7);
  float u = static_cast<float>(h >> 40) / static_cast<float>(1ull << 24);  // [0, 1)
  float scale = 1.0f + static_cast<float>((i / 700) % 5);
  return (2.0f * u - 1.0f) * scale;
}

void store(std::byte* p, DType dt, size_t i, float v) {
  switch (dt) {
    case DType::F32:
      std::memcpy(p + 4 * i, &v, 4);
      return;
    case DType::F16: {
      auto h = static_cast<_Float16>(v);
      std::memcpy(p + 2 * i, &h, 2);
      return;
    }
    case DType::BF16: {
      uint32_t u;
      std::memcpy(&u, &v, 4);
      auto b = static_cast<uint16_t>(u >> 16);  // truncation is fine for inputs
      std::memcpy(p + 2 * i, &b, 2);
      return;
    }
    default:
      FAIL() << "dtype";
  }
}

float load(const std::byte* p, DType dt, size_t i) {
  switch (dt) {
    case DType::F32: {
      float v;
      std::memcpy(&v, p + 4 * i, 4);
      return v;
    }
    case DType::F16: {
      _Float16 h;
      std::memcpy(&h, p + 2 * i, 2);
      return static_cast<float>(h);
    }
    case DType::BF16: {
      uint16_t b;
      std::memcpy(&b, p + 2 * i, 2);
      uint32_t u = static_cast<uint32_t>(b) << 16;
      float v;
      std::memcpy(&v, &u, 4);
      return v;
    }
    default:
      ADD_FAILURE() << "dtype";
      return 0;
  }
}

Bytes make_input(uint32_t rank, size_t count, DType dt, uint64_t salt) {
  Bytes b(count * dtype_size(dt));
  for (size_t i = 0; i < count; ++i) store(b.data(), dt, i, value(rank, i, salt));
  return b;
}

// The compressed allreduce computed in one place from the same codec calls: block j's owner j
// adds the peers' decoded encodings (in rank order) to its own contribution in float32,
// divides, encodes once, and everyone decodes that. With piece > 0 every block is encoded in
// pieces of that many elements, each under its piece seed, as the pipelined schedule does.
Bytes reference(const CodecParams& p, const std::vector<Bytes>& in, size_t count, DType dt, double divisor,
                uint64_t seed, uint64_t step, size_t piece = 0) {
  auto codec = compress::make_codec(p);
  const auto n = static_cast<uint32_t>(in.size());
  const size_t es = dtype_size(dt);
  auto counts = ops::split_blocks(count, n, ops::block_align(p));
  Bytes out(count * es);
  size_t off = 0;
  for (uint32_t j = 0; j < n; ++j) {
    const size_t c = counts[j];
    if (c == 0) continue;
    const size_t step_len = piece == 0 ? c : piece;
    for (size_t at = 0, k = 0; at < c; at += step_len, ++k) {
      const size_t len = std::min(step_len, c - at);
      const size_t eb = codec->encoded_bytes(len);
      std::vector<float> acc(len);
      for (size_t i = 0; i < len; ++i) acc[i] = load(in[j].data() + (off + at) * es, dt, i);
      Bytes enc(eb);
      for (uint32_t q = 0; q < n; ++q) {
        if (q == j) continue;
        codec->encode(in[q].data() + (off + at) * es, len, dt, enc.data(), eb,
                      ops::piece_seed(ops::encode_seed(seed, step, q, j, 0), k));
        codec->decode(enc.data(), eb, acc.data(), len, DType::F32, true);
      }
      if (divisor != 1.0)
        for (float& v : acc) v /= static_cast<float>(divisor);
      codec->encode(acc.data(), len, DType::F32, enc.data(), eb,
                    ops::piece_seed(ops::encode_seed(seed, step, j, j, 1), k));
      codec->decode(enc.data(), eb, out.data() + (off + at) * es, len, dt, false);
    }
    off += c;
  }
  return out;
}

std::string describe_first_diff(const Bytes& a, const Bytes& b, DType dt) {
  const size_t es = dtype_size(dt);
  if (a.size() != b.size()) return "sizes differ";
  for (size_t i = 0; i < a.size() / es; ++i)
    if (std::memcmp(a.data() + i * es, b.data() + i * es, es) != 0)
      return "element " + std::to_string(i) + ": " + std::to_string(load(a.data(), dt, i)) + " vs " +
             std::to_string(load(b.data(), dt, i));
  return "";
}

struct Case {
  CodecParams params;
  DType dtype;
  const char* name;
};

constexpr size_t kPiece = 2048;

std::vector<Case> cases() {
  return {
      {{Kind::kMinMaxU8, 0, 16}, DType::F32, "minmax_f32"},
      {{Kind::kMinMaxU8, 256, 16}, DType::F16, "minmax256_f16"},
      {{Kind::kQSGD, 0, 16}, DType::F32, "qsgd16_f32"},
      {{Kind::kQSGD, 512, 4}, DType::BF16, "qsgd4_bf16"},
      {{Kind::kF16, 0, 16}, DType::F32, "f16_f32"},
      {{Kind::kBF16, 0, 16}, DType::BF16, "bf16_bf16"},
  };
}

class CompressedAllreduceWorlds : public ::testing::TestWithParam<std::tuple<uint32_t, bool>> {
 protected:
  uint32_t n() const { return std::get<0>(GetParam()); }
  bool shm() const { return std::get<1>(GetParam()); }
};

// Bit-exact against the reference, identical on all ranks, several calls (seeds change per call).
TEST_P(CompressedAllreduceWorlds, MatchesReferenceOnEveryRank) {
  auto w = make_world(one_host(n()), quick_options(shm()));
  const uint32_t size = n();
  const std::vector<size_t> counts = {0, 1, 5, 1500, 70001};
  std::vector<std::vector<Bytes>> results(size);  // [rank][case*counts*calls]
  auto errs = run_ranks(w, [&](Communicator& c, uint32_t r) {
    for (const Case& k : cases()) {
      for (bool average : {true, false}) {
        ops::CompressedAllreduce op(k.params, average, false, /*seed=*/99);
        // Pieces of 2048 elements: blocks of the larger buffers go through the pipelined schedule
        // (up to 18 pieces per block) and must still match the whole-block reference bit for bit
        // (QSGD: the reference encoded in the same pieces, each under its own seed).
        op.set_piece_elements(average ? kPiece : 0);
        for (size_t count : counts) {
          for (int call = 0; call < 2; ++call) {
            Bytes buf = make_input(r, count, k.dtype, count * 31 + static_cast<uint64_t>(call));
            op.run(c, buf.data(), count, k.dtype);
            results[r].push_back(std::move(buf));
          }
        }
      }
    }
  });
  expect_all_ok(errs);
  if (::testing::Test::HasFailure()) return;
  size_t idx = 0;
  for (const Case& k : cases()) {
    for (bool average : {true, false}) {
      uint64_t step = 0;
      for (size_t count : counts) {
        for (int call = 0; call < 2; ++call, ++idx, ++step) {
          std::vector<Bytes> in;
          for (uint32_t q = 0; q < size; ++q)
            in.push_back(make_input(q, count, k.dtype, count * 31 + static_cast<uint64_t>(call)));
          const size_t piece = k.params.kind == Kind::kQSGD && average
                                   ? ops::pipeline_piece(k.params, count, size, kPiece)
                                   : 0;
          Bytes want = size == 1
                           ? in[0]
                           : reference(k.params, in, count, k.dtype, average ? size : 1.0, 99, step, piece);
          for (uint32_t r = 0; r < size; ++r)
            ASSERT_EQ(results[r][idx], want)
                << k.name << (average ? " avg" : " sum") << " count " << count << " call " << call << " rank "
                << r << ": " << describe_first_diff(results[r][idx], want, k.dtype);
        }
      }
    }
  }
}

// Deterministic codecs stay close to the true average: every value crossed a codec twice.
TEST_P(CompressedAllreduceWorlds, CloseToTrueAverage) {
  auto w = make_world(one_host(n()), quick_options(shm()));
  const uint32_t size = n();
  const size_t count = 20000;
  auto errs = run_ranks(w, [&](Communicator& c, uint32_t r) {
    for (Kind kind : {Kind::kMinMaxU8, Kind::kF16, Kind::kBF16}) {
      ops::CompressedAllreduce op(CodecParams{kind, 0, 16}, true, false);
      Bytes buf = make_input(r, count, DType::F32, 5);
      op.run(c, buf.data(), count, DType::F32);
      for (size_t i = 0; i < count; ++i) {
        float want = 0;
        for (uint32_t q = 0; q < size; ++q) want += value(q, i, 5);
        want /= static_cast<float>(size);
        const float scale = 1.0f + static_cast<float>((i / 700) % 5);
        // MinMaxU8: each encoding errs by at most one step of a chunk's range (<= 2 * max|x| / 255;
        // chunks may mix two scales, hence the factor 5); casts: a relative half-ulp per crossing.
        float tol = kind == Kind::kMinMaxU8 ? 2.0f * (2.0f * 5.0f / 255.0f)
                    : kind == Kind::kF16    ? 2e-3f * scale
                                            : 2e-2f * scale;
        ASSERT_NEAR(load(buf.data(), DType::F32, i), want, tol)
            << "codec " << static_cast<int>(kind) << " i " << i;
      }
    }
  });
  expect_all_ok(errs);
}

std::string worlds_name(const ::testing::TestParamInfo<std::tuple<uint32_t, bool>>& p) {
  return std::to_string(std::get<0>(p.param)) + (std::get<1>(p.param) ? "ranks_shm" : "ranks_tcp");
}

INSTANTIATE_TEST_SUITE_P(Compressed, CompressedAllreduceWorlds,
                         ::testing::Combine(::testing::Values(1u, 2u, 3u, 4u), ::testing::Bool()),
                         worlds_name);

// QSGD rounds stochastically; the same seed and step must give the same bytes, a different
// step different ones (and rank-dependent seeds keep ranks' rounding independent).
TEST(CompressedSeeds, DistinctPerStepRankBlockPhase) {
  std::vector<uint64_t> seen;
  for (uint64_t step : {0, 1})
    for (uint32_t rank : {0u, 1u})
      for (uint32_t block : {0u, 1u})
        for (uint32_t phase : {0u, 1u}) seen.push_back(ops::encode_seed(5, step, rank, block, phase));
  std::sort(seen.begin(), seen.end());
  EXPECT_EQ(std::unique(seen.begin(), seen.end()), seen.end());
  EXPECT_EQ(ops::encode_seed(5, 3, 1, 2, 0), ops::encode_seed(5, 3, 1, 2, 0));
}

TEST(CompressedBlocks, AlignedCoveringSplit) {
  for (size_t count : {size_t{0}, size_t{1}, size_t{1023}, size_t{1024}, size_t{5000}, size_t{1000003}}) {
    for (uint32_t n : {1u, 2u, 3u, 4u, 7u}) {
      auto c = ops::split_blocks(count, n, 1024);
      ASSERT_EQ(c.size(), n);
      size_t total = 0;
      for (uint32_t j = 0; j < n; ++j) {
        total += c[j];
        if (j + 1 < n && c[j + 1] > 0) {
          ASSERT_EQ(c[j] % 1024, 0u) << "count " << count << " n " << n;
        }
      }
      ASSERT_EQ(total, count);
      const size_t mx = *std::max_element(c.begin(), c.end()), mn = *std::min_element(c.begin(), c.end());
      ASSERT_LE(mx - mn, 1024u);
    }
  }
}

// 2 hosts x 2 ranks: host sums at full precision, compressed among the two leaders.
TEST(CompressedHierarchical, TwoHostsOfTwo) {
  auto w = make_world(testing::hosts_of(4, 2), quick_options(true));
  const CodecParams p{Kind::kMinMaxU8, 0, 16};
  const size_t count = 30001;
  std::vector<Bytes> results(4);
  auto errs = run_ranks(w, [&](Communicator& c, uint32_t r) {
    ops::CompressedAllreduce op(p, true, true, 3);
    Bytes buf = make_input(r, count, DType::F32, 11);
    op.run(c, buf.data(), count, DType::F32);
    results[r] = std::move(buf);
  });
  expect_all_ok(errs);
  if (::testing::Test::HasFailure()) return;
  // Two summands: the order of the local reduce cannot change the sum.
  std::vector<Bytes> host_sums;
  for (uint32_t h = 0; h < 2; ++h) {
    Bytes s(count * 4);
    for (size_t i = 0; i < count; ++i)
      store(s.data(), DType::F32, i, value(2 * h, i, 11) + value(2 * h + 1, i, 11));
    host_sums.push_back(std::move(s));
  }
  Bytes want = reference(p, host_sums, count, DType::F32, 4.0, 3, 0);
  for (uint32_t r = 0; r < 4; ++r) {
    ASSERT_EQ(results[r], want) << "rank " << r << ": " << describe_first_diff(results[r], want, DType::F32);
  }
}

// One host: nothing crosses a network, so the hierarchical variant is a full-precision average.
TEST(CompressedHierarchical, OneHostIsExact) {
  auto w = make_world(one_host(2), quick_options(true));
  const size_t count = 5000;
  auto errs = run_ranks(w, [&](Communicator& c, uint32_t r) {
    ops::CompressedAllreduce op(CodecParams{Kind::kQSGD, 0, 4}, true, true);
    std::vector<float> buf(count);
    for (size_t i = 0; i < count; ++i) buf[i] = value(r, i, 1);
    op.run(c, buf.data(), count, DType::F32);
    for (size_t i = 0; i < count; ++i) ASSERT_EQ(buf[i], (value(0, i, 1) + value(1, i, 1)) / 2.0f) << i;
  });
  expect_all_ok(errs);
}

TEST(CompressedErrors, UnsupportedDtypeAndMismatchedSizes) {
  auto w = make_world(one_host(2), quick_options(false));
  auto errs = run_ranks(w, [&](Communicator& c, uint32_t r) {
    ops::CompressedAllreduce op(CodecParams{Kind::kMinMaxU8, 0, 16}, true, false);
    std::vector<int32_t> ints(100);
    try {
      op.run(c, ints.data(), ints.size(), DType::I32);
      ADD_FAILURE() << "int32 accepted";
    } catch (const Error& e) {
      EXPECT_EQ(e.kind(), ErrorKind::kInvalidArgument);
      EXPECT_NE(std::string(e.what()).find("compressed allreduce"), std::string::npos) << e.what();
    }
    // Ranks disagreeing on the size: an error on both, never a hang or an overflow.
    std::vector<float> buf(r == 0 ? 4096 : 8192, 1.0f);
    try {
      op.run(c, buf.data(), buf.size(), DType::F32);
      ADD_FAILURE() << "mismatched sizes accepted";
    } catch (const Error& e) {
      EXPECT_NE(e.kind(), ErrorKind::kInvalidArgument) << e.what();
      EXPECT_NE(std::string(e.what()).find("compressed allreduce"), std::string::npos) << e.what();
    }
  });
  expect_all_ok(errs);
}

// ---- 1-bit ------------------------------------------------------------------------------------

// One call from zero error state, against the scheme computed in one place.
TEST(CompressedOneBit, FirstCallMatchesReference) {
  for (uint32_t size : {2u, 3u, 4u}) {
    auto w = make_world(one_host(size), quick_options(true));
    const size_t count = 9000;
    const uint32_t chunk = 512;
    std::vector<std::vector<float>> results(size);
    auto errs = run_ranks(w, [&](Communicator& c, uint32_t r) {
      ops::OneBitAllreduce op(chunk);
      std::vector<float> buf(count);
      for (size_t i = 0; i < count; ++i) buf[i] = value(r, i, 2);
      op.run(c, buf.data(), count);
      results[r] = buf;
    });
    expect_all_ok(errs);
    if (::testing::Test::HasFailure()) return;
    auto codec = compress::make_codec(CodecParams{Kind::kSign, chunk, 16});
    auto counts = ops::split_blocks(count, size, chunk);
    std::vector<float> want(count);
    size_t off = 0;
    for (uint32_t j = 0; j < size; ++j) {
      const size_t c = counts[j];
      if (c == 0) continue;
      const size_t eb = codec->encoded_bytes(c);
      Bytes enc(eb);
      std::vector<float> acc(c), x(c);
      for (uint32_t q = 0; q < size; ++q) {
        for (size_t i = 0; i < c; ++i) x[i] = value(q, off + i, 2);
        codec->encode(x.data(), c, DType::F32, enc.data(), eb);
        codec->decode(enc.data(), eb, acc.data(), c, DType::F32, q != 0);
      }
      for (float& v : acc) v /= static_cast<float>(size);
      codec->encode(acc.data(), c, DType::F32, enc.data(), eb);
      codec->decode(enc.data(), eb, want.data() + off, c, DType::F32, false);
      off += c;
    }
    for (uint32_t r = 0; r < size; ++r) {
      ASSERT_EQ(results[r], want) << size << " ranks, rank " << r;
    }
  }
}

// Error feedback: whatever a compression loses is carried into the next call, so the sum of the
// outputs over many calls equals the sum of the true averages minus the errors still carried:
//   sum_t out_t = sum_t avg_t - mean_q(e_worker_q) - e_server   (exactly, up to float rounding)
// and therefore stays within a bounded distance of it however many calls are made.
TEST(CompressedOneBit, ErrorFeedbackTracksTrueAverage) {
  const uint32_t size = 3;
  auto w = make_world(one_host(size), quick_options(true));
  const size_t count = 6000;
  const int steps = 60;
  std::vector<std::vector<float>> sum_out(size, std::vector<float>(count)), worker_err(size),
      server_err(size);
  std::vector<std::vector<float>> outs_last(size);
  auto errs = run_ranks(w, [&](Communicator& c, uint32_t r) {
    ops::OneBitAllreduce op(256);
    std::vector<double> acc(count, 0.0);
    for (int t = 0; t < steps; ++t) {
      std::vector<float> buf(count);
      for (size_t i = 0; i < count; ++i) buf[i] = value(r, i, 1000 + static_cast<uint64_t>(t));
      op.run(c, buf.data(), count);
      for (size_t i = 0; i < count; ++i) acc[i] += buf[i];
      outs_last[r] = buf;
    }
    for (size_t i = 0; i < count; ++i) sum_out[r][i] = static_cast<float>(acc[i]);
    worker_err[r].assign(op.worker_error().begin(), op.worker_error().end());
    server_err[r].assign(op.server_error().begin(), op.server_error().end());
  });
  expect_all_ok(errs);
  if (::testing::Test::HasFailure()) return;
  for (uint32_t r = 1; r < size; ++r) {
    ASSERT_EQ(outs_last[r], outs_last[0]) << "rank " << r << " differs";
  }
  auto counts = ops::split_blocks(count, size, 256);
  std::vector<uint32_t> owner(count);
  for (uint32_t j = 0, i = 0; j < size; ++j)
    for (size_t k = 0; k < counts[j]; ++k) owner[i++] = j;
  double max_gap = 0, max_identity = 0, max_true = 0;
  for (size_t i = 0; i < count; ++i) {
    double truth = 0;
    for (int t = 0; t < steps; ++t)
      for (uint32_t q = 0; q < size; ++q) truth += value(q, i, 1000 + static_cast<uint64_t>(t));
    truth /= size;
    double carried = 0;
    for (uint32_t q = 0; q < size; ++q) carried += worker_err[q][i];
    carried = carried / size + server_err[owner[i]][i];
    const double gap = sum_out[0][i] - truth;
    max_gap = std::max(max_gap, std::abs(gap));
    max_identity = std::max(max_identity, std::abs(gap + carried));
    max_true = std::max(max_true, std::abs(truth));
  }
  EXPECT_LT(max_identity, 1e-3) << "sum of outputs != sum of averages - carried errors";
  // Inputs are at most 5 in magnitude: carried errors stay of that order, never growing with
  // the number of steps (without feedback the gap would grow like steps * error).
  EXPECT_LT(max_gap, 15.0) << "error feedback lets the gap grow";
}

// The 1-bit momentum bucket op: full-precision average while warming up, then the momentum.
TEST(CompressedOneBit, MomentumBucketOp) {
  const uint32_t size = 2;
  auto w = make_world(one_host(size), quick_options(true));
  const size_t count = 3000;
  std::vector<std::vector<float>> moms(size);
  auto errs = run_ranks(w, [&](Communicator& c, uint32_t r) {
    std::vector<float> m(count, 0.5f), we(count, 0.0f), se(count, 0.0f), g(count);
    ops::OneBitMomentumBucketOp op(m.data(), we.data(), se.data(), count, 0.9f, 0);
    for (size_t i = 0; i < count; ++i) g[i] = static_cast<float>(r + 1);
    op.run(c, g.data(), count, DType::F32);  // warm-up: gradient averaged, momentum untouched
    for (size_t i = 0; i < count; ++i) {
      ASSERT_EQ(g[i], 1.5f);
      ASSERT_EQ(m[i], 0.5f);
    }
    op.set_compressing(true);
    for (size_t i = 0; i < count; ++i) g[i] = static_cast<float>(r + 1);
    op.run(c, g.data(), count, DType::F32);
    // m = 0.9 * 0.5 + 0.1 * g = 0.55 (rank 0) and 0.65 (rank 1): constant blocks compress
    // exactly to their mean magnitude, so the average 0.6 comes out within float rounding.
    for (size_t i = 0; i < count; ++i) ASSERT_NEAR(m[i], 0.6f, 1e-6f) << i;
    moms[r] = m;
    std::vector<float> wrong(10);
    EXPECT_THROW(op.run(c, wrong.data(), wrong.size(), DType::F32), Error);
  });
  expect_all_ok(errs);
  if (!::testing::Test::HasFailure()) {
    EXPECT_EQ(moms[0], moms[1]);
  }
}

// Hierarchical 1-bit momentum on 2 hosts x 2 ranks: each host's momenta summed at full
// precision and halved, then exactly the flat 1-bit scheme between the two leaders (same bits,
// same error buffers), broadcast inside each host; the non-leaders' error buffers stay zero.
// Two calls, so the second one starts from the errors the first left.
TEST(CompressedOneBit, HierarchicalMomentumIsFlatAmongLeaders) {
  const size_t count = 5000;
  const uint32_t chunk = 256;
  const float beta1 = 0.9f;
  auto grad = [](uint32_t r, size_t i, int call) { return value(r, i, 20 + call); };
  auto w = make_world(testing::hosts_of(4, 2), quick_options(true));
  std::vector<std::vector<float>> moms(4), wes(4), ses(4);
  auto errs = run_ranks(w, [&](Communicator& c, uint32_t r) {
    std::vector<float> m(count), we(count, 0.0f), se(count, 0.0f), g(count);
    for (size_t i = 0; i < count; ++i) m[i] = value(r, i, 19);
    ops::OneBitMomentumBucketOp op(m.data(), we.data(), se.data(), count, beta1, chunk, nullptr, true);
    op.set_compressing(true);
    for (int call = 0; call < 2; ++call) {
      for (size_t i = 0; i < count; ++i) g[i] = grad(r, i, call);
      op.run(c, g.data(), count, DType::F32);
    }
    moms[r] = m, wes[r] = we, ses[r] = se;
  });
  expect_all_ok(errs);
  if (::testing::Test::HasFailure()) return;

  // The reference: the flat 1-bit allreduce on 2 ranks of host averages.
  auto w2 = make_world(one_host(2), quick_options(true));
  std::vector<std::vector<float>> want_m(2), want_we(2), want_se(2);
  auto errs2 = run_ranks(w2, [&](Communicator& c, uint32_t h) {
    std::vector<float> lm[2], m(count), we(count, 0.0f), se(count, 0.0f);
    for (uint32_t k = 0; k < 2; ++k) {
      lm[k].resize(count);
      for (size_t i = 0; i < count; ++i) lm[k][i] = value(2 * h + k, i, 19);
    }
    ops::OneBitAllreduce op(chunk);
    for (int call = 0; call < 2; ++call) {
      for (size_t i = 0; i < count; ++i) {
        // Every rank's momentum update as the op computes it; after the first call every rank of
        // a host holds the same (broadcast) momentum.
        for (uint32_t k = 0; k < 2; ++k)
          lm[k][i] = beta1 * (call == 0 ? lm[k][i] : m[i]) + (1.0f - beta1) * grad(2 * h + k, i, call) * 1.0f;
        m[i] = (lm[0][i] + lm[1][i]) * 0.5f;
      }
      op.run(c, m.data(), count, we, se);
    }
    want_m[h] = m, want_we[h] = we, want_se[h] = se;
  });
  expect_all_ok(errs2);
  if (::testing::Test::HasFailure()) return;
  ASSERT_EQ(want_m[0], want_m[1]);
  const std::vector<float> zeros(count, 0.0f);
  for (uint32_t r = 0; r < 4; ++r) {
    ASSERT_EQ(moms[r], want_m[0]) << "rank " << r;
    const bool leader = r % 2 == 0;
    ASSERT_EQ(wes[r], leader ? want_we[r / 2] : zeros) << "worker error, rank " << r;
    ASSERT_EQ(ses[r], leader ? want_se[r / 2] : zeros) << "server error, rank " << r;
  }
}

}  // namespace
}  // namespace rumor
