#include "comm/direct.h"

#include <sys/stat.h>
#include <sys/uio.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <new>
#include <string>

#if defined(__x86_64__)
#include <immintrin.h>
#endif

#include "comm/communicator.h"
#include "core/futex.h"
#include "core/reduce.h"
#include "net/socket.h"

namespace rumor {

// One operation's counters. Two slots alternate between consecutive operations: rank 0 clears
// the slot of operation k before it announces k, and no rank can still be in operation k-2 then
// (rank 0 finished k-1, which every rank entered only after leaving k-2).
struct HostDirect::Slot {
  alignas(64) std::atomic<uint32_t> next;  // the next chunk to take
  alignas(64) std::atomic<uint32_t> done;  // chunks reduced and delivered everywhere
  std::atomic<uint32_t> failed;            // 1 + the rank that failed, 0 while none did
};

struct HostDirect::Control {
  uint64_t magic;
  std::atomic<uint32_t> ready;
  Slot slot[2];
};

namespace {
uint64_t own_pid_ns() {
  struct stat st {};
  return ::stat("/proc/self/ns/pid", &st) == 0 ? static_cast<uint64_t>(st.st_ino) : 0;
}

constexpr uint64_t kControlMagic = 0x52554d4f52444952ull;

void cpu_relax() {
#if defined(__x86_64__)
  _mm_pause();
#endif
}

// Copies len bytes between this process and `pid` (a read from it, or a write into it), however
// many calls the kernel needs.
void vm_copy(bool write, pid_t pid, std::byte* local, uint64_t remote, size_t len, const net::OpInfo& info,
             const std::string& peer) {
  while (len > 0) {
    iovec l{local, len};
    iovec r{reinterpret_cast<void*>(remote), len};
    const ssize_t n = write ? ::process_vm_writev(pid, &l, 1, &r, 1, 0) : ::process_vm_readv(pid, &l, 1, &r, 1, 0);
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) {
      const int err = n < 0 ? errno : EIO;
      throw Error(err == ESRCH ? ErrorKind::kPeerGone : ErrorKind::kSystem,
                  info.where() + ": " + (write ? "writing " : "reading ") + std::to_string(len) + " bytes " +
                      (write ? "into " : "of ") + peer + "'s buffer (pid " + std::to_string(pid) +
                      ") directly: " + net::errno_string(err) + " (expected the buffer it announced for this operation)");
    }
    local += n;
    remote += static_cast<uint64_t>(n);
    len -= static_cast<size_t>(n);
  }
}
}  // namespace

std::vector<HostDirect::Entry> HostDirect::share(const Entry& mine, const net::OpInfo& info) {
  const uint32_t n = comm_.size(), r = comm_.rank();
  std::vector<Entry> all(n);
  all[r] = mine;
  std::vector<net::Transfer> ts;
  ts.reserve(2 * (n - 1));
  for (uint32_t q = 0; q < n; ++q) {
    if (q == r) continue;
    ts.push_back(net::make_send(q, &all[r], sizeof(Entry)));
    ts.push_back(net::make_recv(q, &all[q], sizeof(Entry)));
  }
  comm_.exchange(ts, info);
  return all;
}

