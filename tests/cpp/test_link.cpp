// Sizing a pair's TCP streams from its round trip (net/link.h).
#include <gtest/gtest.h>

#include <cmath>

#include "net/link.h"

namespace rumor::net {
namespace {

constexpr size_t MiB = 1024 * 1024;

TEST(LinkStreams, EnoughForTheBandwidthDelayProduct) {
  // 1 Gbit/s (125 MB/s) over 100 ms is 12.5 MB in flight: 3 windows of 4 MiB (12.58 MB) suffice.
  EXPECT_EQ(streams_for_link(0.1, 125e6, 4 * MiB, 1, 16), 3);
  // 10 Gbit/s over 100 ms needs 30 such windows: capped.
  EXPECT_EQ(streams_for_link(0.1, 1.25e9, 4 * MiB, 2, 16), 16);
  // A short link needs one window: the configured minimum stands.
  EXPECT_EQ(streams_for_link(0.0005, 1.25e9, 4 * MiB, 2, 16), 2);
  EXPECT_EQ(streams_for_link(0.02, 1.25e9, 4 * MiB, 2, 16), 6);  // 25 MB / 4.19 MB = 5.96
}

TEST(LinkStreams, MonotoneInRoundTripAndRateWithinTheBounds) {
  int last = 0;
  for (double rtt = 0.001; rtt < 0.5; rtt *= 1.3) {
    const int k = streams_for_link(rtt, 125e6, 2 * MiB, 2, 16);
    EXPECT_GE(k, last);
    EXPECT_GE(k, 2);
    EXPECT_LE(k, 16);
    EXPECT_GE(static_cast<double>(k) * 2 * MiB, std::min(125e6 * rtt, 16.0 * 2 * MiB)) << rtt;
    last = k;
  }
  last = 0;
  for (double rate = 1e6; rate < 1e11; rate *= 2) {
    const int k = streams_for_link(0.05, rate, 4 * MiB, 1, 16);
    EXPECT_GE(k, last);
    last = k;
  }
}

TEST(LinkStreams, UnknownMeasurementsKeepTheMinimum) {
  EXPECT_EQ(streams_for_link(0, 1.25e9, 4 * MiB, 2, 16), 2);
  EXPECT_EQ(streams_for_link(std::nan(""), 1.25e9, 4 * MiB, 2, 16), 2);
  EXPECT_EQ(streams_for_link(0.1, 1.25e9, 0, 3, 16), 3);
  EXPECT_EQ(streams_for_link(0.1, 1.25e9, 4 * MiB, 0, 0), 1);  // at least one stream
}

TEST(LinkStreams, WindowLimitsReadThisNamespace) {
  const WindowLimits w = window_limits();
  // Every Linux has these files; a window of zero would make every long link one stream short.
  EXPECT_GT(w.send, 0u);
  EXPECT_GT(w.recv, 0u);
  EXPECT_EQ(w.per_stream(), std::min(w.send, w.recv));
  EXPECT_FALSE(w.send_limit.empty());
  EXPECT_FALSE(w.recv_limit.empty());
}

// The stripe width rule: heavy retransmission halves it, window-limited streams with little
// retransmission add one, a link's own random loss changes nothing, and nothing is decided
// before a sample of kWidthSampleBytes.
SendCounters sample(uint64_t sent, double retrans, uint64_t busy_us, double limited) {
  return {sent, static_cast<uint64_t>(static_cast<double>(sent) * retrans), busy_us,
          static_cast<uint64_t>(static_cast<double>(busy_us) * limited)};
}

TEST(StripeWidth, HeavyRetransmissionHalvesDownToTheMinimum) {
  // 8 streams through a 100 Mbit, 100 ms link: about half of what was sent was sent again.
  const SendCounters fight = sample(64 * MiB, 0.45, 10'000'000, 0.03);
  EXPECT_EQ(next_stripe_width(8, 2, 8, fight), 4u);
  EXPECT_EQ(next_stripe_width(4, 2, 8, fight), 2u);
  EXPECT_EQ(next_stripe_width(2, 2, 8, fight), 2u);
  EXPECT_EQ(next_stripe_width(3, 2, 8, fight), 2u);
  // Even while the windows limit them: retransmission decides first.
  EXPECT_EQ(next_stripe_width(8, 2, 8, sample(64 * MiB, 0.2, 10'000'000, 0.9)), 4u);
}

TEST(StripeWidth, WindowLimitedStreamsGetOneMore) {
  const SendCounters windowed = sample(64 * MiB, 0.001, 10'000'000, 0.8);
  EXPECT_EQ(next_stripe_width(2, 2, 8, windowed), 3u);
  EXPECT_EQ(next_stripe_width(7, 2, 8, windowed), 8u);
  EXPECT_EQ(next_stripe_width(8, 2, 8, windowed), 8u);
  // Between the two thresholds of retransmission, neither: no oscillation on a lossy link.
  EXPECT_EQ(next_stripe_width(4, 2, 8, sample(64 * MiB, 0.02, 10'000'000, 0.8)), 4u);
}

TEST(StripeWidth, RandomLossAndANetworkLimitedLinkKeepTheWidth) {
  // 0.1% loss (the emulated WAN's): BBR retransmits about that much and keeps its rate.
  EXPECT_EQ(next_stripe_width(8, 2, 8, sample(64 * MiB, 0.001, 10'000'000, 0.1)), 8u);
  EXPECT_EQ(next_stripe_width(5, 2, 8, sample(64 * MiB, 0.0, 10'000'000, 0.0)), 5u);
  EXPECT_EQ(next_stripe_width(5, 2, 8, sample(64 * MiB, 0.0, 0, 0.0)), 5u);  // no busy time reported
}

TEST(StripeWidth, ASmallSampleDecidesNothingAndBoundsHold) {
  EXPECT_EQ(next_stripe_width(8, 2, 8, sample(kWidthSampleBytes - 1, 0.5, 1'000'000, 0.0)), 8u);
  EXPECT_EQ(next_stripe_width(2, 2, 8, sample(kWidthSampleBytes - 1, 0.0, 1'000'000, 1.0)), 2u);
  EXPECT_EQ(next_stripe_width(12, 2, 8, SendCounters{}), 8u);  // clamped into [lo, hi]
  EXPECT_EQ(next_stripe_width(1, 2, 8, SendCounters{}), 2u);
  EXPECT_EQ(next_stripe_width(4, 0, 8, sample(64 * MiB, 0.5, 1'000'000, 0.0)), 2u);
  EXPECT_EQ(next_stripe_width(1, 0, 8, sample(64 * MiB, 0.5, 1'000'000, 0.0)), 1u);  // never below one
}

// Busy microseconds of the busiest stream for a sample that took `s` seconds on the wire.
uint64_t busy_us_for(double s) { return static_cast<uint64_t>(s * 1e6); }

TEST(StripeWidth, BelowTheFloorOnlyWhileOneStreamDeliversAsMuch) {
  // 100 Mbit and 100 ms: 8 streams, then 4, then 2 fight over the shallow queue; the link
  // delivers about 12 MB/s whatever the width, so one stream is kept.
  StripeWidth w(2, 8);
  EXPECT_EQ(w.width(), 8u);
  const uint64_t busy = busy_us_for(64.0 * MiB / 12e6);
  const SendCounters fight = sample(96 * MiB, 0.33, 8 * busy, 0.03);  // 64 MiB delivered
  EXPECT_EQ(w.next(fight, busy), 4u);
  EXPECT_EQ(w.next(fight, busy), 2u);
  for (size_t i = 1; i < kFloorSamples; ++i) EXPECT_EQ(w.next(fight, busy), 2u);  // rates to compare with
  EXPECT_EQ(w.next(fight, busy), 1u);                                             // on trial
  const SendCounters alone = sample(64 * MiB, 0.02, busy + busy / 50, 0.0);       // 2% slower: kept
  for (int i = 0; i < 4; ++i) EXPECT_EQ(w.next(alone, busy + busy / 50), 1u);
  EXPECT_TRUE(w.may_narrow_below_floor());
  // Window-limited on one stream: back up by one, as above the floor.
  EXPECT_EQ(w.next(sample(64 * MiB, 0.0, busy, 0.8), busy), 2u);
}

TEST(StripeWidth, ASlowerTrialReturnsToTheFloorForGood) {
  // 1 Gbit, 100 ms, 0.1% loss: slow start's losses halve 8 streams down to 2 and below, but one
  // stream, limited by its congestion window, delivers far less: back to 2, and never below again.
  StripeWidth w(2, 8);
  const uint64_t busy = busy_us_for(64.0 * MiB / 100e6);
  const SendCounters start = sample(80 * MiB, 0.2, 8 * busy, 0.1);
  EXPECT_EQ(w.next(start, busy), 4u);
  EXPECT_EQ(w.next(start, busy), 2u);
  for (size_t i = 1; i < kFloorSamples; ++i) EXPECT_EQ(w.next(start, busy), 2u);
  EXPECT_EQ(w.next(start, busy), 1u);
  const SendCounters lossy = sample(64 * MiB, 0.001, 2 * busy, 0.05);  // half the rate
  EXPECT_EQ(w.next(lossy, 2 * busy), 1u);                              // one sample is not a mean
  EXPECT_EQ(w.next(lossy, 2 * busy), 2u);
  EXPECT_FALSE(w.may_narrow_below_floor());
  EXPECT_EQ(w.next(start, busy), 2u);  // heavy loss again: stays at the floor
  // And widens from there as before.
  EXPECT_EQ(w.next(sample(64 * MiB, 0.001, busy, 0.8), busy), 3u);
}

TEST(StripeWidth, AFloorOfOneAndSmallSamples) {
  StripeWidth one(1, 4);
  const uint64_t busy = busy_us_for(1.0);
  EXPECT_EQ(one.next(sample(64 * MiB, 0.5, busy, 0.0), busy), 2u);
  EXPECT_EQ(one.next(sample(64 * MiB, 0.5, busy, 0.0), busy), 1u);
  EXPECT_EQ(one.next(sample(64 * MiB, 0.5, busy, 0.0), busy), 1u);
  StripeWidth w(2, 8);
  w.pin(1);
  // Nothing is decided on a small sample, however slow; no busy time counts as no rate.
  EXPECT_EQ(w.next(sample(kWidthSampleBytes - 1, 0.0, busy, 0.0), busy), 1u);
  EXPECT_EQ(w.next(sample(64 * MiB, 0.0, 0, 0.0), 0), 1u);
  w.pin(12);
  EXPECT_EQ(w.width(), 8u);
}

TEST(StripeWidth, AChannelMadeLaterGoesOnFromWhatAnotherLearned) {
  // The world's channel to a peer narrowed to one stream on trial at 100 Mbit and 100 ms; a
  // channel of another communicator to the same peer starts there, with the floor's samples, so
  // a slower trial still sends it back to the floor after two samples of its own.
  StripeWidth world(2, 8);
  const uint64_t busy = busy_us_for(64.0 * MiB / 12e6);
  const SendCounters fight = sample(96 * MiB, 0.33, 8 * busy, 0.03);
  while (world.width() > 1) world.next(fight, busy);
  PathMemory path;
  EXPECT_FALSE(path.stripe_width().has_value());
  path.remember(world);
  ASSERT_TRUE(path.stripe_width().has_value());
  StripeWidth later(2, 8);
  EXPECT_EQ(later.width(), 8u);
  later.resume(*path.stripe_width());
  EXPECT_EQ(later.width(), 1u);
  EXPECT_TRUE(later.may_narrow_below_floor());
  EXPECT_DOUBLE_EQ(later.floor_rate(), world.floor_rate());
  const SendCounters slower = sample(64 * MiB, 0.001, 2 * busy, 0.05);
  EXPECT_EQ(later.next(slower, 2 * busy), 1u);
  EXPECT_EQ(later.next(slower, 2 * busy), 2u);
  EXPECT_FALSE(later.may_narrow_below_floor());
  // What it learned is its own: the world's rule is unchanged.
  EXPECT_EQ(world.width(), 1u);
  EXPECT_TRUE(world.may_narrow_below_floor());
}

TEST(StripeWidth, ResumeKeepsItsOwnBoundsAndIgnoresAnotherFloor) {
  StripeWidth wide(2, 8);  // never decided: all 8 streams
  StripeWidth fewer(2, 4);
  fewer.resume(wide);
  EXPECT_EQ(fewer.width(), 4u);  // within its own streams
  StripeWidth other_floor(1, 8);
  other_floor.pin(1);
  StripeWidth mine(2, 8);
  mine.resume(other_floor);  // learned with another RUMOR_SOCKET_STREAMS: not taken
  EXPECT_EQ(mine.width(), 8u);
}

TEST(StripeWidth, CountersOnlyGrow) {
  const SendCounters a{100, 10, 1000, 500}, b{150, 5, 2000, 600};
  const SendCounters d = b - a;
  EXPECT_EQ(d.sent, 50u);
  EXPECT_EQ(d.resent, 0u);  // a stream that reports less than before contributes nothing
  EXPECT_EQ(d.busy_us, 1000u);
  EXPECT_EQ(d.window_limited_us, 100u);
  SendCounters sum = a;
  sum += b;
  EXPECT_EQ(sum.sent, 250u);
  EXPECT_EQ(sum.window_limited_us, 1100u);
}

}  // namespace
}  // namespace rumor::net
