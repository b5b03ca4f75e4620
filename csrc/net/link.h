// Sizing a peer pair's TCP streams for its path. One stream carries at most its window per round
// trip, and the window is bounded by the socket buffers the system allows: on this kind of host
// (net.ipv4.tcp_wmem max 4 MiB) one stream tops out near 40 MB/s at a 100 ms round trip, a third
// of a 1 Gbit link. A pair on a long link therefore gets as many streams as the bandwidth-delay
// product needs, measured from the connection's own round trip.
#pragma once

#include <algorithm>
#include <array>
#include <cstddef>
#include <cstdint>
#include <mutex>
#include <optional>
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

// What one stream has sent since it opened, from TCP_INFO (zeros where the kernel reports less):
// payload bytes transmitted, and of those the ones sent in vain: sent, yet neither acknowledged
// nor in flight. That is retransmissions, and also transmissions the sender's own queue dropped,
// which TCP sends again without counting them as retransmissions (through the emulated WAN's tbf,
// 8 streams at 100 Mbit had about half of their transmissions dropped so and no retransmission
// counted). Then microseconds with data outstanding, and of those the ones limited by the peer's
// receive window or this end's send buffer rather than by the network.
struct SendCounters {
  uint64_t sent = 0;
  uint64_t resent = 0;
  uint64_t busy_us = 0;
  uint64_t window_limited_us = 0;
  SendCounters& operator+=(const SendCounters& o);
  SendCounters operator-(const SendCounters& o) const;
};
SendCounters send_counters(int fd);

// How many of a long link's streams a striped message should use (the stripe width), from what
// the streams did since the last decision. Sized from RUMOR_LINK_GBIT, a pair may open more
// streams than its path carries: at 100 Mbit and 100 ms, 8 streams retransmitted about half of
// what they sent (their congestion controls fight over a shallow bottleneck queue) and a 24 MiB
// allreduce took 0.49 of the ring bound, where 2-3 streams took 0.93. So: heavy retransmission
// (kNarrowResent of the bytes sent, far above what a link's own random loss costs) halves the
// width; streams that spent most of their busy time limited by their windows, with little
// retransmission, are what more streams are for, and get one more; otherwise it stays.
// ("Retransmission" here is SendCounters::resent: bytes sent in vain, whatever dropped them.) Decided
// only over at least kWidthSampleBytes sent, within [lo, hi]; returns `width` unchanged when the
// sample is smaller (the caller keeps accumulating).
constexpr double kNarrowResent = 0.03;
constexpr double kWidenResent = 0.01;
constexpr double kWidenWindowLimited = 0.5;
constexpr uint64_t kWidthSampleBytes = 8ull << 20;
size_t next_stripe_width(size_t width, size_t lo, size_t hi, const SendCounters& since);

// The stripe width of one long link's pair: next_stripe_width() within [lo, hi], and below lo
// (RUMOR_SOCKET_STREAMS, kept for a LAN's syscall rate) only on trial. lo streams may still be
// too many for a slow path: at 100 Mbit and 100 ms two streams still dropped each other's
// packets (mlp25m's three buckets took 13.7 s, 12.8 s on one stream, as gloo's one). But a
// stream on a lossy path is limited by its congestion window, not by a buffer, so once on one
// stream the rule that adds streams never fires: with one allowed, 1 Gbit, 50 ms and 0.1% loss
// fell from 96.5% to 84.6% of the ring bound. So where streams at lo still send much in vain,
// after kFloorSamples samples there, the width halves below lo, and stays there while its
// samples deliver on average at least kKeepNarrowRate of what the last samples at lo did (bytes
// acknowledged per second the busiest stream was busy; one sample's figure varied by +-15% at
// 100 Mbit, hence means, and one stream's means there came to 0.83-1.1 of two streams'); the
// first mean of two or more below that returns to lo for good. Where one stream is worse, it is
// much worse: a stream's rate under random loss falls with the root of the loss rate.
constexpr double kKeepNarrowRate = 0.75;
constexpr size_t kFloorSamples = 3;
class StripeWidth {
 public:
  StripeWidth(size_t lo, size_t hi);
  size_t width() const { return width_; }
  // Pins the width until the next decision (tests).
  void pin(size_t w);
  // Decides from a sample: the streams' counters summed since the last decision, and the most
  // busy time one stream spent in it (the time the sample took on the wire). Returns the width,
  // unchanged when the sample is below kWidthSampleBytes (the caller keeps accumulating).
  size_t next(const SendCounters& since, uint64_t busiest_us);
  // Continues what `learned` (the rule of another channel to the same peer, with the same lo)
  // decided: its width, within this rule's hi, its recent samples and whether a trial below lo
  // has failed. A rule with another lo learned on other terms and is ignored.
  void resume(const StripeWidth& learned);
  // Whether the width may still go below lo (false once a trial there was slower).
  bool may_narrow_below_floor() const { return below_ok_; }
  // The last sample's rate, and the recent mean at lo and below it (bytes/s), for the log.
  double last_rate() const { return last_rate_; }
  double floor_rate() const { return at_floor_.mean(); }
  double below_rate() const { return below_.mean(); }

 private:
  // The mean of the last four values added.
  struct RecentMean {
    std::array<double, 4> v{};
    size_t n = 0;
    void add(double x) { v[n++ % v.size()] = x; }
    size_t count() const { return std::min(n, v.size()); }
    double mean() const;
  };
  size_t lo_, hi_, width_;
  RecentMean at_floor_, below_;
  double last_rate_ = 0;
  bool below_ok_ = true;
};

// What the channels to one peer learned of the path to it, shared by the channels that every
// communicator of a process opens to that peer (comm::Context keeps one per peer). Each
// communicator has streams of its own, and each channel used to start with all of them: a new
// group's channel (DiLoCo averages on one of its own) sent its first 100 MiB at 100 Mbit and
// 100 ms on 8 streams that dropped each other's packets, while the world's channel to the same
// peer had already narrowed to one. A channel made later starts from the latest decision of any
// of them (StripeWidth::resume) and goes on deciding for itself: that first allreduce took
// 13.7-14.2 s with it and 14.4-15.0 s without (the second 12.8-13.3 s).
class PathMemory {
 public:
  // The latest stripe-width rule a channel to the peer decided with; none before the first.
  std::optional<StripeWidth> stripe_width() const;
  void remember(const StripeWidth& w);

 private:
  mutable std::mutex mu_;  // channels of different communicators decide on their own threads
  std::optional<StripeWidth> width_;
};

}  // namespace rumor::net