bool HostDirect::setup(std::vector<Entry>& entries, const net::OpInfo& info) {
  const uint32_t n = comm_.size(), r = comm_.rank();
  const std::string name = comm_.context().owned_name(comm_.shm_prefix() + "-direct", {comm_.world_ranks()[0]});
  if (r != 0) {
    seg_ = net::ShmSegment::open(name, sizeof(Control), info.deadline, info.where() + ": direct collectives");
    seg_.keep_name();  // rank 0 removes it once everyone has it mapped
    ctl_ = static_cast<Control*>(seg_.data());
    while (ctl_->ready.load(std::memory_order_acquire) == 0) {
      if (info.deadline.expired())
        throw Error(ErrorKind::kTimeout, info.where() + ": rank 0's direct-collective block never became ready");
      cpu_relax();
    }
    if (ctl_->magic != kControlMagic)
      throw Error(ErrorKind::kProtocol, info.where() + ": " + name + " is not a rumor direct-collective block");
  }
  // Can this process reach every peer's memory? (ptrace rules: Yama, containers without
  // CAP_SYS_PTRACE, a seccomp filter.) Every rank must agree before anyone relies on it.
  uint32_t ok = 1;
  for (const Entry& e : entries) ok = ok && e.pid_ns == entries[r].pid_ns && e.pid_ns != 0;
  std::byte probe[1];
  for (uint32_t q = 0; q < n && ok; ++q) {
    if (q == r) continue;
    iovec l{probe, 1};
    iovec rm{reinterpret_cast<void*>(entries[q].addr), 1};
    ok = ::process_vm_readv(entries[q].pid, &l, 1, &rm, 1, 0) == 1;
  }
  Entry mine = entries[r];
  mine.ok = ok;
  entries = share(mine, info);  // every rank has mapped the block, too
  if (r == 0) seg_.unlink_name();
  bool all_ok = true;
  for (const Entry& e : entries) all_ok = all_ok && e.ok != 0;
  return all_ok;
}

HostDirect::Slot* HostDirect::enter(const Entry& mine, std::vector<Entry>& entries, const net::OpInfo& info) {
  if (state_ == State::kOff) return nullptr;
  const uint32_t r = comm_.rank();
  if (state_ == State::kUnknown && r == 0) {
    seg_ = net::ShmSegment::create(
        comm_.context().owned_name(comm_.shm_prefix() + "-direct", {comm_.world_ranks()[0]}), sizeof(Control));
    ctl_ = new (seg_.data()) Control{};  // placement-new on shared memory, owned by seg_
    ctl_->magic = kControlMagic;
    ctl_->ready.store(1, std::memory_order_release);
  }
  if (r == 0 && state_ == State::kOn) {
    Slot& s = ctl_->slot[ops_ % 2];
    s.next.store(0, std::memory_order_relaxed);
    s.done.store(0, std::memory_order_relaxed);
    s.failed.store(0, std::memory_order_relaxed);
  }
  // Announcing the buffers is also the entry barrier: nobody touches a peer's buffer before the
  // peer has entered the operation.
  entries = share(mine, info);
  if (state_ == State::kUnknown) {
    state_ = setup(entries, info) ? State::kOn : State::kOff;
    if (state_ == State::kOff) {
      ctl_ = nullptr;
      seg_ = net::ShmSegment{};
      return nullptr;
    }
  }
  return &ctl_->slot[ops_++ % 2];
}

template <typename Body>
void HostDirect::work(Slot& slot, size_t total, const std::vector<Entry>& peers, const net::OpInfo& info,
                      Body&& body) {
  if (total >= UINT32_MAX)
    throw Error(ErrorKind::kInvalidArgument, info.where() + ": " + std::to_string(total) + " chunks are too many");
  try {
    while (true) {
      const uint32_t i = slot.next.fetch_add(1, std::memory_order_acq_rel);
      if (i >= total) break;
      body(static_cast<size_t>(i));
      if (slot.done.fetch_add(1, std::memory_order_acq_rel) + 1 == total) futex_wake_all(&slot.done);
    }
    wait_done(slot, total, peers, info);
  } catch (...) {
    // The others would otherwise wait for chunks this rank will never finish.
    uint32_t none = 0;  // the first failure is the one to name
    slot.failed.compare_exchange_strong(none, 1 + comm_.rank(), std::memory_order_acq_rel);
    futex_wake_all(&slot.done);
    throw;
  }
}

