// The wire protocol of one-sided windows between hosts (WindowHub's TCP links): the frame every
// message starts with, and the checks on a frame a peer sent, as pure functions over bytes (no
// sockets, no hub state) so they can be fuzzed (tests/fuzz/fuzz_window.cpp).
#pragma once

#include <cstddef>
#include <cstdint>
#include <optional>
#include <string>

namespace rumor::window_wire {

constexpr uint32_t kFrameMagic = 0x4d524657;  // "WFRM"

enum FrameKind : uint8_t {
  kPut = 1,
  kAccumulate = 2,
  kGetRequest = 3,
  kGetReply = 4,
  kAck = 5,
  kMutexAcquire = 6,
  kMutexRelease = 7,
};

enum Status : uint32_t { kOk = 0, kUnknownWindow = 1, kSizeMismatch = 2, kFailed = 3, kNotHolder = 4 };

const char* status_text(uint32_t s);

// The frame every window message starts with on a TCP link.
struct WinFrame {
  uint32_t magic;
  uint8_t kind;
  uint8_t with_p;
  uint16_t reserved;
  uint32_t sender;
  uint32_t status;
  uint64_t window;
  uint64_t op_id;  // the requester's id, echoed in the reply
  uint64_t bytes;  // payload after the frame
  double weight;
  double p;
  uint64_t pad;
};
static_assert(sizeof(WinFrame) == 64);

// What to do with a frame's payload once its header passed check_frame().
enum class Payload {
  kNone,   // no payload
  kRead,   // read it into a buffer of exactly the window's registered size
  kDrain,  // read and discard in bounded pieces (a put to a window that does not exist here):
           // the frame is answered with an error status, nothing is allocated for it
};

// Checks a frame from `peer` before anything is allocated or looked up with its numbers:
// `window_bytes` is the registered size (count * element size) of the window the frame names on
// this rank, nullopt if there is no such window; `drain_limit` the largest window this rank ever
// had (a put to a freed window is at most that big, so more is never drained). Returns empty
// (and *payload) when the frame may be processed; else the protocol violation, after which the
// link is closed.
std::string check_frame(const WinFrame& f, uint32_t peer, std::optional<uint64_t> window_bytes,
                        uint64_t drain_limit, Payload* payload);

}  // namespace rumor::window_wire
