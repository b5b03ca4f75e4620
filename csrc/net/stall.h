// How long a TCP wait may go without a byte moving before the peer is reported (issue 46).
//
// A fixed limit for a whole operation cannot serve every link: 300 s is minutes of waiting for a
// dead peer on a LAN, and too little for a 10-minute transfer across an ocean. The rule here
// bounds silence, not duration:
//   - An operation may last as long as bytes keep moving; the no-progress limit restarts at
//     every byte (Communicator::exchange).
//   - A receive whose peer has started sending the message (its frame header arrived) has a
//     short limit: stall_limit_s() below. The sender holds the whole message in memory once it
//     starts it (held sends start only when released) and needs nothing from anyone else to
//     finish it, so silence longer than a few expected inter-arrival gaps means its process or
//     its host stopped, not that it is busy.
//   - Every other wait (a message that has not started, a send the receiver does not drain)
//     keeps the ceiling, RUMOR_TIMEOUT, of silence: a peer that is late into a collective (a
//     checkpoint, uneven data loading, a straggler upstream in the ring) looks exactly like a
//     dead one from here, and must not be declared dead after seconds.
// RUMOR_ADAPTIVE_DEADLINE=0 restores the old rule (RUMOR_TIMEOUT from the start of the op).
#pragma once

#include <cstddef>

namespace rumor::net {

// What one receive waits for next: the smaller of what is left and this much (the reduce
// staging size: a healthy link delivers it well inside a few RTTs plus its transmission time).
constexpr size_t kStallPieceBytes = 256 * 1024;
// Multiple of the expected time of the next piece that a healthy link never stays silent for.
// Four covers TCP's own retransmission timer (srtt + 4 rttvar) on a steady link.
constexpr double kStallFactor = 4.0;
// Rate assumed for a link with no measured transfer yet (1 MB/s: a slow home uplink), so an
// unmeasured link is given more time, never less.
constexpr double kUnmeasuredRateBps = 1e6;

// Seconds a started receive may go without a byte moving:
//   clamp(kStallFactor * (rtt + min(bytes_outstanding, kStallPieceBytes) / rate), floor, ceiling)
// rate <= 0 means unmeasured (kUnmeasuredRateBps). Non-decreasing in bytes_outstanding and rtt,
// non-increasing in rate; never below floor_s unless the ceiling is lower (the ceiling wins).
double stall_limit_s(size_t bytes_outstanding, double rate_Bps, double rtt_s, double floor_s,
                     double ceiling_s);

}  // namespace rumor::net
