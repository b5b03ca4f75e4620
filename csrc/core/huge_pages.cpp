#include "core/huge_pages.h"

#include <sys/mman.h>
#include <time.h>

#include <cerrno>
#include <cstring>
#include <utility>

#include "core/log.h"

#ifndef MADV_COLLAPSE
#define MADV_COLLAPSE 25  // Linux 6.1's value; older headers lack the name, older kernels say EINVAL
#endif

namespace rumor {

HugeBacking::HugeBacking(bool enabled, Collapse collapse)
    : enabled_(enabled), collapse_(std::move(collapse)) {}

std::pair<uintptr_t, size_t> HugeBacking::interior(const void* p, size_t len) {
  const auto a = reinterpret_cast<uintptr_t>(p);
  const uintptr_t first = (a + kHugePage - 1) & ~(kHugePage - 1);
  const uintptr_t end = (a + len) & ~(kHugePage - 1);
  if (len < kHugePage || end <= first) return {first, 0};
  return {first, end - first};
}

namespace {
double thread_cpu_seconds() {
  timespec t{};
  ::clock_gettime(CLOCK_THREAD_CPUTIME_ID, &t);
  return static_cast<double>(t.tv_sec) + static_cast<double>(t.tv_nsec) * 1e-9;
}
}  // namespace

HugeBacking::Outcome HugeBacking::madvise_collapse(void* start, size_t bytes) {
  const double t0 = thread_cpu_seconds();
  const int rc = ::madvise(start, bytes, MADV_COLLAPSE);
  const int err = rc == 0 ? 0 : errno;
  return Outcome{err, thread_cpu_seconds() - t0};
}

bool HugeBacking::prepare(const void* p, size_t len) {
  if (!enabled_ || stopped_) return false;
  const auto [start, bytes] = interior(p, len);
  if (bytes == 0) return false;
  const auto a = reinterpret_cast<uintptr_t>(p);
  for (Range& r : recent_) {
    if (r.len == 0 || r.start != a || r.len != len) continue;
    if (r.refusals >= kMaxRefusals || (r.moves >= kMaxMoves && r.moves > r.noops)) return false;
    ++collapses_;
    // Only this buffer's own whole pages, and no peer touches them now (the caller has not yet
    // announced the buffer): the kernel copies them into huge pages with the same contents.
    const Outcome o = collapse_(reinterpret_cast<void*>(start), bytes);
    if (o.err != 0) {
      // EINVAL (no MADV_COLLAPSE, THP "never", not anonymous memory) will not change; EAGAIN or
      // ENOMEM (a page pinned, no huge page free now) might, once. So might EINVAL where the
      // kernel has collapsed before: the kernel also says it for 2 MiB that no byte of was
      // written yet, as a buffer allocated at a known place is before its first operation
      // (host_collectives.py's later cells, left on small pages for good when it counted).
      const bool may_change =
          o.err == EAGAIN || o.err == ENOMEM || (o.err == EINVAL && collapses_ - 1 > refused_);
      r.refusals = may_change ? r.refusals + 1 : kMaxRefusals;
      ++refused_;
      RUMOR_LOG(kDebug, "huge pages: " << bytes / kHugePage << " of a " << len << "-byte buffer refused ("
                                       << std::strerror(o.err) << ")"
                                       << (r.refusals >= kMaxRefusals ? ": not asked again" : ""));
      return false;
    }
    r.refusals = 0;
    const bool moved = o.seconds > kNoOpSecondsPerPage * static_cast<double>(bytes / kHugePage);
    if (moved && r.moves > 0) ++removes_;
    if (moved) {
      ++r.moves;
    } else {
      ++r.noops;
      ++noops_;
    }
    RUMOR_LOG(kDebug, "huge pages: " << bytes / kHugePage << " of a " << len << "-byte buffer, "
                                     << (moved ? "moved in " : "already huge, ") << o.seconds * 1e6
                                     << " us of CPU"
                                     << (r.moves >= kMaxMoves && r.moves > r.noops
                                             ? " (allocated afresh each time: left alone now)"
                                             : ""));
    if (removes_ >= kMaxRemoves && static_cast<long>(removes_) * kNoOpsPerRemove > noops_) {
      stopped_ = true;
      RUMOR_LOG(kInfo, "huge pages: "
                           << removes_ << " buffers came back on fresh pages after their collapse, against "
                           << noops_ << " found huge already (buffers allocated afresh for each operation): "
                           << "no more collapses");
    }
    return true;
  }
  recent_[next_] = Range{a, len, 0, 0, 0};
  next_ = (next_ + 1) % kRecent;
  return false;
}

}  // namespace rumor
