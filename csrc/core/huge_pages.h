// Backing a buffer that peers reach through process_vm_readv/writev with 2 MiB pages.
//
// Those calls pin the remote buffer a page at a time before they copy: with 4 KiB pages, a 64
// MiB allreduce among 4 ranks on this host spent 12 ms of each rank's 14 ms of CPU in the kernel
// and took 27.6 ms; with 2 MiB pages 4.5 of 8 ms, and 13.8 ms (benchmarks/host_collectives.py).
// torch backs its tensors with small pages unless THP_MEM_ALLOC_ENABLE is set, and the system
// setting here is "madvise", so the owner of a buffer asks the kernel to collapse it
// (MADV_COLLAPSE, Linux 6.1): once the buffer is seen a second time (DDP's buckets, a training
// loop's gradients), as a collapse costs more than a copy of the buffer (64 MiB: 19-136 ms
// here) and a buffer used once would not earn it back. Only whole 2 MiB pages inside the buffer are
// collapsed, so memory beside it (another tensor's) is never touched and no page is added; contents stay the
// same.
#pragma once

#include <array>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <utility>

namespace rumor {

class HugeBacking {
 public:
  static constexpr size_t kHugePage = size_t{2} << 20;
  // Remembered (start, length) pairs: more than a step's buckets that are large enough.
  static constexpr size_t kRecent = 16;
  static constexpr int kMaxRefusals = 2;
  // CPU time of a collapse (the calling thread's, kernel included) per 2 MiB page: one that found
  // the range huge already took 0.1-15 us here, one that moved pages 480-4400 us, 4 ranks on 2
  // cores. Above this per page, a call did move pages. Not wall time: a rank descheduled among
  // more ranks than cores took up to 80 us a page of wall time for a no-op (64 MiB: 1.7-2.4 ms),
  // which counted as a move, and two such left a buffer alone for good: the next one allocated
  // at its place stayed on small pages (host_collectives.py, 4 ranks: allgather of 64 MiB at
  // 0.64 of the memory bound in the first cell, 0.40-0.48 in the later ones).
  static constexpr double kNoOpSecondsPerPage = 100e-6;
  // A range whose pages had to be moved this many times, more often than they were found huge
  // already, is allocated afresh at the same place for (nearly) every operation (glibc maps and
  // unmaps blocks above its mmap threshold, 32 MiB at most, on every malloc and free: FSDP's
  // gathered parameters): collapsing it would cost more than it saves, so it is left alone.
  static constexpr int kMaxMoves = 2;
  // Collapsing stops altogether once kMaxRemoves ranges had their pages moved again and such
  // re-moves are more than 1 in kNoOpsPerRemove of the calls that found a range huge already (the
  // calls that paid off): FSDP's gathers and gradients come back at several places of one size,
  // each on fresh pages (4 ranks, mlp25m: 122 collapses in 12 steps, 20-190 ms each for 64 MiB,
  // and 8-10% slower steps), where DDP's buckets stay put, and a benchmark's or a job's occasional
  // fresh buffers are outnumbered by the ones used again and again.
  static constexpr int kMaxRemoves = 3;
  static constexpr int kNoOpsPerRemove = 4;

  // What a collapse call did: 0 or the errno it failed with, and the CPU time it took.
  struct Outcome {
    int err = 0;
    double seconds = 0;
  };
  using Collapse = std::function<Outcome(void* start, size_t bytes)>;

  // collapse: MADV_COLLAPSE, its CPU time measured (tests pass their own).
  explicit HugeBacking(bool enabled = true, Collapse collapse = madvise_collapse);

  // Before peers read or write [p, p + len): collapses its whole 2 MiB pages if the same range
  // was seen before, and again on every later sighting (the kernel returns at once where the
  // range is huge already), until its pages keep coming back fresh (kMaxMoves), or until buffers
  // that come back on fresh pages are common here (kMaxRemoves, kNoOpsPerRemove). Returns whether the
  // kernel says the range is on huge pages now (false where nothing was asked). Failures (an old
  // kernel, THP off, pinned pages, no huge page free, pages never written) only cost the speed:
  // a range the kernel refused kMaxRefusals times in a row is not asked about again (at once
  // where the kernel cannot: EINVAL before any collapse succeeded).
  bool prepare(const void* p, size_t len);

  // The 2 MiB pages wholly inside [p, p + len): their start and byte count (0: none).
  static std::pair<uintptr_t, size_t> interior(const void* p, size_t len);
  static Outcome madvise_collapse(void* start, size_t bytes);

  size_t collapses() const { return collapses_; }  // calls made, for tests
  size_t refused() const { return refused_; }      // calls the kernel refused

 private:
  struct Range {
    uintptr_t start = 0;
    size_t len = 0;
    int refusals = 0;
    int moves = 0;  // collapses that moved pages (took longer than a no-op)
    int noops = 0;  // collapses that found the pages huge already
  };
  bool enabled_;
  Collapse collapse_;
  std::array<Range, kRecent> recent_{};
  size_t next_ = 0;                     // where the next new range is remembered (the oldest is forgotten)
  size_t collapses_ = 0, refused_ = 0;  // every call but this one either was refused or succeeded
  int removes_ = 0;                     // collapses that moved the pages of a range collapsed before
  long noops_ = 0;                      // collapses that found the range huge already
  bool stopped_ = false;
};

}  // namespace rumor
