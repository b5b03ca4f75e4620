// TLS on the TCP data channels (issue 46): ranks as threads with their own certificates, over
// loopback TCP (one host per rank, so no shared memory and no direct host path). Results must be
// bit for bit those of the same run in plaintext; mismatched configurations fail on every rank
// within the deadline, with an error that says TLS.
#include <gtest/gtest.h>
#include <poll.h>
#include <sys/socket.h>

#include <atomic>
#include <chrono>
#include <cstring>
#include <string>
#include <vector>

#include "net/tcp_channel.h"
#include "net/tls.h"
#include "ranks.h"
#include "tls_pki.h"

namespace rumor {
namespace {

using testing::describe;
using testing::hosts_of;
using testing::random_token;
using testing::World;

using testing::Mode;
using testing::Pki;
using testing::tls_world;

// Floats with every mantissa bit in use, so a reduction in another order or a single flipped
// bit shows.
std::vector<float> pattern(size_t n, uint32_t rank, uint32_t salt) {
  std::vector<float> v(n);
  uint32_t x = 0x9e3779b9u * (rank + 1) + salt;
  for (auto& f : v) {
    x ^= x << 13;
    x ^= x >> 17;
    x ^= x << 5;
    f = static_cast<float>(x % 2000003) / 1000.003f - 1000.0f;
  }
  return v;
}

struct Results {
  std::vector<std::vector<float>> small_sum, big_sum;
  std::vector<std::vector<uint8_t>> bcast, gathered, p2p;
};

// The same workload on any world: odd sizes, and messages past 8 MiB (striped over the streams).
Results run_workload(World& w) {
  const uint32_t n = static_cast<uint32_t>(w.ctx.size());
  Results res;
  res.small_sum.resize(n);
  res.big_sum.resize(n);
  res.bcast.resize(n);
  res.gathered.resize(n);
  res.p2p.resize(n);
  constexpr size_t kSmall = 1001;              // recursive doubling
  constexpr size_t kBig = (9u << 20) / 4 + 3;  // ~9 MiB of float32, ring, striped
  constexpr size_t kBcast = (8u << 20) + 13;   // scatter + allgather, striped
  constexpr size_t kP2p = (8u << 20) + 5;
  const std::vector<size_t> counts = [n] {
    std::vector<size_t> c;
    for (uint32_t r = 0; r < n; ++r) c.push_back(777 + 3 * r + (r == 1 ? (3u << 20) : 0));
    return c;
  }();
  auto errs = testing::run_ranks(w, [&](Communicator& c, uint32_t r) {
    res.small_sum[r] = pattern(kSmall, r, 1);
    c.allreduce(res.small_sum[r].data(), kSmall, DType::F32, ReduceOp::SUM);
    res.big_sum[r] = pattern(kBig, r, 2);
    c.allreduce(res.big_sum[r].data(), kBig, DType::F32, ReduceOp::SUM);
    res.bcast[r].assign(kBcast, 0);
    if (r == 1)
      for (size_t i = 0; i < kBcast; ++i) res.bcast[r][i] = static_cast<uint8_t>(i * 7 + i / 4099);
    c.broadcast(res.bcast[r].data(), kBcast, DType::U8, 1);
    size_t total = 0, mine = 0;
    for (uint32_t i = 0; i < n; ++i) {
      if (i < r) mine += counts[i];
      total += counts[i];
    }
    res.gathered[r].assign(total, 0);
    for (size_t i = 0; i < counts[r]; ++i) res.gathered[r][mine + i] = static_cast<uint8_t>(r * 31 + i);
    c.allgather(res.gathered[r].data(), counts, DType::U8);
    res.p2p[r].assign(kP2p, 0);
    if (r == 0) {
      for (size_t i = 0; i < kP2p; ++i) res.p2p[r][i] = static_cast<uint8_t>(i ^ (i >> 9));
      c.send(res.p2p[r].data(), kP2p, n - 1);
      c.recv(res.p2p[r].data(), 3, n - 1);
    } else if (r == n - 1) {
      c.recv(res.p2p[r].data(), kP2p, 0);
      c.send(res.p2p[r].data() + 100, 3, 0);
    }
  });
  testing::expect_all_ok(errs);
  return res;
}

class TlsChannels : public ::testing::TestWithParam<uint32_t> {};

TEST_P(TlsChannels, CollectivesAreBitForBitThoseOfPlaintext) {
  const uint32_t n = GetParam();
  Pki pki;
  World plain = tls_world(pki, std::vector<Mode>(n, Mode::kOff));
  const Results want = run_workload(plain);
  World tls = tls_world(pki, std::vector<Mode>(n, Mode::kOn));
  const Results got = run_workload(tls);
  for (uint32_t r = 0; r < n; ++r) {
    EXPECT_EQ(0, std::memcmp(got.small_sum[r].data(), want.small_sum[r].data(), want.small_sum[r].size() * 4))
        << "rank " << r;
    EXPECT_EQ(0, std::memcmp(got.big_sum[r].data(), want.big_sum[r].data(), want.big_sum[r].size() * 4))
        << "rank " << r;
    EXPECT_EQ(got.bcast[r], want.bcast[r]) << "rank " << r;
    EXPECT_EQ(got.gathered[r], want.gathered[r]) << "rank " << r;
    EXPECT_EQ(got.p2p[r], want.p2p[r]) << "rank " << r;
  }
  // The plaintext reference itself against what the ranks put in (the sum of the inputs, taken
  // in float64, within float32 rounding of a ring's order).
  for (size_t i = 0; i < want.big_sum[0].size(); i += 4099) {
    double s = 0;
    for (uint32_t r = 0; r < n; ++r) s += pattern(want.big_sum[0].size(), r, 2)[i];
    EXPECT_NEAR(want.big_sum[0][i], s, 1e-3 * n) << i;
  }
  EXPECT_EQ(want.bcast[0][12345], static_cast<uint8_t>(12345 * 7 + 12345 / 4099));
  EXPECT_EQ(want.p2p[n - 1][77777], static_cast<uint8_t>(77777 ^ (77777 >> 9)));
}

INSTANTIATE_TEST_SUITE_P(Ranks, TlsChannels, ::testing::Values(2u, 3u));

// Every rank fails, none hangs: the op's deadline is 5 s and the test checks each error.
std::vector<std::string> failing_allreduce(const Pki& pki, const std::vector<Mode>& modes) {
  World w = tls_world(pki, modes, 5);
  auto errs = testing::run_ranks(w, [](Communicator& c, uint32_t r) {
    std::vector<float> v = pattern(4096, r, 3);
    c.allreduce(v.data(), v.size(), DType::F32, ReduceOp::SUM);
  });
  std::vector<std::string> out;
  for (size_t r = 0; r < errs.size(); ++r) {
    EXPECT_TRUE(errs[r]) << "rank " << r << " succeeded";
    out.push_back(errs[r] ? describe(errs[r]) : "");
  }
  return out;
}

TEST(TlsChannel, PlaintextRankAndTlsRankBothFailSayingTls) {
  Pki pki;
  // Rank 1 dials (TLS client) with TLS on; rank 0 accepts in plaintext.
  auto e = failing_allreduce(pki, {Mode::kOff, Mode::kOn});
  EXPECT_NE(e[0].find("TLS"), std::string::npos) << e[0];
  EXPECT_NE(e[1].find("TLS"), std::string::npos) << e[1];
  // The other way round: the TLS server hears plaintext.
  e = failing_allreduce(pki, {Mode::kOn, Mode::kOff});
  EXPECT_NE(e[0].find("TLS"), std::string::npos) << e[0];
  EXPECT_NE(e[0].find("rank 1"), std::string::npos) << e[0];
}

TEST(TlsChannel, CertificateOfAnotherCaIsRefused) {
  Pki pki;
  // The dialer's certificate is foreign: the acceptor refuses it in its handshake.
  auto e = failing_allreduce(pki, {Mode::kOn, Mode::kForeignCa});
  EXPECT_NE(e[0].find("certificate refused"), std::string::npos) << e[0];
  EXPECT_NE(e[0].find("rank 1 at 127.0.0.1:"), std::string::npos) << e[0];
  // The acceptor's certificate is foreign: the dialer refuses it.
  e = failing_allreduce(pki, {Mode::kForeignCa, Mode::kOn});
  EXPECT_NE(e[1].find("certificate refused"), std::string::npos) << e[1];
  EXPECT_NE(e[0].find("refused"), std::string::npos) << e[0];
}

TEST(TlsChannel, IncompleteConfigurationNamesWhatIsMissing) {
  Pki pki;
  Options o = tls_options(pki, 0, Mode::kOn, 5);
  o.tls_key_pem.clear();
  try {
    Context c(0, 1, random_token(), o, 0);
    ADD_FAILURE() << "a context without a key was built";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("RUMOR_TLS_KEY"), std::string::npos) << e.what();
  }
}

// ---- One channel pair through a relay that flips a byte of the data ----------------------------

using testing::relay;
using testing::socket_pair;

// Drives t on ch until it finishes, throws, or the deadline passes; the error text or "".
std::string drive(net::TcpChannel& ch, net::Transfer& t, const net::OpInfo& op, const Deadline& deadline) {
  try {
    ch.begin(t, op);
    while (!t.finished()) {
      if (deadline.expired()) return "test deadline passed";
      if (ch.progress(t, op)) continue;
      std::vector<pollfd> fds;
      ch.want(t, fds);
      ::poll(fds.data(), fds.size(), 50);
    }
  } catch (const Error& e) {
    return e.what();
  }
  return {};
}

TEST(TlsChannel, AlteredRecordFailsTheReceiveAsIntegrityAndDeliversNoAlteredByte) {
  Pki pki;
  net::TlsConfig cfg[2];
  for (int r = 0; r < 2; ++r) {
    const auto me = pki.leaf(pki.ca, static_cast<uint32_t>(r));
    cfg[r].cert_pem = me.cert_pem;
    cfg[r].key_pem = me.key_pem;
    cfg[r].ca_pem = pki.ca.cert_pem;
  }
  auto [a, a_wire] = socket_pair();
  auto [b_wire, b] = socket_pair();
  const Deadline deadline = Deadline::after(20);
  constexpr size_t kLen = 1 << 20;
  // Well past both handshakes (a few KiB), inside the payload's records.
  std::thread wire([&, x = a_wire.get(), y = b_wire.get()] {
    relay(x, y, 300 * 1024, deadline);
    // One end gone: the other sees it at once, as through a real connection.
    ::shutdown(x, SHUT_RDWR);
    ::shutdown(y, SHUT_RDWR);
  });

  net::OpInfo op;
  op.name = "send";
  op.comm = "world";
  op.opcode = 9;
  op.tag = 1;
  op.timeout_s = 20;
  std::vector<uint8_t> sent(kLen), got(kLen, 0);
  for (size_t i = 0; i < kLen; ++i) sent[i] = static_cast<uint8_t>(0x10 + i % 97);  // never 0, never >= 0x80
  std::string send_err, recv_err;
  std::thread sender([&, fd = std::move(a)]() mutable {
    std::vector<net::Fd> s;
    s.push_back(std::move(fd));
    std::vector<std::unique_ptr<net::TlsSession>> tls;
    tls.push_back(std::make_unique<net::TlsSession>(std::make_shared<const net::TlsContext>(cfg[1]),
                                                    net::TlsRole::kClient, "rank 0 (test)"));
    net::TcpChannel ch(std::move(s), "rank 0", size_t{1} << 40, std::move(tls));
    net::Transfer t = net::make_send(0, sent.data(), kLen);
    send_err = drive(ch, t, op, deadline);
  });
  {
    std::vector<net::Fd> s;
    s.push_back(std::move(b));
    std::vector<std::unique_ptr<net::TlsSession>> tls;
    tls.push_back(std::make_unique<net::TlsSession>(std::make_shared<const net::TlsContext>(cfg[0]),
                                                    net::TlsRole::kServer, "rank 1 (test)"));
    net::TcpChannel ch(std::move(s), "rank 1", size_t{1} << 40, std::move(tls));
    net::Transfer t = net::make_recv(1, got.data(), kLen);
    recv_err = drive(ch, t, op, deadline);
    EXPECT_NE(recv_err.find("integrity"), std::string::npos) << recv_err;
    EXPECT_NE(recv_err.find("rank 1"), std::string::npos) << recv_err;
    EXPECT_NE(recv_err.find("send (op #1"), std::string::npos) << recv_err;
    EXPECT_LT(t.bytes_done(), kLen);
  }  // the receiver's end closes: the relay and the sender stop
  sender.join();
  wire.join();
  size_t delivered = 0;
  for (size_t i = 0; i < kLen; ++i) {
    ASSERT_TRUE(got[i] == 0 || got[i] == sent[i]) << "byte " << i << " delivered altered";
    delivered += got[i] != 0;
  }
  EXPECT_GT(delivered, 0u);  // the records before the altered one did arrive
  EXPECT_LT(delivered, kLen);
}

struct TlsPair {
  std::unique_ptr<net::TcpChannel> client, server;
};

TlsPair tls_pair(const Pki& pki) {
  auto [c, s] = socket_pair();
  auto make = [&](net::Fd fd, uint32_t rank, net::TlsRole role) {
    net::TlsConfig cfg;
    const auto me = pki.leaf(pki.ca, rank);
    cfg.cert_pem = me.cert_pem;
    cfg.key_pem = me.key_pem;
    cfg.ca_pem = pki.ca.cert_pem;
    std::vector<net::Fd> streams;
    streams.push_back(std::move(fd));
    std::vector<std::unique_ptr<net::TlsSession>> tls;
    tls.push_back(std::make_unique<net::TlsSession>(std::make_shared<const net::TlsContext>(cfg), role,
                                                    "rank " + std::to_string(1 - rank)));
    return std::make_unique<net::TcpChannel>(std::move(streams), "rank " + std::to_string(1 - rank),
                                             size_t{1} << 40, std::move(tls));
  };
  return {make(std::move(c), 1, net::TlsRole::kClient), make(std::move(s), 0, net::TlsRole::kServer)};
}

// The handshake's bytes are no part of a message: a receive during which only the handshake
// moved has not begun, and a peer slow to start sending is not "stopped in the middle".
TEST(TlsChannel, HandshakeAloneDoesNotStartTheProgressDeadline) {
  Pki pki;
  TlsPair ch = tls_pair(pki);
  net::OpInfo op;
  op.name = "recv";
  op.comm = "world";
  op.opcode = 9;
  op.tag = 1;
  op.timeout_s = 20;
  op.stall_floor_s = 0.05;  // the limit is then ~1 s (net/stall.h, rate not measured yet)
  const Deadline deadline = Deadline::after(20);
  constexpr size_t kLen = 4 << 20;
  std::vector<uint8_t> sent(kLen, 0x5a), got(kLen, 0);
  std::string client_err;
  std::thread client([&] {
    // The client's side of the handshake runs under a receive that the server never sends
    // (300 ms: a socketpair handshake takes milliseconds), then it waits past the stall limit
    // before it sends its message: a peer slow to start.
    std::vector<uint8_t> never(16);
    net::Transfer idle = net::make_recv(0, never.data(), never.size());
    ch.client->begin(idle, op);
    const Deadline shaken = Deadline::after(0.3);
    while (!shaken.expired()) {
      if (ch.client->progress(idle, op)) continue;
      std::vector<pollfd> fds;
      ch.client->want(idle, fds);
      ::poll(fds.data(), fds.size(), 10);
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(1500));
    net::Transfer t = net::make_send(0, sent.data(), kLen);
    client_err = drive(*ch.client, t, op, deadline);
  });
  net::Transfer t = net::make_recv(1, got.data(), kLen);
  std::string err;
  try {
    ch.server->begin(t, op);
    while (!t.finished() && !deadline.expired()) {
      ch.server->progress(t, op);
      ch.server->check_stall(t, op, Clock::now());
      std::vector<pollfd> fds;
      ch.server->want(t, fds);
      ::poll(fds.data(), fds.size(), 20);
    }
  } catch (const Error& e) {
    err = e.what();
  }
  client.join();
  EXPECT_EQ(err, "");
  EXPECT_EQ(client_err, "");
  EXPECT_TRUE(t.finished());
  EXPECT_EQ(got, sent);
}

}  // namespace
}  // namespace rumor

