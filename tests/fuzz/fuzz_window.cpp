// sources: csrc/comm/window_wire.cpp
// Window link frames (comm/window_wire.h) as a hostile peer could send them: a byte stream cut
// into 64-byte frames, each checked as the hub's progress thread checks it before allocating.
// Invariants: an accepted frame's payload is never larger than the window's registered size, and
// only drained (never stored) when no window matches; refusals name the peer.
#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <optional>
#include <string>

#include "comm/window_wire.h"

using namespace rumor::window_wire;

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  if (size < 9) return 0;
  // The first bytes choose the receiver's view: the peer's rank and the window size (or none).
  uint32_t peer = data[0];
  uint64_t win_bytes = 0;
  std::memcpy(&win_bytes, data + 1, 8);
  win_bytes &= (uint64_t{1} << 32) - 1;
  const bool have_window = (data[1] & 1) != 0;
  data += 9;
  size -= 9;
  while (size >= sizeof(WinFrame)) {
    WinFrame f;
    std::memcpy(&f, data, sizeof(f));
    data += sizeof(f);
    size -= sizeof(f);
    Payload p = Payload::kNone;
    std::optional<uint64_t> wb = have_window ? std::optional<uint64_t>(win_bytes) : std::nullopt;
    const uint64_t drain_limit = win_bytes ^ (static_cast<uint64_t>(data[-1]) << 20);
    std::string bad = check_frame(f, peer, wb, drain_limit, &p);
    if (!bad.empty()) {
      if (bad.find("rank " + std::to_string(peer)) == std::string::npos) std::abort();
      break;  // the hub closes the link
    }
    if (p == Payload::kRead && (!wb || f.bytes != *wb || f.bytes == 0)) std::abort();
    if (p == Payload::kDrain && (wb || f.bytes > drain_limit)) std::abort();
    if (p == Payload::kNone && f.bytes != 0) std::abort();
    if (f.magic != kFrameMagic || f.sender != peer) std::abort();
    (void)status_text(f.status);
    // The payload follows the frame on the wire: skip what the fuzzer provided of it.
    size_t skip = static_cast<size_t>(std::min<uint64_t>(f.bytes, size));
    data += skip;
    size -= skip;
  }
  return 0;
}
