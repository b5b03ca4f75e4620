#include "net/stall.h"

#include <algorithm>
#include <cmath>

namespace rumor::net {

double stall_limit_s(size_t bytes_outstanding, double rate_Bps, double rtt_s, double floor_s,
                     double ceiling_s) {
  const double rate = rate_Bps > 0 && std::isfinite(rate_Bps) ? rate_Bps : kUnmeasuredRateBps;
  const double rtt = rtt_s > 0 && std::isfinite(rtt_s) ? rtt_s : 0.0;
  const double piece = static_cast<double>(std::min(bytes_outstanding, kStallPieceBytes));
  const double expected = kStallFactor * (rtt + piece / rate);
  return std::min(std::max(expected, floor_s), ceiling_s);
}

}  // namespace rumor::net
