// Collectives among the ranks of one host that read and write each other's buffers in place
// (process_vm_readv/writev: the kernel copies straight between the two processes), instead of
// staging every byte through the shared-memory rings.
//
// Work follows the cores, not the ranks: the buffer is cut into chunks, and whichever rank is
// running takes the next chunk from a counter in shared memory, reads that chunk from every
// rank, reduces it in its cache and writes the result into every rank's buffer. A rank that is
// descheduled (more ranks than free cores) holds up at most the one chunk it took; the others
// finish the rest. The counters double as the closing barrier: a rank returns once every chunk
// is done, so no peer still reads or writes its buffer afterwards.
//
// Bytes moved by an allreduce of S bytes over P ranks: every input read once and every output
// written once (2 P S, the bound), plus the chunk staging in the taker's cache. The kernel pins
// the peer's pages for every copy, which on 4 KiB pages cost more than the bytes: each rank
// backs a buffer it passes again with 2 MiB pages first (core/huge_pages.h).
#pragma once

#include <sys/types.h>

#include <array>
#include <cstddef>
#include <cstdint>
#include <span>
#include <vector>

#include "core/futex.h"
#include "core/huge_pages.h"
#include "net/channel.h"
#include "net/shm.h"
#include "net/socket.h"

namespace rumor {

class Communicator;

// The peers' processes on this host, named by pidfd: a pidfd keeps naming the process it was
// opened for, where a pid number could come to name another process once the dead peer is
// reaped.
class PeerProcesses {
 public:
  // Opens a pidfd for every pid but `self`'s (each must be alive now: call while the peers are
  // known to be inside an operation). False, with nothing kept, where the kernel refuses.
  bool open(const std::vector<int32_t>& pids, uint32_t self);
  bool empty() const { return pids_.empty(); }
  const std::vector<int32_t>& pids() const { return pids_; }
  // Throws kPeerGone naming the first peer that has exited, zombie or reaped.
  void check_alive(const Communicator& comm, const net::OpInfo& info, const char* when) const;

 private:
  std::vector<net::Fd> fds_;  // invalid for this rank
  std::vector<int32_t> pids_;
};

// Small collectives among the ranks of one host with one wait: every rank copies its
// contribution into its slot of a shared segment and counts itself in on a shared counter; the
// last to arrive wakes the sleepers (one futex wake-up per operation), and every rank then reads
// what it needs from the slots into its own buffers. Two sets of slots alternate between
// operations, and the counter needs no reset: a rank enters operation k+2 (rewriting the set of
// k) only after every rank arrived at k+1, so after every rank finished reading k. Each rank also
// writes what it was asked to do (collective, sizes, dtype, op, root) beside its contribution,
// so ranks that disagree are all refused, with the same list, before any buffer is touched.
//
// What goes into a slot, and so each collective's limit (the fits() functions):
//   allreduce       the whole buffer                 -> buffer <= kMaxBytes
//   reduce_scatter  the whole input (every rank's    -> input (the sum of the blocks) <= kMaxBytes
//                   block of it is read by its owner)
//   allgather       this rank's own block only       -> every block <= kMaxBytes (the gathered
//                                                       output may be up to P times that)
class HostSmall {
 public:
  explicit HostSmall(Communicator& comm) : comm_(comm) {}
  HostSmall(const HostSmall&) = delete;
  HostSmall& operator=(const HostSmall&) = delete;

  // Every rank's result is reduced from the slots in rank order: the same bits on every rank.
  void allreduce(std::byte* buf, size_t count, DType dtype, ReduceOp op, const net::OpInfo& info);
  // `in` holds size() blocks of counts[q] elements; `out` (which may be `in`) gets this rank's.
  void reduce_scatter(const std::byte* in, std::byte* out, std::span<const size_t> counts, DType dtype,
                      ReduceOp op, const net::OpInfo& info);
  // In place: buf holds size() blocks of counts[q] elements, this rank's filled in.
  void allgather(std::byte* buf, std::span<const size_t> counts, DType dtype, const net::OpInfo& info);

  static bool fits(size_t bytes) { return bytes <= kMaxBytes; }  // allreduce, reduce
  static bool fits_reduce_scatter(std::span<const size_t> counts, DType dtype);
  static bool fits_allgather(std::span<const size_t> counts, DType dtype);

  static constexpr size_t kMaxBytes = 64 * 1024;  // one slot's data
  static constexpr uint32_t kMaxRanks = 64;

 private:
  struct Header;
  struct Shape;
  struct Slot;
  void setup(const net::OpInfo& info);
  Slot& slot(uint64_t set, uint32_t rank) const;
  // Copies `bytes` of `data` into this rank's slot beside `shape`, waits until every rank has
  // arrived and checks that all asked for the same; returns the set of slots to read.
  uint64_t arrive(const std::byte* data, size_t bytes, const Shape& shape, const net::OpInfo& info);

