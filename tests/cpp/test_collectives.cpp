// Every collective on 1..5 ranks, over TCP and over shared memory, against values computed
// locally. Inputs are small integers stored as floats, so every result is exact.
#include <gtest/gtest.h>
#include <sched.h>
#include <sys/mman.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <bit>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <functional>
#include <future>
#include <mutex>
#include <numeric>
#include <stdexcept>
#include <string>
#include <thread>
#include <tuple>
#include <type_traits>
#include <utility>

#include "comm/arena.h"
#include "comm/direct.h"
#include "core/half.h"
#include "ranks.h"

namespace rumor {
namespace {

using testing::expect_all_ok;
using testing::make_world;
using testing::one_host;
using testing::quick_options;
using testing::run_ranks;

float input(uint32_t rank, size_t i) { return static_cast<float>((rank * 7 + i * 3) % 13); }

class Collectives : public ::testing::TestWithParam<std::tuple<uint32_t, bool>> {
 protected:
  uint32_t n() const { return std::get<0>(GetParam()); }
  bool shm() const { return std::get<1>(GetParam()); }
};

TEST_P(Collectives, AllreduceAllAlgorithmsAndSizes) {
  auto w = make_world(one_host(n()), quick_options(shm()));
  const uint32_t size = n();
  auto errs = run_ranks(w, [size](Communicator& c, uint32_t r) {
    for (size_t count : {size_t{0}, size_t{1}, size_t{5}, size_t{1023}, size_t{16384}, size_t{100003}}) {
      for (auto algo : {AllreduceAlgo::kAuto, AllreduceAlgo::kRing, AllreduceAlgo::kRecursiveDoubling}) {
        for (ReduceOp op : {ReduceOp::SUM, ReduceOp::MAX, ReduceOp::AVG}) {
          std::vector<float> buf(count);
          for (size_t i = 0; i < count; ++i) buf[i] = input(r, i) * static_cast<float>(size);
          c.allreduce(buf.data(), count, DType::F32, op, algo);
          for (size_t i = 0; i < count; ++i) {
            float want = op == ReduceOp::MAX ? 0.0f : 0.0f;
            for (uint32_t q = 0; q < size; ++q) {
              float v = input(q, i) * static_cast<float>(size);
              want = op == ReduceOp::MAX ? (q == 0 ? v : std::max(want, v)) : want + v;
            }
            if (op == ReduceOp::AVG) want /= static_cast<float>(size);
            ASSERT_EQ(buf[i], want) << "count " << count << " i " << i << " op " << op_name(op);
          }
        }
      }
    }
  });
  expect_all_ok(errs);
}

// Sites (RUMOR_SITE) group hosts for the hierarchical allreduce: equal sites take the 2-D path
// (reduce-scatter in the site, allreduce across, allgather), here over mixed shared memory and
// TCP inside a site; counts below the site size, and unequal sites, take one leader per site.
TEST(Sites, HierarchicalAllreduceGroupsBySite) {
  struct Case {
    std::vector<std::string> hosts, sites;
  };
  for (const Case& cs : {Case{{"h0", "h0", "h1", "h2", "h3", "h3"}, {"x", "x", "x", "y", "y", "y"}},
                         Case{{"h0", "h1", "h2", "h3"}, {"x", "y", "x", "y"}},
                         Case{{"h0", "h0", "h1", "h2"}, {"x", "x", "x", "y"}}}) {
    auto w = make_world(cs.hosts, quick_options(true));
    for (auto& c : w.ctx) c->set_sites(cs.sites);
    const uint32_t size = static_cast<uint32_t>(cs.hosts.size());
    auto errs = run_ranks(w, [size](Communicator& c, uint32_t r) {
      for (size_t count : {size_t{1}, size_t{2}, size_t{7}, size_t{1023}, size_t{100003}}) {
        for (ReduceOp op : {ReduceOp::SUM, ReduceOp::MAX, ReduceOp::AVG}) {
          std::vector<float> buf(count);
          for (size_t i = 0; i < count; ++i) buf[i] = input(r, i) * static_cast<float>(size);
          c.allreduce(buf.data(), count, DType::F32, op, AllreduceAlgo::kHierarchical);
          for (size_t i = 0; i < count; ++i) {
            float want = 0.0f;
            for (uint32_t q = 0; q < size; ++q) {
              const float v = input(q, i) * static_cast<float>(size);
              want = op == ReduceOp::MAX ? (q == 0 ? v : std::max(want, v)) : want + v;
            }
            if (op == ReduceOp::AVG) want /= static_cast<float>(size);
            ASSERT_EQ(buf[i], want) << "count " << count << " i " << i << " op " << op_name(op) << " rank "
                                    << r;
          }
        }
      }
    });
    expect_all_ok(errs);
  }
}

// Across hosts a large broadcast runs down a chain from the root (chain_broadcast): every root,
// the chain's ends and middles, chunk counts that do not divide the buffer (300001 floats is
// five 256 KiB chunks, the last short), a buffer of many chunks (16 MiB: 64 chunks of 256 KiB),
// and hosts of several ranks (shared memory and TCP in one chain).
TEST(Collectives, ChainBroadcastAcrossHostsFromEveryRoot) {
  for (const auto& hosts :
       {std::vector<std::string>{"h0", "h1", "h2"}, std::vector<std::string>{"h0", "h0", "h1", "h1", "h2"}}) {
    auto w = make_world(hosts, quick_options(true));
    const uint32_t size = static_cast<uint32_t>(hosts.size());
    auto errs = run_ranks(w, [size](Communicator& c, uint32_t r) {
      for (uint32_t root = 0; root < size; ++root) {
        for (size_t count : {size_t{300001}, size_t{4} << 20}) {
          std::vector<float> b(count);
          for (size_t i = 0; i < count; ++i) b[i] = input(r, i);
          c.broadcast(b.data(), count, DType::F32, root);
          for (size_t i = 0; i < count; ++i) ASSERT_EQ(b[i], input(root, i)) << "root " << root << " i " << i;
        }
      }
    });
    expect_all_ok(errs);
  }
}

// Large buffers overlap the 2-D allreduce's phases (allreduce_2d_overlapped: the site's
// reduce-scatter and allgather piece by piece on the caller's thread, the ring across sites on its
// own). Every element must meet the same additions in the same order as one phase after the
// other: floats whose sums round differently in another order, compared bit for bit with
// RUMOR_SITE_OVERLAP=0, on 3 sites (where the cross ring's order matters) and on a site of one
// host (the host's direct path inside), plus integers against the exact sums.
TEST(Sites, OverlappedAllreduceGivesTheSequentialBits) {
  struct Case {
    std::vector<std::string> hosts, sites;
  };
  const size_t count = 300001;  // 3 pieces in both cases (64 KiB and up per cross block piece)
  auto value = [](uint32_t r, size_t i) {
    const uint64_t h = (r + 1) * 0x9E3779B97F4A7C15ull ^ (i * 0xBF58476D1CE4E5B9ull);
    return static_cast<float>(static_cast<int64_t>(h % 2000001) - 1000000) / 977.0f;
  };
  for (const Case& cs : {Case{{"h0", "h0", "h1", "h2", "h3", "h4"}, {"x", "x", "y", "y", "z", "z"}},
                         Case{{"h0", "h0", "h0", "h1", "h2", "h3"}, {"x", "x", "x", "y", "y", "y"}}}) {
    const uint32_t size = static_cast<uint32_t>(cs.hosts.size());
    // results[overlap][rank]: SUM, AVG, MAX of the floats, one after the other.
    std::vector<std::vector<std::vector<float>>> results(2, std::vector<std::vector<float>>(size));
    std::vector<size_t> scatters(2), allreduces(2);
    for (int overlap = 0; overlap < 2; ++overlap) {
      Options opts = quick_options(true);
      opts.site_overlap = overlap == 1;
      opts.flight_records = 4096;
      auto w = make_world(cs.hosts, opts);
      for (auto& c : w.ctx) c->set_sites(cs.sites);
      auto errs = run_ranks(w, [&](Communicator& c, uint32_t r) {
        for (ReduceOp op : {ReduceOp::SUM, ReduceOp::AVG, ReduceOp::MAX}) {
          std::vector<float> buf(count);
          for (size_t i = 0; i < count; ++i) buf[i] = value(r, i);
          c.allreduce(buf.data(), count, DType::F32, op, AllreduceAlgo::kHierarchical);
          results[overlap][r].insert(results[overlap][r].end(), buf.begin(), buf.end());
        }
        std::vector<int32_t> ints(count);
        for (size_t i = 0; i < count; ++i)
          ints[i] = static_cast<int32_t>((r * 7919 + i * 31) % 100003) - 50000;
        c.allreduce(ints.data(), count, DType::I32, ReduceOp::SUM, AllreduceAlgo::kHierarchical);
        for (size_t i = 0; i < count; ++i) {
          int32_t want = 0;
          for (uint32_t q = 0; q < size; ++q)
            want += static_cast<int32_t>((q * 7919 + i * 31) % 100003) - 50000;
          ASSERT_EQ(ints[i], want) << "i " << i << " rank " << r;
        }
      });
      expect_all_ok(errs);
      for (const auto& rec : w.ctx[0]->recorder().flight_records()) {
        scatters[overlap] += rec.name == "reduce_scatter";
        allreduces[overlap] += rec.name == "allreduce" && rec.comm == "world";
      }
    }
    // One reduce-scatter per allreduce one phase after the other, one per piece overlapped.
    EXPECT_EQ(allreduces[0], 4u);
    EXPECT_EQ(scatters[0], 4u);
    EXPECT_EQ(allreduces[1], 4u);
    EXPECT_EQ(scatters[1], 12u);
    for (uint32_t r = 0; r < size; ++r) {
      ASSERT_EQ(results[1][r].size(), 3 * count);
      EXPECT_EQ(std::memcmp(results[1][r].data(), results[0][r].data(), 3 * count * sizeof(float)), 0)
          << "rank " << r << ": overlapped bits differ from the sequential ones";
      EXPECT_EQ(std::memcmp(results[1][r].data(), results[1][0].data(), 3 * count * sizeof(float)), 0)
          << "rank " << r << " differs from rank 0";
    }
  }
}

// A failure while the two threads of the overlapped allreduce run: one rank brings a different
// count, so its site's reduce-scatter and its cross-site ring both meet frames of the wrong size.
// Every rank must fail (none hangs with its cross-site thread still running), and the next
// operation on the broken communicator says so.
TEST(Sites, OverlappedAllreduceFailsOnEveryRank) {
  Options opts = quick_options(true);
  opts.timeout_s = 10;
  auto w = make_world({"h0", "h1", "h2", "h3"}, opts);
  for (auto& c : w.ctx) c->set_sites({"x", "x", "y", "y"});
  std::vector<std::string> second(4);
  auto errs = run_ranks(w, [&](Communicator& c, uint32_t r) {
    const size_t count = r == 3 ? 400000 : 400003;
    std::vector<float> buf(count, 1.0f);
    try {
      c.allreduce(buf.data(), count, DType::F32, ReduceOp::SUM, AllreduceAlgo::kHierarchical);
    } catch (const Error&) {
      try {
        c.allreduce(buf.data(), count, DType::F32, ReduceOp::SUM, AllreduceAlgo::kHierarchical);
      } catch (const Error& e) {
        second[r] = e.what();
      }
      throw;
    }
  });
  for (uint32_t r = 0; r < 4; ++r) {
    EXPECT_TRUE(errs[r] != nullptr) << "rank " << r << " did not fail";
    EXPECT_NE(second[r].find("unusable after an earlier failure"), std::string::npos) << second[r];
  }
}

// peer_rtts (RUMOR_SITE=auto) connects every pair and reads the kernel's round trip: positive
// over TCP, 0 for the rank itself and over shared memory.
TEST(Sites, PeerRoundTrips) {
  auto w = make_world({"h0", "h0", "h1"}, quick_options(true));
  std::vector<std::vector<double>> rtts(3);
  expect_all_ok(run_ranks(w, [&](Communicator& c, uint32_t r) { rtts[r] = c.peer_rtts(); }));
  for (uint32_t r = 0; r < 3; ++r) {
    ASSERT_EQ(rtts[r].size(), 3u);
    for (uint32_t p = 0; p < 3; ++p) {
      if (p == r || (p < 2 && r < 2))
        EXPECT_EQ(rtts[r][p], 0.0) << r << " -> " << p;
      else
        EXPECT_GT(rtts[r][p], 0.0) << r << " -> " << p;
    }
  }
}

TEST(Sites, RefusesAWrongCountOrAnEmptySite) {
  auto w = make_world(one_host(2), quick_options(false));
  EXPECT_THROW(w.ctx[0]->set_sites({"x"}), Error);
  EXPECT_THROW(w.ctx[0]->set_sites({"x", ""}), Error);
  EXPECT_NO_THROW(w.ctx[0]->set_sites({}));
  EXPECT_FALSE(w.ctx[0]->has_sites());
}

// Large enough that the ring sends each block in several pieces (quick_options' striping
// threshold is 256 KiB), with an odd count so blocks and pieces are uneven; AVG divides each
// piece of the owner's block once.
TEST_P(Collectives, RingAllreduceInPieces) {
  auto w = make_world(one_host(n()), quick_options(shm()));
  const uint32_t size = n();
  auto errs = run_ranks(w, [size](Communicator& c, uint32_t r) {
    const size_t count = 1000003;
    std::vector<float> want(count);
    for (size_t i = 0; i < count; ++i)
      for (uint32_t q = 0; q < size; ++q) want[i] += input(q, i) * static_cast<float>(size);
    for (ReduceOp op : {ReduceOp::SUM, ReduceOp::AVG}) {
      std::vector<float> buf(count);
      for (size_t i = 0; i < count; ++i) buf[i] = input(r, i) * static_cast<float>(size);
      c.allreduce(buf.data(), count, DType::F32, op, AllreduceAlgo::kRing);
      for (size_t i = 0; i < count; ++i)
        ASSERT_EQ(buf[i], op == ReduceOp::AVG ? want[i] / static_cast<float>(size) : want[i])
            << "i " << i << " op " << op_name(op);
    }
  });
  expect_all_ok(errs);
}

TEST_P(Collectives, ReduceScatterAndAllgatherUneven) {
  auto w = make_world(one_host(n()), quick_options(shm()));
  const uint32_t size = n();
  auto errs = run_ranks(w, [size](Communicator& c, uint32_t r) {
    std::vector<size_t> counts(size);
    for (uint32_t q = 0; q < size; ++q) counts[q] = q * 1000 + (q % 2 ? 0 : 77);  // includes 0
    size_t total = std::accumulate(counts.begin(), counts.end(), size_t{0});
    std::vector<size_t> off(size + 1, 0);
    for (uint32_t q = 0; q < size; ++q) off[q + 1] = off[q] + counts[q];

    std::vector<int64_t> buf(total);
    for (size_t i = 0; i < total; ++i) buf[i] = static_cast<int64_t>(r * 100000 + i);
    const std::vector<int64_t> input = buf;
    std::vector<int64_t> mine(counts[r], -1);
    c.reduce_scatter(buf.data(), mine.data(), counts, DType::I64, ReduceOp::SUM);
    ASSERT_EQ(buf, input) << "reduce_scatter must not modify its input";
    for (size_t i = off[r]; i < off[r + 1]; ++i) {
      int64_t want = 0;
      for (uint32_t q = 0; q < size; ++q) want += static_cast<int64_t>(q * 100000 + i);
      ASSERT_EQ(mine[i - off[r]], want);
    }

    std::vector<int64_t> g(total, -1);
    for (size_t i = off[r]; i < off[r + 1]; ++i) g[i] = static_cast<int64_t>(i * 3 + r);
    c.allgather(g.data(), counts, DType::I64);
    for (uint32_t q = 0; q < size; ++q)
      for (size_t i = off[q]; i < off[q + 1]; ++i) ASSERT_EQ(g[i], static_cast<int64_t>(i * 3 + q));
  });
  expect_all_ok(errs);
}

TEST_P(Collectives, BroadcastAndReduceFromEveryRoot) {
  auto w = make_world(one_host(n()), quick_options(shm()));
  const uint32_t size = n();
  auto errs = run_ranks(w, [size](Communicator& c, uint32_t r) {
    for (uint32_t root = 0; root < size; ++root) {
      for (size_t count : {size_t{3}, size_t{300001}}) {  // binomial tree, scatter + allgather
        std::vector<float> b(count);
        for (size_t i = 0; i < count; ++i) b[i] = input(r, i);
        c.broadcast(b.data(), count, DType::F32, root);
        for (size_t i = 0; i < count; ++i) ASSERT_EQ(b[i], input(root, i));

        std::vector<float> red(count);
        for (size_t i = 0; i < count; ++i) red[i] = input(r, i);
        c.reduce(red.data(), count, DType::F32, ReduceOp::SUM, root);
        if (r == root)
          for (size_t i = 0; i < count; ++i) {
            float want = 0;
            for (uint32_t q = 0; q < size; ++q) want += input(q, i);
            ASSERT_EQ(red[i], want);
          }
      }
    }
  });
  expect_all_ok(errs);
}

TEST_P(Collectives, AlltoallBarrierSendRecv) {
  auto w = make_world(one_host(n()), quick_options(shm()));
  const uint32_t size = n();
  auto errs = run_ranks(w, [size](Communicator& c, uint32_t r) {
    // rank r sends (r + q) % 3 * 50000 elements to rank q: some zero, some striped.
    auto amount = [](uint32_t from, uint32_t to) -> size_t { return ((from + to) % 3) * 50000; };
    std::vector<size_t> sc(size), rc(size);
    for (uint32_t q = 0; q < size; ++q) sc[q] = amount(r, q), rc[q] = amount(q, r);
    std::vector<int32_t> in(std::accumulate(sc.begin(), sc.end(), size_t{0}));
    std::vector<int32_t> out(std::accumulate(rc.begin(), rc.end(), size_t{0}), -1);
    size_t k = 0;
    for (uint32_t q = 0; q < size; ++q)
      for (size_t i = 0; i < sc[q]; ++i) in[k++] = static_cast<int32_t>(r * 1000 + q * 10 + i % 7);
    c.alltoall(in.data(), sc, out.data(), rc, DType::I32);
    k = 0;
    for (uint32_t q = 0; q < size; ++q)
      for (size_t i = 0; i < rc[q]; ++i) ASSERT_EQ(out[k++], static_cast<int32_t>(q * 1000 + r * 10 + i % 7));

    c.barrier();

    if (size > 1) {
      std::vector<uint8_t> msg(70001);
      uint32_t to = (r + 1) % size, from = (r + size - 1) % size;
      for (size_t i = 0; i < msg.size(); ++i) msg[i] = static_cast<uint8_t>(r + i);
      std::vector<uint8_t> got(msg.size());
      if (r % 2 == 0) {  // even ranks send first, so odd sizes cannot deadlock on a cycle
        c.send(msg.data(), msg.size(), to);
        c.recv(got.data(), got.size(), from);
      } else {
        c.recv(got.data(), got.size(), from);
        c.send(msg.data(), msg.size(), to);
      }
      for (size_t i = 0; i < got.size(); ++i) ASSERT_EQ(got[i], static_cast<uint8_t>(from + i));
    }
  });
  expect_all_ok(errs);
}

std::string param_name(const ::testing::TestParamInfo<std::tuple<uint32_t, bool>>& p) {
  return std::to_string(std::get<0>(p.param)) + (std::get<1>(p.param) ? "ranks_shm" : "ranks_tcp");
}

INSTANTIATE_TEST_SUITE_P(Worlds, Collectives,
                         ::testing::Combine(::testing::Values(1u, 2u, 3u, 4u, 5u), ::testing::Bool()),
                         param_name);

// The one-host direct allreduce (comm/direct.h) against a float64 reference (exact for
// integers), on sizes around its chunk boundaries, odd rank counts and many operations in a row
// (its counter slots alternate). Every rank must end with the same bits, whichever rank took
// which chunk.
TEST(HostDirect, AllreduceMatchesFloat64Reference) {
  auto value = [](uint32_t rank, size_t i) {
    return std::sin(0.37 * rank + 0.011 * static_cast<double>(i)) * 3.0;
  };
  auto bf16_of = [](float f) {  // small integers only: exact, no rounding needed
    uint32_t bits;
    std::memcpy(&bits, &f, sizeof(bits));
    return static_cast<uint16_t>(bits >> 16);
  };
  for (uint32_t n : {3u, 4u, 5u}) {  // two ranks keep the rings (Communicator::use_direct)
    auto w = make_world(one_host(n), quick_options(true));
    const size_t chunk = HostDirect::kChunkBytes / sizeof(float);
    const std::vector<size_t> counts = {chunk + 1, 3 * chunk, 5 * chunk + 7, (size_t{1} << 20) + 3};
    std::vector<std::vector<std::vector<float>>> seen(n);  // [rank][size] float32 result bits
    auto errs = run_ranks(w, [&, n](Communicator& c, uint32_t r) {
      for (size_t count : counts) {
        std::vector<float> f(count);
        std::vector<double> d(count), want(count, 0.0);
        std::vector<int32_t> k(count);
        std::vector<int64_t> m(count);
        std::vector<uint16_t> b(count);
        for (size_t i = 0; i < count; ++i) {
          f[i] = static_cast<float>(value(r, i));
          d[i] = value(r, i);
          k[i] = static_cast<int32_t>((r * 7 + i * 3) % 1000003) - 500000;
          m[i] = static_cast<int64_t>((r * 31 + i * 17) % 101);
          b[i] = bf16_of(static_cast<float>((r + i) % 13));
          for (uint32_t q = 0; q < n; ++q) want[i] += static_cast<double>(static_cast<float>(value(q, i)));
        }
        c.allreduce(f.data(), count, DType::F32, ReduceOp::SUM);
        c.allreduce(d.data(), count, DType::F64, ReduceOp::AVG);
        c.allreduce(k.data(), count, DType::I32, ReduceOp::SUM);
        c.allreduce(m.data(), count, DType::I64, ReduceOp::MAX);
        c.allreduce(b.data(), count, DType::BF16, ReduceOp::SUM);
        for (size_t i = 0; i < count; ++i) {
          ASSERT_NEAR(f[i], want[i], 1e-5 * (1.0 + std::abs(want[i]))) << "f32 count " << count << " i " << i;
          double avg = 0;
          int64_t ksum = 0, mmax = 0, bsum = 0;
          for (uint32_t q = 0; q < n; ++q) {
            avg += value(q, i);
            ksum += static_cast<int32_t>((q * 7 + i * 3) % 1000003) - 500000;
            mmax = std::max<int64_t>(mmax, static_cast<int64_t>((q * 31 + i * 17) % 101));
            bsum += static_cast<int64_t>((q + i) % 13);
          }
          ASSERT_NEAR(d[i], avg / n, 1e-12) << "f64 avg count " << count << " i " << i;
          ASSERT_EQ(k[i], ksum) << "i32 count " << count << " i " << i;
          ASSERT_EQ(m[i], mmax) << "i64 max count " << count << " i " << i;
          ASSERT_EQ(b[i], bf16_of(static_cast<float>(bsum))) << "bf16 count " << count << " i " << i;
        }
        seen[r].push_back(std::move(f));
      }
    });
    expect_all_ok(errs);
    for (uint32_t r = 1; r < n; ++r)
      for (size_t s = 0; s < counts.size() && s < seen[r].size(); ++s)
        EXPECT_EQ(std::memcmp(seen[r][s].data(), seen[0][s].data(), counts[s] * sizeof(float)), 0)
            << "rank " << r << " holds other float32 bits than rank 0 (" << counts[s] << " elements)";
  }
}

// allreduce_into: the result in another buffer with the input untouched, the bits of the in-place
// allreduce on every rank, on the direct path (which reads the inputs where they are) and on the
// rings (a copy, then in place); ranks in place and out of place may meet in one operation.
TEST(HostDirect, AllreduceIntoGivesTheInPlaceBitsAndKeepsTheInput) {
  auto value = [](uint32_t rank, size_t i) {
    return static_cast<float>(std::sin(0.37 * rank + 0.011 * static_cast<double>(i)) * 3.0);
  };
  const size_t chunk = HostDirect::kChunkBytes / sizeof(float);
  for (const bool shm : {true, false})
    for (uint32_t n : {3u, 4u}) {
      auto w = make_world(one_host(n), quick_options(shm));
      auto errs = run_ranks(w, [&](Communicator& c, uint32_t r) {
        for (size_t count : {chunk + 1, 5 * chunk + 7}) {
          for (ReduceOp op : {ReduceOp::SUM, ReduceOp::AVG}) {
            std::vector<float> in(count), out(count, -7.0f), want(count);
            for (size_t i = 0; i < count; ++i) in[i] = value(r, i);
            want = in;
            c.allreduce(want.data(), count, DType::F32, op);
            const std::vector<float> before = in;
            if (r % 2 == 1) {  // this rank in place, its neighbours out of place
              out = in;
              c.allreduce_into(out.data(), out.data(), count, DType::F32, op);
            } else {
              c.allreduce_into(in.data(), out.data(), count, DType::F32, op);
              ASSERT_EQ(std::memcmp(in.data(), before.data(), count * sizeof(float)), 0) << "input changed";
            }
            ASSERT_EQ(std::memcmp(out.data(), want.data(), count * sizeof(float)), 0)
                << (shm ? "shm" : "tcp") << " n " << n << " rank " << r << " count " << count;
          }
        }
        std::vector<float> buf(2 * chunk);
        try {
          c.allreduce_into(buf.data(), buf.data() + 1, chunk, DType::F32, ReduceOp::SUM);
          ADD_FAILURE() << "an overlapping output was taken";
        } catch (const Error& e) {
          EXPECT_EQ(e.kind(), ErrorKind::kInvalidArgument) << e.what();
        }
        c.allreduce(buf.data(), buf.size(), DType::F32, ReduceOp::SUM);  // and the group goes on
      });
      expect_all_ok(errs);
    }
}

// reduce_scatter and allgather on the direct path: uneven blocks (one empty, one spanning
// several chunks with a partial last one), float64 reference for floats, exact for integers.
TEST(HostDirect, ReduceScatterAndAllgatherUnevenBlocks) {
  for (uint32_t n : {3u, 4u}) {
    auto w = make_world(one_host(n), quick_options(true));
    auto errs = run_ranks(w, [n](Communicator& c, uint32_t r) {
      const size_t chunk = HostDirect::kChunkBytes / sizeof(float);
      std::vector<size_t> counts(n);
      for (uint32_t q = 0; q < n; ++q) counts[q] = q == 1 ? 0 : (q + 2) * chunk + 3 * q + 1;
      const size_t total = std::accumulate(counts.begin(), counts.end(), size_t{0});
      std::vector<size_t> at(n + 1, 0);
      for (uint32_t q = 0; q < n; ++q) at[q + 1] = at[q] + counts[q];
      auto value = [](uint32_t rank, size_t i) {
        return std::cos(0.29 * rank + 0.007 * static_cast<double>(i));
      };
      std::vector<float> in(total);
      std::vector<int32_t> in_i(total);
      for (size_t i = 0; i < total; ++i) {
        in[i] = static_cast<float>(value(r, i));
        in_i[i] = static_cast<int32_t>((i * 5 + r * 11) % 7919);
      }
      std::vector<float> out(counts[r] + 1);
      std::vector<int32_t> out_i(counts[r] + 1);
      c.reduce_scatter(in.data(), out.data(), counts, DType::F32, ReduceOp::SUM);
      c.reduce_scatter(in_i.data(), out_i.data(), counts, DType::I32, ReduceOp::SUM);
      for (size_t j = 0; j < counts[r]; ++j) {
        double want = 0;
        int64_t want_i = 0;
        for (uint32_t q = 0; q < n; ++q) {
          want += static_cast<double>(static_cast<float>(value(q, at[r] + j)));
          want_i += static_cast<int64_t>(((at[r] + j) * 5 + q * 11) % 7919);
        }
        ASSERT_NEAR(out[j], want, 1e-5 * (1.0 + std::abs(want)))
            << "reduce_scatter f32 rank " << r << " j " << j;
        ASSERT_EQ(out_i[j], want_i) << "reduce_scatter i32 rank " << r << " j " << j;
      }
      std::vector<int64_t> g(total, -1);
      for (size_t j = 0; j < counts[r]; ++j) g[at[r] + j] = static_cast<int64_t>(r * 1000003 + j);
      c.allgather(g.data(), counts, DType::I64);
      for (uint32_t q = 0; q < n; ++q)
        for (size_t j = 0; j < counts[q]; ++j)
          ASSERT_EQ(g[at[q] + j], static_cast<int64_t>(q * 1000003 + j))
              << "allgather block " << q << " j " << j;
    });
    expect_all_ok(errs);
  }
}

// allgather on the direct path with this rank's block passed apart (`own`): read where it is by
// whichever rank takes each chunk, and written into every output, the owner's included. Ranks mix
// the four ways to pass it in one operation: filled in place (no own), own apart, own being the
// block itself, and own lying elsewhere inside the output (copied into place first). Uneven
// blocks (one empty), exact everywhere, and own left untouched.
TEST(HostDirect, AllgatherReadsEachOwnBlockWhereItIs) {
  for (uint32_t n : {3u, 4u}) {
    auto w = make_world(one_host(n), quick_options(true));
    auto errs = run_ranks(w, [n](Communicator& c, uint32_t r) {
      const size_t chunk = HostDirect::kChunkBytes / sizeof(int64_t);
      std::vector<size_t> counts(n);
      for (uint32_t q = 0; q < n; ++q) counts[q] = q == 1 ? 0 : (q + 1) * chunk + 5 * q + 3;
      std::vector<size_t> at(n + 1, 0);
      for (uint32_t q = 0; q < n; ++q) at[q + 1] = at[q] + counts[q];
      auto value = [](uint32_t q, size_t j, int round) {
        return static_cast<int64_t>(q * 1000003 + j * 3 + static_cast<size_t>(round) * 7);
      };
      for (int round = 0; round < 3; ++round) {
        std::vector<int64_t> g(at[n], -1), apart(counts[r]);
        for (size_t j = 0; j < counts[r]; ++j) apart[j] = value(r, j, round);
        const int64_t* own = nullptr;
        switch ((r + static_cast<uint32_t>(round)) % 4) {
          case 0:  // in place
            std::copy(apart.begin(), apart.end(), g.begin() + static_cast<ptrdiff_t>(at[r]));
            break;
          case 1:  // apart
            own = apart.data();
            break;
          case 2:  // the block itself
            std::copy(apart.begin(), apart.end(), g.begin() + static_cast<ptrdiff_t>(at[r]));
            own = g.data() + at[r];
            break;
          default:  // elsewhere in the output: overwritten by the others' blocks
            if (r != 0 && counts[r] <= at[r]) {
              std::copy(apart.begin(), apart.end(), g.begin());
              own = g.data();
            } else {
              own = apart.data();
            }
        }
        c.allgather(g.data(), counts, DType::I64, own);
        for (uint32_t q = 0; q < n; ++q)
          for (size_t j = 0; j < counts[q]; ++j)
            ASSERT_EQ(g[at[q] + j], value(q, j, round)) << "round " << round << " block " << q << " j " << j;
        for (size_t j = 0; j < counts[r]; ++j)
          ASSERT_EQ(apart[j], value(r, j, round)) << "own changed, j " << j;
      }
    });
    expect_all_ok(errs);
  }
}

// broadcast on the direct path (an allgather whose only block is the root's): every root, sizes
// around the chunk boundaries, exact bytes everywhere.
TEST(HostDirect, BroadcastFromEveryRoot) {
  for (uint32_t n : {3u, 4u}) {
    auto w = make_world(one_host(n), quick_options(true));
    auto errs = run_ranks(w, [n](Communicator& c, uint32_t r) {
      for (size_t count : {HostDirect::kChunkBytes / 8 + 1, 3 * HostDirect::kChunkBytes / 8 + 5}) {
        for (uint32_t root = 0; root < n; ++root) {
          std::vector<int64_t> v(count, -1);
          if (r == root)
            for (size_t i = 0; i < count; ++i) v[i] = static_cast<int64_t>(root * 1000003 + i * 7);
          c.broadcast(v.data(), count, DType::I64, root);
          for (size_t i = 0; i < count; ++i)
            ASSERT_EQ(v[i], static_cast<int64_t>(root * 1000003 + i * 7)) << "root " << root << " i " << i;
        }
      }
    });
    expect_all_ok(errs);
  }
}

// reduce on the direct path (a reduce_scatter whose only block is the root's): the root gets the
// exact integer sum (and AVG of floats against float64), the others keep their input.
TEST(HostDirect, ReduceToEveryRoot) {
  for (uint32_t n : {3u, 4u}) {
    auto w = make_world(one_host(n), quick_options(true));
    auto errs = run_ranks(w, [n](Communicator& c, uint32_t r) {
      const size_t count = 2 * HostDirect::kChunkBytes / 8 + 3;
      for (uint32_t root = 0; root < n; ++root) {
        std::vector<int64_t> v(count);
        std::vector<double> d(count);
        for (size_t i = 0; i < count; ++i) {
          v[i] = static_cast<int64_t>(r * 100003 + i + root);
          d[i] = 0.25 * r + 1e-3 * static_cast<double>(i);
        }
        const std::vector<int64_t> mine = v;
        c.reduce(v.data(), count, DType::I64, ReduceOp::SUM, root);
        c.reduce(d.data(), count, DType::F64, ReduceOp::AVG, root);
        for (size_t i = 0; i < count; ++i) {
          int64_t want = 0;
          double avg = 0;
          for (uint32_t q = 0; q < n; ++q) {
            want += static_cast<int64_t>(q * 100003 + i + root);
            avg += 0.25 * q + 1e-3 * static_cast<double>(i);
          }
          if (r == root) {
            ASSERT_EQ(v[i], want) << "root " << root << " i " << i;
            ASSERT_NEAR(d[i], avg / n, 1e-12) << "root " << root << " i " << i;
          } else {
            ASSERT_EQ(v[i], mine[i]) << "rank " << r << " (not the root) had its input changed at " << i;
          }
        }
      }
    });
    expect_all_ok(errs);
  }
}

// A rank passing one element more is refused on every rank before any buffer is touched (the
// chunk counts alone could agree and sum mismatched buffers silently).
TEST(HostDirect, MismatchedCountsAreRefusedEverywhere) {
  auto w = make_world(one_host(3), quick_options(true));
  const size_t count = 4 * HostDirect::kChunkBytes / sizeof(float);
  auto errs = run_ranks(w, [count](Communicator& c, uint32_t r) {
    std::vector<float> v(count + (r == 2), 1.0f);
    const std::vector<float> before = v;
    try {
      c.allreduce(v.data(), v.size(), DType::F32, ReduceOp::SUM);
    } catch (...) {
      EXPECT_EQ(v, before) << "rank " << r << ": its buffer changed although the op was refused";
      throw;
    }
  });
  ASSERT_EQ(errs.size(), 3u);
  // Every rank fails; a rank that sees the mismatch first aborts, so the others may hear of that
  // abort before the announcement that would have shown them the mismatch too.
  size_t named = 0;
  for (uint32_t r = 0; r < 3; ++r) {
    ASSERT_TRUE(errs[r]) << "rank " << r << " accepted mismatched sizes";
    const std::string what = testing::describe(errs[r]);
    if (what.find("different sizes") != std::string::npos)
      ++named;
    else
      EXPECT_NE(what.find("aborted"), std::string::npos) << "rank " << r << ": " << what;
  }
  EXPECT_GE(named, 1u) << "no rank said the sizes differ";
}

// Rank 0's choice between the rings and the direct path (two ranks, 1-16 MiB): each path tried
// first, then the faster, the other for kExploreRun operations every kExploreEvery; the first
// operation after a switch does not count; one slow operation does not switch, a path that stays
// slow is left within a few.
TEST(PathChoice, TriesBothThenTakesTheFasterAndLooksAtTheOtherNowAndThen) {
  PathChoice c;
  const size_t mib = size_t{1} << 20;
  double ring = 120e-6, direct = 200e-6;
  auto op = [&] {
    const bool d = c.direct_next(mib);
    c.record(mib, d, d ? direct : ring);
    return d;
  };
  // The rings until one followed another (its time counts), then the direct path likewise.
  EXPECT_EQ((std::vector<bool>{op(), op(), op(), op()}), (std::vector<bool>{false, false, true, true}));
  std::vector<bool> picks;
  for (uint32_t i = 0; i < 4 * PathChoice::kExploreEvery; ++i) picks.push_back(op());
  // Runs on the slower path every kExploreEvery x 200/120 operations: two in 256.
  EXPECT_EQ(std::count(picks.begin(), picks.end(), true), 2 * PathChoice::kExploreRun);
  // Sizes are told apart: 4 MiB has seen nothing yet.
  EXPECT_FALSE(c.direct_next(4 * mib));
  // Past the next run on the direct path, onto the rings again (the first op there not counted).
  while (!op()) {
  }
  while (op()) {
  }
  // One operation 40x slower (a descheduled rank) leaves the rings chosen.
  ASSERT_FALSE(op());
  ASSERT_FALSE(c.direct_next(mib));
  c.record(mib, false, 40 * ring);
  EXPECT_FALSE(op());
  EXPECT_FALSE(op());
  // The rings become slow for good (500 us): the direct path within a few operations.
  ring = 500e-6;
  int until = 0;
  while (!op() && until < 10) ++until;
  EXPECT_LE(until, 6);
  // ... and back to the rings once they are fast again, after the first run on them.
  ring = 110e-6;
  picks.clear();
  while (op()) picks.push_back(true);
  EXPECT_LE(picks.size(), 2 * PathChoice::kExploreEvery);
  for (uint32_t i = 0; i < PathChoice::kExploreRun - 1; ++i) EXPECT_FALSE(op());  // the run
  for (uint32_t i = 0; i + 1 < PathChoice::kExploreEvery; ++i) EXPECT_FALSE(op()) << "op " << i;
  // Far slower: looked at far less often (16x at most), on short operations.
  ring = 1e-6;
  direct = 100 * ring;
  auto runs_in = [&](uint32_t ops) {
    picks.clear();
    for (uint32_t i = 0; i < ops; ++i) picks.push_back(op());
    return std::count(picks.begin(), picks.end(), true) / static_cast<long>(PathChoice::kExploreRun);
  };
  runs_in(PathChoice::kExploreEvery * 40);  // the estimates settle
  EXPECT_EQ(runs_in(PathChoice::kExploreEvery * 32), 2);
  // Long ones: at least every kExploreSeconds of them.
  ring = 1e-3;
  direct = 10 * ring;
  runs_in(PathChoice::kExploreEvery * 40);
  const auto every = static_cast<long>(PathChoice::kExploreSeconds / ring) + PathChoice::kExploreRun;
  EXPECT_NEAR(runs_in(PathChoice::kExploreEvery * 32), PathChoice::kExploreEvery * 32 / every, 1);
}

// Two ranks take the path rank 0 names, whatever the other's own setting says (a disagreement
// would hang, or each would read the other's buffer while it is rewritten), with exact results
// on both paths, and with rank 0 choosing by time every rank ran the same path each time. Other
// operations in between (a 4 KiB allreduce, a broadcast from rank 1, which rank 1 can finish
// before rank 0 starts it) do not shift which operation a written path is for.
TEST(HostDirect, TwoRanksTakeThePathRankZeroNames) {
  const size_t count = (size_t{1} << 20) / sizeof(int64_t) + 3;  // 1 MiB and a bit
  auto run = [&](int rank0, int rank1, int ops) {
    std::vector<Options> o(2, quick_options(true));
    o[0].two_rank_path = rank0;
    o[1].two_rank_path = rank1;
    auto w = make_world(one_host(2), o);
    std::vector<std::string> paths[2];
    auto errs = run_ranks(w, [&](Communicator& c, uint32_t r) {
      std::vector<int64_t> v(count);
      for (int k = 0; k < ops; ++k) {
        for (size_t i = 0; i < count; ++i) v[i] = static_cast<int64_t>(i * (r + 1) + k) - 1000;
        c.allreduce(v.data(), count, DType::I64, ReduceOp::SUM);
        for (size_t i = 0; i < count; ++i)
          ASSERT_EQ(v[i], static_cast<int64_t>(3 * i + 2 * k) - 2000) << "op " << k << " i " << i;
        paths[r].push_back(c.last_algo());
        if (k % 3 == 1) {
          std::vector<float> small(1024, 1.0f);
          c.allreduce(small.data(), small.size(), DType::F32, ReduceOp::SUM);
          ASSERT_EQ(small[5], 2.0f);
          c.broadcast(small.data(), small.size(), DType::F32, 1);
        }
      }
    });
    expect_all_ok(errs);
    EXPECT_EQ(paths[0], paths[1]);
    return paths[0];
  };
  EXPECT_EQ(run(1, 0, 3), std::vector<std::string>(3, "direct"));
  EXPECT_EQ(run(0, 1, 3), std::vector<std::string>(3, "ring"));
  const auto timed = run(-1, 1, 6 + PathChoice::kExploreEvery + PathChoice::kExploreRun);
  // The rings first (three: the first one's time does not count, and each path is named during
  // the operation before, before that one's time is known), then the direct path.
  EXPECT_EQ(std::vector<std::string>(timed.begin(), timed.begin() + 4),
            (std::vector<std::string>{"ring", "ring", "ring", "direct"}));
  const auto direct = std::count(timed.begin(), timed.end(), "direct");
  EXPECT_GE(direct, 2);  // the first tries, and runs on the slower path from then on
  EXPECT_LE(direct, static_cast<long>(timed.size()) - 2);
}

// The same figures with the direct path turned off (the ring): integers must agree exactly.
TEST(HostDirect, OffGivesTheSameIntegers) {
  const uint32_t n = 3;
  const size_t count = 4 * HostDirect::kChunkBytes / sizeof(int64_t) + 5;
  std::vector<std::vector<int64_t>> got(2);
  for (bool direct : {true, false}) {
    Options o = quick_options(true);
    o.host_direct = direct;
    auto w = make_world(one_host(n), o);
    auto errs = run_ranks(w, [&, direct](Communicator& c, uint32_t r) {
      std::vector<int64_t> v(count);
      for (size_t i = 0; i < count; ++i) v[i] = static_cast<int64_t>(i * (r + 1)) - 1000;
      c.allreduce(v.data(), count, DType::I64, ReduceOp::SUM);
      if (r == 0) got[direct ? 0 : 1] = v;
    });
    expect_all_ok(errs);
  }
  ASSERT_EQ(got[0].size(), count);
  EXPECT_EQ(got[0], got[1]);
}

// Ranks sharing cores, each bound to one (rumor-run --bind-cores): a waiting rank spins where no
// late rank is bound to its core and sleeps where one is. Two ranks per CPU here, with more ranks
// than CPUs as on a bound host; hundreds of operations back to back, each exact, on every rank,
// whichever of the two ways each rank waited.
TEST(HostSmall, RanksBoundToCoresStayExact) {
  cpu_set_t all;
  ASSERT_EQ(::sched_getaffinity(0, sizeof(all), &all), 0);
  std::vector<int> cpus;
  for (int c = 0; c < CPU_SETSIZE && cpus.size() < 2; ++c)
    if (CPU_ISSET(c, &all)) cpus.push_back(c);
  const uint32_t n = 4;
  Options o = quick_options(true);
  o.spin_us = 0;  // ranks that share cores, whatever this machine has
  auto w = make_world(one_host(n), o);
  auto errs = run_ranks(w, [&](Communicator& c, uint32_t r) {
    cpu_set_t one;
    CPU_ZERO(&one);
    CPU_SET(cpus[r % cpus.size()], &one);
    ASSERT_EQ(::sched_setaffinity(0, sizeof(one), &one), 0);  // this rank's thread
    const size_t count = 1000;
    std::vector<int64_t> v(count), blocks(count / n);
    for (int round = 0; round < 300; ++round) {
      for (size_t i = 0; i < count; ++i) v[i] = round * 100000 + static_cast<int64_t>(r * 1000 + i);
      if (round % 2 == 0) {
        c.allreduce(v.data(), count, DType::I64, ReduceOp::SUM);
        for (size_t i = 0; i < count; ++i)
          ASSERT_EQ(v[i], n * (round * 100000 + static_cast<int64_t>(i)) + 1000 * (n * (n - 1) / 2))
              << "round " << round << " i " << i;
      } else {
        const std::vector<size_t> counts(n, count / n);
        c.reduce_scatter(v.data(), blocks.data(), counts, DType::I64, ReduceOp::SUM);
        for (size_t i = 0; i < count / n; ++i) {
          const size_t at = r * (count / n) + i;
          ASSERT_EQ(blocks[i], n * (round * 100000 + static_cast<int64_t>(at)) + 1000 * (n * (n - 1) / 2))
              << "round " << round << " i " << i;
        }
      }
    }
  });
  expect_all_ok(errs);
}

// A waiter sharing its core yields a few times before it sleeps (core/futex.h); a yield that came
// back late (something else ran a slice there) stops this wait's yields and the next waits'.
TEST(YieldBudget, ALateYieldPausesTheYieldsOfTheNextWaits) {
  YieldBudget b;
  ASSERT_GT(YieldBudget::kYieldsPerWait, 0);
  EXPECT_EQ(b.begin_wait(), YieldBudget::kYieldsPerWait);
  EXPECT_TRUE(b.after_yield(std::chrono::microseconds(3)));
  EXPECT_TRUE(b.after_yield(YieldBudget::kLateYield - std::chrono::microseconds(1)));
  EXPECT_EQ(b.begin_wait(), YieldBudget::kYieldsPerWait);  // prompt yields keep the budget
  EXPECT_FALSE(b.after_yield(YieldBudget::kLateYield));
  for (uint32_t i = 0; i < YieldBudget::kPausedWaits; ++i) ASSERT_EQ(b.begin_wait(), 0) << "wait " << i;
  EXPECT_EQ(b.begin_wait(), YieldBudget::kYieldsPerWait);
  EXPECT_FALSE(b.after_yield(std::chrono::milliseconds(3)));  // and again
  EXPECT_EQ(b.begin_wait(), 0);
}

// Small allreduces through the shared slots (comm/direct.h, HostSmall): many operations in a
// row with a different value each time (the two slot sets alternate and the arrival counter
// carries on), every dtype and op against a float64 / exact reference, sizes from empty up to
// the slot size, and every rank holding the same bits.
TEST(HostSmall, ManyOperationsMatchTheReference) {
  for (uint32_t n : {2u, 3u, 4u}) {
    auto w = make_world(one_host(n), quick_options(true));
    std::vector<std::vector<float>> last(n);
    auto errs = run_ranks(w, [&, n](Communicator& c, uint32_t r) {
      const size_t sizes[] = {0, 1, 5, 1023, HostSmall::kMaxBytes / sizeof(float)};
      for (int round = 0; round < 40; ++round) {
        const size_t count = sizes[round % 5];
        std::vector<float> f(count);
        std::vector<int32_t> k(count), lo(count);
        for (size_t i = 0; i < count; ++i) {
          f[i] = static_cast<float>(std::sin(0.1 * round + 0.3 * r + 0.01 * static_cast<double>(i)));
          k[i] = static_cast<int32_t>(round * 1000 + r * 10 + i % 7);
          lo[i] = static_cast<int32_t>((r * 13 + i + round) % 17);
        }
        c.allreduce(f.data(), count, DType::F32, ReduceOp::AVG);
        c.allreduce(k.data(), count, DType::I32, ReduceOp::SUM);
        c.allreduce(lo.data(), count, DType::I32, ReduceOp::MIN);
        for (size_t i = 0; i < count; ++i) {
          double avg = 0;
          int64_t sum = 0, mn = INT64_MAX;
          for (uint32_t q = 0; q < n; ++q) {
            avg += static_cast<float>(std::sin(0.1 * round + 0.3 * q + 0.01 * static_cast<double>(i)));
            sum += round * 1000 + q * 10 + static_cast<int64_t>(i % 7);
            mn = std::min<int64_t>(mn, static_cast<int64_t>((q * 13 + i + round) % 17));
          }
          ASSERT_NEAR(f[i], avg / n, 1e-6) << "round " << round << " i " << i;
          ASSERT_EQ(k[i], sum) << "round " << round << " i " << i;
          ASSERT_EQ(lo[i], mn) << "round " << round << " i " << i;
        }
        if (round == 39) last[r] = f;
      }
    });
    expect_all_ok(errs);
    for (uint32_t r = 1; r < n; ++r)
      EXPECT_EQ(last[r], last[0]) << "rank " << r << " holds other bits than rank 0";
  }
}

// A rank that contributes another size (or dtype) is named on every rank instead of summing
// mismatched slots.
TEST(HostSmall, MismatchedSizesAreReportedEverywhere) {
  auto w = make_world(one_host(3), quick_options(true));
  auto errs = run_ranks(w, [](Communicator& c, uint32_t r) {
    std::vector<float> v(r == 2 ? 9 : 8, 1.0f);
    c.allreduce(v.data(), v.size(), DType::F32, ReduceOp::SUM);
  });
  ASSERT_EQ(errs.size(), 3u);
  for (uint32_t r = 0; r < 3; ++r) {
    ASSERT_TRUE(errs[r]) << "rank " << r << " summed mismatched buffers";
    const std::string what = testing::describe(errs[r]);
    EXPECT_NE(what.find("rank 2 36 bytes"), std::string::npos) << "rank " << r << ": " << what;
    EXPECT_NE(what.find("rank 0 32 bytes"), std::string::npos) << "rank " << r << ": " << what;
  }
}

// The other small collectives through the same slots (HostSmall): many rounds in a row mixing
// reduce_scatter, allgather, broadcast (every root) and allreduce, so the two slot sets and the
// arrival counter carry on across collectives; sizes from empty up to each collective's limit
// (the whole input for reduce_scatter, one block for allgather), odd element counts, float32 /
// int32 / bfloat16. References: integers exact; float32 summed in rank order in float32 (what
// every rank must compute, bit for bit); bfloat16 inputs are small integers, so exact too.
namespace small_ref {
uint16_t bf16_of(float f) {  // small integers only: exact, no rounding needed
  uint32_t bits;
  std::memcpy(&bits, &f, sizeof(bits));
  return static_cast<uint16_t>(bits >> 16);
}
double source(int round, uint32_t rank, size_t i) {
  return std::sin(0.1 * round + 0.3 * rank + 0.01 * static_cast<double>(i));
}
int64_t whole(int round, uint32_t rank, size_t i) {
  return static_cast<int64_t>((rank * 13 + i * 3 + static_cast<size_t>(round)) % 29);
}
// Element i of rank `rank`'s input in round `round`, as the dtype's bits.
template <typename T>
T input(int round, uint32_t rank, size_t i) {
  if constexpr (std::is_same_v<T, float>)
    return static_cast<float>(source(round, rank, i));
  else if constexpr (std::is_same_v<T, int32_t>)
    return static_cast<int32_t>(round * 100000 + whole(round, rank, i) * 1000 + rank) - 7;
  else
    return bf16_of(static_cast<float>(whole(round, rank, i)));
}
// The sum over n ranks of element i, folded in rank order.
template <typename T>
T sum(int round, uint32_t n, size_t i) {
  if constexpr (std::is_same_v<T, float>) {
    float acc = input<float>(round, 0, i);
    for (uint32_t q = 1; q < n; ++q) acc += input<float>(round, q, i);
    return acc;
  } else if constexpr (std::is_same_v<T, int32_t>) {
    int64_t acc = 0;
    for (uint32_t q = 0; q < n; ++q) acc += input<int32_t>(round, q, i);
    return static_cast<int32_t>(acc);
  } else {
    int64_t acc = 0;
    for (uint32_t q = 0; q < n; ++q) acc += whole(round, q, i);
    return bf16_of(static_cast<float>(acc));
  }
}
// Splits `total` elements into n blocks, the first ones one longer; with `hole`, block 1 is
// empty and block 0 takes its share.
std::vector<size_t> blocks(size_t total, uint32_t n, bool hole) {
  std::vector<size_t> c(n);
  for (uint32_t q = 0; q < n; ++q) c[q] = total / n + (q < total % n ? 1 : 0);
  if (hole && n > 1) {
    c[0] += c[1];
    c[1] = 0;
  }
  return c;
}

template <typename T>
void one_round(Communicator& c, DType dt, int round, uint32_t r, size_t pick) {
  const uint32_t n = c.size();
  const size_t limit = HostSmall::kMaxBytes / sizeof(T);
  const size_t sizes[] = {0, 1, 5, 1023, limit - 1, limit};
  const size_t count = sizes[pick % 6];
  const bool hole = round % 2 == 1;
  const std::string where = "round " + std::to_string(round) + " " + std::string(dtype_name(dt)) + " count " +
                            std::to_string(count) + " rank " + std::to_string(r);
  // reduce_scatter: the whole input is at most one slot.
  {
    const auto counts = blocks(count, n, hole);
    size_t at = 0;
    for (uint32_t q = 0; q < r; ++q) at += counts[q];
    std::vector<T> in(count), out(counts[r] + 1, T{});
    for (size_t i = 0; i < count; ++i) in[i] = input<T>(round, r, i);
    const std::vector<T> in_before = in;
    const T guard = out.back();
    c.reduce_scatter(in.data(), out.data(), counts, dt, ReduceOp::SUM);
    for (size_t j = 0; j < counts[r]; ++j) {
      const T want = sum<T>(round, n, at + j);
      ASSERT_EQ(std::memcmp(&out[j], &want, sizeof(T)), 0) << "reduce_scatter " << where << " j " << j;
    }
    ASSERT_EQ(std::memcmp(&out.back(), &guard, sizeof(T)), 0)
        << "reduce_scatter wrote past its block, " << where;
    ASSERT_EQ(in, in_before) << "reduce_scatter changed its input, " << where;
  }
  // allgather: each block is at most one slot, so the output may be n slots.
  {
    const auto counts = blocks(count * n, n, hole);
    std::vector<size_t> at(n + 1, 0);
    for (uint32_t q = 0; q < n; ++q) at[q + 1] = at[q] + counts[q];
    std::vector<T> buf(at[n], T{});
    for (size_t j = 0; j < counts[r]; ++j) buf[at[r] + j] = input<T>(round, r, j);
    c.allgather(buf.data(), counts, dt);
    for (uint32_t q = 0; q < n; ++q)
      for (size_t j = 0; j < counts[q]; ++j) {
        const T want = input<T>(round, q, j);
        ASSERT_EQ(std::memcmp(&buf[at[q] + j], &want, sizeof(T)), 0)
            << "allgather " << where << " block " << q;
      }
  }
  // broadcast from every root in turn.
  for (uint32_t root = 0; root < n; ++root) {
    std::vector<T> buf(count, T{});
    if (r == root)
      for (size_t i = 0; i < count; ++i) buf[i] = input<T>(round + 1, root, i);
    c.broadcast(buf.data(), count, dt, root);
    for (size_t i = 0; i < count; ++i) {
      const T want = input<T>(round + 1, root, i);
      ASSERT_EQ(std::memcmp(&buf[i], &want, sizeof(T)), 0) << "broadcast root " << root << " " << where;
    }
  }
  // An allreduce between them: the same slots, the same counter.
  {
    std::vector<T> buf(count);
    for (size_t i = 0; i < count; ++i) buf[i] = input<T>(round, r, i);
    c.allreduce(buf.data(), count, dt, ReduceOp::SUM);
    for (size_t i = 0; i < count; ++i) {
      const T want = sum<T>(round, n, i);
      ASSERT_EQ(std::memcmp(&buf[i], &want, sizeof(T)), 0) << "allreduce " << where << " i " << i;
    }
  }
}
}  // namespace small_ref

TEST(HostSmall, AllCollectivesMixedMatchTheReference) {
  for (uint32_t n : {2u, 3u, 4u}) {
    auto w = make_world(one_host(n), quick_options(true));
    auto errs = run_ranks(w, [](Communicator& c, uint32_t r) {
      for (int round = 0; round < 36; ++round) {
        const auto pick = static_cast<size_t>(round / 3);
        switch (round % 3) {
          case 0:
            small_ref::one_round<float>(c, DType::F32, round, r, pick);
            break;
          case 1:
            small_ref::one_round<int32_t>(c, DType::I32, round, r, pick);
            break;
          default:
            small_ref::one_round<uint16_t>(c, DType::BF16, round, r, pick);
            break;
        }
        if (::testing::Test::HasFatalFailure()) return;
      }
      // AVG divides once, after the rank-order float32 sum.
      const size_t count = 1001;
      const auto counts = small_ref::blocks(count, c.size(), false);
      size_t at = 0;
      for (uint32_t q = 0; q < r; ++q) at += counts[q];
      std::vector<float> in(count), out(counts[r]);
      for (size_t i = 0; i < count; ++i) in[i] = small_ref::input<float>(99, r, i);
      c.reduce_scatter(in.data(), out.data(), counts, DType::F32, ReduceOp::AVG);
      for (size_t j = 0; j < counts[r]; ++j)
        ASSERT_NEAR(out[j], small_ref::sum<float>(99, c.size(), at + j) / c.size(), 1e-6) << "avg j " << j;
    });
    expect_all_ok(errs);
  }
}

// A rank passing other block sizes to allgather or reduce_scatter is named on every rank, every
// rank's buffers untouched.
TEST(HostSmall, MismatchedBlocksAreReportedEverywhere) {
  for (int what = 0; what < 2; ++what) {
    auto w = make_world(one_host(3), quick_options(true));  // a refused operation aborts the group
    auto errs = run_ranks(w, [what](Communicator& c, uint32_t r) {
      std::vector<size_t> counts = {4, 4, r == 2 ? size_t{5} : size_t{4}};
      std::vector<float> buf(13, static_cast<float>(r + 1)), out(5, -1.0f);
      const std::vector<float> before = buf, out_before = out;
      try {
        if (what == 0) c.allgather(buf.data(), counts, DType::F32);
        if (what == 1) c.reduce_scatter(buf.data(), out.data(), counts, DType::F32, ReduceOp::SUM);
      } catch (...) {
        EXPECT_EQ(buf, before) << "rank " << r << ": its buffer changed although the op was refused";
        EXPECT_EQ(out, out_before) << "rank " << r << ": its output changed although the op was refused";
        throw;
      }
    });
    ASSERT_EQ(errs.size(), 3u);
    for (uint32_t r = 0; r < 3; ++r) {
      ASSERT_TRUE(errs[r]) << "case " << what << ": rank " << r << " accepted a mismatch";
      const std::string got = testing::describe(errs[r]);
      const char* want[2][2] = {{"rank 2 52 bytes (allgather", "rank 0 48 bytes (allgather"},
                                {"rank 2 52 bytes (reduce_scatter", "rank 1 48 bytes (reduce_scatter"}};
      for (const char* part : want[what])
        EXPECT_NE(got.find(part), std::string::npos) << "rank " << r << ": " << got;
    }
  }
}

// A member that never connects (it died while the group formed) holds the others in the channel
// setup of their first operation until the deadline, unless the communicator is aborted: live
// membership aborts it when the member's death is known, and every wait must end then. The
// deadline here is far beyond ctest's, so waiting it out fails the test.
TEST(Abort, EndsAWaitForAPeerThatNeverConnects) {
  for (int op = 0; op < 2; ++op)
    for (bool shm : {true, false}) {
      Options o = testing::quick_options(shm);
      o.timeout_s = 3600;
      auto w = testing::make_world(testing::one_host(3), o);
      std::atomic<int> finished{0};
      auto errs = testing::run_ranks_shared(w, [&, op](std::shared_ptr<Communicator> c, uint32_t r) {
        std::vector<float> x(3 * HostDirect::kChunkBytes / sizeof(float), 1.0f);
        if (op == 1) c->allreduce(x.data(), x.size(), DType::F32, ReduceOp::SUM);  // set up, all three
        if (r == 2) {  // never enters the op; stays alive until the others are done
          while (finished.load() < 2) std::this_thread::sleep_for(std::chrono::milliseconds(5));
          return;
        }
        std::thread aborter([c] {
          std::this_thread::sleep_for(std::chrono::milliseconds(200));
          c->abort("test: rank 2 died while the group formed");
        });
        try {
          if (op == 0) c->barrier();
          // The second: once set up, the host's direct path waits in timed slices, not woken by the abort.
          if (op == 1) c->allreduce(x.data(), x.size(), DType::F32, ReduceOp::SUM);
        } catch (...) {
          aborter.join();
          finished.fetch_add(1);
          throw;
        }
        aborter.join();
        finished.fetch_add(1);
      });
      // Each rank fails on its own abort or, if that reached it first, on the other's; none
      // reports a timeout it never reached.
      int named = 0;
      for (uint32_t r = 0; r < 2; ++r) {
        ASSERT_TRUE(errs[r]) << "op " << op << ", shm " << shm << ": rank " << r
                             << " passed an op rank 2 never entered";
        const std::string got = testing::describe(errs[r]);
        named += got.find("test: rank 2 died while the group formed") != std::string::npos ? 1 : 0;
        EXPECT_EQ(got.find("timed out"), std::string::npos) << "op " << op << ", shm " << shm << ": " << got;
        EXPECT_EQ(got.find("before the deadline"), std::string::npos)
            << "op " << op << ", shm " << shm << ": " << got;
      }
      EXPECT_GE(named, 1) << "op " << op << ", shm " << shm
                          << ": no rank named the abort's reason: " << testing::describe(errs[0]) << " / "
                          << testing::describe(errs[1]);
      EXPECT_FALSE(errs[2]);
    }
}

TEST(Hierarchical, TwoHostsOfTwoAndUnevenHosts) {
  for (auto hosts : {testing::hosts_of(4, 2), std::vector<std::string>{"a", "a", "a", "b", "c"}}) {
    auto w = make_world(hosts, quick_options(true));
    const uint32_t size = static_cast<uint32_t>(hosts.size());
    auto errs = run_ranks(w, [size](Communicator& c, uint32_t r) {
      for (size_t count : {size_t{9}, size_t{200003}}) {
        std::vector<float> buf(count);
        for (size_t i = 0; i < count; ++i) buf[i] = input(r, i) * static_cast<float>(size);
        c.allreduce(buf.data(), count, DType::F32, ReduceOp::AVG, AllreduceAlgo::kHierarchical);
        for (size_t i = 0; i < count; ++i) {
          float want = 0;
          for (uint32_t q = 0; q < size; ++q) want += input(q, i);
          ASSERT_EQ(buf[i], want) << "i " << i;
        }
      }
    });
    expect_all_ok(errs);
  }
}

TEST(Striping, ManyStreamsLargeAndSmallMessagesInterleaved) {
  Options o = quick_options(false);
  o.streams = 4;
  auto w = make_world(one_host(3), o);
  auto errs = run_ranks(w, [](Communicator& c, uint32_t r) {
    for (size_t count : {size_t{1}, size_t{1 << 20}, size_t{17}, size_t{(1 << 18) + 5}, size_t{2}}) {
      std::vector<float> buf(count, static_cast<float>(r + 1));
      c.allreduce(buf.data(), count, DType::F32, ReduceOp::SUM, AllreduceAlgo::kRing);
      for (float v : buf) ASSERT_EQ(v, 6.0f);
    }
  });
  expect_all_ok(errs);
}

TEST(Worker, ManyNonblockingOpsInFlight) {
  auto w = make_world(one_host(3), quick_options(true));
  auto errs = run_ranks(w, [](Communicator& c, uint32_t r) {
    constexpr int kOps = 8;
    std::vector<std::vector<float>> bufs(kOps);
    std::vector<std::shared_ptr<Work>> works;
    for (int k = 0; k < kOps; ++k) {
      bufs[k].assign(static_cast<size_t>(1000 * (k + 1)), static_cast<float>(r + k));
      works.push_back(c.worker().submit(
          [&c, &b = bufs[k]] { c.allreduce(b.data(), b.size(), DType::F32, ReduceOp::SUM); }));
    }
    for (int k = kOps - 1; k >= 0; --k) {  // waited in reverse order
      works[k]->wait(Deadline::after(30));
      for (float v : bufs[k]) ASSERT_EQ(v, static_cast<float>(3 * k + 3));
    }
  });
  expect_all_ok(errs);
}

// run() on an idle worker runs the task on the caller's thread and wakes the worker's thread
// only if work was queued meanwhile: that work must still run, not wait for a later submit.
TEST(Worker, WorkQueuedDuringAnInlineRunStillRuns) {
  Worker worker;
  worker.submit([] {})->wait(Deadline::after(30));  // the worker's thread exists and is idle
  std::promise<void> inside, release;
  std::shared_future<void> released = release.get_future().share();
  std::thread caller([&] {
    worker.run(
        [&] {
          inside.set_value();
          released.wait();
        },
        Deadline::after(30));
  });
  inside.get_future().wait();
  std::atomic<bool> ran{false};
  auto queued = worker.submit([&] { ran = true; });
  release.set_value();
  caller.join();
  queued->wait(Deadline::after(30));
  EXPECT_TRUE(ran.load());
}

// A task's captures may be the last owner of something whose destructor takes a lock that a
// submitting thread holds (the GIL, for a Python-backed optimizer step): the worker must drop
// them without its own mutex held, or submit() and the destructor wait for each other.
TEST(Worker, CapturesAreReleasedWithoutTheWorkerLock) {
  Worker worker;
  std::mutex outer;  // plays the GIL
  std::atomic<bool> in_destructor{false};
  struct Holder {
    std::mutex* outer;
    std::atomic<bool>* entered;
    ~Holder() {
      entered->store(true);
      std::lock_guard lk(*outer);
    }
  };
  std::unique_lock held(outer);
  auto holder = std::make_shared<Holder>(&outer, &in_destructor);  // no temporary Holder
  auto first = worker.submit([h = holder] {});
  holder.reset();  // the task's capture is the last owner
  const Deadline dl = Deadline::after(30);
  while (!in_destructor.load()) {
    if (dl.expired()) FAIL() << "the task's captures were never released";
    std::this_thread::yield();
  }
  // The worker now waits for `outer` in the destructor; this thread holds it and submits.
  auto second = std::async(std::launch::async, [&] { return worker.submit([] {}); });
  if (second.wait_for(std::chrono::seconds(20)) != std::future_status::ready) {
    ADD_FAILURE() << "submit() blocked while the worker released a task's captures: lock inversion";
    std::fflush(nullptr);
    std::_Exit(1);  // both threads are deadlocked: nothing can be joined
  }
  held.unlock();
  first->wait(Deadline::after(30));
  second.get()->wait(Deadline::after(30));
}

// A waiter may drop the last other owner of the worker the moment wait() returns (rumor.shutdown()
// right after a nonblocking op): were the task's captures released after finish(), the worker's
// own thread could run ~Worker and try to join itself (std::terminate, "Resource deadlock
// avoided"). So no capture may outlive the moment its work is seen done.
TEST(Worker, CapturesAreReleasedBeforeTheWorkIsDone) {
  Worker worker;
  std::atomic<int> seen{-1};  // done() as the capture was destroyed: 0 or 1
  struct Probe {
    std::shared_ptr<std::shared_ptr<Work>> work;
    std::atomic<int>* seen;
    ~Probe() {
      if (*work) seen->store((*work)->done() ? 1 : 0);
    }
  };
  auto slot = std::make_shared<std::shared_ptr<Work>>();
  std::promise<void> go;
  auto gate = go.get_future().share();
  {
    auto probe = std::make_shared<Probe>(Probe{slot, &seen});
    *slot = worker.submit([p = std::move(probe), gate] { gate.wait(); });
  }
  go.set_value();  // the task runs only once the probe can see its Work
  (*slot)->wait(Deadline::after(30));
  EXPECT_EQ(seen.load(), 0) << "a task's captures were released after its work was reported done";
}

// The case behind that rule: a communicator-like owner whose last reference is the task's own
// capture once the caller has waited and let go. The owner must be destroyed on the caller's
// thread, not on the worker's.
TEST(Worker, OwnerDroppedRightAfterWaitIsDestroyedByTheCaller) {
  struct Owner {
    Worker worker;
    std::thread::id destroyed_on;
    std::atomic<std::thread::id>* out;
    ~Owner() { out->store(std::this_thread::get_id()); }
  };
  for (int i = 0; i < 200; ++i) {
    std::atomic<std::thread::id> where{};
    auto owner = std::make_shared<Owner>();
    owner->out = &where;
    auto work = owner->worker.submit([o = owner] {});
    work->wait(Deadline::after(30));
    owner.reset();
    ASSERT_EQ(where.load(), std::this_thread::get_id()) << "round " << i;
  }
}

}  // namespace
}  // namespace rumor

