#include "core/huge_pages.h"

#include <sys/mman.h>

#include <cerrno>
#include <utility>

#ifndef MADV_COLLAPSE
#define MADV_COLLAPSE 25  // Linux 6.1's value; older headers lack the name, older kernels say EINVAL
#endif

namespace rumor {

std::pair<uintptr_t, size_t> HugeBacking::interior(const void* p, size_t len) {
  const auto a = reinterpret_cast<uintptr_t>(p);
  const uintptr_t first = (a + kHugePage - 1) & ~(kHugePage - 1);
  const uintptr_t end = (a + len) & ~(kHugePage - 1);
  if (len < kHugePage || end <= first) return {first, 0};
  return {first, end - first};
}

bool HugeBacking::prepare(const void* p, size_t len) {
  if (!enabled_) return false;
  const auto [start, bytes] = interior(p, len);
  if (bytes == 0) return false;
  const auto a = reinterpret_cast<uintptr_t>(p);
  for (Range& r : recent_) {
    if (r.len == 0 || r.start != a || r.len != len) continue;
    if (r.refusals >= kMaxRefusals) return false;
    ++collapses_;
    // Only this buffer's own whole pages, and no peer touches them now (the caller has not yet
    // announced the buffer): the kernel copies them into huge pages with the same contents.
    if (::madvise(reinterpret_cast<void*>(start), bytes, MADV_COLLAPSE) != 0) {
      // EINVAL (no MADV_COLLAPSE, THP "never", not anonymous memory) will not change; EAGAIN or
      // ENOMEM (a page pinned, no huge page free now) might, once.
      r.refusals = errno == EAGAIN || errno == ENOMEM ? r.refusals + 1 : kMaxRefusals;
      ++refused_;
    }
    return true;
  }
  recent_[next_] = Range{a, len, 0};
  next_ = (next_ + 1) % kRecent;
  return false;
}

}  // namespace rumor
