// net::TlsStream, TLS over a nonblocking socket for an event loop (the window hub's progress
// thread): bytes both ways bit for bit with the handshake run inside the transfers; a peer whose
// certificate another CA issued is refused on both ends; a byte altered in flight fails the
// receiver as an integrity failure, delivers no altered byte, and fails the sender too.
#include <gtest/gtest.h>
#include <poll.h>
#include <sys/socket.h>

#include <cstring>
#include <string>
#include <thread>
#include <vector>

#include "net/socket.h"
#include "net/tls_stream.h"
#include "tls_pki.h"

namespace rumor {
namespace {

using testing::Pki;

std::vector<std::byte> pattern(size_t n, uint32_t salt) {
  std::vector<std::byte> v(n);
  uint32_t x = 0x9e3779b9u + salt;
  for (auto& b : v) {
    x ^= x << 13;
    x ^= x >> 17;
    x ^= x << 5;
    b = static_cast<std::byte>(0x10 + x % 0x60);  // never 0, never >= 0x80: an altered byte shows
  }
  return v;
}

// Sends `out` and receives `in.size()` bytes at once on one nonblocking socket, in pieces of
// uneven sizes, until both are done, a call throws or the deadline passes; the error text or "".
// `got` counts the bytes received.
std::string exchange(int fd, net::TlsStream& s, const std::vector<std::byte>& out, std::vector<std::byte>& in,
                     size_t& got, const Deadline& deadline) {
  size_t sent = 0;
  got = 0;
  size_t piece = 1;
  try {
    while (sent < out.size() || got < in.size() || s.wants_write()) {
      if (deadline.expired()) return "test deadline passed";
      bool moved = false;
      if (sent < out.size()) {
        piece = piece * 7 % 300007 + 1;  // 1 byte to ~300 KiB: records split and joined
        const size_t n = std::min(piece, out.size() - sent);
        // Two parts, as the window hub sends a frame's header and its payload.
        const std::span<const std::byte> parts[2] = {{out.data() + sent, n / 3},
                                                     {out.data() + sent + n / 3, n - n / 3}};
        const size_t taken = s.send(parts);
        sent += taken;
        moved |= taken > 0;
      } else {
        s.pump();
      }
      while (got < in.size()) {
        const size_t n = s.recv({in.data() + got, std::min<size_t>(in.size() - got, 65537)});
        if (n == 0) break;
        got += n;
        moved = true;
      }
      if (moved) continue;
      const bool can_send = sent < out.size() && s.handshake_done();
      pollfd p{fd, static_cast<short>(POLLIN | (can_send || s.wants_write() ? POLLOUT : 0)), 0};
      ::poll(&p, 1, 50);
    }
  } catch (const Error& e) {
    return e.what();
  }
  return {};
}

net::Fd nonblocking(net::Fd fd) {
  net::set_nonblocking(fd.get(), true);
  return fd;
}

std::unique_ptr<net::TlsSession> session(const Pki& pki, uint32_t rank, net::TlsRole role,
                                         bool foreign = false) {
  return std::make_unique<net::TlsSession>(std::make_shared<const net::TlsContext>(pki.config(rank, foreign)),
                                           role, "rank " + std::to_string(1 - rank) + " (test)");
}

struct Outcome {
  std::string err[2];
  std::vector<std::byte> got[2];
  size_t got_n[2] = {0, 0};
};

// Rank 1 (client) and rank 0 (server) exchange `bytes` each way over a and b.
Outcome run_pair(const Pki& pki, net::Fd a, net::Fd b, size_t bytes, bool foreign_client,
                 const std::vector<std::byte>& to_server, const std::vector<std::byte>& to_client) {
  Outcome o;
  o.got[0].assign(bytes, std::byte{0});
  o.got[1].assign(bytes, std::byte{0});
  const Deadline deadline = Deadline::after(20);
  std::thread client([&, fd = nonblocking(std::move(a))] {
    net::TlsStream s(fd.get(), session(pki, 1, net::TlsRole::kClient, foreign_client));
    o.err[1] = exchange(fd.get(), s, to_server, o.got[1], o.got_n[1], deadline);
  });
  {
    const net::Fd fd = nonblocking(std::move(b));
    net::TlsStream s(fd.get(), session(pki, 0, net::TlsRole::kServer));
    o.err[0] = exchange(fd.get(), s, to_client, o.got[0], o.got_n[0], deadline);
  }  // the server's end closes: a client still waiting sees it
  client.join();
  return o;
}

TEST(TlsStream, BytesBothWaysBitForBit) {
  Pki pki;
  auto [a, b] = testing::socket_pair();
  constexpr size_t kLen = (3u << 20) + 17;
  const auto up = pattern(kLen, 1), down = pattern(kLen, 2);
  Outcome o = run_pair(pki, std::move(a), std::move(b), kLen, false, up, down);
  ASSERT_EQ(o.err[0], "");
  ASSERT_EQ(o.err[1], "");
  EXPECT_TRUE(o.got[0] == up) << "the server received other bytes";
  EXPECT_TRUE(o.got[1] == down) << "the client received other bytes";
}

TEST(TlsStream, CertificateOfAnotherCaIsRefusedOnBothEnds) {
  Pki pki;
  auto [a, b] = testing::socket_pair();
  const auto up = pattern(4096, 1), down = pattern(4096, 2);
  Outcome o = run_pair(pki, std::move(a), std::move(b), 4096, /*foreign_client=*/true, up, down);
  EXPECT_NE(o.err[0].find("certificate refused"), std::string::npos) << o.err[0];
  EXPECT_NE(o.err[0].find("rank 1 (test)"), std::string::npos) << o.err[0];
  // The client finished its handshake before the server checked it: it hears the refusal (the
  // server's alert) on its next read, or when its next send finds the connection closed.
  EXPECT_NE(o.err[1].find("the peer refused this end"), std::string::npos) << o.err[1];
  EXPECT_NE(o.err[1].find("rank 0 (test)"), std::string::npos) << o.err[1];
  EXPECT_EQ(o.got_n[0], 0u);
  EXPECT_EQ(o.got_n[1], 0u);
}

TEST(TlsStream, AlteredByteFailsTheReceiverAndTheSenderAndDeliversNothingAltered) {
  Pki pki;
  auto [a, a_wire] = testing::socket_pair();
  auto [b_wire, b] = testing::socket_pair();
  const Deadline deadline = Deadline::after(20);
  std::thread wire([&, x = a_wire.get(), y = b_wire.get()] {
    testing::relay(x, y, 300 * 1024, deadline);  // past the handshake, inside the data's records
    ::shutdown(x, SHUT_RDWR);
    ::shutdown(y, SHUT_RDWR);
  });
  constexpr size_t kLen = 1 << 20;
  const auto up = pattern(kLen, 3);
  // The server sends nothing: the client's only news of the failure is the server's alert.
  Outcome o = run_pair(pki, std::move(a), std::move(b), kLen, false, up, {});
  wire.join();
  EXPECT_NE(o.err[0].find("integrity"), std::string::npos) << o.err[0];
  EXPECT_NE(o.err[0].find("rank 1 (test)"), std::string::npos) << o.err[0];
  EXPECT_NE(o.err[1], "") << "the sender did not hear of the failure";
  EXPECT_GT(o.got_n[0], 0u);  // the records before the altered one did arrive
  EXPECT_LT(o.got_n[0], kLen);
  for (size_t i = 0; i < kLen; ++i)
    ASSERT_TRUE(o.got[0][i] == std::byte{0} || o.got[0][i] == up[i]) << "byte " << i << " delivered altered";
}

}  // namespace
}  // namespace rumor
