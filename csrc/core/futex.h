// Cross-process wait/wake on a 32-bit word in shared memory (no FUTEX_PRIVATE_FLAG, so the
// kernel keys the wait on the physical page and processes mapping it can wake each other).
#pragma once

#include <linux/futex.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <atomic>
#include <cstdint>
#include <ctime>

namespace rumor {

inline void futex_wait(std::atomic<uint32_t>* word, uint32_t expected, int timeout_us) {
  timespec ts{timeout_us / 1000000, static_cast<long>(timeout_us % 1000000) * 1000};
  ::syscall(SYS_futex, reinterpret_cast<uint32_t*>(word), FUTEX_WAIT, expected, &ts, nullptr, 0);
}

inline void futex_wake_all(std::atomic<uint32_t>* word) {
  ::syscall(SYS_futex, reinterpret_cast<uint32_t*>(word), FUTEX_WAKE, INT32_MAX, nullptr, nullptr, 0);
}

}  // namespace rumor
