// Windows' TCP links over TLS (issue 46): a rank whose certificate another CA issued is refused on
// its window link, on both ends, naming the peer; a byte altered in flight fails the operation on
// both ends and is never applied to a window. (The closed forms over TLS: WindowTest's "tls"
// instances in test_window.cpp.) No communicator here: ranks meet at a thread barrier, so the
// window link is the only connection between them.
#include <arpa/inet.h>
#include <gtest/gtest.h>
#include <netinet/in.h>
#include <poll.h>
#include <sys/socket.h>

#include <barrier>
#include <string>
#include <thread>
#include <vector>

#include "comm/window.h"
#include "net/socket.h"
#include "tls_pki.h"

namespace rumor {
namespace {

using testing::Mode;
using testing::Pki;
using testing::World;

Deadline dl() { return Deadline::after(20); }

// Runs fn(hub, rank, barrier) on every rank of w in its own thread; each rank's error text or "".
std::vector<std::string> run_hubs(World& w,
                                  const std::function<void(WindowHub&, uint32_t, std::barrier<>&)>& fn) {
  const auto n = static_cast<uint32_t>(w.ctx.size());
  std::barrier<> meet(n);
  std::vector<std::string> errs(n);
  std::vector<std::thread> threads;
  for (uint32_t r = 0; r < n; ++r)
    threads.emplace_back([&, r] {
      try {
        WindowHub hub(w.ctx[r]);
        fn(hub, r, meet);
      } catch (const std::exception& e) {
        errs[r] = e.what();
      }
    });
  for (auto& t : threads) t.join();
  return errs;
}

void create(WindowHub& hub, std::barrier<>& meet, std::vector<float>& x) {
  hub.create(1, "w", x.data(), x.size(), DType::F32, false, dl());
  meet.arrive_and_wait();
  hub.attach(1, dl());
  meet.arrive_and_wait();
  hub.seal(1);
}

// What put from `rank` to the other rank failed with, or "" if it succeeded.
std::string failed_put(WindowHub& hub, uint32_t rank, const std::vector<float>& x) {
  try {
    hub.wait(hub.put(1, x.data(), {{1 - rank, 1.0}}, false, false, false, dl()), dl());
  } catch (const Error& e) {
    return e.what();
  }
  return "";
}

TEST(WindowTls, CertificateOfAnotherCaIsRefusedOnBothEndsNamingThePeer) {
  for (uint32_t foreign : {0u, 1u}) {
    Pki pki;
    std::vector<Mode> modes(2, Mode::kOn);
    modes[foreign] = Mode::kForeignCa;
    World w = testing::tls_world(pki, modes);
    std::string put_err[2];
    auto errs = run_hubs(w, [&](WindowHub& hub, uint32_t r, std::barrier<>& meet) {
      std::vector<float> x(1000, 1.0f + static_cast<float>(r));
      create(hub, meet, x);
      put_err[r] = failed_put(hub, r, x);
      meet.arrive_and_wait();
      // Nothing of the peer's reached this rank's window: its slot still holds this rank's tensor.
      std::vector<float> out(x.size());
      hub.update(1, 0.0, {{1 - r, 1.0}}, false, false, out.data(), false, dl());
      EXPECT_EQ(out, x) << "rank " << r;
      meet.arrive_and_wait();
    });
    for (uint32_t r = 0; r < 2; ++r) {
      EXPECT_EQ(errs[r], "") << "rank " << r;
      EXPECT_NE(put_err[r], "") << "rank " << r << "'s put succeeded (foreign rank " << foreign << ")";
      EXPECT_NE(put_err[r].find("window link to rank " + std::to_string(1 - r)), std::string::npos)
          << put_err[r];
    }
    // The rank that checked the foreign certificate says so and names the peer it refused.
    const uint32_t checker = 1 - foreign;
    EXPECT_NE(put_err[checker].find("certificate refused"), std::string::npos) << put_err[checker];
    EXPECT_NE(put_err[checker].find("rank " + std::to_string(foreign) + " at 127.0.0.1:"), std::string::npos)
        << put_err[checker];
    EXPECT_NE(put_err[checker].find("window link"), std::string::npos) << put_err[checker];
  }
}

// A listener on loopback that forwards the one connection it accepts to `to_port`, altering the
// byte at `flip_at` of what the dialer sends (see testing::relay).
class FlipRelay {
 public:
  FlipRelay(uint16_t to_port, size_t flip_at) {
    listen_ = net::Fd(::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0));
    sockaddr_in a{};
    a.sin_family = AF_INET;
    a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    socklen_t len = sizeof(a);
    if (::bind(listen_.get(), reinterpret_cast<sockaddr*>(&a), len) != 0 || ::listen(listen_.get(), 1) != 0 ||
        ::getsockname(listen_.get(), reinterpret_cast<sockaddr*>(&a), &len) != 0)
      throw std::runtime_error("relay: cannot listen on loopback");
    port_ = ntohs(a.sin_port);
    thread_ = std::thread([this, to_port, flip_at] {
      const Deadline deadline = Deadline::after(30);
      pollfd p{listen_.get(), POLLIN, 0};
      if (::poll(&p, 1, 30000) != 1) return;
      net::Fd in(::accept4(listen_.get(), nullptr, nullptr, SOCK_CLOEXEC));
      net::Fd out(::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0));
      sockaddr_in to{};
      to.sin_family = AF_INET;
      to.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
      to.sin_port = htons(to_port);
      if (in.get() < 0 || ::connect(out.get(), reinterpret_cast<sockaddr*>(&to), sizeof(to)) != 0) return;
      testing::relay(in.get(), out.get(), flip_at, deadline);
      // One end gone: the other sees it at once, as through a real connection.
      ::shutdown(in.get(), SHUT_RDWR);
      ::shutdown(out.get(), SHUT_RDWR);
    });
  }
  ~FlipRelay() {
    ::shutdown(listen_.get(), SHUT_RDWR);  // wakes an accept that never came
    thread_.join();
  }
  FlipRelay(const FlipRelay&) = delete;
  FlipRelay& operator=(const FlipRelay&) = delete;
  uint16_t port() const { return port_; }

