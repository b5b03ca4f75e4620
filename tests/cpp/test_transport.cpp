// Connection setup and failure behaviour: hostile connections are refused without disturbing
// the job, and every failure becomes an error on every rank instead of a hang.
#include <gtest/gtest.h>
#include <poll.h>
#include <sched.h>
#include <sys/socket.h>

#include <cerrno>
#include <cstring>
#include <thread>

#include "net/dial.h"
#include "net/handshake.h"
#include "net/socket.h"
#include "ranks.h"

namespace rumor {
namespace {

using testing::describe;
using testing::make_world;
using testing::one_host;
using testing::quick_options;
using testing::run_ranks;

// Connects to `port`, sends `bytes` and reads until the listener closes the connection;
// returns true if anything it sent was an Accept.
bool try_handshake(int port, const void* bytes, size_t len) {
  Deadline dl = Deadline::after(10);
  net::Fd fd = net::connect_tcp(net::HostPort{"127.0.0.1", port}, dl, "test client");
  net::write_all(fd.get(), bytes, len, dl, "test client");
  ::shutdown(fd.get(), SHUT_WR);
  std::string got;
  char buf[256];
  while (true) {
    pollfd p{fd.get(), POLLIN, 0};
    if (::poll(&p, 1, dl.ms_left(1000)) <= 0 && dl.expired()) break;
    ssize_t n = ::recv(fd.get(), buf, sizeof(buf), MSG_DONTWAIT);
    if (n == 0 || (n < 0 && errno != EAGAIN && errno != EINTR)) break;
    if (n > 0) got.append(buf, static_cast<size_t>(n));
  }
  return got.find(std::string(net::kAccept, 8)) != std::string::npos;
}

std::array<uint8_t, net::kHelloBytes> hello_bytes(uint32_t version, uint32_t rank) {
  net::Hello h;
  h.version = version;
  h.rank = rank;
  return net::encode_hello(h);
}

TEST(Handshake, WrongKeyVersionGarbageAreRejectedAndJobContinues) {
  auto w = make_world(one_host(2), quick_options(false), testing::test_token());
  const int port = w.ctx[0]->port();
  const uint64_t before = w.ctx[0]->rejected_connections();

  // A hello in the right format gets a challenge, never an Accept, without the key's proof.
  auto good_hello = hello_bytes(net::kProtocolVersion, 1);
  EXPECT_FALSE(try_handshake(port, good_hello.data(), good_hello.size()));
  auto bad_version = hello_bytes(net::kProtocolVersion + 1, 1);
  EXPECT_FALSE(try_handshake(port, bad_version.data(), bad_version.size()));
  auto bad_rank = hello_bytes(net::kProtocolVersion, 7);
  EXPECT_FALSE(try_handshake(port, bad_rank.data(), bad_rank.size()));
  const char garbage[] = "GET / HTTP/1.1\r\nHost: x\r\n\r\n0123456789012345678901234567890123456789";
  EXPECT_FALSE(try_handshake(port, garbage, sizeof(garbage)));
  // The job's token is public: a key derived from another token fails at the listener's proof.
  EXPECT_THROW(net::dial(net::HostPort{"127.0.0.1", port}, net::unauthenticated_key(testing::test_token(99)),
                         {1, 0, 0, 0u}, Deadline::after(10), "wrong key"),
               Error);

  // A half-open client that never finishes its hello must not block the real peers.
  net::Fd stalled = net::connect_tcp(net::HostPort{"127.0.0.1", port}, Deadline::after(5), "stalled");
  ::send(stalled.get(), "RUM", 3, MSG_NOSIGNAL);

  auto errs = run_ranks(w, [](Communicator& c, uint32_t r) {
    std::vector<double> v(1000, r + 1.0);
    c.allreduce(v.data(), v.size(), DType::F64, ReduceOp::SUM);
    for (double x : v) ASSERT_EQ(x, 3.0);
  });
  testing::expect_all_ok(errs);
  Deadline dl = Deadline::after(10);
  while (w.ctx[0]->rejected_connections() < before + 5 && !dl.expired())
    std::this_thread::sleep_for(std::chrono::milliseconds(5));
  EXPECT_GE(w.ctx[0]->rejected_connections(), before + 5);
}

TEST(Failures, MismatchedSizesFailEveryRank) {
  for (bool shm : {false, true}) {
    auto w = make_world(one_host(3), quick_options(shm));
    auto errs = run_ranks(w, [](Communicator& c, uint32_t r) {
      std::vector<float> v(r == 1 ? 5000 : 4000, 1.0f);
      c.allreduce(v.data(), v.size(), DType::F32, ReduceOp::SUM, AllreduceAlgo::kRing);
    });
    bool saw_size_message = false;
    for (size_t r = 0; r < errs.size(); ++r) {
      ASSERT_TRUE(errs[r]) << "rank " << r << " did not fail (shm=" << shm << ")";
      saw_size_message |= describe(errs[r]).find("sizes differ across ranks") != std::string::npos;
    }
    EXPECT_TRUE(saw_size_message);
  }
}

TEST(Failures, DifferentCollectivesAreDetected) {
  auto w = make_world(one_host(2), quick_options(true));
  auto errs = run_ranks(w, [](Communicator& c, uint32_t r) {
    std::vector<float> v(64, 1.0f);
    if (r == 0)
      c.allreduce(v.data(), v.size(), DType::F32, ReduceOp::SUM);
    else
      c.broadcast(v.data(), v.size(), DType::F32, 1);
  });
  ASSERT_TRUE(errs[0]);
  EXPECT_NE(describe(errs[0]).find("different orders"), std::string::npos) << describe(errs[0]);
}

TEST(Failures, MissingPeerTimesOutNamingOpAndPeer) {
  Options o = quick_options(true);
  o.timeout_s = 1.0;
  auto w = make_world(one_host(3), o);
  auto errs = run_ranks(w, [](Communicator& c, uint32_t r) {
    if (r == 2) return;  // never joins
    std::vector<float> v(10, 1.0f);
    c.allreduce(v.data(), v.size(), DType::F32, ReduceOp::SUM);
  });
  for (uint32_t r : {0u, 1u}) {
    ASSERT_TRUE(errs[r]);
    std::string msg = describe(errs[r]);
    EXPECT_NE(msg.find("allreduce"), std::string::npos) << msg;
  }
  std::string msg0 = describe(errs[0]) + describe(errs[1]);
  EXPECT_NE(msg0.find("rank 2"), std::string::npos) << msg0;
}

TEST(Failures, AbortedCommunicatorRefusesNewWork) {
  Options o = quick_options(false);
  o.timeout_s = 1.0;
  auto w = make_world(one_host(2), o);
  auto errs = run_ranks(w, [](Communicator& c, uint32_t r) {
    std::vector<float> v(10, 1.0f);
    if (r == 0) {
      EXPECT_THROW(c.allreduce(v.data(), v.size(), DType::F32, ReduceOp::SUM), Error);
      try {
        c.allreduce(v.data(), v.size(), DType::F32, ReduceOp::SUM);
        ADD_FAILURE() << "second op after failure should throw";
      } catch (const Error& e) {
        EXPECT_EQ(e.kind(), ErrorKind::kAborted);
      }
    }
  });
  testing::expect_all_ok(errs);
}

TEST(Failures, PeerThatLeavesMidStreamFailsOthersPromptly) {
  for (bool shm : {false, true}) {
    auto w = make_world(one_host(3), quick_options(shm));  // 20 s deadline
    auto start = Clock::now();
    auto errs = run_ranks(w, [](Communicator& c, uint32_t r) {
      std::vector<float> v(1 << 20, 1.0f);
      c.allreduce(v.data(), v.size(), DType::F32, ReduceOp::SUM);
      if (r == 1) {
        c.abort("rank 1 leaves");  // what a dying process's sockets and rings look like to peers
        return;
      }
      c.allreduce(v.data(), v.size(), DType::F32, ReduceOp::SUM);
    });
    auto took = std::chrono::duration<double>(Clock::now() - start).count();
    for (uint32_t r : {0u, 2u}) {
      ASSERT_TRUE(errs[r]) << "rank " << r << " shm=" << shm;
      try {
        std::rethrow_exception(errs[r]);
      } catch (const Error& e) {
        EXPECT_TRUE(e.kind() == ErrorKind::kPeerGone || e.kind() == ErrorKind::kAborted) << e.what();
      }
    }
    EXPECT_LT(took, 15.0) << "peers waited for the deadline instead of seeing the abort";
  }
}
// A rank spins before sleeping only where every rank of its host can have a core: the rule is
// decided in set_peers from this thread's CPU affinity, and an explicit setting is kept.
TEST(Context, SpinsOnlyWhereEveryLocalRankHasACore) {
  cpu_set_t saved;
  ASSERT_EQ(::sched_getaffinity(0, sizeof(saved), &saved), 0);
  cpu_set_t one;
  CPU_ZERO(&one);
  for (int c = 0; c < CPU_SETSIZE; ++c)
    if (CPU_ISSET(c, &saved)) {
      CPU_SET(c, &one);
      break;
    }
  auto spin_after_setup = [](const std::vector<std::string>& hosts, int spin_us) {
    Options o = testing::quick_options(false);
    o.spin_us = spin_us;
    testing::World w = testing::make_world(hosts, o);
    return w.ctx.front()->options().spin_us;
  };
  ASSERT_EQ(::sched_setaffinity(0, sizeof(one), &one), 0);  // this thread: one core
  const int two_ranks_one_core = spin_after_setup(testing::one_host(2), -1);
  const int two_hosts_one_core = spin_after_setup({"a", "b"}, -1);
  const int explicit_setting = spin_after_setup(testing::one_host(2), 7);
  ASSERT_EQ(::sched_setaffinity(0, sizeof(saved), &saved), 0);
  EXPECT_EQ(two_ranks_one_core, 0);
  EXPECT_EQ(two_hosts_one_core, Options::kDefaultSpinUs);  // one rank of this host: its core is its own
  EXPECT_EQ(explicit_setting, 7);
  if (CPU_COUNT(&saved) >= 2) {
    EXPECT_EQ(spin_after_setup(testing::one_host(2), -1), Options::kDefaultSpinUs);
  }
}

}  // namespace
}  // namespace rumor
