// The connection handshake as an attacker meets it: wrong keys, replayed and forged proofs, a
// second claim of a stream, floods of half-open connections and a listener at the fd limit.
// Every wait has a deadline; the only timing bound ("not spinning") is generous.
#include <dirent.h>
#include <fcntl.h>
#include <gtest/gtest.h>
#include <netinet/in.h>
#include <poll.h>
#include <sys/resource.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cstring>
#include <thread>

#include "net/auth.h"
#include "net/dial.h"
#include "net/handshake.h"
#include "net/listener.h"
#include "net/socket.h"
#include "ranks.h"

namespace rumor {
namespace {

using testing::describe;
using testing::World;

net::Key test_key(uint8_t seed) {
  net::Key k{};
  for (size_t i = 0; i < k.size(); ++i) k[i] = static_cast<uint8_t>(seed * 31 + i);
  return k;
}

// n ranks with an explicit connection key, TCP only (one host id per rank: no shared memory).
World keyed_world(uint32_t n, const net::Key& key) {
  World w;
  Options o = testing::quick_options(false);
  const net::Token token = testing::random_token();
  std::vector<std::string> addrs, hosts;
  for (uint32_t r = 0; r < n; ++r) {
    w.ctx.push_back(std::make_shared<Context>(r, n, token, o, 0, key));
    addrs.push_back("127.0.0.1:" + std::to_string(w.ctx.back()->port()));
    // Appended, not "h" + std::to_string(r): GCC 12 at -O3 reports a false -Wrestrict overlap
    // inside operator+(const char*, std::string&&) (GCC bug 105651).
    hosts.push_back(std::string("h").append(std::to_string(r)));
  }
  for (auto& c : w.ctx) c->set_peers(addrs, hosts);
  for (auto& c : w.ctx) c->seal();
  return w;
}

// An allreduce on a new communicator `comm_id` (a stream id is handed out once per Context, so
// every check in one world uses its own communicator).
void allreduce_works(World& w, uint64_t comm_id = 0) {
  const uint32_t n = static_cast<uint32_t>(w.ctx.size());
  std::vector<std::exception_ptr> errs(n);
  std::vector<std::thread> threads;
  for (uint32_t r = 0; r < n; ++r)
    threads.emplace_back([&, r] {
      try {
        std::vector<uint32_t> all(n);
        for (uint32_t i = 0; i < n; ++i) all[i] = i;
        Communicator c(w.ctx[r], comm_id, "check", all);
        std::vector<double> v(1000, r + 1.0);
        c.allreduce(v.data(), v.size(), DType::F64, ReduceOp::SUM);
        for (double x : v)
          if (x != n * (n + 1) / 2.0) throw Error(ErrorKind::kProtocol, "wrong sum " + std::to_string(x));
      } catch (...) {
        errs[r] = std::current_exception();
      }
    });
  for (auto& t : threads) t.join();
  testing::expect_all_ok(errs);
}

template <class F>
bool wait_for(F pred, double seconds) {
  Deadline dl = Deadline::after(seconds);
  while (!pred()) {
    if (dl.expired()) return pred();
    std::this_thread::sleep_for(std::chrono::milliseconds(5));
  }
  return true;
}

net::HostPort local(int port) { return net::HostPort{"127.0.0.1", port}; }

// A client that runs the protocol by hand: the tests forge or replay its parts.
struct ManualClient {
  net::Fd fd;
  net::Hello hello;
  std::array<uint8_t, net::kChallengeBytes> challenge{};

