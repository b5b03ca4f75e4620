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

}  // namespace
}  // namespace rumor::net
