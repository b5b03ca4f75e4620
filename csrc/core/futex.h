// Cross-process wait/wake on a 32-bit word in shared memory (no FUTEX_PRIVATE_FLAG, so the
// kernel keys the wait on the physical page and processes mapping it can wake each other).
#pragma once

#include <linux/futex.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <atomic>
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

}  // namespace rumor
