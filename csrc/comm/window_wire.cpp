#include "comm/window_wire.h"

namespace rumor::window_wire {

const char* status_text(uint32_t s) {
  switch (s) {
    case kUnknownWindow:
      return "no such window there (freed, or never created on that rank)";
    case kSizeMismatch:
      return "the window there has another size";
    case kFailed:
      return "the target could not lock its slot before the deadline";
    case kNotHolder:
      return "this rank does not hold that mutex";
    default:
      return "unknown status";
  }
}

std::string check_frame(const WinFrame& f, uint32_t peer, std::optional<uint64_t> window_bytes,
                        uint64_t drain_limit, Payload* payload) {
  *payload = Payload::kNone;
  const std::string from = "window frame from rank " + std::to_string(peer);
  if (f.magic != kFrameMagic) return from + ": bad magic";
  if (f.sender != peer) return from + " claims to come from rank " + std::to_string(f.sender);
  if (f.with_p > 1) return from + ": with_p flag " + std::to_string(f.with_p);
  const std::string size_text = std::to_string(f.bytes) + " bytes";
  switch (f.kind) {
    case kPut:
    case kAccumulate:
    case kGetReply:
      if (f.kind == kGetReply && f.status != kOk) {
        if (f.bytes != 0) return from + ": a refusing get reply carries " + size_text;
        return {};
      }
      if (!window_bytes) {
        // A window freed here while the peer still wrote to it: answered "no such window". The
        // payload is drained, not stored, and can be no larger than a window this rank had.
        if (f.bytes > drain_limit)
          return from + ": payload of " + size_text + " for window #" + std::to_string(f.window) +
                 ", which does not exist here (no window here was ever larger than " +
                 std::to_string(drain_limit) + " bytes)";
        *payload = f.bytes > 0 ? Payload::kDrain : Payload::kNone;
        return {};
      }
      // The one size the payload may have: the window's registered size, which also keeps it a
      // whole number of elements. Anything else is refused before a byte is allocated.
      if (f.bytes != *window_bytes)
        return from + ": payload of " + size_text + " for window #" + std::to_string(f.window) + " of " +
               std::to_string(*window_bytes) + " bytes";
      *payload = f.bytes > 0 ? Payload::kRead : Payload::kNone;
      return {};
    case kGetRequest:
    case kAck:
    case kMutexAcquire:
    case kMutexRelease:
      if (f.bytes != 0) return from + ": a frame of kind " + std::to_string(f.kind) + " carries " + size_text;
      return {};
    default:
      return from + ": unknown kind " + std::to_string(f.kind);
  }
}

}  // namespace rumor::window_wire