namespace rumor {
namespace {

// A send and a receive to the same peer at once (neighbor_allreduce's exchange), large enough
// that both sockets fill: each rank's receive must go on reading while its own send's ciphertext
// waits for the socket, or the two ranks wait for each other until the deadline.
TEST(TlsChannel, SendAndReceiveAtOnceBothWaysDoNotWaitForEachOther) {
  Pki pki;
  World w = tls_world(pki, {Mode::kOn, Mode::kOn});
  constexpr size_t kBytes = 64u << 20;  // striped, many times the sockets' buffers
  testing::expect_all_ok(testing::run_ranks(w, [&](Communicator& c, uint32_t r) {
    std::vector<uint8_t> out(kBytes), in(kBytes, 0);
    for (size_t i = 0; i < kBytes; ++i) out[i] = static_cast<uint8_t>(i * 13 + r * 101 + i / 65521);
    c.barrier();
    std::vector<net::Transfer> ts;
    ts.push_back(net::make_recv(1 - r, in.data(), kBytes));
    ts.push_back(net::make_send(1 - r, out.data(), kBytes));
    net::OpInfo op;
    op.name = "exchange";
    op.comm = "world";
    op.timeout_s = 20;
    op.deadline = Deadline::after(20);
    c.exchange(ts, op);
    for (size_t i = 0; i < kBytes; ++i)
      ASSERT_EQ(in[i], static_cast<uint8_t>(i * 13 + (1 - r) * 101 + i / 65521)) << "byte " << i;
  }));
}

}  // namespace
}  // namespace rumor
