// Cross-process wait/wake on a 32-bit word in shared memory (no FUTEX_PRIVATE_FLAG, so the
// kernel keys the wait on the physical page and processes mapping it can wake each other).
#pragma once

#include <linux/futex.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <cstdint>
#include <ctime>

#if defined(__x86_64__)
#include <immintrin.h>
#endif

namespace rumor {

inline void futex_wait(std::atomic<uint32_t>* word, uint32_t expected, int timeout_us) {
  timespec ts{timeout_us / 1000000, static_cast<long>(timeout_us % 1000000) * 1000};
  ::syscall(SYS_futex, reinterpret_cast<uint32_t*>(word), FUTEX_WAIT, expected, &ts, nullptr, 0);
}

inline void futex_wake_all(std::atomic<uint32_t>* word) {
  ::syscall(SYS_futex, reinterpret_cast<uint32_t*>(word), FUTEX_WAKE, INT32_MAX, nullptr, nullptr, 0);
}

// One beat of a spin before the futex sleep: lets a sibling hyperthread run meanwhile.
inline void cpu_relax() {
#if defined(__x86_64__)
  _mm_pause();
#endif
}

// How many sched_yield calls a waiter makes before its futex sleep, where it shares a core with
// the ranks it waits for (more ranks than cores). The rank that has yet to arrive is then likely
// the one runnable on this core, and a yield hands it the core without the futex round trip: no
// wake-up call by the last arrival, no sleeper to rouse (on a VM an interrupt between CPUs each).
// rumor-syncfloor, 4 processes on 2 cores: 17-23 us per synchronization sleeping at once, 5-10 us
// yielding first. A yield that comes back late found something else running there (a compute
// thread, another job), which it lets run a whole time slice past the last arrival, where a
// sleeper would have been woken at once: then this wait and the next kPausedWaits sleep at once.
class YieldBudget {
 public:
  static constexpr int kYieldsPerWait = 4;
  static constexpr std::chrono::microseconds kLateYield{200};
  static constexpr uint32_t kPausedWaits = 256;

  // The yields the wait starting now may make.
  int begin_wait() {
    if (paused_ == 0) return kYieldsPerWait;
    --paused_;
    return 0;
  }
  // After a yield that took `took`: whether this wait may yield again.
  bool after_yield(std::chrono::nanoseconds took) {
    if (took < kLateYield) return true;
    paused_ = kPausedWaits;
    return false;
  }

 private:
  uint32_t paused_ = 0;
};

}  // namespace rumor