namespace rumor {
namespace {

TEST(SharedArena, AllreduceReadsPeersInPlace) {
  for (uint32_t n : {2u, 3u, 4u}) {
    auto w = testing::make_world(testing::one_host(n), testing::quick_options(true));
    auto errs = testing::run_ranks_shared(w, [n](std::shared_ptr<Communicator> comm, uint32_t r) {
      SharedArena arena(comm, 1 << 20);
      // Two buckets at different offsets; the second of odd length.
      auto* a = reinterpret_cast<float*>(arena.data());
      auto* b = reinterpret_cast<int64_t*>(arena.data() + 512 * 1024);
      const size_t na = 100003, nb = 7;
      for (size_t i = 0; i < na; ++i) a[i] = input(r, i) * static_cast<float>(n);
      for (size_t i = 0; i < nb; ++i) b[i] = static_cast<int64_t>(r * 10 + i);
      for (int rep = 0; rep < 2; ++rep) {
        if (rep == 1)
          for (size_t i = 0; i < na; ++i) a[i] = input(r, i) * static_cast<float>(n);
        arena.allreduce(a, na, DType::F32, ReduceOp::AVG);
        for (size_t i = 0; i < na; ++i) {
          float want = 0;
          for (uint32_t q = 0; q < n; ++q) want += input(q, i);
          ASSERT_EQ(a[i], want) << "n " << n << " i " << i;
        }
      }
      arena.allreduce(b, nb, DType::I64, ReduceOp::MAX);
      for (size_t i = 0; i < nb; ++i) ASSERT_EQ(b[i], static_cast<int64_t>((n - 1) * 10 + i));
      std::vector<float> outside(4);
      EXPECT_THROW(arena.allreduce(outside.data(), outside.size(), DType::F32, ReduceOp::SUM), Error);
    });
    testing::expect_all_ok(errs);
  }
}

TEST(SharedArena, AllreduceIntoLeavesTheInputsAndFillsEveryOutput) {
  // Small integers: every float sum is exact, so the result must match bit for bit; bf16 sums
  // in float32 and rounds once (values here are exact in bf16 too).
  for (uint32_t n : {1u, 2u, 3u, 4u}) {
    auto w = testing::make_world(testing::one_host(n), testing::quick_options(true));
    auto errs = testing::run_ranks_shared(w, [n](std::shared_ptr<Communicator> comm, uint32_t r) {
      SharedArena arena(comm, 4 << 20);
      const size_t count = 100003;  // uneven blocks, several chunks each
      auto* in = reinterpret_cast<float*>(arena.data());
      auto* out = reinterpret_cast<float*>(arena.data() + (1 << 20));
      auto value = [](uint32_t q, size_t i) { return static_cast<float>((i * 7 + q * 13) % 101); };
      for (int rep = 0; rep < 2; ++rep) {
        for (size_t i = 0; i < count; ++i) {
          in[i] = value(r, i) + static_cast<float>(rep);
          out[i] = -1.0f;
        }
        arena.allreduce_into(in, out, count, DType::F32, ReduceOp::SUM);
        for (size_t i = 0; i < count; ++i) {
          float want = 0;
          for (uint32_t q = 0; q < n; ++q) want += value(q, i) + static_cast<float>(rep);
          ASSERT_EQ(out[i], want) << "n " << n << " rank " << r << " i " << i;
          ASSERT_EQ(in[i], value(r, i) + static_cast<float>(rep)) << "the input must stay";
        }
      }
      // AVG divides once; the outputs of every rank hold the same bits.
      for (size_t i = 0; i < count; ++i) in[i] = static_cast<float>(r + 1);
      arena.allreduce_into(in, out, count, DType::F32, ReduceOp::AVG);
      for (size_t i = 0; i < count; ++i) ASSERT_EQ(out[i], static_cast<float>(n + 1) / 2.0f) << i;
      auto* hb = reinterpret_cast<uint16_t*>(arena.data() + (2 << 20));
      auto* ho = hb + 4096;
      for (size_t i = 0; i < 1001; ++i) hb[i] = half::f32_to_bf16(static_cast<float>(r + i % 3));
      arena.allreduce_into(hb, ho, 1001, DType::BF16, ReduceOp::SUM);
      for (size_t i = 0; i < 1001; ++i) {
        float want = 0;
        for (uint32_t q = 0; q < n; ++q) want += static_cast<float>(q + i % 3);
        ASSERT_EQ(half::bf16_to_f32(ho[i]), want) << i;
      }
      std::vector<float> outside(4);
      EXPECT_THROW(arena.allreduce_into(outside.data(), out, 4, DType::F32, ReduceOp::SUM), Error);
      EXPECT_THROW(arena.allreduce_into(in, outside.data(), 4, DType::F32, ReduceOp::SUM), Error);
      EXPECT_THROW(arena.allreduce_into(in, in + 2, 4, DType::F32, ReduceOp::SUM), Error);
    });
    testing::expect_all_ok(errs);
  }
}

TEST(SharedArena, EveryElementSumsInRankOrderWhoeverOwnsItsBlock) {
  // Values of mixed magnitudes, where float addition depends on its order: in place or not, every
  // element is the left fold over ranks 0..n-1, the fold HostSmall and HostDirect compute, so a
  // bucket's result does not depend on where the blocks fall (a layout rebuilt in another order)
  // nor on the path (a restarted job that ends up on another must match an uninterrupted one).
  for (uint32_t n : {3u, 4u}) {
    auto w = testing::make_world(testing::one_host(n), testing::quick_options(true));
    auto errs = testing::run_ranks_shared(w, [n](std::shared_ptr<Communicator> comm, uint32_t r) {
      SharedArena arena(comm, 2 << 20);
      const size_t count = 40009;
      auto* buf = reinterpret_cast<float*>(arena.data());
      auto* in = reinterpret_cast<float*>(arena.data() + (1 << 19));
      auto* out = reinterpret_cast<float*>(arena.data() + (1 << 20));
      auto value = [](uint32_t q, size_t i) {
        const uint64_t h = (i + 1) * 0x9E3779B97F4A7C15ull ^ (q + 1) * 0xC2B2AE3D27D4EB4Full;
        const float m = 1.0f + static_cast<float>(h >> 41) / static_cast<float>(1 << 23);
        return std::ldexp((h & 1) ? -m : m, static_cast<int>((h >> 8) % 40) - 20);
      };
      for (ReduceOp op : {ReduceOp::SUM, ReduceOp::AVG}) {
        for (size_t i = 0; i < count; ++i) buf[i] = in[i] = value(r, i);
        arena.allreduce(buf, count, DType::F32, op);
        arena.allreduce_into(in, out, count, DType::F32, op);
        size_t order_matters = 0;
        for (size_t i = 0; i < count; ++i) {
          float want = value(0, i), backwards = value(n - 1, i);
          for (uint32_t q = 1; q < n; ++q) {
            want += value(q, i);
            backwards += value(n - 1 - q, i);
          }
          order_matters += want != backwards;
          if (op == ReduceOp::AVG) want /= static_cast<float>(n);
          ASSERT_EQ(std::bit_cast<uint32_t>(buf[i]), std::bit_cast<uint32_t>(want))
              << "in place, n " << n << " rank " << r << " i " << i;
          ASSERT_EQ(std::bit_cast<uint32_t>(out[i]), std::bit_cast<uint32_t>(want))
              << "out of place, n " << n << " rank " << r << " i " << i;
        }
        ASSERT_GT(order_matters, count / 10) << "the values must tell the orders apart";
      }
    });
    testing::expect_all_ok(errs);
  }
}

TEST(SharedArena, TheRanksThatRunTakeTheChunksOfOneThatIsHeld) {
  // Rank 1 is held inside the first chunk it reduced until the others have reduced every other
  // chunk: with fixed blocks they would never reach its block's chunks and the closing barrier
  // would time out. The others first wait for rank 1 to hold a chunk (they hold at most one each
  // meanwhile, of 40), so it does get one. Then calls of other sizes use both claim counters.
  const uint32_t n = 3;
  const size_t count = 40 * 16384, chunks = count * sizeof(float) / (64 << 10);
  auto w = testing::make_world(testing::one_host(n), testing::quick_options(true));
  std::atomic<size_t> by_others{0};
  std::atomic<bool> held{false};
  std::vector<std::vector<size_t>> seen(n);  // per rank: the first element of each chunk it ran
  std::vector<std::vector<std::pair<size_t, size_t>>> small(n);  // the later calls': (count, first)
  auto wait_for = [](const std::function<bool()>& done, const char* what) {
    const auto until = std::chrono::steady_clock::now() + std::chrono::seconds(15);
    while (!done()) {
      if (std::chrono::steady_clock::now() > until)
        throw std::runtime_error(std::string("waited 15 s for ") + what);
      std::this_thread::yield();
    }
  };
  auto errs = testing::run_ranks_shared(w, [&](std::shared_ptr<Communicator> comm, uint32_t r) {
    SharedArena arena(comm, count * sizeof(float));
    auto* buf = reinterpret_cast<float*>(arena.data());
    auto value = [](uint32_t q, size_t i) { return static_cast<float>((i * 5 + q * 11) % 97); };
    for (size_t i = 0; i < count; ++i) buf[i] = value(r, i);
    arena.allreduce(buf, count, DType::F32, ReduceOp::SUM, [&](size_t first, size_t) {
      seen[r].push_back(first);
      if (r == 1) {
        if (seen[r].size() > 1) return;
        held = true;
        wait_for([&] { return by_others.load() == chunks - 1; }, "the others to reduce every other chunk");
      } else {
        wait_for([&] { return held.load(); }, "rank 1 to hold a chunk");
        by_others.fetch_add(1);
      }
    });
    for (size_t i = 0; i < count; ++i)
      ASSERT_EQ(buf[i], value(0, i) + value(1, i) + value(2, i)) << "rank " << r << " i " << i;
    for (size_t m : {size_t{1}, size_t{16384}, size_t{0}, size_t{3 * 16384 + 5}, size_t{777}}) {
      for (size_t i = 0; i < m; ++i) buf[i] = value(r, i + m);
      arena.allreduce(buf, m, DType::F32, ReduceOp::SUM,
                      [&](size_t first, size_t) { small[r].push_back({m, first}); });
      for (size_t i = 0; i < m; ++i)
        ASSERT_EQ(buf[i], value(0, i + m) + value(1, i + m) + value(2, i + m)) << "rank " << r << " m " << m;
    }
  });
  testing::expect_all_ok(errs);
  EXPECT_EQ(seen[1].size(), 1u) << "rank 1 was held in its first chunk: the others take the rest";
  std::vector<size_t> all;
  for (const auto& v : seen) all.insert(all.end(), v.begin(), v.end());
  std::sort(all.begin(), all.end());
  ASSERT_EQ(all.size(), chunks) << "every chunk reduced exactly once";
  for (size_t k = 0; k < chunks; ++k) EXPECT_EQ(all[k], k * 16384);
  // Below 64 KiB per rank the pieces shrink (whole pages) so that every rank can take one: 64 KiB
  // on 3 ranks is three pieces of at most 24 KiB, one element is one piece.
  std::vector<std::pair<size_t, size_t>> pieces;
  for (const auto& v : small) pieces.insert(pieces.end(), v.begin(), v.end());
  std::sort(pieces.begin(), pieces.end());
  const std::vector<std::pair<size_t, size_t>> want = {{1, 0},         {777, 0},       {16384, 0},
                                                       {16384, 6144},  {16384, 12288}, {49157, 0},
                                                       {49157, 16384}, {49157, 32768}, {49157, 49152}};
  EXPECT_EQ(pieces, want);
}

TEST(SharedArena, AverageIntoDeltasGivesEveryContributorItsDifference) {
  // Small integers: every sum is exact, and the reference divides once in float64 as the kernel
  // does, so it must match bit for bit.
  for (uint32_t n : {1u, 2u, 3u, 4u}) {
    auto w = testing::make_world(testing::one_host(n), testing::quick_options(true));
    auto errs = testing::run_ranks_shared(w, [n](std::shared_ptr<Communicator> comm, uint32_t r) {
      SharedArena arena(comm, 8 << 20);
      const size_t count = 100003;  // not a multiple of the ranks: uneven blocks, several chunks
      auto* x = reinterpret_cast<double*>(arena.data());
      auto* d = reinterpret_cast<double*>(arena.data() + (1 << 20));
      auto value = [](uint32_t q, size_t i) { return static_cast<double>((i * 7 + q * 13) % 101); };
      auto old_delta = [](uint32_t q, size_t i) { return static_cast<double>((i * 3 + q) % 5) - 2.0; };
      const double untouched = -1234.0;
      // Everyone with its weights; then rank 0 skipped and the last rank bringing a pending delta.
      std::vector<std::vector<uint8_t>> roles = {std::vector<uint8_t>(n, SharedArena::kWeights)};
      if (n > 1) {
        std::vector<uint8_t> mixed(n, SharedArena::kWeights);
        mixed[0] = SharedArena::kSkip;
        mixed[n - 1] = SharedArena::kWeightsPlusDelta;
        roles.push_back(mixed);
      }
      for (const auto& role : roles) {
        for (size_t i = 0; i < count; ++i) {
          x[i] = value(r, i);
          d[i] = role[r] == SharedArena::kWeightsPlusDelta ? old_delta(r, i) : untouched;
        }
        arena.average_into_deltas(x, d, count, DType::F64, role);
        double contributors = 0;
        for (uint8_t v : role) contributors += v != SharedArena::kSkip;
        for (size_t i = 0; i < count; ++i) {
          double sum = 0;
          for (uint32_t q = 0; q < n; ++q)
            if (role[q] != SharedArena::kSkip)
              sum += value(q, i) + (role[q] == SharedArena::kWeightsPlusDelta ? old_delta(q, i) : 0.0);
          const double want = role[r] == SharedArena::kSkip ? untouched : sum / contributors - value(r, i);
          ASSERT_EQ(d[i], want) << "n " << n << " rank " << r << " i " << i;
          ASSERT_EQ(x[i], value(r, i)) << "the weights must stay";
        }
      }
      auto* f = reinterpret_cast<float*>(arena.data() + (3 << 20));
      for (size_t i = 0; i < 1001; ++i) f[i] = static_cast<float>(r + 1);
      arena.average_into_deltas(f, f + 1001, 1001, DType::F32,
                                std::vector<uint8_t>(n, SharedArena::kWeights));
      for (size_t i = 0; i < 1001; ++i)
        ASSERT_EQ(f[1001 + i], static_cast<float>(n + 1) / 2.0f - (static_cast<float>(r) + 1.0f)) << i;
      std::vector<double> outside(4);
      const std::vector<uint8_t> all(n, SharedArena::kWeights);
      EXPECT_THROW(arena.average_into_deltas(outside.data(), d, 4, DType::F64, all), Error);
      EXPECT_THROW(arena.average_into_deltas(x, d, 4, DType::I64, all), Error);
      EXPECT_THROW(arena.average_into_deltas(x, x + 2, 4, DType::F64, all), Error);
      EXPECT_THROW(arena.average_into_deltas(x, d, 4, DType::F64, std::vector<uint8_t>(n + 1, 1)), Error);
      EXPECT_THROW(arena.average_into_deltas(x, d, 4, DType::F64, std::vector<uint8_t>(n, 0)), Error);
      EXPECT_THROW(arena.average_into_deltas(x, d, 4, DType::F64, std::vector<uint8_t>(n, 3)), Error);
    });
    testing::expect_all_ok(errs);
  }
}

// Resident kilobytes of this process's mapping that starts at `at` (its Rss in
// /proc/self/smaps), -1 if no mapping starts there.
long resident_kib(const void* at) {
  std::ifstream smaps("/proc/self/smaps");
  std::string line;
  bool inside = false;
  while (std::getline(smaps, line)) {
    unsigned long start = 0, end = 0;
    if (std::sscanf(line.c_str(), "%lx-%lx ", &start, &end) == 2 && line.find('-') < line.find(' ')) {
      inside = start == reinterpret_cast<uintptr_t>(at);
      continue;
    }
    long kib = 0;
    if (inside && std::sscanf(line.c_str(), "Rss: %ld kB", &kib) == 1) return kib;
  }
  return -1;
}

bool kernel_populates() {
#ifdef MADV_POPULATE_WRITE
  const size_t page = static_cast<size_t>(::sysconf(_SC_PAGESIZE));
  void* p = ::mmap(nullptr, page, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  if (p == MAP_FAILED) return false;
  const bool ok = ::madvise(p, page, MADV_POPULATE_WRITE) == 0;
  ::munmap(p, page);
  return ok;
#else
  return false;
#endif
}

TEST(SharedArena, MapsEveryPageOfEveryRankAtConstruction) {
  // A page first touched during a round costs a fault there, and with 4 ranks on 2 cores the
  // first AsyncModelAverage round took 10x the next ones: every rank maps every page up front.
  if (!kernel_populates()) GTEST_SKIP() << "the kernel lacks MADV_POPULATE_WRITE (Linux < 5.14)";
  const uint32_t n = 3;
  const size_t bytes = size_t{3} << 20;
  auto w = testing::make_world(testing::one_host(n), testing::quick_options(true));
  auto errs = testing::run_ranks_shared(w, [bytes](std::shared_ptr<Communicator> comm, uint32_t r) {
    SharedArena arena(comm, bytes);
    for (uint32_t q = 0; q < comm->size(); ++q)
      // At least: rank 0's arena carries the allreduce's claim counters in a page behind its buffers.
      EXPECT_GE(resident_kib(arena.data_of(q)), static_cast<long>(bytes / 1024))
          << "rank " << r << "'s mapping of rank " << q << "'s arena";
  });
  testing::expect_all_ok(errs);
}

}  // namespace
}  // namespace rumor
