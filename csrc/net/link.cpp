#include "net/link.h"

#include <linux/tcp.h>  // not netinet/tcp.h: glibc's tcp_info stops before tcpi_min_rtt
#include <netinet/in.h>
#include <sys/socket.h>

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <fstream>

namespace rumor::net {

namespace {

// The last number of a /proc/sys file (tcp_wmem holds "min default max"); 0 when unreadable.
size_t sysctl_last(const char* path) {
  std::ifstream f(path);
  size_t v = 0, last = 0;
  while (f >> v) last = v;
  return last;
}

}  // namespace

WindowLimits window_limits() {
  WindowLimits w;
  const size_t wauto = sysctl_last("/proc/sys/net/ipv4/tcp_wmem") / 2;
  const size_t wset = sysctl_last("/proc/sys/net/core/wmem_max");  // the kernel doubles it
  const size_t rauto = sysctl_last("/proc/sys/net/ipv4/tcp_rmem") / 2;
  const size_t rset = sysctl_last("/proc/sys/net/core/rmem_max");
  w.send_by_setsockopt = wset > wauto;
  w.send = std::max(wauto, wset);
  w.send_limit = w.send_by_setsockopt ? "net.core.wmem_max" : "net.ipv4.tcp_wmem";
  w.recv = std::max(rauto, rset);
  w.recv_limit = rset > rauto ? "net.core.rmem_max" : "net.ipv4.tcp_rmem";
  return w;
}

double measured_rtt_s(int fd) {
  tcp_info info{};
  socklen_t len = sizeof(info);
  if (::getsockopt(fd, IPPROTO_TCP, TCP_INFO, &info, &len) != 0) return 0;
  return std::max(info.tcpi_rtt, info.tcpi_rcv_rtt) * 1e-6;
}

double measured_min_rtt_s(int fd) {
  tcp_info info{};
  socklen_t len = sizeof(info);
  if (::getsockopt(fd, IPPROTO_TCP, TCP_INFO, &info, &len) != 0) return 0;
  // An older kernel fills less of the struct; ~0 is "no sample yet".
  if (len < offsetof(tcp_info, tcpi_min_rtt) + sizeof(info.tcpi_min_rtt) || info.tcpi_min_rtt == ~0u) return 0;
  return info.tcpi_min_rtt * 1e-6;
}

int streams_for_link(double rtt_s, double rate, size_t window, int min_streams, int max_streams) {
  const int lo = std::max(1, min_streams), hi = std::max(lo, max_streams);
  if (!(rtt_s > 0) || !(rate > 0) || window == 0) return lo;
  const double need = std::ceil(rate * rtt_s / static_cast<double>(window));
  if (need >= hi) return hi;
  return std::max(lo, static_cast<int>(need));
}

void set_long_link_buffers(int fd, const WindowLimits& limits) {
  if (!limits.send_by_setsockopt) return;
  // Asked in kernel units: the kernel doubles the value for its bookkeeping, half of which is
  // payload, so asking for `send` payload bytes means asking for `send`.
  int bytes = static_cast<int>(std::min<size_t>(limits.send, 1u << 30));
  ::setsockopt(fd, SOL_SOCKET, SO_SNDBUF, &bytes, sizeof(bytes));
}

}  // namespace rumor::net
