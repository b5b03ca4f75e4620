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
  if (len < offsetof(tcp_info, tcpi_min_rtt) + sizeof(info.tcpi_min_rtt) || info.tcpi_min_rtt == ~0u)
    return 0;
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

SendCounters& SendCounters::operator+=(const SendCounters& o) {
  sent += o.sent;
  resent += o.resent;
  busy_us += o.busy_us;
  window_limited_us += o.window_limited_us;
  return *this;
}

SendCounters SendCounters::operator-(const SendCounters& o) const {
  // Counters only grow; a stream that reports less than before (none) contributes nothing.
  auto d = [](uint64_t a, uint64_t b) { return a > b ? a - b : 0; };
  return {d(sent, o.sent), d(resent, o.resent), d(busy_us, o.busy_us),
          d(window_limited_us, o.window_limited_us)};
}

SendCounters send_counters(int fd) {
  tcp_info info{};
  socklen_t len = sizeof(info);
  if (::getsockopt(fd, IPPROTO_TCP, TCP_INFO, &info, &len) != 0) return {};
  // tcpi_busy_time .. tcpi_sndbuf_limited came with Linux 4.10, tcpi_bytes_sent with 4.19.
  if (len < offsetof(tcp_info, tcpi_bytes_sent) + sizeof(info.tcpi_bytes_sent)) return {};
  // In flight: the unacknowledged segments at their full size (the last may be shorter, so the
  // waste is if anything underestimated by less than a segment).
  const uint64_t in_flight = static_cast<uint64_t>(info.tcpi_unacked) * info.tcpi_snd_mss;
  const uint64_t arrived = info.tcpi_bytes_acked + in_flight;
  return {info.tcpi_bytes_sent, info.tcpi_bytes_sent > arrived ? info.tcpi_bytes_sent - arrived : 0,
          info.tcpi_busy_time, info.tcpi_rwnd_limited + info.tcpi_sndbuf_limited};
}

size_t next_stripe_width(size_t width, size_t lo, size_t hi, const SendCounters& since) {
  lo = std::max<size_t>(lo, 1);
  hi = std::max(hi, lo);
  width = std::clamp(width, lo, hi);
  if (since.sent < kWidthSampleBytes) return width;
  const double vain = static_cast<double>(since.resent) / static_cast<double>(since.sent);
  if (vain > kNarrowResent) return std::max(lo, width / 2);
  const double limited =
      since.busy_us > 0 ? static_cast<double>(since.window_limited_us) / static_cast<double>(since.busy_us)
                        : 0;
  if (vain <= kWidenResent && limited > kWidenWindowLimited) return std::min(hi, width + 1);
  return width;
}

StripeWidth::StripeWidth(size_t lo, size_t hi)
    : lo_(std::max<size_t>(lo, 1)), hi_(std::max(hi, lo_)), width_(hi_) {}

double StripeWidth::RecentMean::mean() const {
  double sum = 0;
  for (size_t i = 0; i < count(); ++i) sum += v[i];
  return count() > 0 ? sum / static_cast<double>(count()) : 0;
}

void StripeWidth::pin(size_t w) { width_ = std::clamp<size_t>(w, 1, hi_); }

void StripeWidth::resume(const StripeWidth& learned) {
  if (learned.lo_ != lo_) return;
  at_floor_ = learned.at_floor_;
  below_ = learned.below_;
  last_rate_ = learned.last_rate_;
  below_ok_ = learned.below_ok_;
  width_ = std::clamp<size_t>(learned.width_, 1, hi_);
}

size_t StripeWidth::next(const SendCounters& since, uint64_t busiest_us) {
  if (since.sent < kWidthSampleBytes) return width_;
  const double delivered = static_cast<double>(since.sent - std::min(since.resent, since.sent));
  last_rate_ = busiest_us > 0 ? delivered * 1e6 / static_cast<double>(busiest_us) : 0;
  if (width_ < lo_) {
    below_.add(last_rate_);
    if (below_.count() >= 2 && below_.mean() < kKeepNarrowRate * at_floor_.mean()) {
      below_ok_ = false;
      return width_ = lo_;
    }
    return width_ = next_stripe_width(width_, 1, lo_, since);
  }
  if (width_ == lo_) at_floor_.add(last_rate_);
  const size_t w = next_stripe_width(width_, lo_, hi_, since);
  const bool fight = static_cast<double>(since.resent) > kNarrowResent * static_cast<double>(since.sent);
  if (w == lo_ && width_ == lo_ && fight && below_ok_ && lo_ > 1 && at_floor_.count() >= kFloorSamples) {
    below_ = RecentMean{};
    return width_ = lo_ / 2;
  }
  return width_ = w;
}

std::optional<StripeWidth> PathMemory::stripe_width() const {
  std::lock_guard lk(mu_);
  return width_;
}

void PathMemory::remember(const StripeWidth& w) {
  std::lock_guard lk(mu_);
  width_ = w;
}

}  // namespace rumor::net
