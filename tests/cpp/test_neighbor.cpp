// Neighbor exchange (comm/neighbor.h) on threads-as-ranks, over TCP and shared memory. Inputs
// are small integers and weights are powers of two or thirds checked with a tolerance, so the
// expected values are computed locally.
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <numeric>
#include <tuple>

#include "comm/neighbor.h"
#include "ranks.h"

namespace rumor {
namespace {

using testing::describe;
using testing::expect_all_ok;
using testing::hosts_of;
using testing::make_world;
using testing::one_host;
using testing::quick_options;
using testing::run_ranks;

float value(uint32_t rank, size_t i) { return static_cast<float>(rank * 10 + (i % 7)); }

// Exponential graph with base 2: i sends to i + 2^k, receives from i - 2^k (mod n).
std::vector<uint32_t> exp_dsts(uint32_t n, uint32_t r) {
  std::vector<uint32_t> d;
  for (uint32_t s = 1; s < n; s *= 2) d.push_back((r + s) % n);
  return d;
}
std::vector<uint32_t> exp_srcs(uint32_t n, uint32_t r) {
  std::vector<uint32_t> d;
  for (uint32_t s = 1; s < n; s *= 2) d.push_back((r + n - s) % n);
  return d;
}

class NeighborOps : public ::testing::TestWithParam<std::tuple<uint32_t, bool>> {
 protected:
  uint32_t n() const { return std::get<0>(GetParam()); }
  bool shm() const { return std::get<1>(GetParam()); }
};

TEST_P(NeighborOps, ExponentialGraphUniformWeights) {
  auto w = make_world(one_host(n()), quick_options(shm()));
  const uint32_t size = n();
  auto errs = run_ranks(w, [size](Communicator& c, uint32_t r) {
    auto srcs_r = exp_srcs(size, r);
    auto dsts_r = exp_dsts(size, r);
    const double wt = 1.0 / static_cast<double>(srcs_r.size() + 1);
    std::vector<NeighborEdge> srcs, dsts;
    for (uint32_t s : srcs_r) srcs.push_back({s, wt});
    for (uint32_t d : dsts_r) dsts.push_back({d, 1.0});
    for (size_t count : {size_t{0}, size_t{1}, size_t{1000}, size_t{70001}}) {
      std::vector<float> in(count), out(count, -1.0f);
      for (size_t i = 0; i < count; ++i) in[i] = value(r, i);
      neighbor_allreduce(c, in.data(), out.data(), count, DType::F32, wt, srcs, dsts, true);
      for (size_t i = 0; i < count; ++i) {
        double want = wt * value(r, i);
        for (uint32_t s : srcs_r) want += wt * value(s, i);
        ASSERT_NEAR(out[i], want, 1e-4 * (1 + std::fabs(want))) << "count " << count << " i " << i;
      }
    }
  });
  expect_all_ok(errs);
}

TEST_P(NeighborOps, DynamicMoveScalingAndInPlace) {
  if (n() < 2) GTEST_SKIP() << "needs two ranks";
  auto w = make_world(one_host(n()), quick_options(shm()));
  const uint32_t size = n();
  auto errs = run_ranks(w, [size](Communicator& c, uint32_t r) {
    const uint32_t prev = (r + size - 1) % size, next = (r + 1) % size;
    const size_t count = 3001;
    std::vector<double> buf(count);
    for (size_t i = 0; i < count; ++i) buf[i] = value(r, i);
    // Self weight 0, receive from the left, send to the right: the data moves one step.
    NeighborEdge src[1] = {{prev, 1.0}}, dst[1] = {{next, 1.0}};
    neighbor_allreduce(c, buf.data(), buf.data(), count, DType::F64, 0.0, src, dst, true);
    for (size_t i = 0; i < count; ++i) ASSERT_EQ(buf[i], value(prev, i));
    // The sender scales by its destination weight (0.25 r), the receiver by 2 and itself by 0.5.
    for (size_t i = 0; i < count; ++i) buf[i] = value(r, i);
    NeighborEdge src2[1] = {{prev, 2.0}}, dst2[1] = {{next, 0.25 * r}};
    std::vector<double> out(count);
    neighbor_allreduce(c, buf.data(), out.data(), count, DType::F64, 0.5, src2, dst2, true);
    for (size_t i = 0; i < count; ++i)
      ASSERT_EQ(out[i], 0.5 * value(r, i) + 2.0 * 0.25 * prev * value(prev, i));
  });
  expect_all_ok(errs);
}

TEST_P(NeighborOps, ReusedScratchAcrossSizesAndWeights) {
  if (n() < 2) GTEST_SKIP() << "needs two ranks";
  auto w = make_world(one_host(n()), quick_options(shm()));
  const uint32_t size = n();
  auto errs = run_ranks(w, [size](Communicator& c, uint32_t r) {
    NeighborScratch scratch;
    const uint32_t prev = (r + size - 1) % size, next = (r + 1) % size;
    // Shrinking and growing sizes, and weights that need 0, 1 or 2 scaled copies, through one scratch.
    for (size_t count : {size_t{5000}, size_t{3}, size_t{0}, size_t{12000}, size_t{7}}) {
      for (double dw : {1.0, 0.5, 0.25}) {
        std::vector<float> x(count), y(count, -1.0f);
        for (size_t i = 0; i < count; ++i) x[i] = value(r, i);
        std::vector<NeighborEdge> srcs = {{prev, 1.0}}, dsts = {{next, dw}};
        if (size > 2) {
          srcs.push_back({(r + 2) % size, 2.0});
          dsts.push_back({(r + size - 2) % size, 1.0 - dw + 0.5});
        }
        neighbor_allreduce(c, x.data(), y.data(), count, DType::F32, 0.5, srcs, dsts, false, &scratch);
        for (size_t i = 0; i < count; ++i) {
          float want = 0.5f * value(r, i) + static_cast<float>(dw) * value(prev, i);
          if (size > 2) want += 2.0f * static_cast<float>(1.0 - dw + 0.5) * value((r + 2) % size, i);
          ASSERT_EQ(y[i], want) << "count " << count << " dw " << dw << " i " << i;
        }
      }
    }
  });
  expect_all_ok(errs);
}

TEST_P(NeighborOps, HalfTypesAccumulateInFloat) {
  if (n() < 2) GTEST_SKIP() << "needs two ranks";
  auto w = make_world(one_host(n()), quick_options(shm()));
  const uint32_t size = n();
  auto errs = run_ranks(w, [size](Communicator& c, uint32_t r) {
    const uint32_t prev = (r + size - 1) % size, next = (r + 1) % size;
    const size_t count = 1500;
    NeighborEdge src[1] = {{prev, 0.5}}, dst[1] = {{next, 1.0}};
    std::vector<_Float16> h(count), ho(count);
    for (size_t i = 0; i < count; ++i) h[i] = static_cast<_Float16>(value(r, i));
    neighbor_allreduce(c, h.data(), ho.data(), count, DType::F16, 0.5, src, dst, false);
    for (size_t i = 0; i < count; ++i)
      ASSERT_EQ(static_cast<float>(ho[i]), 0.5f * value(r, i) + 0.5f * value(prev, i));
    // bf16 bits: 1.0 = 0x3f80; weights 0.5 keep the sums exact for small integers.
    std::vector<uint16_t> b(count), bo(count);
    auto to_bf16 = [](float f) {
      uint32_t u;
      std::memcpy(&u, &f, 4);
      return static_cast<uint16_t>(u >> 16);
    };
    auto from_bf16 = [](uint16_t x) {
      uint32_t u = static_cast<uint32_t>(x) << 16;
      float f;
      std::memcpy(&f, &u, 4);
      return f;
    };
    for (size_t i = 0; i < count; ++i) b[i] = to_bf16(value(r, i));
    neighbor_allreduce(c, b.data(), bo.data(), count, DType::BF16, 0.5, src, dst, false);
    for (size_t i = 0; i < count; ++i)
      ASSERT_EQ(from_bf16(bo[i]), 0.5f * value(r, i) + 0.5f * value(prev, i));
  });
  expect_all_ok(errs);
}

TEST_P(NeighborOps, EmptySendListsAndAllgatherVariableSizes) {
  auto w = make_world(one_host(n()), quick_options(shm()));
  const uint32_t size = n();
  auto errs = run_ranks(w, [size](Communicator& c, uint32_t r) {
    // Star into rank 0: everyone else sends to 0, rank 0 sends nothing.
    std::vector<NeighborEdge> srcs, dsts;
    if (r == 0)
      for (uint32_t q = 1; q < size; ++q) srcs.push_back({q, 1.0});
    else
      dsts.push_back({0, 1.0});
    std::vector<float> x(10, static_cast<float>(r)), y(10);
    neighbor_allreduce(c, x.data(), y.data(), 10, DType::F32, 1.0, srcs, dsts, true);
    const float want = r == 0 ? static_cast<float>(size * (size - 1) / 2) : static_cast<float>(r);
    for (float v : y) ASSERT_EQ(v, want);

    // Allgather over the exponential graph; rank q contributes q+1 values of q.
    auto srcs_r = exp_srcs(size, r);
    auto dsts_r = exp_dsts(size, r);
    std::vector<uint64_t> mine = {(r + 1) * sizeof(int32_t)};
    auto sizes = neighbor_exchange_words(c, mine, srcs_r, dsts_r, true);
    ASSERT_EQ(sizes.size(), srcs_r.size());
    std::vector<size_t> recv_bytes(sizes.begin(), sizes.end());
    std::vector<int32_t> in(r + 1, static_cast<int32_t>(r));
    std::vector<int32_t> out(std::accumulate(recv_bytes.begin(), recv_bytes.end(), size_t{0}) / 4, -1);
    neighbor_allgather(c, in.data(), in.size() * 4, srcs_r, recv_bytes, dsts_r, out.data(), true);
    size_t k = 0;
    for (uint32_t s : srcs_r)
      for (uint32_t j = 0; j <= s; ++j) ASSERT_EQ(out[k++], static_cast<int32_t>(s));
    ASSERT_EQ(k, out.size());
  });
  expect_all_ok(errs);
}

TEST_P(NeighborOps, MismatchWithCheckRaisesEverywhere) {
  if (n() < 3) GTEST_SKIP() << "needs three ranks";
  auto w = make_world(one_host(n()), quick_options(shm()));
  const uint32_t size = n();
  auto errs = run_ranks(w, [size](Communicator& c, uint32_t r) {
    // Ring, except rank 1 also sends to rank 2's right neighbor, which does not expect it.
    const uint32_t prev = (r + size - 1) % size, next = (r + 1) % size;
    std::vector<NeighborEdge> srcs = {{prev, 0.5}}, dsts = {{next, 1.0}};
    if (r == 1) dsts.push_back({(r + 2) % size, 1.0});
    std::vector<float> x(5, 1.0f), y(5);
    try {
      neighbor_allreduce(c, x.data(), y.data(), 5, DType::F32, 0.5, srcs, dsts, true);
      ADD_FAILURE() << "rank " << r << ": no error";
    } catch (const Error& e) {
      EXPECT_EQ(e.kind(), ErrorKind::kInvalidArgument);
      const std::string want = "rank 1 sends to rank " + std::to_string(3 % size) + ", but rank " +
                               std::to_string(3 % size) + " does not receive from rank 1";
      EXPECT_NE(std::string(e.what()).find(want), std::string::npos) << e.what();
    }
    // The check failed before any data moved: the communicator is still usable.
    std::vector<NeighborEdge> s2 = {{prev, 0.5}}, d2 = {{next, 1.0}};
    neighbor_allreduce(c, x.data(), y.data(), 5, DType::F32, 0.5, s2, d2, true);
    for (float v : y) ASSERT_EQ(v, 1.0f);
  });
  expect_all_ok(errs);
}

TEST_P(NeighborOps, MismatchWithoutCheckFailsInsteadOfHanging) {
  if (n() < 2) GTEST_SKIP() << "needs two ranks";
  Options o = quick_options(shm());
  o.timeout_s = 2;
  auto w = make_world(one_host(n()), o);
  const uint32_t size = n();
  auto errs = run_ranks(w, [size](Communicator& c, uint32_t r) {
    // Rank 0 expects a message from its left neighbor, which sends nothing.
    const uint32_t prev = (r + size - 1) % size;
    std::vector<NeighborEdge> srcs, dsts;
    if (r == 0) srcs.push_back({prev, 1.0});
    std::vector<float> x(4, 1.0f), y(4);
    neighbor_allreduce(c, x.data(), y.data(), 4, DType::F32, 1.0, srcs, dsts, false);
    c.barrier();
  });
  ASSERT_TRUE(errs[0] != nullptr);
  const std::string e0 = describe(errs[0]);
  EXPECT_NE(e0.find("neighbor_allreduce"), std::string::npos) << e0;
  EXPECT_NE(e0.find("rank " + std::to_string(size - 1)), std::string::npos) << e0;
}

TEST_P(NeighborOps, UnexpectedSendWithoutCheckIsAProtocolError) {
  if (n() < 2) GTEST_SKIP() << "needs two ranks";
  Options o = quick_options(shm());
  o.timeout_s = 3;
  auto w = make_world(one_host(n()), o);
  auto errs = run_ranks(w, [](Communicator& c, uint32_t r) {
    // Rank 1 sends to rank 0, which does not expect it: the stale message must fail rank 0's
    // next receive from rank 1 instead of being read as that op's data.
    std::vector<NeighborEdge> srcs, dsts;
    if (r == 1) dsts.push_back({0, 1.0});
    std::vector<float> x(4, 1.0f), y(4);
    neighbor_allreduce(c, x.data(), y.data(), 4, DType::F32, 1.0, srcs, dsts, false);
    std::vector<NeighborEdge> s2, d2;
    if (r == 0) s2.push_back({1, 1.0});
    if (r == 1) d2.push_back({0, 1.0});
    neighbor_allreduce(c, x.data(), y.data(), 4, DType::F32, 1.0, s2, d2, false);
  });
  ASSERT_TRUE(errs[0] != nullptr);
  try {
    std::rethrow_exception(errs[0]);
  } catch (const Error& e) {
    EXPECT_EQ(e.kind(), ErrorKind::kProtocol) << e.what();
  }
}

TEST_P(NeighborOps, BadArguments) {
  auto w = make_world(one_host(n()), quick_options(shm()));
  const uint32_t size = n();
  auto errs = run_ranks(w, [size](Communicator& c, uint32_t r) {
    std::vector<float> x(4), y(4);
    auto expect_invalid = [&](std::vector<NeighborEdge> s, std::vector<NeighborEdge> d, DType t, double sw) {
      try {
        neighbor_allreduce(c, x.data(), y.data(), 1, t, sw, s, d, true);
        ADD_FAILURE() << "no error";
      } catch (const Error& e) {
        EXPECT_EQ(e.kind(), ErrorKind::kInvalidArgument) << e.what();
      }
    };
    expect_invalid({{size, 1.0}}, {}, DType::F32, 1.0);
    expect_invalid({{r, 1.0}}, {}, DType::F32, 1.0);
    expect_invalid({}, {}, DType::I32, 1.0);
    expect_invalid({}, {}, DType::F32, std::nan(""));
    if (size > 1) expect_invalid({}, {{(r + 1) % size, 1.0}, {(r + 1) % size, 1.0}}, DType::F32, 1.0);
    // Local validation failures leave the communicator usable.
    neighbor_allreduce(c, x.data(), y.data(), 4, DType::F32, 1.0, {}, {}, true);
  });
  expect_all_ok(errs);
}

INSTANTIATE_TEST_SUITE_P(Neighbor, NeighborOps,
                         ::testing::Combine(::testing::Values(1u, 2u, 4u), ::testing::Bool()),
                         [](const auto& info) {
                           return std::to_string(std::get<0>(info.param)) + "ranks_" +
                                  (std::get<1>(info.param) ? "shm" : "tcp");
                         });

TEST(NeighborHierarchical, TwoHostsTwoRanksEach) {
  // Hosts {0,1} and {2,3}; machines exchange in a 2-ring with weights 0.5 / 0.5.
  auto w = make_world(hosts_of(4, 2), quick_options(true));
  auto errs = run_ranks(w, [](Communicator& c, uint32_t r) {
    const uint32_t machine = r / 2, other = 1 - machine;
    std::vector<NeighborEdge> srcs = {{other, 0.5}}, dsts = {{other, 1.0}};
    std::vector<float> x(1000), y(1000);
    for (size_t i = 0; i < x.size(); ++i) x[i] = value(r, i);
    hierarchical_neighbor_allreduce(c, x.data(), y.data(), x.size(), DType::F32, 0.5, srcs, dsts, true);
    for (size_t i = 0; i < x.size(); ++i) {
      float m0 = (value(0, i) + value(1, i)) / 2, m1 = (value(2, i) + value(3, i)) / 2;
      ASSERT_EQ(y[i], 0.5f * m0 + 0.5f * m1);
    }
    // Machine 1 expects machine 0, machine 0 sends nothing: every rank raises the same error.
    std::vector<NeighborEdge> s2, d2;
    if (machine == 1) s2.push_back({0, 0.5});
    try {
      hierarchical_neighbor_allreduce(c, x.data(), y.data(), x.size(), DType::F32, 0.5, s2, d2, true);
      ADD_FAILURE() << "no error";
    } catch (const Error& e) {
      EXPECT_EQ(e.kind(), ErrorKind::kInvalidArgument);
      EXPECT_NE(std::string(e.what()).find("machine 1 receives from machine 0"), std::string::npos)
          << e.what();
    }
    // And the communicator still works.
    hierarchical_neighbor_allreduce(c, x.data(), y.data(), x.size(), DType::F32, 0.5, srcs, dsts, false);
    for (size_t i = 0; i < x.size(); ++i) {
      float m0 = (value(0, i) + value(1, i)) / 2, m1 = (value(2, i) + value(3, i)) / 2;
      ASSERT_EQ(y[i], 0.5f * m0 + 0.5f * m1);
    }
  });
  expect_all_ok(errs);
}

TEST(NeighborHierarchical, OneHostKeepingItsWeightsGetsTheHostAverage) {
  // Every rank on one host and a machine mix of weight 1 without edges (what Decentralized's
  // schedules give one node): the result is the host's allreduce average, the same bits on every
  // rank, with or without shared memory; a machine mix that scales (self weight 0.75, as a
  // folded self-loop gives) still applies, on every rank.
  for (const bool shm : {true, false}) {
    auto w = make_world(hosts_of(4, 4), quick_options(shm));
    auto errs = run_ranks(w, [](Communicator& c, uint32_t r) {
      std::vector<float> x(100003), y(x.size(), -1.0f), want(x.size());
      for (size_t i = 0; i < x.size(); ++i) x[i] = value(r, i) / 3.0f;
      want = x;
      c.allreduce(want.data(), want.size(), DType::F32, ReduceOp::AVG);
      hierarchical_neighbor_allreduce(c, x.data(), y.data(), x.size(), DType::F32, 1.0, {}, {}, true);
      for (size_t i = 0; i < x.size(); ++i) ASSERT_EQ(y[i], want[i]) << "rank " << r << " i " << i;
      hierarchical_neighbor_allreduce(c, x.data(), y.data(), x.size(), DType::F32, 0.75, {}, {}, false);
      for (size_t i = 0; i < x.size(); ++i) ASSERT_EQ(y[i], 0.75f * want[i]) << "rank " << r << " i " << i;
    });
    expect_all_ok(errs);
  }
}

TEST(NeighborHierarchical, UnevenInterleavedHostsOverTcp) {
  // Hosts by rank: A B A B B. Machine 0 = {0, 2}, machine 1 = {1, 3, 4} (first-appearance
  // order); shared memory off, so the local steps run over TCP too.
  auto w = make_world({"A", "B", "A", "B", "B"}, quick_options(false));
  auto errs = run_ranks(w, [](Communicator& c, uint32_t r) {
    const uint32_t machine = (r == 0 || r == 2) ? 0 : 1, other = 1 - machine;
    std::vector<NeighborEdge> srcs = {{other, 0.25}}, dsts = {{other, 2.0}};
    std::vector<double> x(777), y(777);
    for (size_t i = 0; i < x.size(); ++i) x[i] = value(r, i);
    hierarchical_neighbor_allreduce(c, x.data(), y.data(), x.size(), DType::F64, 0.5, srcs, dsts, true);
    for (size_t i = 0; i < x.size(); ++i) {
      const double m0 = (value(0, i) + value(2, i)) / 2.0;
      const double m1 = (value(1, i) + value(3, i) + value(4, i)) / 3.0;
      const double mine = machine == 0 ? m0 : m1, theirs = machine == 0 ? m1 : m0;
      ASSERT_NEAR(y[i], 0.5 * mine + 0.25 * 2.0 * theirs, 1e-12) << "rank " << r << " i " << i;
    }
  });
  expect_all_ok(errs);
}

TEST(NeighborKernel, WeightedSumMatchesDouble) {
  const size_t n = 1237;
  std::vector<float> a(n), b(n), c(n), out(n);
  for (size_t i = 0; i < n; ++i) {
    a[i] = static_cast<float>(i % 17) - 8;
    b[i] = static_cast<float>(i % 5);
    c[i] = static_cast<float>(i % 3) * 0.5f;
  }
  const void* srcs[2] = {b.data(), c.data()};
  double ws[2] = {0.25, -2.0};
  weighted_sum(out.data(), a.data(), 0.5, srcs, ws, n, DType::F32);
  for (size_t i = 0; i < n; ++i) ASSERT_EQ(out[i], 0.5f * a[i] + 0.25f * b[i] - 2.0f * c[i]);
  // In place (out aliases in).
  weighted_sum(a.data(), a.data(), 2.0, {}, {}, n, DType::F32);
  for (size_t i = 0; i < n; ++i) ASSERT_EQ(a[i], 2.0f * (static_cast<float>(i % 17) - 8));
}

TEST(NeighborKernel, UniformSumDividesOnce) {
  // Integer-valued inputs: (a + b + c) / 3 is one correctly rounded division, where scaling
  // each term by fl(1/3) rounds several times and misses it for some values.
  const size_t n = 1500;
  std::vector<float> a(n), b(n), c(n), out(n);
  std::vector<double> d(n), e(n), out64(n);
  for (size_t i = 0; i < n; ++i) {
    a[i] = static_cast<float>(i % 50);
    b[i] = static_cast<float>((i / 50) % 50);
    c[i] = static_cast<float>(i % 7) * 3;
    d[i] = static_cast<double>(i);
    e[i] = static_cast<double>(i % 13);
  }
  const void* srcs[2] = {b.data(), c.data()};
  uniform_weighted_sum(out.data(), a.data(), 1.0 / 3.0, srcs, n, DType::F32);
  for (size_t i = 0; i < n; ++i) ASSERT_EQ(out[i], (a[i] + b[i] + c[i]) / 3.0f) << i;
  const void* srcs64[1] = {e.data()};
  uniform_weighted_sum(out64.data(), d.data(), 0.5, srcs64, n, DType::F64);
  for (size_t i = 0; i < n; ++i) ASSERT_EQ(out64[i], (d[i] + e[i]) / 2.0) << i;
  // A weight that is not 1/k scales the sum once; in place works.
  uniform_weighted_sum(a.data(), a.data(), 0.3, srcs, n, DType::F32);
  for (size_t i = 0; i < n; ++i) ASSERT_EQ(a[i], static_cast<float>(i % 50 + b[i] + c[i]) * 0.3f) << i;
  std::vector<int32_t> ints(4);
  const void* isrc[1] = {ints.data()};
  EXPECT_THROW(uniform_weighted_sum(ints.data(), ints.data(), 0.5, isrc, 4, DType::I32), Error);
}

}  // namespace
}  // namespace rumor
