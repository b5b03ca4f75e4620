// Decentralized ops (ops/decentralized_op.h) on threads-as-ranks: the weight mix as a bucket op
// (flat and hierarchical) and the low-precision ring mix, checked against a local simulation
// that uses the same codec, and for the replica invariant (a neighbour's replica of a rank is
// that rank's tracked copy, bit for bit).
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <mutex>
#include <vector>

#include "compress/codec.h"
#include "ops/decentralized_op.h"
#include "ranks.h"

namespace rumor {
namespace {

using testing::expect_all_ok;
using testing::hosts_of;
using testing::make_world;
using testing::one_host;
using testing::quick_options;
using testing::run_ranks;

double start_value(uint32_t rank, size_t i) { return static_cast<double>(rank) * 0.25 + 0.001 * (i % 13); }

class WeightMix : public ::testing::TestWithParam<bool> {};

// A ring with weights 1/2 (self), 1/4 (each neighbour), run through BucketOp::run as the engine
// would; the gradient arguments are ignored.
TEST_P(WeightMix, RingAsBucketOp) {
  const uint32_t n = 4;
  const size_t count = 5000;
  auto w = make_world(one_host(n), quick_options(GetParam()));
  auto errs = run_ranks(w, [&](Communicator& c, uint32_t r) {
    std::vector<double> x(count), out(count, -1.0);
    for (size_t i = 0; i < count; ++i) x[i] = start_value(r, i);
    ops::WeightMixOp op(reinterpret_cast<uintptr_t>(x.data()), reinterpret_cast<uintptr_t>(out.data()), count,
                        DType::F64, false);
    ops::MixPlan plan;
    plan.self_weight = 0.5;
    plan.srcs = {{(r + n - 1) % n, 0.25}, {(r + 1) % n, 0.25}};
    plan.dsts = {(r + n - 1) % n, (r + 1) % n};
    op.set_plan(plan);
    float grad = 0;
    op.run(c, &grad, 1, DType::F32);
    for (size_t i = 0; i < count; ++i) {
      const double want =
          0.5 * start_value(r, i) + 0.25 * (start_value((r + n - 1) % n, i) + start_value((r + 1) % n, i));
      ASSERT_NEAR(out[i], want, 1e-12) << "rank " << r << " element " << i;
      ASSERT_EQ(x[i], start_value(r, i)) << "the weights must stay untouched";
    }
  });
  expect_all_ok(errs);
}

// 2 hosts x 2 ranks: host averages, then host 0 keeps 3/4 of its own and 1/4 of host 1's.
TEST_P(WeightMix, Hierarchical) {
  const uint32_t n = 4;
  const size_t count = 3000;
  auto w = make_world(hosts_of(n, 2), quick_options(GetParam()));
  auto errs = run_ranks(w, [&](Communicator& c, uint32_t r) {
    std::vector<float> x(count), out(count);
    for (size_t i = 0; i < count; ++i) x[i] = static_cast<float>(start_value(r, i));
    ops::WeightMixOp op(reinterpret_cast<uintptr_t>(x.data()), reinterpret_cast<uintptr_t>(out.data()), count,
                        DType::F32, true);
    const uint32_t host = r / 2;
    ops::MixPlan plan;
    plan.self_weight = host == 0 ? 0.75 : 0.5;
    plan.srcs = {{1 - host, host == 0 ? 0.25 : 0.5}};
    plan.dsts = {1 - host};
    op.mix(c, plan);
    for (size_t i = 0; i < count; ++i) {
      const double h0 = (start_value(0, i) + start_value(1, i)) / 2,
                   h1 = (start_value(2, i) + start_value(3, i)) / 2;
      const double want = host == 0 ? 0.75 * h0 + 0.25 * h1 : 0.5 * h0 + 0.5 * h1;
      ASSERT_NEAR(out[i], want, 1e-5) << "rank " << r << " element " << i;
    }
  });
  expect_all_ok(errs);
}

TEST(WeightMixArgs, RejectsOverlapAndIntegers) {
  std::vector<float> buf(100);
  const auto a = reinterpret_cast<uintptr_t>(buf.data());
  EXPECT_THROW(ops::WeightMixOp(a, a + 40, 50, DType::F32, false), Error);
  EXPECT_THROW(ops::WeightMixOp(a, a + 200, 50, DType::I32, false), Error);
  EXPECT_THROW(ops::LowPrecisionMixOp(a, 50, DType::F16, false, 0), Error);
}

INSTANTIATE_TEST_SUITE_P(Transports, WeightMix, ::testing::Values(false, true), [](const auto& info) {
  return info.param ? std::string("shm") : std::string("tcp");
});

// Several rounds of "optimizer step" (x -= a rank- and round-dependent amount), prepare and
// exchange on a ring of 3; checked against a simulation of the documented rule.
TEST(LowPrecisionMix, MatchesSimulationAndKeepsReplicasEqual) {
  const uint32_t n = 3;
  const size_t count = 2500;
  const int rounds = 4;
  auto step = [](uint32_t r, int t, size_t i) {
    return 0.01 * std::sin(static_cast<double>(r * 7 + t * 3 + i));
  };

  // Simulation: xh[j] is rank j's tracked copy (= its neighbours' replica of it).
  auto codec = compress::make_codec(compress::CodecParams{});
  std::vector<std::vector<double>> xs(n, std::vector<double>(count)), xh(n);
  for (uint32_t r = 0; r < n; ++r)
    for (size_t i = 0; i < count; ++i) xs[r][i] = start_value(0, i);
  for (uint32_t r = 0; r < n; ++r) xh[r] = xs[r];
  std::vector<std::byte> q(codec->encoded_bytes(count));
  for (int t = 0; t < rounds; ++t) {
    std::vector<std::vector<double>> next = xs;
    for (uint32_t r = 0; r < n; ++r) {
      const auto &L = xh[(r + n - 1) % n], &R = xh[(r + 1) % n], &S = xh[r];
      for (size_t i = 0; i < count; ++i) {
        double y = xs[r][i] - step(r, t, i);
        next[r][i] = y + (1.0 / 3.0) * (L[i] + R[i] - 2.0 * S[i]);
      }
    }
    for (uint32_t r = 0; r < n; ++r) {
      std::vector<double> d(count);
      for (size_t i = 0; i < count; ++i) d[i] = next[r][i] - xh[r][i];
      codec->encode(d.data(), count, DType::F64, q.data(), q.size());
      codec->decode(q.data(), q.size(), xh[r].data(), count, DType::F64, true);
    }
    xs = next;
  }

  std::vector<std::vector<double>> self(n), left(n), right(n), final_x(n);
  std::mutex mu;
  auto w = make_world(one_host(n), quick_options(true));
  auto errs = run_ranks(w, [&](Communicator& c, uint32_t r) {
    std::vector<double> x(count);
    for (size_t i = 0; i < count; ++i) x[i] = start_value(0, i);  // same start everywhere
    ops::LowPrecisionMixOp op(reinterpret_cast<uintptr_t>(x.data()), count, DType::F64, false, 0);
    for (int t = 0; t < rounds; ++t) {
      for (size_t i = 0; i < count; ++i) x[i] -= step(r, t, i);
      op.prepare(c);
      op.exchange(c);
    }
    std::lock_guard lk(mu);
    self[r] = op.copy_state(0);
    left[r] = op.copy_state(1);
    right[r] = op.copy_state(2);
    final_x[r] = x;
  });
  expect_all_ok(errs);
  for (uint32_t r = 0; r < n; ++r) {
    ASSERT_EQ(self[r].size(), count);
    for (size_t i = 0; i < count; ++i) {
      ASSERT_EQ(self[r][i], xh[r][i]) << "rank " << r << " tracked copy, element " << i;
      ASSERT_EQ(final_x[r][i], xs[r][i]) << "rank " << r << " weights, element " << i;
    }
    EXPECT_EQ(right[(r + n - 1) % n], self[r]) << "left neighbour's replica of rank " << r;
    EXPECT_EQ(left[(r + 1) % n], self[r]) << "right neighbour's replica of rank " << r;
  }
}

// 2 hosts x 2 ranks: ranks of a host end with the same weights, and only leaders keep copies.
TEST(LowPrecisionMix, HierarchicalHostsAgree) {
  const uint32_t n = 4;
  const size_t count = 1200;
  std::vector<std::vector<float>> final_x(n);
  std::vector<size_t> copies(n);
  std::mutex mu;
  auto w = make_world(hosts_of(n, 2), quick_options(true));
  auto errs = run_ranks(w, [&](Communicator& c, uint32_t r) {
    std::vector<float> x(count, 1.0f);
    ops::LowPrecisionMixOp op(reinterpret_cast<uintptr_t>(x.data()), count, DType::F32, true, 0);
    for (int t = 0; t < 3; ++t) {
      for (size_t i = 0; i < count; ++i) x[i] -= 0.01f * static_cast<float>((r + 1) * (i % 5));
      op.prepare(c);
      op.exchange(c);
    }
    std::lock_guard lk(mu);
    final_x[r] = x;
    copies[r] = op.copy_state(0).size();
  });
  expect_all_ok(errs);
  EXPECT_EQ(final_x[0], final_x[1]);
  EXPECT_EQ(final_x[2], final_x[3]);
  EXPECT_NE(final_x[0], final_x[2]);
  EXPECT_EQ(copies[0], count);
  EXPECT_EQ(copies[1], 0u);
  EXPECT_EQ(copies[2], count);
  EXPECT_EQ(copies[3], 0u);
}

}  // namespace
}  // namespace rumor
