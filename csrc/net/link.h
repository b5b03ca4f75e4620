// Sizing a peer pair's TCP streams for its path. One stream carries at most its window per round
// trip, and the window is bounded by the socket buffers the system allows: on this kind of host
// (net.ipv4.tcp_wmem max 4 MiB) one stream tops out near 40 MB/s at a 100 ms round trip, a third
// of a 1 Gbit link. A pair on a long link therefore gets as many streams as the bandwidth-delay
// product needs, measured from the connection's own round trip.
#pragma once

#include <cstddef>
#include <string>

namespace rumor::net {

// What the system lets one stream keep in flight, in payload bytes (socket buffers also count
// the kernel's per-packet overhead: about half of a buffer is payload).
struct WindowLimits {
  size_t send = 0;  // the larger of autotuning's maximum and what SO_SNDBUF may ask for
  size_t recv = 0;
  bool send_by_setsockopt = false;  // SO_SNDBUF allows more than autotuning reaches
  std::string send_limit;           // the sysctl that bounds `send`, for the log
  std::string recv_limit;
  size_t per_stream() const { return send < recv ? send : recv; }
};

// Reads net.ipv4.tcp_{w,r}mem and net.core.{w,r}mem_max of this network namespace.
WindowLimits window_limits();

// The connected socket's smoothed round trip as the kernel measured it (TCP_INFO: the larger of
// the sender's and the receiver's estimates), in seconds; 0 when unknown.
double measured_rtt_s(int fd);
// The smallest round trip the kernel has sampled on the socket (TCP_INFO's tcpi_min_rtt: the
// handshake's first, free of queues and of the peer's scheduling), in seconds; 0 when unknown.
double measured_min_rtt_s(int fd);

// Streams that keep `rate` bytes/s in flight over a round trip of `rtt_s` with `window` payload
// bytes per stream: ceil(rate * rtt / window), within [min_streams, max_streams].
int streams_for_link(double rtt_s, double rate, size_t window, int min_streams, int max_streams);

// Round trips above this are long links: their streams get the largest send buffer allowed
// (set_long_link_buffers) and more streams than the configured minimum where needed.
constexpr double kLongLinkRtt = 0.002;

// On a long link, asks for the largest send buffer SO_SNDBUF allows when that exceeds what
// autotuning would reach (the receive side keeps autotuning, whose maximum is usually larger).
void set_long_link_buffers(int fd, const WindowLimits& limits);

}  // namespace rumor::net
