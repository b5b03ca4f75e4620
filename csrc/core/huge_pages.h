// Backing a buffer that peers reach through process_vm_readv/writev with 2 MiB pages.
//
// Those calls pin the remote buffer a page at a time before they copy: with 4 KiB pages, a 64
// MiB allreduce among 4 ranks on this host spent 12 ms of each rank's 14 ms of CPU in the kernel
// and took 27.6 ms; with 2 MiB pages 4.5 of 8 ms, and 13.8 ms (benchmarks/host_collectives.py).
// torch backs its tensors with small pages unless THP_MEM_ALLOC_ENABLE is set, and the system
// setting here is "madvise", so the owner of a buffer asks the kernel to collapse it
// (MADV_COLLAPSE, Linux 6.1): once the buffer is seen a second time (DDP's buckets, a training
// loop's gradients), as a collapse costs about one copy of the buffer and a buffer used once
// would not earn it back. Only whole 2 MiB pages inside the buffer are collapsed, so memory
// beside it (another tensor's) is never touched and no page is added; contents stay the same.
#pragma once

#include <array>
#include <cstddef>
#include <cstdint>
#include <utility>

namespace rumor {

class HugeBacking {
 public:
  static constexpr size_t kHugePage = size_t{2} << 20;
  // Remembered (start, length) pairs: more than a step's buckets that are large enough.
  static constexpr size_t kRecent = 16;
  static constexpr int kMaxRefusals = 2;

  explicit HugeBacking(bool enabled = true) : enabled_(enabled) {}

  // Before peers read or write [p, p + len): collapses its whole 2 MiB pages if the same range
  // was seen before (and again on every later sighting: the kernel returns at once where the
  // range is huge already, and a buffer freed and allocated again at the same place is not).
  // Returns whether a collapse was asked for. Failures (an old kernel, THP off, pinned pages, no
  // huge page free) only cost the speed: a range the kernel refused kMaxRefusals times is not
  // asked about again.
  bool prepare(const void* p, size_t len);

  // The 2 MiB pages wholly inside [p, p + len): their start and byte count (0: none).
  static std::pair<uintptr_t, size_t> interior(const void* p, size_t len);

  size_t collapses() const { return collapses_; }  // calls made, for tests
  size_t refused() const { return refused_; }      // calls the kernel refused

 private:
  struct Range {
    uintptr_t start = 0;
    size_t len = 0;
    int refusals = 0;
  };
  bool enabled_;
  std::array<Range, kRecent> recent_{};
  size_t next_ = 0;  // where the next new range is remembered (the oldest is forgotten)
  size_t collapses_ = 0, refused_ = 0;
};

}  // namespace rumor
