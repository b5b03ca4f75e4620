// The TLS layer (net/tls.h) between two ends over socketpairs, each end in its own thread with a
// deadline: a mutual handshake and bytes both ways, then every way a peer is refused (and the
// refusing context still accepting a good peer afterwards), a tampered record, a stalled peer.
#include <gtest/gtest.h>
#include <openssl/err.h>
#include <openssl/pem.h>
#include <openssl/ssl.h>
#include <openssl/x509v3.h>
#include <poll.h>
#include <pthread.h>
#include <signal.h>
#include <sys/socket.h>
#include <sys/time.h>

#include <algorithm>
#include <cstring>
#include <functional>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "net/handshake.h"
#include "net/socket.h"
#include "net/tls.h"

namespace rumor {
namespace {

using net::PemCredentials;
using net::TlsContext;
using net::TlsRole;
using net::TlsSession;
using ContextPtr = std::shared_ptr<const TlsContext>;

constexpr double kDeadlineS = 20;

net::CertTime hours_from_now(int h) { return std::chrono::system_clock::now() + std::chrono::hours(h); }

// One job's CA and two ranks' certificates, plus a second CA (another job, or an attacker's).
struct Pki {
  PemCredentials ca = net::make_ca("rumor job a", hours_from_now(-1), hours_from_now(24));
  PemCredentials other_ca = net::make_ca("rumor job b", hours_from_now(-1), hours_from_now(24));
  PemCredentials server = leaf("rank-0", {"rank-0.job-a", "127.0.0.1"});
  PemCredentials client = leaf("rank-1", {"rank-1.job-a"});