 private:
  net::Fd listen_;
  uint16_t port_ = 0;
  std::thread thread_;
};

TEST(WindowTls, AlteredByteFailsTheOperationOnBothEndsAndIsNeverApplied) {
  Pki pki;
  std::unique_ptr<FlipRelay> relay;
  // Rank 1 dials rank 0 (the higher rank dials) through the relay: its one window link.
  World w =
      testing::tls_world(pki, {Mode::kOn, Mode::kOn}, 20, [&](uint32_t r, std::vector<std::string> addrs) {
        if (r == 1) {
          const uint16_t port0 = static_cast<uint16_t>(std::stoi(addrs[0].substr(addrs[0].rfind(':') + 1)));
          relay = std::make_unique<FlipRelay>(port0, 400 * 1024);  // inside the put's 1 MiB payload
          addrs[0] = "127.0.0.1:" + std::to_string(relay->port());
        }
        return addrs;
      });
  constexpr size_t kCount = 1 << 18;  // 1 MiB of float32
  std::string put_err[2];
  auto errs = run_hubs(w, [&](WindowHub& hub, uint32_t r, std::barrier<>& meet) {
    std::vector<float> x(kCount);
    for (size_t i = 0; i < kCount; ++i)
      x[i] = static_cast<float>(r * 3 + 1) + static_cast<float>(i % 1013) / 7.0f;
    create(hub, meet, x);
    if (r == 1) put_err[1] = failed_put(hub, 1, x);  // its bytes are altered on the way
    meet.arrive_and_wait();
    // Rank 0 learned of it first (rank 1 heard it from rank 0): its own put fails with it.
    if (r == 0) put_err[0] = failed_put(hub, 0, x);
    std::vector<float> out(kCount);
    hub.update(1, 0.0, {{1 - r, 1.0}}, false, false, out.data(), false, dl());
    EXPECT_EQ(out, x) << "rank " << r << ": the peer's slot changed";
    meet.arrive_and_wait();
  });
  relay.reset();
  EXPECT_EQ(errs[0], "");
  EXPECT_EQ(errs[1], "");
  EXPECT_NE(put_err[0].find("integrity"), std::string::npos) << put_err[0];
  EXPECT_NE(put_err[0].find("rank 1 at 127.0.0.1:"), std::string::npos) << put_err[0];
  EXPECT_NE(put_err[1].find("window link to rank 0 failed"), std::string::npos) << put_err[1];
}

}  // namespace
}  // namespace rumor

namespace rumor {
namespace {

// Window links over TLS beside the ranks' TLS channels: a large exchange on a channel after the
// window link shook hands goes through, bit for bit.
TEST(WindowTls, ChannelsBesideTlsWindowLinksCarryLargeMessages) {
  Pki pki;
  World w = testing::tls_world(pki, {Mode::kOn, Mode::kOn});
  constexpr size_t kCount = 16u << 20;  // 64 MiB of float32: striped
  testing::expect_all_ok(testing::run_ranks(w, [&](Communicator& c, uint32_t r) {
    WindowHub hub(w.ctx[r]);
    std::vector<float> x(1000, 1.0f);
    hub.create(1, "w", x.data(), x.size(), DType::F32, false, dl());
    c.barrier();
    hub.attach(1, dl());
    c.barrier();
    hub.seal(1);
    // Both ways at once on one channel, as neighbor_allreduce and the ring do.
    std::vector<float> v(kCount, static_cast<float>(r + 1));
    c.allreduce(v.data(), kCount, DType::F32, ReduceOp::SUM);
    for (size_t i = 0; i < kCount; i += 4099) ASSERT_EQ(v[i], 3.0f) << i;
    c.barrier();
  }));
}

}  // namespace
}  // namespace rumor
