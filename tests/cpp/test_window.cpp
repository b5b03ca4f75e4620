// One-sided windows (comm/window.h): closed forms for put / accumulate / get / update over shared
// memory, TCP and mixed hosts; passive progress; push-sum weights; mutexes; torn-read and
// lost-update stress; errors.
#include <gtest/gtest.h>
#include <poll.h>
#include <sys/socket.h>

#include <atomic>
#include <chrono>
#include <cmath>
#include <functional>
#include <future>
#include <thread>

#include "comm/window.h"
#include "comm/window_wire.h"
#include "core/half.h"
#include "ranks.h"
#include "tls_pki.h"

namespace rumor {
namespace {

using testing::World;

constexpr double kTimeout = 20;

Deadline dl() { return Deadline::after(kTimeout); }

// The collective creation sequence the Python layer runs.
void create(WindowHub& hub, Communicator& c, uint64_t id, void* data, size_t count, DType dt, bool zero) {
  hub.create(id, "w" + std::to_string(id), data, count, dt, zero, dl());
  c.barrier();
  hub.attach(id, dl());
  c.barrier();
  hub.seal(id);
}

class WindowTest : public ::testing::TestWithParam<std::tuple<uint32_t, int>> {
 protected:
  // mode 0: one host, shared memory; 1: TCP only; 2: two hosts (shm inside, TCP across); 3: TCP
  // only with TLS on (every link and channel).
  World world() {
    auto [n, mode] = GetParam();
    if (mode == 3)
      return testing::tls_world(testing::Pki(), std::vector<testing::Mode>(n, testing::Mode::kOn));
    return testing::make_world(mode == 2 ? testing::hosts_of(n, (n + 1) / 2) : testing::one_host(n),
                               testing::quick_options(mode != 1));
  }
};

TEST_P(WindowTest, PutAccumulateGetUpdateClosedForms) {
  World w = world();
  const uint32_t n = static_cast<uint32_t>(w.ctx.size());
  constexpr size_t K = 1000;
  testing::expect_all_ok(testing::run_ranks(w, [&](Communicator& c, uint32_t r) {
    WindowHub hub(w.ctx[r]);
    std::vector<float> x(K);
    for (size_t i = 0; i < K; ++i) x[i] = static_cast<float>(r) + static_cast<float>(i % 7);
    auto expect_x = [&](uint32_t rank, size_t i) {
      return static_cast<float>(rank) + static_cast<float>(i % 7);
    };
    create(hub, c, 1, x.data(), K, DType::F32, /*zero=*/false);
    // Before any put, the slots hold this rank's own tensor (BlueFog's convention).
    if (n > 1) {
      std::vector<float> out(K);
      hub.update(1, 0.0, {{(r + 1) % n, 1.0}}, false, false, out.data(), false, dl());
      for (size_t i = 0; i < K; ++i) ASSERT_EQ(out[i], expect_x(r, i));
    }
    c.barrier();  // nobody puts before every rank checked its initial slots
    // Ring put: rank r -> r+1 with weight 0.25 + r.
    uint32_t next = (r + 1) % n, prev = (r + n - 1) % n;
    if (n > 1) hub.wait(hub.put(1, x.data(), {{next, 0.25 + r}}, false, false, false, dl()), dl());
    c.barrier();
    if (n > 1) {
      hub.update(1, 0.5, {{prev, 1.0}}, /*reset=*/true, false, x.data(), false, dl());
      for (size_t i = 0; i < K; ++i)
        ASSERT_FLOAT_EQ(x[i], 0.5f * expect_x(r, i) + static_cast<float>(0.25 + prev) * expect_x(prev, i))
            << i;
    }
    c.barrier();
    // Accumulate twice from every other rank into a zero-initialised window.
    std::vector<float> y(K, static_cast<float>(r + 1));
    create(hub, c, 2, y.data(), K, DType::F32, /*zero=*/true);
    std::vector<std::pair<uint32_t, double>> all;
    for (uint32_t j = 0; j < n; ++j)
      if (j != r) all.emplace_back(j, 0.5);
    for (int t = 0; t < 2; ++t) hub.wait(hub.put(2, y.data(), all, true, false, false, dl()), dl());
    c.barrier();
    auto ver = hub.versions(2);
    for (uint32_t j = 0; j < n; ++j) ASSERT_EQ(ver[j], j == r ? 0u : 2u) << "version of slot " << j;
    std::vector<std::pair<uint32_t, double>> ones;
    for (uint32_t j = 0; j < n; ++j)
      if (j != r) ones.emplace_back(j, 1.0);
    hub.update(2, 1.0, ones, true, false, y.data(), false, dl());
    float want = static_cast<float>(r + 1);
    for (uint32_t j = 0; j < n; ++j)
      if (j != r) want += 0.5f * 2.0f * static_cast<float>(j + 1);
    for (size_t i = 0; i < K; ++i) ASSERT_FLOAT_EQ(y[i], want);
    for (uint32_t j = 0; j < n; ++j) ASSERT_EQ(hub.versions(2)[j], 0u);
    c.barrier();
    // Get: pull 2 * (published value of prev), which is prev's updated y.
    if (n > 1) {
      hub.wait(hub.get(2, {{prev, 2.0}}, false, false, dl()), dl());
      std::vector<float> out(K);
      hub.update(2, 0.0, {{prev, 1.0}}, false, false, out.data(), false, dl());
      float prev_y = static_cast<float>(prev + 1);
      for (uint32_t j = 0; j < n; ++j)
        if (j != prev) prev_y += 0.5f * 2.0f * static_cast<float>(j + 1);
      for (size_t i = 0; i < K; ++i) ASSERT_FLOAT_EQ(out[i], 2.0f * prev_y);
    }
    c.barrier();
    hub.free(1, dl());
    hub.free(2, dl());
    c.barrier();
  }));
}

TEST_P(WindowTest, PushSumWeightsPreserveMass) {
  World w = world();
  const uint32_t n = static_cast<uint32_t>(w.ctx.size());
  if (n < 2) GTEST_SKIP();
  constexpr size_t K = 64;
  std::vector<double> final_x(n), final_p(n);
  testing::expect_all_ok(testing::run_ranks(w, [&](Communicator& c, uint32_t r) {
    WindowHub hub(w.ctx[r]);
    std::vector<double> x(K, static_cast<double>(r));
    create(hub, c, 7, x.data(), K, DType::F64, /*zero=*/true);
    // Directed ring push-sum: keep half, push half to the next rank, several rounds with
    // unequal counts per rank; p travels with x.
    uint32_t next = (r + 1) % n, prev = (r + n - 1) % n;
    for (uint32_t round = 0; round < 3 + r; ++round) {
      hub.wait(hub.put(7, x.data(), {{next, 0.5}}, true, true, false, dl()), dl());
      for (auto& v : x) v *= 0.5;
      hub.set_p(7, hub.p(7) * 0.5);
      hub.update(7, 1.0, {{prev, 1.0}}, true, true, x.data(), false, dl());
    }
    c.barrier();
    hub.update(7, 1.0, {{prev, 1.0}}, true, true, x.data(), false, dl());
    final_x[r] = x[0];
    final_p[r] = hub.p(7);
    for (size_t i = 1; i < K; ++i) ASSERT_EQ(x[i], x[0]);
    c.barrier();
  }));
  double sx = 0, sp = 0, want = 0;
  for (uint32_t r = 0; r < n; ++r) {
    sx += final_x[r];
    sp += final_p[r];
    want += r;
  }
  EXPECT_NEAR(sx, want, 1e-12);
  EXPECT_NEAR(sp, n, 1e-12);
}

TEST_P(WindowTest, PassiveProgressWhileTargetBlocked) {
  World w = world();
  const uint32_t n = static_cast<uint32_t>(w.ctx.size());
  if (n < 2) GTEST_SKIP();
  std::promise<void> all_put;
  std::shared_future<void> all_put_f = all_put.get_future().share();
  std::atomic<uint32_t> done{0};
  testing::expect_all_ok(testing::run_ranks(w, [&](Communicator& c, uint32_t r) {
    WindowHub hub(w.ctx[r]);
    std::vector<float> x(4096, static_cast<float>(r + 1));
    create(hub, c, 3, x.data(), x.size(), DType::F32, true);
    if (r == 0) {
      // Makes no call into its hub (nor any collective) until every peer's put completed.
      all_put_f.wait();
      std::vector<std::pair<uint32_t, double>> srcs;
      for (uint32_t j = 1; j < n; ++j) srcs.emplace_back(j, 1.0);
      hub.update(3, 0.0, srcs, false, false, x.data(), false, dl());
      float want = 0;
      for (uint32_t j = 1; j < n; ++j) want += static_cast<float>(j + 1);
      for (float v : x) ASSERT_EQ(v, want);
    } else {
      hub.wait(hub.put(3, x.data(), {{0, 1.0}}, false, false, false, dl()), dl());
      if (done.fetch_add(1) + 1 == n - 1) all_put.set_value();
    }
    c.barrier();
  }));
}

TEST_P(WindowTest, ManyWritersNoTornReadsNothingLost) {
  World w = world();
  const uint32_t n = static_cast<uint32_t>(w.ctx.size());
  if (n < 2) GTEST_SKIP();
  constexpr size_t K = 20000;  // big enough that a copy is interrupted if it is not guarded
  constexpr int kRounds = 60;
  testing::expect_all_ok(testing::run_ranks(w, [&](Communicator& c, uint32_t r) {
    WindowHub hub(w.ctx[r]);
    std::vector<float> x(K, 0.0f);
    std::vector<float> acc(K, 0.0f);
    create(hub, c, 4, x.data(), K, DType::F32, true);
    create(hub, c, 5, acc.data(), K, DType::F32, true);
    if (r == 0) {
      std::vector<std::pair<uint32_t, double>> srcs;
      for (uint32_t j = 1; j < n; ++j) srcs.emplace_back(j, 1.0);
      std::vector<float> out(K);
      double collected = 0;
      std::atomic<bool> stop{false};
      // Read while the others write: every combined tensor must be one version per sender.
      int reads = 0;
      auto check = [&] {
        hub.update(4, 0.0, srcs, false, false, out.data(), false, dl());
        for (size_t i = 1; i < K; ++i) ASSERT_EQ(out[i], out[0]) << "torn read at element " << i;
        hub.update(5, 0.0, srcs, /*reset=*/true, false, out.data(), false, dl());
        for (size_t i = 1; i < K; ++i) ASSERT_EQ(out[i], out[0]) << "torn accumulate at element " << i;
        collected += out[0];
        ++reads;
      };
      auto bar = std::async(std::launch::async, [&] {
        c.barrier();
        stop = true;
      });
      while (!stop.load()) check();
      bar.get();
      check();
      // Each sender accumulated 1.0 kRounds times; nothing may be lost.
      EXPECT_EQ(collected, static_cast<double>((n - 1) * kRounds));
      EXPECT_GT(reads, 1);
    } else {
      std::vector<float> v(K);
      std::vector<float> one(K, 1.0f);
      for (int t = 1; t <= kRounds; ++t) {
        // All elements of a put carry the same version number, so a torn read shows.
        for (auto& e : v) e = static_cast<float>(t * 100 + r);
        hub.wait(hub.put(4, v.data(), {{0, 1.0}}, false, false, false, dl()), dl());
        hub.wait(hub.put(5, one.data(), {{0, 1.0}}, true, false, false, dl()), dl());
      }
      c.barrier();
    }
    c.barrier();
  }));
}

TEST_P(WindowTest, MutexExcludes) {
  World w = world();
  const uint32_t n = static_cast<uint32_t>(w.ctx.size());
  if (n < 2) GTEST_SKIP();
  int counter = 0;  // guarded only by rank 0's window mutex
  std::atomic<int> inside{0};
  std::atomic<int> overlap{0};
  testing::expect_all_ok(testing::run_ranks(w, [&](Communicator& c, uint32_t r) {
    WindowHub hub(w.ctx[r]);
    std::vector<float> x(16, 0.0f);
    create(hub, c, 6, x.data(), x.size(), DType::F32, true);
    for (int t = 0; t < 20; ++t) {
      hub.mutex_acquire(6, {0}, dl());
      if (inside.fetch_add(1) != 0) overlap.fetch_add(1);
      int v = counter;
      std::this_thread::yield();
      counter = v + 1;
      inside.fetch_sub(1);
      hub.mutex_release(6, {0}, dl());
    }
    // A put holding the target's mutex while another rank holds it waits, then lands.
    if (r != 0) hub.wait(hub.put(6, x.data(), {{0, 1.0}}, false, false, /*require_mutex=*/true, dl()), dl());
    c.barrier();
  }));
  EXPECT_EQ(overlap.load(), 0);
  EXPECT_EQ(counter, static_cast<int>(20 * n));
}

std::string param_name(const ::testing::TestParamInfo<std::tuple<uint32_t, int>>& info) {
  static const char* modes[] = {"shm", "tcp", "twohosts", "tls"};
  return std::to_string(std::get<0>(info.param)) + "ranks_" + modes[std::get<1>(info.param)];
}

INSTANTIATE_TEST_SUITE_P(Ranks, WindowTest,
                         ::testing::Combine(::testing::Values(1u, 2u, 3u, 5u), ::testing::Values(0, 1, 2)),
                         param_name);
INSTANTIATE_TEST_SUITE_P(Tls, WindowTest, ::testing::Combine(::testing::Values(2u, 3u), ::testing::Values(3)),
                         param_name);

TEST(Window, HalfTypesCombineInFloat) {
  World w = testing::make_world(testing::one_host(2), testing::quick_options(false));
  testing::expect_all_ok(testing::run_ranks(w, [&](Communicator& c, uint32_t r) {
    WindowHub hub(w.ctx[r]);
    std::vector<uint16_t> x(100, half::f32_to_bf16(static_cast<float>(r + 1)));
    create(hub, c, 1, x.data(), x.size(), DType::BF16, true);
    hub.wait(hub.put(1, x.data(), {{1 - r, 0.5}}, false, false, false, dl()), dl());
    c.barrier();
    hub.update(1, 0.5, {{1 - r, 1.0}}, false, false, x.data(), false, dl());
    for (auto v : x) ASSERT_EQ(half::bf16_to_f32(v), 1.5f);  // 0.5*(r+1) + 0.5*(2-r)
    c.barrier();
  }));
}

TEST(Window, Errors) {
  World w = testing::make_world(testing::one_host(2), testing::quick_options(false));
  testing::expect_all_ok(testing::run_ranks(w, [&](Communicator& c, uint32_t r) {
    WindowHub hub(w.ctx[r]);
    std::vector<float> x(8, 1.0f);
    std::vector<int32_t> ints(8);
    EXPECT_THROW(hub.create(9, "ints", ints.data(), 8, DType::I32, false, dl()), Error);
    create(hub, c, 1, x.data(), x.size(), DType::F32, false);
    EXPECT_THROW(hub.put(2, x.data(), {{1 - r, 1.0}}, false, false, false, dl()), Error);  // unknown id
    EXPECT_THROW(hub.put(1, x.data(), {{r, 1.0}}, false, false, false, dl()), Error);      // to itself
    EXPECT_THROW(hub.put(1, x.data(), {{7, 1.0}}, false, false, false, dl()), Error);      // no such rank
    EXPECT_THROW(hub.update(1, 1.0, {{1 - r, 1.0}, {1 - r, 1.0}}, false, false, x.data(), false, dl()),
                 Error);
    c.barrier();
    // A window freed on the target: the put is refused by the target, naming why.
    if (r == 1) hub.free(1, dl());
    c.barrier();
    if (r == 0) {
      try {
        hub.wait(hub.put(1, x.data(), {{1, 1.0}}, false, false, false, dl()), dl());
        ADD_FAILURE() << "put to a freed window succeeded";
      } catch (const Error& e) {
        EXPECT_NE(std::string(e.what()).find("no such window"), std::string::npos) << e.what();
      }
    }
    c.barrier();
  }));
}

TEST(Window, DeadPeerFailsPromptly) {
  World w = testing::make_world(testing::one_host(2), testing::quick_options(false));
  std::promise<void> gone;
  auto gone_f = gone.get_future().share();
  testing::expect_all_ok(testing::run_ranks(w, [&](Communicator& c, uint32_t r) {
    auto hub = std::make_unique<WindowHub>(w.ctx[r]);
    std::vector<float> x(1 << 16, 1.0f);
    create(*hub, c, 1, x.data(), x.size(), DType::F32, false);
    if (r == 1) {
      hub.reset();  // closes its links, as a process exit would
      gone.set_value();
      return;
    }
    gone_f.wait();
    auto t0 = Clock::now();
    try {
      for (int i = 0; i < 100; ++i)
        hub->wait(hub->put(1, x.data(), {{1, 1.0}}, false, false, false, dl()), dl());
      ADD_FAILURE() << "put to a closed peer succeeded";
    } catch (const Error& e) {
      EXPECT_EQ(e.kind(), ErrorKind::kPeerGone) << e.what();
    }
    EXPECT_LT(std::chrono::duration<double>(Clock::now() - t0).count(), kTimeout / 2);
  }));
}

// ---- hostile peers on a window link ----

constexpr uint64_t kWindowLink = 1ull << 62;  // the hub's TCP links' communicator id

// Reads and discards until the hub closes the link; false if it stays open past `seconds`.
bool drained_until_closed(int fd, double seconds) {
  auto end = Clock::now() + std::chrono::duration<double>(seconds);
  std::vector<char> sink(1 << 16);
  while (Clock::now() < end) {
    pollfd p{fd, POLLIN, 0};
    if (::poll(&p, 1, 100) != 1) continue;
    ssize_t n = ::recv(fd, sink.data(), sink.size(), 0);
    if (n <= 0) return true;
  }
  return false;
}

window_wire::WinFrame frame(uint8_t kind, uint64_t window, uint64_t op, uint64_t bytes) {
  return window_wire::WinFrame{window_wire::kFrameMagic, kind, 0, 0, 1, 0, window, op, bytes, 1.0, 0, 0};
}

// Rank 1 plays a hostile peer on the raw link to rank 0's hub; `attack` writes to it. Returns what
// a put from rank 0 to rank 1 failed with afterwards.
template <typename Attack>
std::string hostile_link(size_t count, const std::function<void(WindowHub&)>& setup, Attack attack) {
  World w = testing::make_world(testing::one_host(2), testing::quick_options(false));
  std::promise<void> done, created;
  auto done_f = done.get_future().share();
  auto created_f = created.get_future().share();
  std::string failure;
  testing::expect_all_ok(testing::run_ranks(w, [&](Communicator&, uint32_t r) {
    if (r == 1) {
      auto fds = w.ctx[1]->tcp_streams(kWindowLink, 0, 1, dl());
      // The link exists during create(); the window only once it returned.
      if (created_f.wait_for(std::chrono::seconds(20)) != std::future_status::ready) {
        ADD_FAILURE() << "rank 0 did not create its window";
        return;
      }
      attack(fds.at(0).get());
      EXPECT_TRUE(drained_until_closed(fds.at(0).get(), kTimeout)) << "the hub kept the link open";
      done.set_value();
      return;
    }
    WindowHub hub(w.ctx[0]);
    setup(hub);
    std::vector<float> x(count, 1.0f);
    hub.create(1, "target", x.data(), x.size(), DType::F32, false, dl());
    created.set_value();
    if (done_f.wait_for(std::chrono::seconds(60)) != std::future_status::ready) {
      ADD_FAILURE() << "the hostile peer did not finish";
      return;
    }
    try {
      hub.wait(hub.put(1, x.data(), {{1, 1.0}}, false, false, false, dl()), dl());
      ADD_FAILURE() << "a put over the failed link succeeded";
    } catch (const Error& e) {
      failure = e.what();
    }
  }));
  return failure;
}

// The old hub allocated whatever a frame asked for (up to 1 TiB) before looking at the window.
TEST(WindowWire, OversizedFrameIsRefusedBeforeAllocating) {
  std::string why = hostile_link(
      8, [](WindowHub&) {},
      [](int fd) {
        auto f = frame(window_wire::kPut, 1, 1, uint64_t{1} << 40);
        ASSERT_EQ(::send(fd, &f, sizeof(f), MSG_NOSIGNAL), static_cast<ssize_t>(sizeof(f)));
      });
  EXPECT_NE(why.find("payload of 1099511627776 bytes for window #1 of 32 bytes"), std::string::npos) << why;
}

TEST(WindowWire, PayloadOnARequestFrameIsRefused) {
  std::string why = hostile_link(
      8, [](WindowHub&) {},
      [](int fd) {
        auto f = frame(window_wire::kGetRequest, 1, 1, 4096);
        ASSERT_EQ(::send(fd, &f, sizeof(f), MSG_NOSIGNAL), static_cast<ssize_t>(sizeof(f)));
      });
  EXPECT_NE(why.find("carries 4096 bytes"), std::string::npos) << why;
}

// Get requests sent without ever reading the replies: the hub's reply queue is bounded and the
// flooding peer's link is failed, instead of queueing a snapshot of the window per request.
TEST(WindowWire, RequestFloodWithoutReadingClosesTheLink) {
  std::string why = hostile_link(
      16384, [](WindowHub& hub) { hub.set_reply_limits(8, size_t{1} << 20); },
      [](int fd) {
        for (uint64_t op = 1; op <= 4000; ++op) {
          auto f = frame(window_wire::kGetRequest, 1, op, 0);
          if (::send(fd, &f, sizeof(f), MSG_NOSIGNAL) != static_cast<ssize_t>(sizeof(f))) break;
        }
      });
  EXPECT_NE(why.find("sends requests faster than it reads the replies"), std::string::npos) << why;
}

TEST(WindowWire, CheckFrame) {
  using namespace window_wire;
  Payload pl;
  EXPECT_EQ(check_frame(frame(kPut, 1, 1, 32), 1, 32, 32, &pl), "");
  EXPECT_EQ(pl, Payload::kRead);
  EXPECT_NE(check_frame(frame(kPut, 1, 1, 33), 1, 32, 32, &pl), "");  // not the window's size
  EXPECT_NE(check_frame(frame(kPut, 1, 1, 32), 2, 32, 32, &pl), "");  // claims another sender
  EXPECT_EQ(check_frame(frame(kPut, 1, 1, 32), 1, std::nullopt, 32, &pl), "");
  EXPECT_EQ(pl, Payload::kDrain);  // no such window: drained in pieces, answered "no such window"
  EXPECT_NE(check_frame(frame(kPut, 1, 1, uint64_t{1} << 40), 1, std::nullopt, 32, &pl), "");
  EXPECT_NE(check_frame(frame(kAck, 1, 1, 1), 1, 32, 32, &pl), "");
  EXPECT_NE(check_frame(frame(99, 1, 1, 0), 1, 32, 32, &pl), "");
  auto bad = frame(kPut, 1, 1, 32);
  bad.magic ^= 1;
  EXPECT_NE(check_frame(bad, 1, 32, 32, &pl), "");
}

}  // namespace
}  // namespace rumor