  Communicator& comm_;
  net::ShmSegment seg_;
  Header* hdr_ = nullptr;
  // How long a rank bound to a core no late rank needs spins before it sleeps (arrive()).
  static constexpr int kBoundSpinUs = 200;
  uint64_t ops_ = 0;
  YieldBudget yields_;         // with cores shared, yields before a sleep (core/futex.h)
  std::vector<int32_t> cpus_;  // each rank's one CPU, -1 where a rank may run on several
  int my_cpu_ = -1;
  PeerProcesses peers_;
};

// Two ranks of one host, allreduce of 1 to 16 MiB: the rings stage every byte in cache and win
// where the two cores hand cache lines to each other quickly; the direct path hands over far fewer
// lines and wins where that is slow. Which it is can change while a job runs: the two vCPUs of
// this VM sit on cores that share a cache or not as the hypervisor places them, flipping every
// second or so (1 MiB: rings 70-150 us or 400-600 us, direct 200-400 us). So rank 0 times both
// paths and names one for each operation, and every rank takes the path rank 0 named
// (HostDirect::allreduce_chosen): they cannot disagree.
class PathChoice {
 public:
  // Before an operation of `bytes`: whether to name the direct path. Each path is tried first;
  // then the faster by recent times, and the other one for kExploreRun operations in a row after
  // kExploreEvery times (slower / faster estimate) operations (kExploreSeconds at most), so that a change of
  // the slower one's speed is seen. A run costs in proportion to how much slower that path is, so a far
  // slower one is looked at as much less often (the rings at 75 us against the direct path at
  // 300: every 64th operation cost 19% of the rings' time, mostly for nothing: there the direct
  // path does not get faster, the rings get slower, and the rings' own times show that).
  bool direct_next(size_t bytes);
  // After it, in the order the operations ran: what it took on the path it took. Only the times of
  // operations that follow one on the same path count: the first after a switch finds the
  // caches as the other path left them (a lone ring operation among direct ones took 220-330 us
  // where the rings in a row took 100), and counting it kept the rings from ever being chosen back.
  void record(size_t bytes, bool direct, double seconds);

  static constexpr uint32_t kExploreEvery = 64;
  static constexpr uint32_t kExploreRun = 2;
  static constexpr double kMaxSlower = 16;  // the longest wait is kExploreEvery times this
  // ... and never longer than this much time on the faster path: where an operation takes a
  // millisecond (4 MiB), 64 of them outlast a state of the VM's cores (bf16 4 MiB: stuck on the
  // direct path at 0.9-1.5 ms while the rings took 0.7 ms).
  static constexpr double kExploreSeconds = 0.025;
  // Weight of a new time above the estimate; one above twice the estimate counts as twice: a
  // rank descheduled once should not switch the path for the next hundred operations, while a
  // path that became slow for good is left within a few operations. A faster time weighs more
  // (nothing makes an operation spuriously fast): a slower path that became the faster one is
  // taken after the first run on it (with 0.25 alone, the rings sped up 4x were taken back after
  // two runs, 128 operations, 40 ms).
  static constexpr double kWeight = 0.25;
  static constexpr double kWeightDown = 0.75;

 private:
  struct Size {
    double est[2] = {0, 0};  // seconds: rings, direct
    bool seen[2] = {false, false};
    uint32_t since = 0;  // choices by time since the last run on the slower path
    uint32_t left = 0;   // operations left of the current run on the slower path
    int exploring = 0;   // that path
    int last = -1;       // the path of the last operation recorded
  };
  Size& of(size_t bytes);
  std::array<Size, 4> sizes_;  // by power of two: [1, 2), [2, 4), [4, 8), [8, 16) MiB
};

class HostDirect {
 public:
  explicit HostDirect(Communicator& comm);
  HostDirect(const HostDirect&) = delete;
  HostDirect& operator=(const HostDirect&) = delete;