std::byte* HostDirect::reduce_chunk(const std::byte* mine, size_t off, size_t elems, const std::vector<Entry>& peers,
                                    DType dtype, ReduceOp op, const net::OpInfo& info) {
  const uint32_t n = comm_.size(), r = comm_.rank();
  const size_t len = elems * dtype_size(dtype);
  scratch_.resize(static_cast<size_t>(n + 1) * kChunkBytes);
  auto staged = [&](uint32_t q) { return scratch_.data() + static_cast<size_t>(q) * kChunkBytes; };
  for (uint32_t q = 0; q < n; ++q)
    if (q != r) vm_copy(false, peers[q].pid, staged(q), peers[q].addr + off, len, info, comm_.peer_desc(q));
  // Ranks summed in rank order whoever takes the chunk, so a result never depends on which rank
  // happened to be running.
  std::byte* acc = staged(n);
  std::memcpy(acc, r == 0 ? mine : staged(0), len);
  for (uint32_t q = 1; q < n; ++q) reduce_into(acc, q == r ? mine : staged(q), elems, dtype, op);
  if (op == ReduceOp::AVG) finish_average(acc, elems, dtype, n);
  return acc;
}

namespace {
// Chunks never straddle two ranks' blocks: chunk i is `elems` elements from `first` of `block`.
struct Piece {
  uint32_t block;
  size_t first, elems;
};
struct Pieces {
  std::vector<size_t> start;  // first chunk of each block, and the total at the end
  size_t chunk_elems;
  Pieces(std::span<const size_t> counts, size_t chunk_elems) : start(counts.size() + 1, 0), chunk_elems(chunk_elems) {
    for (size_t b = 0; b < counts.size(); ++b) start[b + 1] = start[b] + (counts[b] + chunk_elems - 1) / chunk_elems;
  }
  size_t total() const { return start.back(); }
  Piece at(size_t i, std::span<const size_t> counts) const {
    const auto b = static_cast<uint32_t>(std::upper_bound(start.begin(), start.end(), i) - start.begin() - 1);
    const size_t first = (i - start[b]) * chunk_elems;
    return Piece{b, first, std::min(chunk_elems, counts[b] - first)};
  }
};
}  // namespace

bool HostDirect::allreduce(std::byte* buf, size_t count, DType dtype, ReduceOp op, const net::OpInfo& info) {
  std::vector<Entry> peers;
  Slot* slot = enter(Entry{reinterpret_cast<uint64_t>(buf), static_cast<int32_t>(::getpid()), 1, 0, own_pid_ns()}, peers, info);
  if (slot == nullptr) return false;
  const uint32_t n = comm_.size(), r = comm_.rank();
  const size_t es = dtype_size(dtype), chunk_elems = kChunkBytes / es;
  work(*slot, (count + chunk_elems - 1) / chunk_elems, peers, info, [&](size_t i) {
    const size_t first = i * chunk_elems, elems = std::min(chunk_elems, count - first);
    const size_t off = first * es, len = elems * es;
    std::memcpy(buf + off, reduce_chunk(buf + off, off, elems, peers, dtype, op, info), len);
    for (uint32_t q = 0; q < n; ++q)
      if (q != r) vm_copy(true, peers[q].pid, buf + off, peers[q].addr + off, len, info, comm_.peer_desc(q));
  });
  return true;
}

bool HostDirect::reduce_scatter(const std::byte* in, std::byte* out, std::span<const size_t> counts, DType dtype,
                                ReduceOp op, const net::OpInfo& info) {
  std::vector<Entry> peers;
  Slot* slot = enter(Entry{reinterpret_cast<uint64_t>(in), static_cast<int32_t>(::getpid()), 1,
                           reinterpret_cast<uint64_t>(out), own_pid_ns()},
                     peers, info);
  if (slot == nullptr) return false;
  const uint32_t r = comm_.rank();
  const size_t es = dtype_size(dtype);
  const Pieces pieces(counts, kChunkBytes / es);
  std::vector<size_t> block_off(counts.size() + 1, 0);
  for (size_t b = 0; b < counts.size(); ++b) block_off[b + 1] = block_off[b] + counts[b] * es;
  work(*slot, pieces.total(), peers, info, [&](size_t i) {
    const Piece p = pieces.at(i, counts);
    const size_t off = block_off[p.block] + p.first * es, len = p.elems * es;
    std::byte* sum = reduce_chunk(in + off, off, p.elems, peers, dtype, op, info);
    if (p.block == r)
      std::memcpy(out + p.first * es, sum, len);
    else
      vm_copy(true, peers[p.block].pid, sum, peers[p.block].out + p.first * es, len, info, comm_.peer_desc(p.block));
  });
  return true;
}

