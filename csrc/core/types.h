// Element types, reduction ops and the error type shared by every layer.
#pragma once

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <stdexcept>
#include <string>
#include <string_view>

namespace rumor {

enum class DType : uint8_t { F32 = 0, F16 = 1, BF16 = 2, F64 = 3, I32 = 4, I64 = 5, U8 = 6, I8 = 7, I16 = 8 };
enum class ReduceOp : uint8_t { SUM = 0, AVG = 1, MIN = 2, MAX = 3, PROD = 4 };

constexpr int kNumDTypes = 9;

constexpr size_t dtype_size(DType t) {
  switch (t) {
    case DType::F32:
    case DType::I32:
      return 4;
    case DType::F16:
    case DType::BF16:
    case DType::I16:
      return 2;
    case DType::F64:
    case DType::I64:
      return 8;
    case DType::U8:
    case DType::I8:
      return 1;
  }
  return 0;
}

std::string_view dtype_name(DType t);
std::string_view op_name(ReduceOp op);

// Raised everywhere in the core; `kind` lets the Python layer map it onto a precise exception.
enum class ErrorKind : uint8_t {
  kInvalidArgument = 0,  // bad input from the caller (sizes, ranks, dtypes)
  kTimeout = 1,          // a deadline passed while waiting on a peer
  kPeerGone = 2,         // a peer closed its connection or its process exited
  kProtocol = 3,         // a peer sent something other than what this rank expected
  kAborted = 4,          // the communicator failed earlier and refuses new work
  kSystem = 5,           // an OS call failed
};

class Error : public std::runtime_error {
 public:
  Error(ErrorKind kind, const std::string& what) : std::runtime_error(what), kind_(kind) {}
  ErrorKind kind() const { return kind_; }

 private:
  ErrorKind kind_;
};

using Clock = std::chrono::steady_clock;

// A point in time after which a blocking wait gives up. Every wait in the core takes one.
class Deadline {
 public:
  explicit Deadline(Clock::time_point at) : at_(at) {}
  static Deadline after(double seconds) {
    return Deadline(Clock::now() +
                    std::chrono::duration_cast<Clock::duration>(std::chrono::duration<double>(seconds)));
  }
  // A wait that has no progress of its own to watch (a peer's shared memory appearing, a
  // connection being set up) must also end when its communicator is aborted, or a peer that
  // died mid-setup holds every other rank until the deadline. The flag must outlive the copy.
  Deadline cancelled_by(const std::atomic<bool>* flag) const {
    Deadline d = *this;
    d.cancel_ = flag;
    return d;
  }
  bool cancelled() const { return cancel_ != nullptr && cancel_->load(std::memory_order_relaxed); }
  // A condition-variable wait cannot see the flag: it waits in slices of this when there is one.
  Clock::time_point wake_by(std::chrono::milliseconds slice = std::chrono::milliseconds(20)) const {
    return cancel_ == nullptr ? at_ : std::min(at_, Clock::now() + slice);
  }
  bool expired() const { return cancelled() || Clock::now() >= at_; }
  // Milliseconds left, clamped to [0, cap_ms]; used as a poll() timeout.
  int ms_left(int cap_ms) const;
  Clock::time_point at() const { return at_; }

 private:
  Clock::time_point at_;
  const std::atomic<bool>* cancel_ = nullptr;
};

}  // namespace rumor