  ManualClient(int port, net::Hello h) : hello(h) {
    Deadline dl = Deadline::after(10);
    fd = net::connect_tcp(local(port), dl, "manual client");
    auto b = net::encode_hello(hello);
    net::write_all(fd.get(), b.data(), b.size(), dl, "manual client");
    net::read_all(fd.get(), challenge.data(), challenge.size(), dl, "manual client");
  }
  net::Nonce server_nonce() const {
    net::Nonce n{};
    std::memcpy(n.data(), &challenge[16], n.size());
    return n;
  }
  // Sends `proof`; true if the listener accepted, false if it closed the connection.
  bool finish(const std::array<uint8_t, net::kProofBytes>& proof) {
    Deadline dl = Deadline::after(10);
    net::write_all(fd.get(), proof.data(), proof.size(), dl, "manual client");
    char ack[8];
    try {
      net::read_all(fd.get(), ack, sizeof(ack), dl, "manual client");
    } catch (const Error& e) {
      EXPECT_EQ(e.kind(), ErrorKind::kPeerGone) << e.what();
      return false;
    }
    return std::memcmp(ack, net::kAccept, 8) == 0;
  }
};

net::Hello hello_for(uint32_t rank, uint64_t comm, uint32_t stream) {
  net::Hello h;
  h.rank = rank;
  h.comm_id = comm;
  h.stream = stream;
  h.nonce = net::random_nonce();
  return h;
}

TEST(Auth, ClientWithWrongKeyIsRefusedAndTheJobStillConnects) {
  const net::Key key = test_key(1), wrong = test_key(2);
  World w = keyed_world(2, key);
  const int port = w.ctx[0]->port();
  const uint64_t before = w.ctx[0]->rejected_connections();

  // A client that does not check the listener's proof and answers with one under another key,
  // claiming exactly the stream the real rank 1 will dial.
  ManualClient m(port, hello_for(1, 0, 0));
  const auto forged = net::handshake_proof(wrong, false, m.hello, m.server_nonce(), 0);
  EXPECT_FALSE(m.finish(net::encode_proof(forged)));
  EXPECT_TRUE(wait_for([&] { return w.ctx[0]->rejected_connections() > before; }, 10));

  // A well-behaved client with the wrong key stops at the listener's proof.
  try {
    net::dial(local(port), wrong, {1, 0, 1, 0u}, Deadline::after(10), "connecting to rank 0 at test");
    ADD_FAILURE() << "a dialer with the wrong key connected";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("proof did not match the job key"), std::string::npos) << e.what();
  }
  // Neither took the place of the job's own streams.
  allreduce_works(w);
}

TEST(Auth, ReplayedClientProofIsRefused) {
  const net::Key key = test_key(3);
  // Two listeners with the same key: a replay on the second meets a fresh stream id, so only the
  // freshness of the listener's nonce can refuse it (not the once-only claim).
  net::Listener a(key, 0, 2, 0), b(key, 0, 2, 0);
  const net::Hello h = hello_for(1, 7, 0);
  ManualClient good(a.port(), h);
  const auto proof = net::encode_proof(net::handshake_proof(key, false, h, good.server_nonce(), 0));
  ASSERT_TRUE(good.finish(proof));
  net::Fd taken = a.take(7, 1, 0, Deadline::after(10));
  ASSERT_TRUE(taken.valid());

  ManualClient replay(b.port(), h);  // the recorded hello, nonce and all
  EXPECT_NE(0, std::memcmp(&replay.challenge[16], &good.challenge[16], net::kNonceBytes));
  EXPECT_FALSE(replay.finish(proof));
  EXPECT_TRUE(wait_for([&] { return b.rejected() >= 1; }, 10));
  EXPECT_THROW(b.take(7, 1, 0, Deadline::after(0.2)), Error);

  // The same at the level of the state machine: another server nonce, same proof.
  net::Nonce n1 = net::random_nonce(), n2 = net::random_nonce();
  net::ServerHandshake s1(key, 0, 2, n1), s2(key, 0, 2, n2);
  auto hb = net::encode_hello(h);
  s1.feed(hb);
  s2.feed(hb);
  const auto p1 = net::encode_proof(net::handshake_proof(key, false, h, n1, 0));
  s1.feed(p1);
  s2.feed(p1);
  EXPECT_EQ(s1.state(), net::ServerHandshake::State::kAuthenticated);
  EXPECT_EQ(s2.state(), net::ServerHandshake::State::kFailed);
}

TEST(Auth, ReflectedServerProofIsRefused) {
  const net::Key key = test_key(4);
  net::Nonce n = net::random_nonce();
  net::ServerHandshake s(key, 0, 2, n);
  const net::Hello h = hello_for(1, 0, 0);
  s.feed(net::encode_hello(h));
  ASSERT_EQ(s.state(), net::ServerHandshake::State::kProof);
  auto out = s.output();
  ASSERT_EQ(out.size(), net::kChallengeBytes);
  // The listener's own proof sent back as the client's.
  net::Mac server_proof{};
  std::memcpy(server_proof.data(), out.data() + 48, net::kMacBytes);
  s.feed(net::encode_proof(server_proof));
  EXPECT_EQ(s.state(), net::ServerHandshake::State::kFailed);
}

TEST(Auth, ClientRefusesAServerThatDoesNotKnowTheKey) {
  // A fake listener: reads the hello, answers with a well-formed challenge and a random proof.
  auto [lfd, port] = net::listen_tcp(0, "127.0.0.1");
  std::thread fake([fd = lfd.get()] {
    try {
      pollfd pf{fd, POLLIN, 0};
      if (::poll(&pf, 1, 10000) != 1) return;
      net::Fd c(::accept(fd, nullptr, nullptr));
      if (!c.valid()) return;
      Deadline dl = Deadline::after(10);
      uint8_t hello[net::kHelloBytes];
      net::read_all(c.get(), hello, sizeof(hello), dl, "fake server");
      std::array<uint8_t, net::kChallengeBytes> ch{};
      std::memcpy(ch.data(), net::kChallengeMagic, 8);
      ch[8] = net::kProtocolVersion;  // little-endian u32; server rank 0 follows
      net::Nonce junk = net::random_nonce(), junk2 = net::random_nonce();
      std::memcpy(&ch[16], junk.data(), 32);
      std::memcpy(&ch[48], junk2.data(), 32);
      net::write_all(c.get(), ch.data(), ch.size(), dl, "fake server");
      char buf[64];
      [[maybe_unused]] ssize_t n = ::recv(c.get(), buf, sizeof(buf), 0);  // until the client hangs up
    } catch (const Error& e) {
      ADD_FAILURE() << "fake server: " << e.what();
    }
  });
  const net::Key key = test_key(5);
  Context ctx(1, 2, testing::random_token(), testing::quick_options(false), 0, key);
  const std::string fake_addr = "127.0.0.1:" + std::to_string(port);
  ctx.set_peers({fake_addr, "127.0.0.1:" + std::to_string(ctx.port())}, {"a", "b"});
  try {
    ctx.tcp_streams(0, 0, 1, Deadline::after(10));
    ADD_FAILURE() << "connected to a listener that does not know the key";
  } catch (const Error& e) {
    const std::string msg = e.what();
    EXPECT_EQ(e.kind(), ErrorKind::kProtocol);
    EXPECT_NE(msg.find("connecting to rank 0 at " + fake_addr), std::string::npos) << msg;
    EXPECT_NE(msg.find("the peer's proof did not match the job key"), std::string::npos) << msg;
  }
  fake.join();
}

TEST(Auth, SecondClaimOfAStreamIsRefusedAndTheFirstStays) {
  const net::Key key = test_key(6);
  World w = keyed_world(2, key);
  // Rank 1's stream of comm 5 is accepted and parked, not yet taken by rank 0.
  std::vector<net::Fd> first = w.ctx[1]->tcp_streams(5, 0, 1, Deadline::after(10));
  ASSERT_EQ(first.size(), 1u);
  const uint64_t before = w.ctx[0]->rejected_connections();
  // Another holder of the key claims the same (comm 5, rank 1, stream 0).
  try {
    net::dial(local(w.ctx[0]->port()), key, {1, 5, 0, 0u}, Deadline::after(10), "second claim");
    ADD_FAILURE() << "a second claim of comm 5 rank 1 stream 0 was accepted";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("already connected there"), std::string::npos) << e.what();
  }
  EXPECT_TRUE(wait_for([&] { return w.ctx[0]->rejected_connections() > before; }, 10));
  // Rank 0 gets the first stream, and it carries data.
  std::vector<net::Fd> got = w.ctx[0]->tcp_streams(5, 1, 1, Deadline::after(10));
  ASSERT_EQ(got.size(), 1u);
  const char msg[] = "the first stream";
  net::write_all(first[0].get(), msg, sizeof(msg), Deadline::after(10), "send");
  char buf[sizeof(msg)] = {};
  net::read_all(got[0].get(), buf, sizeof(buf), Deadline::after(10), "recv");
  EXPECT_STREQ(buf, msg);
  // And no second stream of that id is waiting.
  EXPECT_THROW(w.ctx[0]->tcp_streams(5, 1, 1, Deadline::after(0.2)), Error);
}

