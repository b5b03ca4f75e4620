// Test support for TLS (issue 46): a job's CA and another job's, rank certificates, contexts with
// TLS on, and a relay that alters one byte in flight. Shared by the channel, stream and window
// TLS tests.
#pragma once

#include <poll.h>
#include <sys/socket.h>

#include <chrono>
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

#include "net/socket.h"
#include "net/tls.h"
#include "ranks.h"

namespace rumor::testing {

inline net::CertTime hours_from_now(int h) {
  return std::chrono::system_clock::now() + std::chrono::hours(h);
}

struct Pki {
  net::PemCredentials ca = net::make_ca("rumor test job", hours_from_now(-1), hours_from_now(24));
  net::PemCredentials other_ca = net::make_ca("another job", hours_from_now(-1), hours_from_now(24));
  net::PemCredentials leaf(const net::PemCredentials& issuer, uint32_t rank) const {
    return net::issue_certificate(issuer, "rank-" + std::to_string(rank), {"job.rumor.test", "127.0.0.1"},
                                  hours_from_now(-1), hours_from_now(24));
  }
  // Rank `rank`'s configuration: its certificate from the job's CA (or from another CA, `foreign`).
  net::TlsConfig config(uint32_t rank, bool foreign = false) const {
    const auto me = leaf(foreign ? other_ca : ca, rank);
    net::TlsConfig cfg;
    cfg.cert_pem = me.cert_pem;
    cfg.key_pem = me.key_pem;
    cfg.ca_pem = ca.cert_pem;
    cfg.expected_peer_name = "job.rumor.test";
    return cfg;
  }
};

enum class Mode { kOff, kOn, kForeignCa };

inline Options tls_options(const Pki& pki, uint32_t rank, Mode mode, double timeout_s) {
  Options o = quick_options(false);
  o.timeout_s = timeout_s;
  o.deadline_floor_s = timeout_s;
  if (mode == Mode::kOff) return o;
  const net::TlsConfig cfg = pki.config(rank, mode == Mode::kForeignCa);
  o.tls_cert_pem = cfg.cert_pem;
  o.tls_key_pem = cfg.key_pem;
  o.tls_ca_pem = cfg.ca_pem;
  o.tls_peer_name = cfg.expected_peer_name;
  return o;
}

// modes[r]: rank r's TLS configuration. Every rank on its own host: all channels are TCP.
// `dial_addrs` (optional): the addresses rank r dials its peers at, per rank, in place of their
// listeners' (a relay's, say).
inline World tls_world(
    const Pki& pki, const std::vector<Mode>& modes, double timeout_s = 20,
    const std::function<std::vector<std::string>(uint32_t, std::vector<std::string>)>& dial_addrs = nullptr) {
  const uint32_t n = static_cast<uint32_t>(modes.size());
  const net::Token token = random_token();
  World w;
  std::vector<std::string> addrs;
  for (uint32_t r = 0; r < n; ++r) {
    w.ctx.push_back(std::make_shared<Context>(r, n, token, tls_options(pki, r, modes[r], timeout_s), 0));
    addrs.push_back("127.0.0.1:" + std::to_string(w.ctx.back()->port()));
  }
  for (uint32_t r = 0; r < n; ++r)
    w.ctx[r]->set_peers(dial_addrs ? dial_addrs(r, addrs) : addrs, hosts_of(n, 1));
  for (auto& c : w.ctx) c->seal();
  return w;
}

inline std::pair<net::Fd, net::Fd> socket_pair() {
  int fds[2];
  if (::socketpair(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0, fds) != 0) throw std::runtime_error("socketpair");
  return {net::Fd(fds[0]), net::Fd(fds[1])};
}

// Forwards a <-> b until either end closes or the deadline passes; the byte at offset
// `flip_at` of the a -> b direction (counted from the first byte) is XORed with 0x80.
inline void relay(int a, int b, size_t flip_at, const Deadline& deadline) {
  size_t forwarded = 0;
  std::vector<uint8_t> buf(64 * 1024);
  while (!deadline.expired()) {
    pollfd p[2] = {{a, POLLIN, 0}, {b, POLLIN, 0}};
    if (::poll(p, 2, 50) <= 0) continue;
    for (int i = 0; i < 2; ++i) {
      if (!(p[i].revents & (POLLIN | POLLHUP | POLLERR))) continue;
      ssize_t n = ::recv(p[i].fd, buf.data(), buf.size(), MSG_DONTWAIT);
      if (n <= 0) return;
      if (i == 0) {
        if (flip_at >= forwarded && flip_at < forwarded + static_cast<size_t>(n))
          buf[flip_at - forwarded] ^= 0x80;
        forwarded += static_cast<size_t>(n);
      }
      if (::send(i == 0 ? b : a, buf.data(), static_cast<size_t>(n), MSG_NOSIGNAL) != n) return;
    }
  }
}

}  // namespace rumor::testing
