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

// A local peer whose doorbell never appears (it gave up on this world and removed it) holds
// set_peers until the deadline; Context::abort ends that wait with the reason, and a set_peers
// that starts after the abort fails before it waits at all.
TEST(Failures, ContextAbortEndsSetPeersWaitingForADoorbell) {
  Options o = quick_options(true);
  o.timeout_s = 120.0;  // far past ctest's limit: only the abort can end the wait in time
  auto lone = std::make_shared<Context>(0, 2, testing::random_token(), o, 0);
  const std::vector<std::string> addrs{"127.0.0.1:" + std::to_string(lone->port()), "127.0.0.1:1"};
  std::exception_ptr err;
  std::thread waiter([&] {
    try {
      lone->set_peers(addrs, one_host(2));
    } catch (...) {
      err = std::current_exception();
    }
  });
  // Usually inside the wait by now; before it or inside, set_peers must fail the same way.
  std::this_thread::sleep_for(std::chrono::milliseconds(50));
  lone->abort("member r2 exited");
  waiter.join();
  ASSERT_TRUE(err) << "set_peers returned without rank 1's doorbell";
  try {
    std::rethrow_exception(err);
  } catch (const Error& e) {
    EXPECT_EQ(e.kind(), ErrorKind::kAborted) << e.what();
    EXPECT_NE(std::string(e.what()).find("doorbell of rank 1"), std::string::npos) << e.what();
    EXPECT_NE(std::string(e.what()).find("member r2 exited"), std::string::npos) << e.what();
  }
  auto later = std::make_shared<Context>(0, 2, testing::random_token(), o, 0);
  later->abort("first");
  later->abort("second");  // the first reason stands
  try {
    later->set_peers(addrs, one_host(2));
    ADD_FAILURE() << "set_peers after abort returned";
  } catch (const Error& e) {
    EXPECT_EQ(e.kind(), ErrorKind::kAborted);
    EXPECT_NE(std::string(e.what()).find("first"), std::string::npos) << e.what();
  }
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
// The options of a world's first context once set_peers resolved them, the world made while
// this thread may run on `cpus` of its CPUs only (0: all of them).
Options resolved(const std::vector<std::string>& hosts, const Options& o, int cpus) {
  cpu_set_t saved;
  EXPECT_EQ(::sched_getaffinity(0, sizeof(saved), &saved), 0);
  cpu_set_t some;
  CPU_ZERO(&some);
  for (int c = 0, kept = 0; c < CPU_SETSIZE && (cpus == 0 || kept < cpus); ++c)
    if (CPU_ISSET(c, &saved)) {
      CPU_SET(c, &some);
      ++kept;
    }
  EXPECT_EQ(::sched_setaffinity(0, sizeof(some), &some), 0);
  Options got;
  {
    testing::World w = testing::make_world(hosts, o);
    got = w.ctx.front()->options();
  }
  EXPECT_EQ(::sched_setaffinity(0, sizeof(saved), &saved), 0);
  return got;
}

int machine_cpus() {
  cpu_set_t set;
  return ::sched_getaffinity(0, sizeof(set), &set) == 0 ? CPU_COUNT(&set) : 1;
}

// A rank spins before sleeping only where every rank of its host can have a core: the rule is
// decided in set_peers from this thread's CPU affinity, and an explicit setting is kept.
TEST(Context, SpinsOnlyWhereEveryLocalRankHasACore) {
  Options o = testing::quick_options(false);
  EXPECT_EQ(resolved(testing::one_host(2), o, 1).spin_us, 0);
  // One rank of this host: its core is its own.
  EXPECT_EQ(resolved({"a", "b"}, o, 1).spin_us, Options::kDefaultSpinUs);
  if (machine_cpus() >= 2) {
    EXPECT_EQ(resolved(testing::one_host(2), o, 2).spin_us, Options::kDefaultSpinUs);
  }
  o.spin_us = 7;
  EXPECT_EQ(resolved(testing::one_host(2), o, 1).spin_us, 7);
}

// The direct path starts at the small-message limit where each rank has a core, at several MiB
// where they share cores; set explicitly, the setting stands.
TEST(Context, DirectPathThresholdFollowsTheCores) {
  Options o = testing::quick_options(false);
  o.host_direct_min_bytes = -1;
  EXPECT_EQ(resolved(testing::one_host(3), o, 1).host_direct_min_bytes, Options::kSharedCoresDirectMinBytes);
  if (machine_cpus() >= 3) {
    EXPECT_EQ(resolved(testing::one_host(3), o, 3).host_direct_min_bytes, 0);
  }
  o.host_direct_min_bytes = 4096;
  EXPECT_EQ(resolved(testing::one_host(3), o, 1).host_direct_min_bytes, 4096);
}

}  // namespace
}  // namespace rumor