  PemCredentials leaf(const std::string& cn, const std::vector<std::string>& sans, int from_h = -1,
                      int to_h = 24) {
    return net::issue_certificate(ca, cn, sans, hours_from_now(from_h), hours_from_now(to_h));
  }
};

ContextPtr context(const PemCredentials& me, const PemCredentials& ca, std::string expected = "") {
  net::TlsConfig c;
  c.cert_pem = me.cert_pem;
  c.key_pem = me.key_pem;
  c.ca_pem = ca.cert_pem;
  c.expected_peer_name = std::move(expected);
  return std::make_shared<const TlsContext>(c);
}

struct SocketPair {
  net::Fd a, b;
};
SocketPair socket_pair() {
  int fds[2];
  if (::socketpair(AF_UNIX, SOCK_STREAM | SOCK_NONBLOCK | SOCK_CLOEXEC, 0, fds) != 0)
    throw Error(ErrorKind::kSystem, "socketpair: " + net::errno_string(errno));
  return {net::Fd(fds[0]), net::Fd(fds[1])};
}

std::vector<uint8_t> random_bytes(size_t n, uint32_t seed) {
  std::mt19937 g(seed);
  std::vector<uint8_t> v(n);
  for (auto& x : v) x = static_cast<uint8_t>(g());
  return v;
}

// What one end's function ended with: "" if it returned, else its error.
struct Outcome {
  std::string error;
  ErrorKind kind = ErrorKind::kSystem;
  bool ok() const { return error.empty(); }
};
Outcome outcome_of(const std::function<void()>& fn) {
  try {
    fn();
  } catch (const Error& e) {
    return {e.what(), e.kind()};
  } catch (const std::exception& e) {
    return {std::string("non-rumor exception: ") + e.what()};
  }
  return {};
}

// Both ends at once: `a` in a thread, `b` here.
std::pair<Outcome, Outcome> both(const std::function<void()>& a, const std::function<void()>& b) {
  Outcome oa, ob;
  std::thread t([&] { oa = outcome_of(a); });
  ob = outcome_of(b);
  t.join();
  return {oa, ob};
}

// The caller's socket loop, as a channel would run it: sends `out` (sealed `chunk` plaintext
// bytes at a time) while receiving until `got` holds `want` bytes, full duplex on one thread.
void exchange(int fd, TlsSession& s, std::span<const uint8_t> out, size_t want, std::vector<uint8_t>& got,
              const Deadline& dl, size_t chunk = 16384) {
  std::vector<uint8_t> buf(64 * 1024);
  size_t off = 0;
  while (true) {
    while (off < out.size() && s.pending_out() < 256 * 1024) {
      const size_t n = std::min(chunk, out.size() - off);
      s.write(out.subspan(off, n));
      off += n;
    }
    const bool flushed = net::tls_send_some(fd, s);
    // No more than `want`: what follows belongs to the caller's next exchange.
    while (got.size() < want) {
      const size_t n = s.read(std::span(buf).first(std::min(buf.size(), want - got.size())));
      if (n == 0) break;
      got.insert(got.end(), buf.begin(), buf.begin() + static_cast<long>(n));
    }
    if (off == out.size() && flushed && got.size() >= want) return;
    if (s.peer_closed()) throw Error(ErrorKind::kPeerGone, "exchange: the peer closed TLS");
    pollfd p{fd, static_cast<short>(POLLIN | (flushed ? 0 : POLLOUT)), 0};
    const int rc = ::poll(&p, 1, dl.ms_left(1000));
    if (rc == 0 && dl.expired())
      throw Error(ErrorKind::kTimeout, "exchange: deadline with " + std::to_string(got.size()) + " of " +
                                           std::to_string(want) + " bytes received");
    if (rc > 0 && (p.revents & (POLLIN | POLLHUP | POLLERR))) {
      const ssize_t n = ::recv(fd, buf.data(), buf.size(), 0);
      if (n > 0)
        s.feed(std::span<const uint8_t>(buf.data(), static_cast<size_t>(n)));
      else if (n == 0)
        throw Error(ErrorKind::kPeerGone, "exchange: the peer closed the socket");
      else if (errno != EAGAIN && errno != EINTR)
        throw Error(ErrorKind::kPeerGone, "exchange: recv: " + net::errno_string(errno));
    }
  }
}

// A handshake and one byte each way: what proves a session works end to end.
void handshake_and_ping(int fd, TlsSession& s) {
  const Deadline dl = Deadline::after(kDeadlineS);
  net::tls_handshake(fd, s, dl);
  const uint8_t ping = 0x5a;
  std::vector<uint8_t> got;
  exchange(fd, s, std::span<const uint8_t>(&ping, 1), 1, got, dl);
  if (got != std::vector<uint8_t>{ping}) throw Error(ErrorKind::kProtocol, "ping came back wrong");
}

// A fresh session on `server` accepts a good client: a refusal left the context usable.
void expect_accepts_good_peer(const ContextPtr& server, const Pki& pki) {
  auto sp = socket_pair();
  auto client = context(pki.client, pki.ca);
  auto [s, c] = both(
      [&] {
        TlsSession ss(server, TlsRole::kServer, "good client");
        handshake_and_ping(sp.a.get(), ss);
      },
      [&] {
        TlsSession cs(client, TlsRole::kClient, "server");
        handshake_and_ping(sp.b.get(), cs);
      });
  EXPECT_TRUE(s.ok()) << s.error;
  EXPECT_TRUE(c.ok()) << c.error;
}

// The server end refuses `client_ctx`'s session: returns {server's outcome, client's outcome}.
std::pair<Outcome, Outcome> try_client(const ContextPtr& server, const ContextPtr& client) {
  auto sp = socket_pair();
  return both(
      [&] {
        TlsSession ss(server, TlsRole::kServer, "127.0.0.1:41234 (rank 1)");
        handshake_and_ping(sp.a.get(), ss);
      },
      [&] {
        // TLS 1.3: the client's handshake ends before the server judged its certificate, so
        // the refusal shows on the ping's read.
        TlsSession cs(client, TlsRole::kClient, "127.0.0.1:29500 (rank 0)");
        handshake_and_ping(sp.b.get(), cs);
      });
}

std::string openssl_error_text() {
  const unsigned long e = ERR_get_error();
  ERR_clear_error();
  const char* r = e != 0 ? ERR_reason_error_string(e) : nullptr;
  return r != nullptr ? r : "(no OpenSSL error)";
}

// A client written straight on OpenSSL (blocking socket with timeouts), for the peers
// TlsContext refuses to be: one without a certificate, one capped at TLS 1.2. Returns "" if it
// connected and read a byte, else what failed.
std::string raw_client(int fd, int max_version, const PemCredentials* cred) {
  net::set_nonblocking(fd, false);
  timeval tv{10, 0};
  ::setsockopt(fd, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof(tv));
  ::setsockopt(fd, SOL_SOCKET, SO_SNDTIMEO, &tv, sizeof(tv));
  std::unique_ptr<SSL_CTX, decltype(&SSL_CTX_free)> ctx(SSL_CTX_new(TLS_client_method()), &SSL_CTX_free);
  SSL_CTX_set_min_proto_version(ctx.get(), TLS1_2_VERSION);
  SSL_CTX_set_max_proto_version(ctx.get(), max_version);
  SSL_CTX_set_verify(ctx.get(), SSL_VERIFY_NONE, nullptr);
  if (cred != nullptr) {
    std::unique_ptr<BIO, decltype(&BIO_free)> cb(BIO_new_mem_buf(cred->cert_pem.data(), -1), &BIO_free);
    std::unique_ptr<BIO, decltype(&BIO_free)> kb(BIO_new_mem_buf(cred->key_pem.data(), -1), &BIO_free);
    std::unique_ptr<X509, decltype(&X509_free)> cert(PEM_read_bio_X509(cb.get(), nullptr, nullptr, nullptr),
                                                     &X509_free);
    std::unique_ptr<EVP_PKEY, decltype(&EVP_PKEY_free)> key(
        PEM_read_bio_PrivateKey(kb.get(), nullptr, nullptr, nullptr), &EVP_PKEY_free);
    if (!cert || !key || SSL_CTX_use_certificate(ctx.get(), cert.get()) != 1 ||
        SSL_CTX_use_PrivateKey(ctx.get(), key.get()) != 1)
      return "raw client setup: " + openssl_error_text();
  }
  std::unique_ptr<SSL, decltype(&SSL_free)> ssl(SSL_new(ctx.get()), &SSL_free);
  SSL_set_fd(ssl.get(), fd);
  ERR_clear_error();
  if (SSL_connect(ssl.get()) != 1) return "connect: " + openssl_error_text();
  char b = 0x5a;  // the server's ping
  if (SSL_write(ssl.get(), &b, 1) != 1) return "write: " + openssl_error_text();
  if (SSL_read(ssl.get(), &b, 1) != 1) return "read: " + openssl_error_text();
  return "";
}

std::pair<Outcome, std::string> try_raw_client(const ContextPtr& server, int max_version,
                                               const PemCredentials* cred) {
  auto sp = socket_pair();
  std::string client;
  Outcome s;
  std::thread t([&] {
    s = outcome_of([&] {
      TlsSession ss(server, TlsRole::kServer, "raw client");
      handshake_and_ping(sp.a.get(), ss);
    });
    sp.a.reset();  // the raw client's blocking read ends here if no alert reached it
  });
  std::thread raw([&] {
    // OpenSSL write()s to the socket without MSG_NOSIGNAL: a refusing server's close would raise
    // SIGPIPE. Blocked in this thread only, the write fails with EPIPE instead, and the signal
    // left pending dies with the thread.
    sigset_t pipe;
    sigemptyset(&pipe);
    sigaddset(&pipe, SIGPIPE);
    pthread_sigmask(SIG_BLOCK, &pipe, nullptr);
    client = raw_client(sp.b.get(), max_version, cred);
  });
  raw.join();
  t.join();
  return {s, client};
}

// Also records the text in the test's XML report (--gtest_output=xml): the messages users read.
#define EXPECT_HAS(text, part)                                                  \
  do {                                                                          \
    ::testing::Test::RecordProperty("error_" + std::to_string(__LINE__), text); \
    EXPECT_NE(std::string(text).find(part), std::string::npos) << (text);       \
  } while (0)

TEST(Tls, MutualHandshakeThenBytesBothWaysBitForBit) {
  Pki pki;
  auto server = context(pki.server, pki.ca, "rank-1.job-a");
  auto client = context(pki.client, pki.ca);
  auto sp = socket_pair();
  // 1 MiB and odd sizes around the 16 KiB record size, each both ways, on one session.
  const std::vector<size_t> sizes = {size_t{1} << 20, 1, 3, 16383, 16384, 16385, 65537, 1000003};
  std::vector<std::vector<uint8_t>> to_client, to_server, at_client(sizes.size()), at_server(sizes.size());
  for (size_t i = 0; i < sizes.size(); ++i) {
    to_client.push_back(random_bytes(sizes[i], static_cast<uint32_t>(2 * i)));
    to_server.push_back(random_bytes(sizes[i], static_cast<uint32_t>(2 * i + 1)));
  }
  std::string server_suite, client_suite, server_saw, client_saw;
  auto [s, c] = both(
      [&] {
        const Deadline dl = Deadline::after(kDeadlineS);
        TlsSession ss(server, TlsRole::kServer, "client end");
        net::tls_handshake(sp.a.get(), ss, dl);
        server_suite = ss.suite();
        server_saw = ss.peer_subject();
        for (size_t i = 0; i < sizes.size(); ++i)
          exchange(sp.a.get(), ss, to_client[i], sizes[i], at_server[i], dl, 4099);
      },
      [&] {
        const Deadline dl = Deadline::after(kDeadlineS);
        // The expected name per session, here an IP address subjectAltName.
        TlsSession cs(client, TlsRole::kClient, "server end", "127.0.0.1");
        net::tls_handshake(sp.b.get(), cs, dl);
        client_suite = cs.suite();
        client_saw = cs.peer_subject();
        for (size_t i = 0; i < sizes.size(); ++i)
          exchange(sp.b.get(), cs, to_server[i], sizes[i], at_client[i], dl, 16384 + 7);
      });
  ASSERT_TRUE(s.ok()) << s.error;
  ASSERT_TRUE(c.ok()) << c.error;
  EXPECT_EQ(server_suite, "TLS_AES_128_GCM_SHA256");
  EXPECT_EQ(client_suite, "TLS_AES_128_GCM_SHA256");
  EXPECT_HAS(server_saw, "CN=rank-1");
  EXPECT_HAS(client_saw, "CN=rank-0");
  for (size_t i = 0; i < sizes.size(); ++i) {
    EXPECT_TRUE(at_server[i] == to_server[i]) << "client -> server, " << sizes[i] << " bytes";
    EXPECT_TRUE(at_client[i] == to_client[i]) << "server -> client, " << sizes[i] << " bytes";
  }
}

TEST(Tls, EverySuiteOfThePolicyWorks) {
  Pki pki;
  for (const char* suite : {"TLS_AES_256_GCM_SHA384", "TLS_CHACHA20_POLY1305_SHA256"}) {
    net::TlsConfig c;
    c.cert_pem = pki.server.cert_pem;
    c.key_pem = pki.server.key_pem;
    c.ca_pem = pki.ca.cert_pem;
    c.suites = suite;
    auto server = std::make_shared<const TlsContext>(c);
    auto client = context(pki.client, pki.ca);
    auto sp = socket_pair();
    std::string got_suite;
    auto [s, cl] = both(
        [&] {
          TlsSession ss(server, TlsRole::kServer, "client");
          handshake_and_ping(sp.a.get(), ss);
          got_suite = ss.suite();
        },
        [&] {
          TlsSession cs(client, TlsRole::kClient, "server");
          handshake_and_ping(sp.b.get(), cs);
        });
    EXPECT_TRUE(s.ok()) << s.error;
    EXPECT_TRUE(cl.ok()) << cl.error;
    EXPECT_EQ(got_suite, suite);
  }
}

TEST(Tls, ConfigurationErrorsNameWhatIsWrong) {
  Pki pki;
  net::TlsConfig c;
  c.cert_pem = pki.server.cert_pem;
  c.key_pem = pki.client.key_pem;  // another certificate's key
  c.ca_pem = pki.ca.cert_pem;
  try {
    TlsContext ctx(c);
    ADD_FAILURE() << "a key of another certificate was accepted";
  } catch (const Error& e) {
    EXPECT_EQ(e.kind(), ErrorKind::kInvalidArgument);
    EXPECT_HAS(e.what(), "does not match the certificate");
  }
  c.key_pem = pki.server.key_pem;
  c.suites = "TLS_AES_128_CCM_8_SHA256";  // not an allowed suite
  try {
    TlsContext ctx(c);
    ADD_FAILURE() << "a suite outside the policy was accepted";
  } catch (const Error& e) {
    EXPECT_HAS(e.what(), "TLS_AES_128_CCM_8_SHA256");
  }
  c.suites = net::kTlsSuites;
  c.ca_pem = "not a certificate";
  EXPECT_THROW(TlsContext{c}, Error);
}

TEST(Tls, ClientWithoutCertificateRefused) {
  Pki pki;
  auto server = context(pki.server, pki.ca);
  auto [s, client] = try_raw_client(server, TLS1_3_VERSION, nullptr);
  EXPECT_FALSE(s.ok());
  EXPECT_EQ(s.kind, ErrorKind::kProtocol);
  EXPECT_HAS(s.error, "tls handshake with raw client: the peer presented no certificate");
  EXPECT_FALSE(client.empty());
  expect_accepts_good_peer(server, pki);
}

// The server refuses a client presenting `cert` (it trusts the right CA, so it gets as far as
// presenting it) with `why`; the client learns it on its first read; the server's context then
// accepts a good client.
void expect_refused(const Pki& pki, const PemCredentials& cert, const std::string& why) {
  auto server = context(pki.server, pki.ca, "rank-1.job-a");
  auto [s, c] = try_client(server, context(cert, pki.ca));
  EXPECT_EQ(s.kind, ErrorKind::kProtocol);
  EXPECT_HAS(s.error, "tls handshake with 127.0.0.1:41234 (rank 1): peer certificate refused: " + why);
  EXPECT_HAS(s.error, "its subject: /CN=rank-1");
  EXPECT_HAS(c.error, "with 127.0.0.1:29500 (rank 0): ");
  expect_accepts_good_peer(server, pki);
}

TEST(Tls, CertificateFromAnotherCaRefused) {
  Pki pki;
  expect_refused(pki,
                 net::issue_certificate(pki.other_ca, "rank-1", {"rank-1.job-a"}, hours_from_now(-1),
                                        hours_from_now(24)),
                 "unable to get local issuer certificate");
}

TEST(Tls, ExpiredCertificateRefused) {
  Pki pki;
  expect_refused(pki, pki.leaf("rank-1", {"rank-1.job-a"}, -48, -1), "certificate has expired");
}

TEST(Tls, NotYetValidCertificateRefused) {
  Pki pki;
  expect_refused(pki, pki.leaf("rank-1", {"rank-1.job-a"}, 24, 48), "certificate is not yet valid");
}

TEST(Tls, WrongPeerNameRefused) {
  Pki pki;
  // Same CA, another job's name: refused by name.
  expect_refused(pki, pki.leaf("rank-1", {"rank-1.job-b"}),
                 "hostname mismatch (expected the name 'rank-1.job-a')");
  // The client checks names too: a server expected under another name is refused there.
  auto [s, c] = try_client(context(pki.server, pki.ca), context(pki.client, pki.ca, "rank-7.job-a"));
  EXPECT_HAS(c.error, "peer certificate refused: hostname mismatch (expected the name 'rank-7.job-a')");
  EXPECT_FALSE(s.ok());
}

TEST(Tls, PlaintextClientRefusedAsNotTls) {
  Pki pki;
  auto server = context(pki.server, pki.ca);
  net::Hello hello;
  hello.rank = 1;
  const auto rumor_hello = net::encode_hello(hello);
  const std::string http = "GET / HTTP/1.1\r\nHost: x\r\n\r\n";
  for (const std::string& bytes : {std::string(rumor_hello.begin(), rumor_hello.end()), http}) {
    auto sp = socket_pair();
    const Deadline dl = Deadline::after(5);
    net::write_all(sp.b.get(), bytes.data(), bytes.size(), dl, "plaintext client");
    Outcome s = outcome_of([&] {
      TlsSession ss(server, TlsRole::kServer, "10.0.0.2:41234 (rank 3)");
      net::tls_handshake(sp.a.get(), ss, dl);
    });
    EXPECT_FALSE(dl.expired()) << "refused only at the deadline";
    EXPECT_EQ(s.kind, ErrorKind::kProtocol);
    EXPECT_HAS(s.error, "tls handshake with 10.0.0.2:41234 (rank 3): the peer did not speak TLS");
    EXPECT_HAS(s.error, bytes.substr(0, 5));
  }
  expect_accepts_good_peer(server, pki);
}

TEST(Tls, Tls12ClientRefused) {
  Pki pki;
  auto server = context(pki.server, pki.ca);
  auto [s, client] = try_raw_client(server, TLS1_2_VERSION, &pki.client);
  EXPECT_HAS(s.error, "the peer does not speak TLS 1.3");
  EXPECT_FALSE(client.empty());
  // The same raw client allowed TLS 1.3 gets through: the refusal was the version.
  auto [s13, client13] = try_raw_client(server, TLS1_3_VERSION, &pki.client);
  EXPECT_TRUE(s13.ok()) << s13.error;
  EXPECT_EQ(client13, "");
  expect_accepts_good_peer(server, pki);
}

TEST(Tls, StalledPeerFailsAtTheDeadline) {
  Pki pki;
  auto server = context(pki.server, pki.ca);
  auto client = context(pki.client, pki.ca);
  {
    auto sp = socket_pair();  // sp.b stays open and silent
    TlsSession ss(server, TlsRole::kServer, "silent client");
    try {
      net::tls_handshake(sp.a.get(), ss, Deadline::after(0.3));
      ADD_FAILURE() << "handshake with a silent peer returned";
    } catch (const Error& e) {
      EXPECT_EQ(e.kind(), ErrorKind::kTimeout);
      EXPECT_HAS(e.what(),
                 "tls handshake with silent client: deadline passed while waiting for the client's hello");
    }
  }
  {
    auto sp = socket_pair();  // the client's hello goes into sp.b, which nobody reads
    TlsSession cs(client, TlsRole::kClient, "silent server");
    try {
      net::tls_handshake(sp.a.get(), cs, Deadline::after(0.3));
      ADD_FAILURE() << "handshake with a silent peer returned";
    } catch (const Error& e) {
      EXPECT_EQ(e.kind(), ErrorKind::kTimeout);
      EXPECT_HAS(e.what(), "waiting for the server's hello");
    }
  }
}

// Forwards bytes between two sockets; in the client -> server direction it flips one bit in
// the `flip_at`-th record of type application data (22 = handshake, 23 = application data:
// TLS 1.3 also seals the client's late handshake messages into type 23, so it is counted past).
void relay(int client_side, int server_side, int flip_at, const Deadline& dl) {
  std::vector<uint8_t> upstream, buf(64 * 1024);
  int records = 0;
  pollfd p[2] = {{client_side, POLLIN, 0}, {server_side, POLLIN, 0}};
  while (!dl.expired()) {
    if (::poll(p, 2, dl.ms_left(100)) <= 0) continue;
    for (int i = 0; i < 2; ++i) {
      if (!(p[i].revents & (POLLIN | POLLHUP | POLLERR))) continue;
      const ssize_t n = ::recv(p[i].fd, buf.data(), buf.size(), 0);
      if (n == 0 || (n < 0 && errno != EAGAIN && errno != EINTR)) return;  // one side is gone
      if (n < 0) continue;
      if (i == 1) {
        net::write_all(client_side, buf.data(), static_cast<size_t>(n), dl, "relay");
        continue;
      }
      upstream.insert(upstream.end(), buf.begin(), buf.begin() + n);
      while (upstream.size() >= 5) {
        const size_t len = 5 + (size_t{upstream[3]} << 8 | upstream[4]);
        if (upstream.size() < len) break;
        if (upstream[0] == 23 && ++records == flip_at) upstream[5 + (len - 5) / 2] ^= 0x10;
        net::write_all(server_side, upstream.data(), len, dl, "relay");
        upstream.erase(upstream.begin(), upstream.begin() + static_cast<long>(len));
      }
    }
  }
}

TEST(Tls, FlippedByteIsAnIntegrityFailureAndNothingCorruptIsDelivered) {
  Pki pki;
  auto server = context(pki.server, pki.ca);
  auto client = context(pki.client, pki.ca);
  auto to_relay = socket_pair();    // client <-> relay
  auto from_relay = socket_pair();  // relay <-> server
  const std::vector<uint8_t> data = random_bytes(size_t{1} << 20, 99);
  std::vector<uint8_t> delivered;
  const Deadline dl = Deadline::after(kDeadlineS);
  // Each thread owns its sockets: one that ends closes them, so the others see it at once.
  std::thread r([&, near = std::move(to_relay.b), far = std::move(from_relay.a)] {
    try {
      relay(near.get(), far.get(), 20, dl);
    } catch (const Error&) {  // a side went away mid-write
    }
  });
  auto [s, c] = both(
      [&] {
        const net::Fd fd = std::move(from_relay.b);
        TlsSession ss(server, TlsRole::kServer, "10.0.0.2:41234 (rank 3)");
        net::tls_handshake(fd.get(), ss, dl);
        exchange(fd.get(), ss, {}, data.size(), delivered, dl);
      },
      [&] {
        const net::Fd fd = std::move(to_relay.a);
        TlsSession cs(client, TlsRole::kClient, "server");
        net::tls_handshake(fd.get(), cs, dl);
        std::vector<uint8_t> none;
        exchange(fd.get(), cs, data, 0, none, dl);
      });
  r.join();
  EXPECT_EQ(s.kind, ErrorKind::kProtocol);
  EXPECT_HAS(s.error, "tls read with 10.0.0.2:41234 (rank 3): integrity check failed");
  // Everything delivered is the input's prefix, and the flipped record (the 20th sealed one, so
  // at most 19 records of 16 KiB before it) never came out, nor anything after it.
  ASSERT_LT(delivered.size(), data.size());
  EXPECT_GT(delivered.size(), 0u);
  EXPECT_LE(delivered.size(), size_t{19} * 16384);
  EXPECT_TRUE(std::equal(delivered.begin(), delivered.end(), data.begin()))
      << "a corrupted byte was delivered";
  (void)c;  // the client may or may not have finished writing before the server gave up
}

TEST(Tls, PkiCertificatesCarryThePolicy) {
  Pki pki;
  std::unique_ptr<BIO, decltype(&BIO_free)> b(BIO_new_mem_buf(pki.server.cert_pem.data(), -1), &BIO_free);
  std::unique_ptr<X509, decltype(&X509_free)> x(PEM_read_bio_X509(b.get(), nullptr, nullptr, nullptr),
                                                &X509_free);
  ASSERT_TRUE(x);
  EXPECT_EQ(X509_get_version(x.get()), X509_VERSION_3);
  EXPECT_EQ(X509_check_ca(x.get()), 0);
  EXPECT_NE(X509_get_extended_key_usage(x.get()) & XKU_SSL_SERVER, 0u);
  EXPECT_NE(X509_get_extended_key_usage(x.get()) & XKU_SSL_CLIENT, 0u);
  EXPECT_EQ(X509_check_host(x.get(), "rank-0.job-a", 0, 0, nullptr), 1);
  EXPECT_EQ(X509_check_ip_asc(x.get(), "127.0.0.1", 0), 1);
  EXPECT_EQ(OBJ_obj2nid(X509_get0_tbs_sigalg(x.get())->algorithm), NID_ecdsa_with_SHA256);
  std::unique_ptr<BIO, decltype(&BIO_free)> cb(BIO_new_mem_buf(pki.ca.cert_pem.data(), -1), &BIO_free);
  std::unique_ptr<X509, decltype(&X509_free)> ca(PEM_read_bio_X509(cb.get(), nullptr, nullptr, nullptr),
                                                 &X509_free);
  ASSERT_TRUE(ca);
  EXPECT_EQ(X509_check_ca(ca.get()), 1);
  // Serial numbers are random: two leaves of one CA differ.
  std::unique_ptr<BIO, decltype(&BIO_free)> b2(BIO_new_mem_buf(pki.client.cert_pem.data(), -1), &BIO_free);
  std::unique_ptr<X509, decltype(&X509_free)> x2(PEM_read_bio_X509(b2.get(), nullptr, nullptr, nullptr),
                                                 &X509_free);
  ASSERT_TRUE(x2);
  EXPECT_NE(ASN1_INTEGER_cmp(X509_get0_serialNumber(x.get()), X509_get0_serialNumber(x2.get())), 0);
  EXPECT_THROW(net::issue_certificate(pki.ca, "x", {"a,DNS:evil"}, hours_from_now(-1), hours_from_now(1)),
               Error);
}

// The uncompressed public point of a certificate's key (04 || x || y).
std::vector<uint8_t> public_point(const std::string& cert_pem) {
  std::unique_ptr<BIO, decltype(&BIO_free)> b(BIO_new_mem_buf(cert_pem.data(), -1), &BIO_free);
  std::unique_ptr<X509, decltype(&X509_free)> x(PEM_read_bio_X509(b.get(), nullptr, nullptr, nullptr),
                                                &X509_free);
  if (!x) throw Error(ErrorKind::kInvalidArgument, "public_point: not a PEM certificate");
  unsigned char* raw = nullptr;
  const size_t n = EVP_PKEY_get1_encoded_public_key(X509_get0_pubkey(x.get()), &raw);
  std::vector<uint8_t> out(raw, raw + n);
  OPENSSL_free(raw);
  return out;
}

std::vector<uint8_t> from_hex(const std::string& hex) {
  std::vector<uint8_t> out;
  for (size_t i = 0; i + 1 < hex.size(); i += 2)
    out.push_back(static_cast<uint8_t>(std::stoul(hex.substr(i, 2), nullptr, 16)));
  return out;
}

// P-256's group order n (SEC 2) and its base point G, uncompressed.
const std::string kP256Order = "ffffffff00000000ffffffffffffffffbce6faada7179e84f3b9cac2fc632551";
const std::string kP256Generator =
    "04"
    "6b17d1f2e12c4247f8bce6e563a440f277037d812deb33a0f4a13945d898c296"
    "4fe342e2fe1a7f9b8ee7eb4a7c0f9e162bce33576b315ececbb6406837bf51f5";

TEST(Tls, CaFromAGivenScalarHasThatKey) {
  // d = 1: the public key is G itself, an answer known without OpenSSL.
  std::vector<uint8_t> one(32, 0);
  one[31] = 1;
  const PemCredentials ca = net::make_ca("rumor scalar one", hours_from_now(-1), hours_from_now(1), one);
  EXPECT_EQ(public_point(ca.cert_pem), from_hex(kP256Generator));
  // The key PEM holds the scalar: a leaf it signs verifies against the certificate.
  EXPECT_NO_THROW(net::issue_certificate(ca, "leaf", {}, hours_from_now(-1), hours_from_now(1)));
  std::vector<uint8_t> n = from_hex(kP256Order);
  std::vector<uint8_t> n_minus_1 = n;
  n_minus_1[31] -= 1;
  EXPECT_NO_THROW(net::make_ca("rumor n-1", hours_from_now(-1), hours_from_now(1), n_minus_1));
  for (const auto& bad : {std::vector<uint8_t>(32, 0), n, std::vector<uint8_t>(32, 0xff)}) {
    try {
      net::make_ca("rumor bad", hours_from_now(-1), hours_from_now(1), bad);
      ADD_FAILURE() << "a scalar outside [1, n-1] was taken";
    } catch (const Error& e) {
      EXPECT_EQ(e.kind(), ErrorKind::kInvalidArgument);
      EXPECT_HAS(std::string(e.what()), "not in [1, n-1] for P-256");
    }
  }
  try {
    net::make_ca("rumor short", hours_from_now(-1), hours_from_now(1), std::vector<uint8_t>(31, 1));
    ADD_FAILURE() << "a 31-byte scalar was taken";
  } catch (const Error& e) {
    EXPECT_HAS(std::string(e.what()), "a P-256 private scalar is 32 bytes, got 31");
  }
}

// Two hosts, each with its own CA certificate (own serial, own validity) made from one scalar:
// a leaf of either is trusted by the other. A CA of the same name from another scalar is not.
TEST(Tls, CasFromOneScalarTrustEachOthersLeaves) {
  const std::vector<uint8_t> scalar = random_bytes(32, 7);  // below n: its first byte is not 0xff
  ASSERT_LT(scalar[0], 0xff);
  const std::string name = "rumor job CA 0123";
  const PemCredentials ca_a = net::make_ca(name, hours_from_now(-1), hours_from_now(24), scalar);
  const PemCredentials ca_b = net::make_ca(name, hours_from_now(-2), hours_from_now(25), scalar);
  EXPECT_NE(ca_a.cert_pem, ca_b.cert_pem);
  EXPECT_EQ(public_point(ca_a.cert_pem), public_point(ca_b.cert_pem));
  const PemCredentials leaf_a =
      net::issue_certificate(ca_a, "host a", {}, hours_from_now(-1), hours_from_now(24));
  const PemCredentials leaf_b =
      net::issue_certificate(ca_b, "host b", {}, hours_from_now(-1), hours_from_now(24));
  auto [s, c] = try_client(context(leaf_a, ca_a), context(leaf_b, ca_b));
  EXPECT_TRUE(s.ok()) << s.error;
  EXPECT_TRUE(c.ok()) << c.error;

  std::vector<uint8_t> other = scalar;
  other[31] ^= 1;
  const PemCredentials ca_x = net::make_ca(name, hours_from_now(-1), hours_from_now(24), other);
  EXPECT_NE(public_point(ca_x.cert_pem), public_point(ca_a.cert_pem));
  const PemCredentials leaf_x =
      net::issue_certificate(ca_x, "host x", {}, hours_from_now(-1), hours_from_now(24));
  auto [s2, c2] = try_client(context(leaf_a, ca_a), context(leaf_x, ca_x));
  // The client checks the server's certificate first and refuses it; the server hears why.
  EXPECT_HAS(c2.error, "peer certificate refused: ");
  EXPECT_HAS(s2.error, "the peer refused this end: tlsv1 alert unknown ca");
}

}  // namespace
}  // namespace rumor