size_t open_fds() {
  size_t n = 0;
  DIR* d = ::opendir("/proc/self/fd");
  if (d == nullptr) return 0;
  while (const dirent* e = ::readdir(d))
    if (e->d_name[0] != '.') ++n;
  ::closedir(d);
  return n - 1;  // the directory's own fd
}

// The soft fd limit raised (for a flood) or lowered (to the fds in use), restored on exit.
struct FdLimit {
  rlimit saved{};
  explicit FdLimit(rlim_t soft) {
    ::getrlimit(RLIMIT_NOFILE, &saved);
    rlimit r = saved;
    r.rlim_cur = std::min(soft, saved.rlim_max);
    ::setrlimit(RLIMIT_NOFILE, &r);
  }
  ~FdLimit() { ::setrlimit(RLIMIT_NOFILE, &saved); }
};

TEST(Auth, FloodOfHalfOpenConnectionsDoesNotStopTheJob) {
  FdLimit limit(8192);
  const net::Key key = test_key(7);
  World w = keyed_world(2, key);
  const int port = w.ctx[0]->port();
  const size_t fds_before = open_fds();

  std::atomic<int> opened{0};
  std::atomic<bool> flooding{true};
  std::vector<net::Fd> held;
  std::thread flood([&] {
    const auto partial = net::encode_hello(hello_for(1, 0, 0));
    for (int i = 0; i < 3000; ++i) {
      net::Fd fd;
      try {
        fd = net::connect_tcp(local(port), Deadline::after(20), "flood");
      } catch (const Error&) {
        continue;
      }
      if (i % 3 == 1) ::send(fd.get(), partial.data(), 20, MSG_NOSIGNAL);  // a partial hello
      if (i % 3 != 2) held.push_back(std::move(fd));                       // half-open, held
      opened.fetch_add(1);                                                 // else: connect and close
    }
    flooding = false;
  });
  std::atomic<size_t> max_pending{0};
  std::thread watch([&] {
    while (flooding.load()) {
      size_t p = w.ctx[0]->pending_connections();
      if (p > max_pending.load()) max_pending = p;
      std::this_thread::sleep_for(std::chrono::milliseconds(1));
    }
  });
  // The job connects while the flood is well under way.
  EXPECT_TRUE(wait_for([&] { return opened.load() >= 500 || !flooding.load(); }, 30));
  allreduce_works(w);
  flood.join();
  watch.join();
  EXPECT_GE(opened.load(), 2500);
  EXPECT_LE(max_pending.load(), 128u);
  EXPECT_LE(w.ctx[0]->pending_connections(), 128u);
  // The listener may still be working through the flood's last connections when it ends.
  EXPECT_TRUE(wait_for([&] { return w.ctx[0]->rejected_connections() >= 2000u; }, 20))
      << w.ctx[0]->rejected_connections() << " connections refused of " << opened.load();

  held.clear();
  // Every connection of the flood closes on the listener's side too (EOF, the cap or the
  // handshake deadline); the job's own streams closed with its communicators.
  EXPECT_TRUE(wait_for([&] { return open_fds() <= fds_before; }, 20))
      << open_fds() << " fds open, " << fds_before << " before the flood";
  EXPECT_TRUE(wait_for([&] { return w.ctx[0]->pending_connections() == 0; }, 20));
  allreduce_works(w, 1);
}