bool HostDirect::allgather(std::byte* buf, std::span<const size_t> counts, DType dtype, const net::OpInfo& info) {
  std::vector<Entry> peers;
  Slot* slot = enter(Entry{reinterpret_cast<uint64_t>(buf), static_cast<int32_t>(::getpid()), 1, 0, own_pid_ns()}, peers, info);
  if (slot == nullptr) return false;
  const uint32_t n = comm_.size(), r = comm_.rank();
  const size_t es = dtype_size(dtype);
  const Pieces pieces(counts, kChunkBytes / es);
  std::vector<size_t> block_off(counts.size() + 1, 0);
  for (size_t b = 0; b < counts.size(); ++b) block_off[b + 1] = block_off[b] + counts[b] * es;
  work(*slot, pieces.total(), peers, info, [&](size_t i) {
    const Piece p = pieces.at(i, counts);
    const size_t off = block_off[p.block] + p.first * es, len = p.elems * es;
    // Read once from the block's owner (into this rank's own copy of the block, which needs it
    // anyway), then write from there into every other rank.
    if (p.block != r) vm_copy(false, peers[p.block].pid, buf + off, peers[p.block].addr + off, len, info,
                              comm_.peer_desc(p.block));
    for (uint32_t q = 0; q < n; ++q)
      if (q != r && q != p.block)
        vm_copy(true, peers[q].pid, buf + off, peers[q].addr + off, len, info, comm_.peer_desc(q));
  });
  return true;
}

void HostDirect::wait_done(Slot& slot, size_t total, const std::vector<Entry>& peers, const net::OpInfo& info) {
  const auto spin = std::chrono::microseconds(std::max(0, comm_.context().options().spin_us));
  const auto spin_until = Clock::now() + spin;
  auto next_alive_check = Clock::now() + std::chrono::milliseconds(100);
  while (true) {
    const uint32_t done = slot.done.load(std::memory_order_acquire);
    if (done >= total) return;
    if (const uint32_t f = slot.failed.load(std::memory_order_acquire); f != 0)
      throw Error(ErrorKind::kPeerGone, info.where() + ": " + comm_.peer_desc(f - 1) +
                                            " failed while the ranks were reducing each other's buffers (" +
                                            std::to_string(done) + " of " + std::to_string(total) + " chunks done)");
    const auto now = Clock::now();
    if (now < spin_until) {
      cpu_relax();
      continue;
    }
    if (info.deadline.expired())
      throw Error(ErrorKind::kTimeout, info.where() + ": timed out after " + std::to_string(info.timeout_s) +
                                           " s with " + std::to_string(done) + " of " + std::to_string(total) +
                                           " chunks reduced (a rank that took a chunk never finished it)");
    // Only the rank finishing the last chunk wakes the sleepers: one wake-up per operation.
    futex_wait(&slot.done, done, 20 * 1000);
    if (Clock::now() >= next_alive_check) {
      for (uint32_t q = 0; q < peers.size(); ++q)
        if (q != comm_.rank() && net::process_gone(peers[q].pid))
          throw Error(ErrorKind::kPeerGone, info.where() + ": " + comm_.peer_desc(q) + " (pid " +
                                                std::to_string(peers[q].pid) + ") exited with " +
                                                std::to_string(total - slot.done.load()) + " chunks not reduced");
      next_alive_check = Clock::now() + std::chrono::milliseconds(100);
    }
  }
}

}  // namespace rumor
