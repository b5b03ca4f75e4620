// The progress deadline rule (net/stall.h) as a pure function: bytes outstanding, the link's
// rate and RTT, the floor and the ceiling in; seconds of silence allowed out. Then TcpChannel
// applying it over a loopback connection whose sending end the test writes by hand.
#include <gtest/gtest.h>
#include <sys/socket.h>

#include <chrono>
#include <cstddef>
#include <stdexcept>
#include <string>
#include <thread>
#include <vector>

#include "loopback.h"
#include "net/socket.h"
#include "net/stall.h"
#include "net/tcp_channel.h"

using rumor::net::kStallFactor;
using rumor::net::kStallPieceBytes;
using rumor::net::kUnmeasuredRateBps;
using rumor::net::stall_limit_s;

namespace {
constexpr double kFloor = 2.0;
constexpr double kCeiling = 300.0;
const std::vector<size_t> kSizes = {0,
                                    1,
                                    1000,
                                    64 * 1024,
                                    kStallPieceBytes - 1,
                                    kStallPieceBytes,
                                    kStallPieceBytes + 1,
                                    64u << 20,
                                    size_t{1} << 40};
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
        EXPECT_LE(stall_limit_s(b, r, kRtts[i - 1], kFloor, kCeiling),
                  stall_limit_s(b, r, kRtts[i], kFloor, kCeiling));
  // A faster measured link never earns a longer wait (from the first measured rate on).
  for (size_t b : kSizes)
    for (double t : kRtts)
      for (size_t i = 3; i < kRates.size(); ++i)
        EXPECT_GE(stall_limit_s(b, kRates[i - 1], t, kFloor, kCeiling),
                  stall_limit_s(b, kRates[i], t, kFloor, kCeiling));
  // The floor and the ceiling move the result the way they move.
  EXPECT_LE(stall_limit_s(1 << 20, 1.25e6, 0.01, 1.0, kCeiling),
            stall_limit_s(1 << 20, 1.25e6, 0.01, 5.0, kCeiling));
  EXPECT_LE(stall_limit_s(1 << 20, 1e3, 1.0, kFloor, 60.0), stall_limit_s(1 << 20, 1e3, 1.0, kFloor, 600.0));
}

// ---- the rule applied by TcpChannel: a real loopback TCP connection, the sender played by hand ----

namespace {
using rumor::Clock;
using rumor::Error;
using rumor::ErrorKind;
using namespace rumor::net;

using Pair = rumor::testing::LoopbackPair;
using rumor::testing::loopback_pair;

OpInfo test_op(double floor_s, double timeout_s) {
  OpInfo op;
  op.name = "allreduce";
  op.comm = "world";
  op.opcode = 1;
  op.tag = 3;
  op.timeout_s = timeout_s;
  op.stall_floor_s = floor_s;
  return op;
}

// Sends the frame header of a `len`-byte message and its first `first` bytes, as a peer that
// then stops would.
void send_start(int fd, const OpInfo& op, size_t len, size_t first) {
  std::vector<std::byte> payload(len);
  Transfer s = make_send(0, payload.data(), len);
  Part p;
  p.len = len;
  FrameHeader h = make_header(p, s, op);
  write_all(fd, &h, sizeof(h), rumor::Deadline::after(10), "test header");
  if (first > 0) write_all(fd, payload.data(), first, rumor::Deadline::after(10), "test payload");
}

// Drives the receive until check_stall throws or `guard_s` passes; returns the error text, ""
// if none came.
std::string drive(TcpChannel& ch, Transfer& t, const OpInfo& op, double guard_s) {
  const auto end =
      Clock::now() + std::chrono::duration_cast<Clock::duration>(std::chrono::duration<double>(guard_s));
  while (Clock::now() < end) {
    ch.progress(t, op);
    try {
      ch.check_stall(t, op, Clock::now());
    } catch (const Error& e) {
      EXPECT_EQ(e.kind(), ErrorKind::kTimeout);
      return e.what();
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(5));
  }
  return {};
}
}  // namespace

TEST(StallChannel, PeerSilentMidMessageIsReportedWithTheRulesNumbers) {
  Pair s = loopback_pair();
  std::vector<Fd> streams;
  streams.push_back(std::move(s.ours));
  TcpChannel ch(std::move(streams), "rank 7", size_t{1} << 40);
  const OpInfo op = test_op(0.2, 30);
  constexpr size_t kLen = 1 << 20;
  std::vector<std::byte> buf(kLen);
  Transfer t = make_recv(0, buf.data(), kLen);
  ch.begin(t, op);
  send_start(s.theirs.get(), op, kLen, 1000);
  const std::string msg = drive(ch, t, op, 20);  // the guard is the ceiling's order, not a timing bound
  ASSERT_FALSE(msg.empty()) << "a receive silent mid-message was never reported";
  EXPECT_EQ(t.bytes_done(), 1000u);
  for (const char* part : {"allreduce (op #3, world)", "rank 7 stopped in the middle of a message",
                           "no byte for", "1048576 bytes (1000 done, 1047576 outstanding)", "link to rank 7",
                           "RTT", "floor 0.2 s", "ceiling 30 s"})
    EXPECT_NE(msg.find(part), std::string::npos) << part << " missing from: " << msg;
}

TEST(StallChannel, WaitsItDoesNotCoverAreLeftToTheCeiling) {
  Pair s = loopback_pair();
  std::vector<Fd> streams;
  streams.push_back(std::move(s.ours));
  TcpChannel ch(std::move(streams), "rank 7", size_t{1} << 40);
  constexpr size_t kLen = 1 << 20;
  std::vector<std::byte> buf(kLen);
  // A message the peer has not begun (it may be late into the op, not dead): never reported.
  const OpInfo op = test_op(0.05, 30);
  Transfer t = make_recv(0, buf.data(), kLen);
  ch.begin(t, op);
  EXPECT_EQ(drive(ch, t, op, 0.5), "");
  // The same peer, begun and silent, but with the rule off (RUMOR_ADAPTIVE_DEADLINE=0).
  const OpInfo fixed = test_op(0, 30);
  send_start(s.theirs.get(), op, kLen, 10);
  EXPECT_EQ(drive(ch, t, fixed, 0.5), "");
  EXPECT_EQ(t.bytes_done(), 10u);
  // A send the receiver does not drain: never reported by the rule either.
  std::vector<std::byte> big(64u << 20);
  Transfer snd = make_send(0, big.data(), big.size());
  ch.begin(snd, op);
  const auto end = Clock::now() + std::chrono::milliseconds(500);
  while (Clock::now() < end) {
    ch.progress(snd, op);
    EXPECT_NO_THROW(ch.check_stall(snd, op, Clock::now()));
    std::this_thread::sleep_for(std::chrono::milliseconds(5));
  }
  EXPECT_LT(snd.bytes_done(), big.size()) << "the send was meant to stall on a full socket";
}