TEST(Auth, ListenerPausesAtTheFdLimitInsteadOfSpinning) {
  const net::Key key = test_key(8);
  net::Listener l(key, 0, 2, 0);
  // Client sockets made before the limit: connect() needs no new fd.
  std::vector<net::Fd> clients;
  for (int i = 0; i < 4; ++i) clients.emplace_back(::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0));
  std::vector<net::Fd> filler;
  {
    int max_fd = 0;
    for (int fd = 0; fd < 65536; ++fd)
      if (::fcntl(fd, F_GETFD) != -1) max_fd = fd;
    FdLimit limit(static_cast<rlim_t>(max_fd + 1 + 8));
    while (true) {
      int fd = ::dup(0);
      if (fd < 0) break;
      filler.emplace_back(fd);
    }
    ASSERT_EQ(errno, EMFILE);
    sockaddr_in a{};
    a.sin_family = AF_INET;
    a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    a.sin_port = htons(static_cast<uint16_t>(l.port()));
    for (auto& c : clients) ASSERT_EQ(::connect(c.get(), reinterpret_cast<sockaddr*>(&a), sizeof(a)), 0);
    ASSERT_TRUE(wait_for([&] { return l.accept_backoffs() > 0; }, 10));
    const double cpu0 = l.thread_cpu_seconds();
    const auto t0 = Clock::now();
    while (Clock::now() - t0 < std::chrono::seconds(2))
      std::this_thread::sleep_for(std::chrono::milliseconds(50));
    const double used = l.thread_cpu_seconds() - cpu0;
    EXPECT_GE(cpu0, 0.0);
    EXPECT_LT(used, 0.6) << "the listener thread used " << used << " s of CPU in 2 s at the fd limit";
    EXPECT_GE(l.accept_backoffs(), 2u);  // it keeps trying
    filler.clear();
  }
  // With fds free again the waiting connections are accepted and can authenticate.
  net::DialRequest req{1, 0, 0, 0u};
  EXPECT_EQ(net::client_handshake(clients[0].get(), key, req, Deadline::after(10), "after the limit"),
            net::DialOutcome::kAccepted);
  EXPECT_TRUE(l.take(0, 1, 0, Deadline::after(10)).valid());
}

TEST(Auth, KeyArgumentAndUnauthenticatedKey) {
  const net::Token t = testing::test_token();
  const net::Key a = net::unauthenticated_key(t), b = net::unauthenticated_key(testing::test_token(8));
  EXPECT_NE(a, b);
  // Two contexts with no key but the same token connect (the key derived alike on both).
  World w;
  Options o = testing::quick_options(false);
  for (uint32_t r = 0; r < 2; ++r) w.ctx.push_back(std::make_shared<Context>(r, 2, t, o, 0));
  std::vector<std::string> addrs;
  for (auto& c : w.ctx) addrs.push_back("127.0.0.1:" + std::to_string(c->port()));
  for (auto& c : w.ctx) c->set_peers(addrs, {"a", "b"});
  allreduce_works(w);
  // A listener bound to loopback only.
  Context lo(0, 2, t, o, 0, std::nullopt, "127.0.0.1");
  EXPECT_GT(lo.port(), 0);
  EXPECT_THROW(Context(0, 2, t, o, 0, std::nullopt, "no-such-host.invalid"), Error);
}

}  // namespace
}  // namespace rumor
