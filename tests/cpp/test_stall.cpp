// The progress deadline rule (net/stall.h) as a pure function: bytes outstanding, the link's
// rate and RTT, the floor and the ceiling in; seconds of silence allowed out.
#include <gtest/gtest.h>

#include <cstddef>
#include <vector>

#include "net/stall.h"

using rumor::net::kStallFactor;
using rumor::net::kStallPieceBytes;
using rumor::net::kUnmeasuredRateBps;
using rumor::net::stall_limit_s;

namespace {
constexpr double kFloor = 2.0;
constexpr double kCeiling = 300.0;
const std::vector<size_t> kSizes = {0, 1, 1000, 64 * 1024, kStallPieceBytes - 1, kStallPieceBytes,
                                    kStallPieceBytes + 1, 64u << 20, size_t{1} << 40};
const std::vector<double> kRates = {-1, 0, 1e3, 1.25e5, 1.25e6, 1.25e8, 1.25e9, 1e12};  // <= 0: unmeasured
const std::vector<double> kRtts = {0, 1e-4, 0.005, 0.1, 0.3, 2.0, 30.0, 1e4};
}  // namespace

TEST(StallRule, ExactFormulaInsideTheBounds) {
  // 1 Mbit/s link, 100 ms RTT, a 1 MiB message left: the next piece is kStallPieceBytes.
  const double expected = kStallFactor * (0.1 + static_cast<double>(kStallPieceBytes) / 1.25e5);
  EXPECT_DOUBLE_EQ(stall_limit_s(1 << 20, 1.25e5, 0.1, kFloor, kCeiling), expected);
  // Less than a piece left: only what is left counts.
  EXPECT_DOUBLE_EQ(stall_limit_s(1000, 1e3, 0.0, 0.5, kCeiling), kStallFactor * 1.0);
  // Unmeasured rate: the conservative default, never a division by zero.
  EXPECT_DOUBLE_EQ(stall_limit_s(kStallPieceBytes, 0, 0, 0.0, kCeiling),
                   kStallFactor * static_cast<double>(kStallPieceBytes) / kUnmeasuredRateBps);
  EXPECT_DOUBLE_EQ(stall_limit_s(kStallPieceBytes, -5, 0, 0.0, kCeiling),
                   stall_limit_s(kStallPieceBytes, 0, 0, 0.0, kCeiling));
}

TEST(StallRule, FloorOnAFastLinkCeilingOnADeadSlowOne) {
  // A LAN (10 Gbit, 50 us): the floor, so a stopped peer is reported after it.
  EXPECT_DOUBLE_EQ(stall_limit_s(64u << 20, 1.25e9, 50e-6, kFloor, kCeiling), kFloor);
  // 1 kB/s with a 30 s RTT wants far more than the ceiling: the ceiling wins.
  EXPECT_DOUBLE_EQ(stall_limit_s(64u << 20, 1e3, 30.0, kFloor, kCeiling), kCeiling);
  // A ceiling below the floor (RUMOR_TIMEOUT set below RUMOR_DEADLINE_FLOOR) still bounds it.
  EXPECT_DOUBLE_EQ(stall_limit_s(64u << 20, 1.25e9, 50e-6, 10.0, 3.0), 3.0);
}

TEST(StallRule, BoundsHoldEverywhere) {
  for (size_t b : kSizes)
    for (double r : kRates)
      for (double t : kRtts) {
        const double x = stall_limit_s(b, r, t, kFloor, kCeiling);
        EXPECT_GE(x, kFloor) << b << " " << r << " " << t;
        EXPECT_LE(x, kCeiling) << b << " " << r << " " << t;
      }
}

TEST(StallRule, MonotoneInBytesRttAndRate) {
  for (double r : kRates)
    for (double t : kRtts)
      for (size_t i = 1; i < kSizes.size(); ++i)
        EXPECT_LE(stall_limit_s(kSizes[i - 1], r, t, kFloor, kCeiling),
                  stall_limit_s(kSizes[i], r, t, kFloor, kCeiling))
            << "bytes " << kSizes[i - 1] << " -> " << kSizes[i] << " at " << r << " B/s, " << t << " s";
  for (size_t b : kSizes)
    for (double r : kRates)
      for (size_t i = 1; i < kRtts.size(); ++i)
        EXPECT_LE(stall_limit_s(b, r, kRtts[i - 1], kFloor, kCeiling), stall_limit_s(b, r, kRtts[i], kFloor, kCeiling));
  // A faster measured link never earns a longer wait (from the first measured rate on).
  for (size_t b : kSizes)
    for (double t : kRtts)
      for (size_t i = 3; i < kRates.size(); ++i)
        EXPECT_GE(stall_limit_s(b, kRates[i - 1], t, kFloor, kCeiling), stall_limit_s(b, kRates[i], t, kFloor, kCeiling));
  // The floor and the ceiling move the result the way they move.
  EXPECT_LE(stall_limit_s(1 << 20, 1.25e6, 0.01, 1.0, kCeiling), stall_limit_s(1 << 20, 1.25e6, 0.01, 5.0, kCeiling));
  EXPECT_LE(stall_limit_s(1 << 20, 1e3, 1.0, kFloor, 60.0), stall_limit_s(1 << 20, 1e3, 1.0, kFloor, 600.0));
}