  // In-place allreduce of `count` elements on every rank (collective). Returns false, before
  // touching any buffer, where the kernel does not let these processes reach each other's memory
  // (decided together by all ranks on first use, then remembered: the caller then takes another
  // path for this and every later call), or where two ranks' buffers are not all on huge pages
  // (pays(): the caller takes another path for this call).
  bool allreduce(std::byte* buf, size_t count, DType dtype, ReduceOp op, const net::OpInfo& info) {
    return allreduce(buf, buf, count, dtype, op, info);
  }
  // The same into `out` (which is `in` or does not overlap it): the inputs are read where they are.
  // `choice` (two ranks): -1 as pays() decides; otherwise rank 0's value is taken by every rank,
  // 1 for this path, 0 to return false (the rings). `publish`: rank 0 writes it as the path of
  // the next chosen allreduce before it announces (allreduce_chosen).
  bool allreduce(const std::byte* in, std::byte* out, size_t count, DType dtype, ReduceOp op,
                 const net::OpInfo& info, int choice = -1, int publish = -1);
  // Two ranks (Communicator::two_rank_choice): this path or, returning false, the rings, as rank 0
  // named (PathChoice). Rank 0 names each operation's path during the one before, in the control
  // block, before it sends anything there; the peer reads it when it starts the operation, after
  // it received something of the one before, so both take the same path with no message of its
  // own. Where the rings are named that costs one cache line, not an announcement round trip.
  bool allreduce_chosen(const std::byte* in, std::byte* out, size_t count, DType dtype, ReduceOp op,
                        const net::OpInfo& info);
  // reduce_scatter: `in` holds size() blocks of counts[q] elements; `out` gets this rank's block
  // reduced. Every input byte is read once, every output byte written once.
  bool reduce_scatter(const std::byte* in, std::byte* out, std::span<const size_t> counts, DType dtype,
                      ReduceOp op, const net::OpInfo& info);
  // allgather: `out` gets size() blocks, this rank's read from `in` (which may be its own block
  // of `out`: in place). Each block is read once from where its owner holds it and written once
  // into every rank's output, the owner's included unless in place.
  bool allgather(const std::byte* in, std::byte* out, std::span<const size_t> counts, DType dtype,
                 const net::OpInfo& info);

  // Rank 0's choice between the rings and this path for two ranks (Communicator::two_rank_choice).
  PathChoice& choice() { return choice_; }

  // Chunk the takers work on: each of the P chunks it reads stays in L2 while it is reduced.
  static constexpr size_t kChunkBytes = 256 * 1024;

 private:
  struct Entry {  // what every rank tells the others at the start of an operation
    uint64_t addr;
    int32_t pid;
    uint32_t ok;      // first use: whether this rank could read every peer's buffer
    uint64_t out;     // reduce_scatter: the output block
    uint64_t pid_ns;  // first use: a pid means the same process only inside one pid namespace
    uint64_t shape;   // hash of the operation, dtype, op and block sizes: must match everywhere
    uint32_t huge;    // the buffer (allreduce, allgather) or input (reduce_scatter) is on huge pages
    int32_t choice;   // rank 0's: the path every rank takes (allreduce's choice), -1 for pays()
  };
  struct Slot;
  struct Control;

  // What this rank tells the others: its buffer (and reduce_scatter's output block), its pid.
  static Entry announce(uint64_t shape, bool huge, const void* buf, const void* out = nullptr);
  // Whether the direct path beats the rings for these buffers: from 3 ranks on always; two ranks
  // as rank 0 chose, or without a choice only where every buffer is on huge pages (on 4 KiB pages
  // the kernel's pinning made it slower than the rings, whose bytes stay in cache). All ranks
  // decide alike from the same entries.
  bool pays(const std::vector<Entry>& entries) const;
  std::vector<Entry> share(const Entry& mine, const net::OpInfo& info);
  bool setup(std::vector<Entry>& entries, const net::OpInfo& info);
  // Announces this rank's buffers; nullptr where the path is off (nothing touched then).
  // `reduces`: the operation stages peers' chunks for reduce_chunk (its scratch is sized here,
  // once per operation).
  // Rank 0 writes `publish` (>= 0) as the next chosen allreduce's path before it announces.
  Slot* enter(const Entry& mine, std::vector<Entry>& entries, bool reduces, const net::OpInfo& info,
              int publish = -1);
  void publish_choice(int direct);
  // Takes chunks 0..total-1 from the slot's counter and runs body(i) on each, then waits until
  // every rank's chunks are done.
  template <typename Body>
  void work(Slot& slot, size_t total, const net::OpInfo& info, Body&& body);
  void wait_done(Slot& slot, size_t total, const net::OpInfo& info);
  // Reads this chunk of every rank's input (own from `mine`, peers' at their address + off) and
  // leaves their reduction, in rank order, at `dst` (scratch when null; `mine` itself may be it).
  std::byte* reduce_chunk(const std::byte* mine, size_t off, size_t elems, const std::vector<Entry>& peers,
                          DType dtype, ReduceOp op, const net::OpInfo& info, std::byte* dst = nullptr);

  Communicator& comm_;
  enum class State { kUnknown, kOn, kOff } state_ = State::kUnknown;
  net::ShmSegment seg_;
  Control* ctl_ = nullptr;
  uint64_t ops_ = 0;  // operations on this path so far (the same count on every rank)
  std::vector<std::byte> scratch_;
  std::vector<const void*> srcs_;  // reduce_chunk's inputs, in rank order
  // Opened while every peer was inside the first operation. Checked between a chunk's reads and
  // its writes, so a write never targets a process that has exited.
  PeerProcesses peers_;
  // This rank's buffers, backed by 2 MiB pages before peers pin them (core/huge_pages.h).
  HugeBacking huge_;
  PathChoice choice_;
  uint64_t chosen_ = 0;  // allreduce_chosen calls so far (the same count on both ranks)
  int pending_ = -1;     // rank 0: the path it wrote for the next one
};

}  // namespace rumor
