#include "comm/direct.h"

#include <poll.h>
#include <sched.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <sys/uio.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <new>
#include <string>

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

namespace {
// What every shared block rank 0 makes for its group starts with: the others map the block and
// check it before they trust anything else in it.
struct BlockHead {
  uint64_t magic;
  uint32_t ranks;
  std::atomic<uint32_t> ready;  // set last, once the rest is in place
};
}  // namespace

struct HostDirect::Control {
  BlockHead head;
  Slot slot[2];
  // Two ranks: the path of the chosen allreduce k (allreduce_chosen) in choice[k % 2], 1 direct,
  // 0 the rings; written by rank 0 during allreduce k - 1.
  alignas(64) std::atomic<int32_t> choice[2];
};

namespace {
uint64_t own_pid_ns() {
  struct stat st{};
  return ::stat("/proc/self/ns/pid", &st) == 0 ? static_cast<uint64_t>(st.st_ino) : 0;
}

constexpr uint64_t kControlMagic = 0x52554d4f52444952ull;

// Named after the group's first member too: the local groups of two hosts share an id, and where
// the "hosts" are threads of one process (tests) they also share the owner tag.
std::string segment_name(const Communicator& comm, const char* what) {
  const uint32_t first = comm.world_ranks()[0];
  return comm.context().owned_name(comm.shm_prefix() + "-" + what + "-" + std::to_string(first), {first});
}

// Rank 0's side of a shared block: made under `name`, zeroed, headed and marked ready.
template <typename Block>
Block* create_block(net::ShmSegment& seg, const std::string& name, size_t bytes, uint64_t magic,
                    uint32_t ranks) {
  seg = net::ShmSegment::create(name, bytes);
  auto* b = new (seg.data()) Block{};  // placement-new on shared memory, owned by seg
  b->head.magic = magic;
  b->head.ranks = ranks;
  b->head.ready.store(1, std::memory_order_release);
  return b;
}

// The other ranks' side: maps the block rank 0 made under `name` (keeping the name: rank 0
// removes it once every rank has it mapped), waits until rank 0 marked it ready and checks that
// it is the block this group of `ranks` expects.
template <typename Block>
Block* open_block(net::ShmSegment& seg, const std::string& name, size_t bytes, uint64_t magic, uint32_t ranks,
                  const net::OpInfo& info, const char* what) {
  seg = net::ShmSegment::open(name, bytes, info.deadline, info.where() + ": " + what);
  seg.keep_name();
  auto* b = static_cast<Block*>(seg.data());
  while (b->head.ready.load(std::memory_order_acquire) == 0) {
    if (info.deadline.expired())
      throw Error(ErrorKind::kTimeout, info.where() + ": rank 0's " + what + " never became ready");
    cpu_relax();
  }
  if (b->head.magic != magic || b->head.ranks != ranks)
    throw Error(ErrorKind::kProtocol, info.where() + ": " + name + " is not rumor's " + what + " for " +
                                          std::to_string(ranks) + " ranks");
  return b;
}

// Copies len bytes between this process and `pid` (a read from it, or a write into it), however
// many calls the kernel needs.
void vm_copy(bool write, pid_t pid, std::byte* local, uint64_t remote, size_t len, const net::OpInfo& info,
             const std::string& peer) {
  while (len > 0) {
    iovec l{local, len};
    iovec r{reinterpret_cast<void*>(remote), len};
    const ssize_t n =
        write ? ::process_vm_writev(pid, &l, 1, &r, 1, 0) : ::process_vm_readv(pid, &l, 1, &r, 1, 0);
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) {
      const int err = n < 0 ? errno : EIO;
      throw Error(err == ESRCH ? ErrorKind::kPeerGone : ErrorKind::kSystem,
                  info.where() + ": " + (write ? "writing " : "reading ") + std::to_string(len) + " bytes " +
                      (write ? "into " : "of ") + peer + "'s buffer (pid " + std::to_string(pid) +
                      ") directly: " + net::errno_string(err) +
                      " (expected the buffer it announced for this operation)");
    }
    local += n;
    remote += static_cast<uint64_t>(n);
    len -= static_cast<size_t>(n);
  }
}
}  // namespace

namespace {
// Every rank's `mine`, in rank order (a small all-to-all over the group's channels).
template <typename T>
std::vector<T> share_all(Communicator& comm, const T& mine, const net::OpInfo& info) {
  const uint32_t n = comm.size(), r = comm.rank();
  std::vector<T> all(n);
  all[r] = mine;
  std::vector<net::Transfer> ts;
  ts.reserve(2 * (n - 1));
  for (uint32_t q = 0; q < n; ++q) {
    if (q == r) continue;
    ts.push_back(net::make_send(q, &all[r], sizeof(T)));
    ts.push_back(net::make_recv(q, &all[q], sizeof(T)));
  }
  comm.exchange(ts, info);
  return all;
}
}  // namespace

PathChoice::Size& PathChoice::of(size_t bytes) {
  size_t k = 0;
  while (k + 1 < sizes_.size() && bytes >= (size_t{2} << (20 + k))) ++k;
  return sizes_[k];
}

bool PathChoice::direct_next(size_t bytes) {
  Size& s = of(bytes);
  if (s.left > 0) {
    --s.left;
    return s.exploring == 1;
  }
  if (!s.seen[0]) return false;
  if (!s.seen[1]) return true;
  const int faster = s.est[1] < s.est[0] ? 1 : 0;
  const double slower = std::clamp(s.est[1 - faster] / std::max(s.est[faster], 1e-9), 1.0, kMaxSlower);
  const double wait = std::min(kExploreEvery * slower, kExploreSeconds / std::max(s.est[faster], 1e-9));
  if (++s.since < wait) return faster == 1;
  s.since = 0;
  s.exploring = 1 - faster;
  s.left = kExploreRun - 1;
  return s.exploring == 1;
}

void PathChoice::record(size_t bytes, bool direct, double seconds) {
  Size& s = of(bytes);
  const int i = direct ? 1 : 0;
  const bool warm = s.last == i;
  s.last = i;
  if (!warm) return;
  if (!s.seen[i]) {
    s.seen[i] = true;
    s.est[i] = seconds;
    return;
  }
  s.est[i] += (seconds < s.est[i] ? kWeightDown : kWeight) * (std::min(seconds, 2 * s.est[i]) - s.est[i]);
}

HostDirect::HostDirect(Communicator& comm) : comm_(comm), huge_(comm.context().options().huge_pages) {}

HostDirect::Entry HostDirect::announce(uint64_t shape, bool huge, const void* buf, const void* out) {
  return Entry{reinterpret_cast<uint64_t>(buf),
               static_cast<int32_t>(::getpid()),
               1,
               reinterpret_cast<uint64_t>(out),
               own_pid_ns(),
               shape,
               huge ? 1u : 0u,
               -1};
}

bool HostDirect::pays(const std::vector<Entry>& entries) const {
  if (comm_.size() > 2) return true;
  if (entries[0].choice >= 0) return entries[0].choice == 1;
  for (const Entry& e : entries)
    if (e.huge == 0) return false;
  return true;
}

namespace {
// A hash of what every rank must pass alike: the operation, dtype, op and every block count.
uint64_t shape_hash(uint32_t what, DType dtype, ReduceOp op, std::span<const size_t> counts) {
  uint64_t h = 1469598103934665603ull;  // FNV-1a over the words
  auto mix = [&h](uint64_t v) {
    for (int i = 0; i < 8; ++i) {
      h ^= (v >> (8 * i)) & 0xff;
      h *= 1099511628211ull;
    }
  };
  mix(what);
  mix(static_cast<uint64_t>(dtype));
  mix(static_cast<uint64_t>(op));
  for (size_t c : counts) mix(c);
  return h;
}
}  // namespace

std::vector<HostDirect::Entry> HostDirect::share(const Entry& mine, const net::OpInfo& info) {
  return share_all(comm_, mine, info);
}

bool HostDirect::setup(std::vector<Entry>& entries, const net::OpInfo& info) {
  const uint32_t n = comm_.size(), r = comm_.rank();
  const std::string name = segment_name(comm_, "direct");
  if (r != 0)
    ctl_ =
        open_block<Control>(seg_, name, sizeof(Control), kControlMagic, n, info, "direct-collective block");
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
  // Opened now, while every peer is inside this operation and so alive.
  std::vector<int32_t> pids(n);
  for (uint32_t q = 0; q < n; ++q) pids[q] = entries[q].pid;
  ok = ok && peers_.open(pids, r);
  Entry mine = entries[r];
  mine.ok = ok;
  entries = share(mine, info);  // every rank has mapped the block, too
  if (r == 0) seg_.unlink_name();
  bool all_ok = true;
  for (const Entry& e : entries) all_ok = all_ok && e.ok != 0;
  return all_ok;
}

HostDirect::Slot* HostDirect::enter(const Entry& mine, std::vector<Entry>& entries, bool reduces,
                                    const net::OpInfo& info, int publish) {
  if (state_ == State::kOff) return nullptr;
  const uint32_t r = comm_.rank();
  if (state_ == State::kUnknown && r == 0)
    ctl_ = create_block<Control>(seg_, segment_name(comm_, "direct"), sizeof(Control), kControlMagic,
                                 comm_.size());
  if (publish >= 0 && r == 0) publish_choice(publish);
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
      peers_ = PeerProcesses{};
      return nullptr;
    }
  }
  for (uint32_t q = 0; q < entries.size(); ++q)
    if (entries[q].shape != entries[0].shape) {
      // Every rank holds every entry, so every rank throws here, before touching any buffer.
      std::string all;
      for (uint32_t k = 0; k < entries.size(); ++k)
        all += (k ? ", " : "") + comm_.peer_desc(k) + " " + std::to_string(entries[k].shape % 1000000);
      throw Error(ErrorKind::kProtocol, info.where() +
                                            ": the ranks passed different sizes, dtypes or ops "
                                            "(shape hashes mod 1e6: " +
                                            all + ")");
    }
  for (uint32_t q = 0; q < entries.size(); ++q)
    if (entries[q].pid != peers_.pids()[q])
      throw Error(ErrorKind::kProtocol, info.where() + ": " + comm_.peer_desc(q) + " announced pid " +
                                            std::to_string(entries[q].pid) + " (expected " +
                                            std::to_string(peers_.pids()[q]) +
                                            ", the process of the first operation)");
  // P peers' chunks and the reduction of a chunk (reduce_chunk).
  if (reduces) scratch_.resize(static_cast<size_t>(comm_.size() + 1) * kChunkBytes);
  return &ctl_->slot[ops_++ % 2];
}

template <typename Body>
void HostDirect::work(Slot& slot, size_t total, const net::OpInfo& info, Body&& body) {
  if (total >= UINT32_MAX)
    throw Error(ErrorKind::kInvalidArgument,
                info.where() + ": " + std::to_string(total) + " chunks are too many");
  try {
    while (true) {
      const uint32_t i = slot.next.fetch_add(1, std::memory_order_acq_rel);
      if (i >= total) break;
      body(static_cast<size_t>(i));
      if (slot.done.fetch_add(1, std::memory_order_acq_rel) + 1 == total) futex_wake_all(&slot.done);
    }
    wait_done(slot, total, info);
  } catch (...) {
    // The others would otherwise wait for chunks this rank will never finish.
    uint32_t none = 0;  // the first failure is the one to name
    slot.failed.compare_exchange_strong(none, 1 + comm_.rank(), std::memory_order_acq_rel);
    futex_wake_all(&slot.done);
    throw;
  }
}

std::byte* HostDirect::reduce_chunk(const std::byte* mine, size_t off, size_t elems,
                                    const std::vector<Entry>& peers, DType dtype, ReduceOp op,
                                    const net::OpInfo& info, std::byte* dst) {
  const uint32_t n = comm_.size(), r = comm_.rank();
  const size_t len = elems * dtype_size(dtype);
  auto staged = [&](uint32_t q) { return scratch_.data() + static_cast<size_t>(q) * kChunkBytes; };
  for (uint32_t q = 0; q < n; ++q)
    if (q != r) vm_copy(false, peers[q].pid, staged(q), peers[q].addr + off, len, info, comm_.peer_desc(q));
  // Ranks folded in rank order whoever takes the chunk, so a result never depends on which rank
  // happened to be running; one pass over the P inputs (half types summed in fp32, rounded once).
  srcs_.resize(n);
  for (uint32_t q = 0; q < n; ++q) srcs_[q] = q == r ? mine : staged(q);
  std::byte* acc = dst != nullptr ? dst : staged(n);
  reduce_many(acc, srcs_.data(), n, elems, dtype, op);
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
  std::vector<size_t> start;     // first chunk of each block, and the total at the end
  std::vector<size_t> byte_off;  // where each block starts in the buffer
  size_t chunk_elems;
  Pieces(std::span<const size_t> counts, size_t es)
      : start(counts.size() + 1, 0),
        byte_off(counts.size() + 1, 0),
        chunk_elems(HostDirect::kChunkBytes / es) {
    for (size_t b = 0; b < counts.size(); ++b) {
      start[b + 1] = start[b] + (counts[b] + chunk_elems - 1) / chunk_elems;
      byte_off[b + 1] = byte_off[b] + counts[b] * es;
    }
  }
  size_t total() const { return start.back(); }
  Piece at(size_t i, std::span<const size_t> counts) const {
    const auto b = static_cast<uint32_t>(std::upper_bound(start.begin(), start.end(), i) - start.begin() - 1);
    const size_t first = (i - start[b]) * chunk_elems;
    return Piece{b, first, std::min(chunk_elems, counts[b] - first)};
  }
};
}  // namespace

void HostDirect::publish_choice(int direct) {
  // Before this rank sends anything in this operation: the peer has received something of it by
  // the time it starts the next one (release here, acquire in its receive), and reads this then.
  ctl_->choice[chosen_ % 2].store(direct, std::memory_order_release);
}

bool HostDirect::allreduce_chosen(const std::byte* in, std::byte* out, size_t count, DType dtype, ReduceOp op,
                                  const net::OpInfo& info) {
  if (state_ == State::kOff) return false;
  const bool leader = comm_.rank() == 0;
  const size_t bytes = count * dtype_size(dtype);
  auto decide = [&] {
    const int fixed = comm_.context().options().two_rank_path;
    return fixed >= 0 ? fixed : choice_.direct_next(bytes) ? 1 : 0;
  };
  const uint64_t k = chosen_++;  // publish_choice now writes choice[(k + 1) % 2], the next one's
  const int next = leader ? decide() : -1;
  if (k == 0) {
    // No path was written for the first one: rank 0's travels in its announcement (the path is
    // set up there where this is its first use), the next one's is written before that.
    const int take = leader ? decide() : -1;
    pending_ = next;
    return allreduce(in, out, count, dtype, op, info, take, next);
  }
  const int take = leader ? pending_ : ctl_->choice[k % 2].load(std::memory_order_acquire);
  pending_ = next;
  if (take == 1) return allreduce(in, out, count, dtype, op, info, 1, next);
  if (leader) publish_choice(next);
  return false;
}

bool HostDirect::allreduce(const std::byte* in, std::byte* out, size_t count, DType dtype, ReduceOp op,
                           const net::OpInfo& info, int choice, int publish) {
  std::vector<Entry> peers;
  const size_t whole[] = {count};
  bool huge = false;
  if (state_ != State::kOff) {
    const size_t bytes = count * dtype_size(dtype);
    huge = huge_.prepare(in, bytes);
    // Out of place, the peers write the output as they read the input: both are pinned alike.
    if (out != in) huge = huge_.prepare(out, bytes) && huge;
  }
  // A rank in place and one out of place may meet: each says where it reads and where it is written.
  Entry mine = announce(shape_hash(1, dtype, op, whole), huge, in, out);
  mine.choice = choice;
  Slot* slot = enter(mine, peers, true, info, publish);
  if (slot == nullptr || !pays(peers)) return false;
  const uint32_t n = comm_.size(), r = comm_.rank();
  const size_t es = dtype_size(dtype), chunk_elems = kChunkBytes / es;
  work(*slot, (count + chunk_elems - 1) / chunk_elems, info, [&](size_t i) {
    const size_t first = i * chunk_elems, elems = std::min(chunk_elems, count - first);
    const size_t off = first * es, len = elems * es;
    // Straight into this rank's output (in place: over the input it has just read), no copy back.
    reduce_chunk(in + off, off, elems, peers, dtype, op, info, out + off);
    peers_.check_alive(comm_, info, "before writing a reduced chunk");
    for (uint32_t q = 0; q < n; ++q)
      if (q != r) vm_copy(true, peers[q].pid, out + off, peers[q].out + off, len, info, comm_.peer_desc(q));
  });
  return true;
}

bool HostDirect::reduce_scatter(const std::byte* in, std::byte* out, std::span<const size_t> counts,
                                DType dtype, ReduceOp op, const net::OpInfo& info) {
  std::vector<Entry> peers;
  bool huge = false;
  if (state_ != State::kOff) {
    const size_t es = dtype_size(dtype);
    size_t total = 0;
    for (size_t c : counts) total += c;
    huge = huge_.prepare(in, total * es);                          // read by every rank: most of the pinning
    if (out != in) huge_.prepare(out, counts[comm_.rank()] * es);  // written (counts has one per rank)
  }
  Slot* slot = enter(announce(shape_hash(2, dtype, op, counts), huge, in, out), peers, true, info);
  if (slot == nullptr || !pays(peers)) return false;
  const uint32_t r = comm_.rank();
  const size_t es = dtype_size(dtype);
  const Pieces pieces(counts, es);
  work(*slot, pieces.total(), info, [&](size_t i) {
    const Piece p = pieces.at(i, counts);
    const size_t off = pieces.byte_off[p.block] + p.first * es, len = p.elems * es;
    std::byte* sum = reduce_chunk(in + off, off, p.elems, peers, dtype, op, info);
    peers_.check_alive(comm_, info, "before writing a reduced chunk");
    if (p.block == r)
      std::memcpy(out + p.first * es, sum, len);
    else
      vm_copy(true, peers[p.block].pid, sum, peers[p.block].out + p.first * es, len, info,
              comm_.peer_desc(p.block));
  });
  return true;
}

bool HostDirect::allgather(const std::byte* in, std::byte* out, std::span<const size_t> counts, DType dtype,
                           const net::OpInfo& info) {
  std::vector<Entry> peers;
  const uint32_t n = comm_.size(), r = comm_.rank();
  const size_t es = dtype_size(dtype);
  const Pieces pieces(counts, es);
  bool huge = false;
  if (state_ != State::kOff) {
    huge = huge_.prepare(out, pieces.byte_off.back());
    if (in != out + pieces.byte_off[r]) huge = huge_.prepare(in, counts[r] * es) && huge;
  }
  // Where peers read this rank's block, and where they write its output.
  Slot* slot =
      enter(announce(shape_hash(3, dtype, ReduceOp::SUM, counts), huge, in, out), peers, false, info);
  if (slot == nullptr || !pays(peers)) return false;
  auto in_place = [&](uint32_t q) { return peers[q].addr == peers[q].out + pieces.byte_off[q]; };
  work(*slot, pieces.total(), info, [&](size_t i) {
    const Piece p = pieces.at(i, counts);
    const size_t off = pieces.byte_off[p.block] + p.first * es, len = p.elems * es;
    // Read once from the block's owner into this rank's output (which needs it anyway), then
    // written from there, still in cache, into every other rank's (the owner's too, unless the
    // owner gathers in place).
    std::byte* from = out + off;
    if (p.block == r) {
      if (!in_place(r)) std::memcpy(out + off, in + p.first * es, len);
    } else {
      vm_copy(false, peers[p.block].pid, out + off, peers[p.block].addr + p.first * es, len, info,
              comm_.peer_desc(p.block));
    }
    peers_.check_alive(comm_, info, "before writing a gathered chunk");
    for (uint32_t q = 0; q < n; ++q)
      if (q != r && (q != p.block || !in_place(q)))
        vm_copy(true, peers[q].pid, from, peers[q].out + off, len, info, comm_.peer_desc(q));
  });
  return true;
}

void HostDirect::wait_done(Slot& slot, size_t total, const net::OpInfo& info) {
  const auto spin = std::chrono::microseconds(std::max(0, comm_.context().options().spin_us));
  const auto spin_until = Clock::now() + spin;
  auto next_alive_check = Clock::now() + std::chrono::milliseconds(100);
  while (true) {
    const uint32_t done = slot.done.load(std::memory_order_acquire);
    if (done >= total) return;
    if (const uint32_t f = slot.failed.load(std::memory_order_acquire); f != 0)
      throw Error(ErrorKind::kPeerGone, info.where() + ": " + comm_.peer_desc(f - 1) +
                                            " failed while the ranks were reducing each other's buffers (" +
                                            std::to_string(done) + " of " + std::to_string(total) +
                                            " chunks done)");
    const auto now = Clock::now();
    if (now < spin_until) {
      cpu_relax();
      continue;
    }
    if (info.deadline.expired())
      throw Error(ErrorKind::kTimeout, info.where() + ": timed out after " + std::to_string(info.timeout_s) +
                                           " s with " + std::to_string(done) + " of " +
                                           std::to_string(total) +
                                           " chunks reduced (a rank that took a chunk never finished it)");
    // Only the rank finishing the last chunk wakes the sleepers: one wake-up per operation.
    futex_wait(&slot.done, done, 20 * 1000);
    if (Clock::now() >= next_alive_check) {
      peers_.check_alive(comm_, info, "while waiting for the chunks others took");
      next_alive_check = Clock::now() + std::chrono::milliseconds(100);
    }
  }
}

// ---- small messages ----------------------------------------------------------------------------

struct HostSmall::Header {
  BlockHead head;
  alignas(64) std::atomic<uint32_t> arrived;  // n per completed operation, wrapping
  // Ranks inside futex_wait on `arrived`: the last to arrive makes the wake-up call only when
  // someone sleeps (1.3 us a call on this VM, for ranks that all spun and need none).
  alignas(64) std::atomic<uint32_t> sleepers;
};

// What a rank was asked to do: every rank's must be the same.
struct HostSmall::Shape {
  uint64_t hash;   // shape_hash of the operation, dtype, op and every block count
  uint64_t bytes;  // the operation's size, for the error message
  uint32_t opcode;
  uint32_t dtype, op;
  Shape(const net::OpInfo& info, DType dt, ReduceOp rop, std::span<const size_t> counts, uint64_t total)
      : hash(shape_hash(info.opcode, dt, rop, counts)),
        bytes(total),
        opcode(info.opcode),
        dtype(static_cast<uint32_t>(dt)),
        op(static_cast<uint32_t>(rop)) {}
  bool operator==(const Shape&) const = default;
};

struct HostSmall::Slot {
  Shape shape;
  std::atomic<uint64_t> stamp;  // the operation (1, 2, ...) whose data the slot holds
  alignas(64) std::byte data[kMaxBytes];
};

namespace {
constexpr uint64_t kSmallMagic = 0x52554d4f52534d4cull;

std::string opcode_name(uint32_t opcode) {
  switch (static_cast<Opcode>(opcode)) {
    case Opcode::kAllreduce:
      return "allreduce";
    case Opcode::kReduceScatter:
      return "reduce_scatter";
    case Opcode::kAllgather:
      return "allgather";
    case Opcode::kBroadcast:
      return "broadcast";
    case Opcode::kReduce:
      return "reduce";
    default:
      return "opcode " + std::to_string(opcode);
  }
}

size_t total_bytes(std::span<const size_t> counts, DType dtype) {
  size_t t = 0;
  for (size_t c : counts) t += c;
  return t * dtype_size(dtype);
}
}  // namespace

bool HostSmall::fits_reduce_scatter(std::span<const size_t> counts, DType dtype) {
  return fits(total_bytes(counts, dtype));
}

bool HostSmall::fits_allgather(std::span<const size_t> counts, DType dtype) {
  for (size_t c : counts)
    if (c > kMaxBytes / dtype_size(dtype)) return false;
  return true;
}

namespace {
// The one CPU this thread may run on, or -1 where it may run on several.
int32_t bound_cpu() {
  cpu_set_t set;
  CPU_ZERO(&set);
  if (::sched_getaffinity(0, sizeof(set), &set) != 0 || CPU_COUNT(&set) != 1) return -1;
  for (int c = 0; c < CPU_SETSIZE; ++c)
    if (CPU_ISSET(c, &set)) return c;
  return -1;
}
}  // namespace

HostSmall::Slot& HostSmall::slot(uint64_t set, uint32_t rank) const {
  auto* base = reinterpret_cast<std::byte*>(hdr_) + 4096;
  return *reinterpret_cast<Slot*>(base + (set * comm_.size() + rank) * sizeof(Slot));
}

void HostSmall::setup(const net::OpInfo& info) {
  static_assert(sizeof(Header) <= 4096 && sizeof(Slot) == kMaxBytes + 64);
  const uint32_t n = comm_.size(), r = comm_.rank();
  const std::string name = segment_name(comm_, "small");
  const size_t bytes = 4096 + 2 * static_cast<size_t>(n) * sizeof(Slot);
  if (r == 0) {
    hdr_ = create_block<Header>(seg_, name, bytes, kSmallMagic, n);
    seg_.populate(info.where() + ": small-message slots");
  } else {
    hdr_ = open_block<Header>(seg_, name, bytes, kSmallMagic, n, info, "small-message slots");
  }
  // Everyone has mapped it once every rank's pid and CPU have arrived everywhere (one round); the
  // pids are kept for the liveness checks while waiting, the CPUs for the bound waits (arrive).
  struct Who {
    int32_t pid, cpu;
  };
  const std::vector<Who> all = share_all(comm_, Who{static_cast<int32_t>(::getpid()), bound_cpu()}, info);
  std::vector<int32_t> pids(n);
  cpus_.resize(n);
  my_cpu_ = all[r].cpu;  // -1 unless every rank is bound to one CPU
  for (uint32_t q = 0; q < n; ++q) {
    pids[q] = all[q].pid;
    cpus_[q] = all[q].cpu;
    if (all[q].cpu < 0) my_cpu_ = -1;
  }
  if (r == 0) seg_.unlink_name();
  peers_.open(pids, r);  // without pidfds the wait still ends at the deadline
}

uint64_t HostSmall::arrive(const std::byte* data, size_t bytes, const Shape& shape, const net::OpInfo& info) {
  if (hdr_ == nullptr) setup(info);
  const uint32_t n = comm_.size(), r = comm_.rank();
  const uint64_t set = ops_ % 2;
  const auto target = static_cast<uint32_t>(static_cast<uint64_t>(n) * (ops_ + 1));
  ++ops_;
  Slot& mine = slot(set, r);
  if (bytes > 0) std::memcpy(mine.data, data, bytes);  // data may be null when empty
  mine.shape = shape;
  mine.stamp.store(ops_, std::memory_order_release);
  // The increment publishes the slot (release); the last arrival wakes everyone who slept.
  // seq_cst on the count and on `sleepers`, here and in the sleeper: either the sleeper sees
  // this arrival before it sleeps, or this rank sees the sleeper and wakes it.
  if (hdr_->arrived.fetch_add(1, std::memory_order_seq_cst) + 1 == target) {
    if (hdr_->sleepers.load(std::memory_order_seq_cst) != 0) futex_wake_all(&hdr_->arrived);
  } else {
    int spin_us = std::max(0, comm_.context().options().spin_us);
    // Ranks sharing cores (spin 0) but each bound to one (rumor-run --bind-cores): sleeping
    // hands this core to a rank that has yet to arrive only if one is bound here. If none is,
    // nothing needs this core, and a sleep would only idle it, so that the wake-up has to rouse
    // an idle CPU (on a VM an exit to the hypervisor and back). Spin then, a while.
    if (spin_us == 0 && my_cpu_ >= 0) {
      bool needed_here = false;
      for (uint32_t q = 0; q < n && !needed_here; ++q)
        needed_here =
            q != r && cpus_[q] == my_cpu_ && slot(set, q).stamp.load(std::memory_order_acquire) != ops_;
      if (!needed_here) spin_us = kBoundSpinUs;
    }
    // Spin 0: this core is shared with ranks that may not have arrived; hand it over first.
    int yields = spin_us == 0 ? yields_.begin_wait() : 0;
    const auto spin_until = Clock::now() + std::chrono::microseconds(spin_us);
    auto next_alive_check = Clock::now() + std::chrono::milliseconds(100);
    while (true) {
      const uint32_t now = hdr_->arrived.load(std::memory_order_acquire);
      if (static_cast<int32_t>(now - target) >= 0) break;
      if (Clock::now() < spin_until) {
        cpu_relax();
        continue;
      }
      if (yields > 0) {
        --yields;
        const auto y0 = Clock::now();
        ::sched_yield();
        if (!yields_.after_yield(Clock::now() - y0)) yields = 0;
        continue;
      }
      if (info.deadline.expired())
        throw Error(ErrorKind::kTimeout,
                    info.where() + ": timed out after " + std::to_string(info.timeout_s) + " s with " +
                        std::to_string(n - (target - now)) + " of " + std::to_string(n) +
                        " ranks arrived (the others never entered this " + info.name + ")");
      hdr_->sleepers.fetch_add(1, std::memory_order_seq_cst);
      if (const uint32_t again = hdr_->arrived.load(std::memory_order_seq_cst); again == now)
        futex_wait(&hdr_->arrived, now, 20 * 1000);
      hdr_->sleepers.fetch_sub(1, std::memory_order_seq_cst);
      if (Clock::now() >= next_alive_check) {
        if (!peers_.empty()) peers_.check_alive(comm_, info, ("before entering this " + info.name).c_str());
        next_alive_check = Clock::now() + std::chrono::milliseconds(100);
      }
    }
  }
  bool same = true;
  for (uint32_t q = 0; q < n; ++q) same = same && slot(set, q).shape == shape;
  if (!same) {  // every rank sees the same slots, so every rank reports the same list
    std::string all;
    for (uint32_t q = 0; q < n; ++q) {
      const Shape& s = slot(set, q).shape;
      if (q > 0) all += ", ";
      all += comm_.peer_desc(q);
      all += ' ';
      all += std::to_string(s.bytes);
      all += " bytes (";
      all += opcode_name(s.opcode);
      all += ' ';
      all += dtype_name(static_cast<DType>(s.dtype));
      all += ' ';
      all += op_name(static_cast<ReduceOp>(s.op));
      all += ", block sizes hash mod 1e6 ";
      all += std::to_string(s.hash % 1000000);
      all += ')';
    }
    throw Error(ErrorKind::kProtocol, info.where() + ": the ranks asked for different operations (" + all +
                                          "); every rank must pass the same counts, dtype, op and root");
  }
  return set;
}

void HostSmall::allreduce(std::byte* buf, size_t count, DType dtype, ReduceOp op, const net::OpInfo& info) {
  const size_t whole[] = {count}, bytes = count * dtype_size(dtype);
  const uint64_t set = arrive(buf, bytes, Shape(info, dtype, op, whole, bytes), info);
  // Rank order, whoever reduces: every rank computes the same bits, in one pass over the slots.
  const uint32_t n = comm_.size();
  const void* srcs[kMaxRanks];
  for (uint32_t q = 0; q < n; ++q) srcs[q] = slot(set, q).data;
  if (count > 0) reduce_many(buf, srcs, n, count, dtype, op);
  if (op == ReduceOp::AVG) finish_average(buf, count, dtype, n);
}

void HostSmall::reduce_scatter(const std::byte* in, std::byte* out, std::span<const size_t> counts,
                               DType dtype, ReduceOp op, const net::OpInfo& info) {
  const size_t bytes = total_bytes(counts, dtype);
  const uint64_t set = arrive(in, bytes, Shape(info, dtype, op, counts, bytes), info);
  const uint32_t n = comm_.size(), r = comm_.rank();
  size_t off = 0;
  for (uint32_t q = 0; q < r; ++q) off += counts[q] * dtype_size(dtype);
  const void* srcs[kMaxRanks];
  for (uint32_t q = 0; q < n; ++q) srcs[q] = slot(set, q).data + off;
  if (counts[r] > 0) reduce_many(out, srcs, n, counts[r], dtype, op);
  if (op == ReduceOp::AVG) finish_average(out, counts[r], dtype, n);
}

void HostSmall::allgather(std::byte* buf, std::span<const size_t> counts, DType dtype,
                          const net::OpInfo& info) {
  const uint32_t n = comm_.size(), r = comm_.rank();
  const size_t es = dtype_size(dtype);
  std::vector<size_t> off(n + 1, 0);
  for (uint32_t q = 0; q < n; ++q) off[q + 1] = off[q] + counts[q] * es;
  const uint64_t set =
      arrive(buf + off[r], counts[r] * es, Shape(info, dtype, ReduceOp::SUM, counts, off[n]), info);
  for (uint32_t q = 0; q < n; ++q)
    if (q != r && counts[q] > 0) std::memcpy(buf + off[q], slot(set, q).data, counts[q] * es);
}

bool PeerProcesses::open(const std::vector<int32_t>& pids, uint32_t self) {
  std::vector<net::Fd> fds(pids.size());
  for (uint32_t q = 0; q < pids.size(); ++q) {
    if (q == self) continue;
    const long fd = ::syscall(SYS_pidfd_open, static_cast<pid_t>(pids[q]), 0u);
    if (fd < 0) return false;  // kernel before 5.3, or a seccomp filter
    fds[q] = net::Fd(static_cast<int>(fd));
  }
  fds_ = std::move(fds);
  pids_ = pids;
  return true;
}

void PeerProcesses::check_alive(const Communicator& comm, const net::OpInfo& info, const char* when) const {
  // A pidfd polls readable once its process has exited.
  constexpr uint32_t kBatch = 64;
  pollfd fds[kBatch];
  uint32_t owner[kBatch];
  uint32_t q = 0;
  while (q < fds_.size()) {
    uint32_t k = 0;
    for (; q < fds_.size() && k < kBatch; ++q)
      if (fds_[q].valid()) {
        fds[k] = pollfd{fds_[q].get(), POLLIN, 0};
        owner[k++] = q;
      }
    if (k == 0) continue;
    int rc;
    do rc = ::poll(fds, k, 0);
    while (rc < 0 && errno == EINTR);
    if (rc < 0)
      throw Error(ErrorKind::kSystem,
                  info.where() + ": polling the peers' pidfds: " + net::errno_string(errno));
    for (uint32_t i = 0; i < k && rc > 0; ++i)
      if (fds[i].revents != 0)
        throw Error(ErrorKind::kPeerGone, info.where() + ": " + comm.peer_desc(owner[i]) + " (pid " +
                                              std::to_string(pids_[owner[i]]) + ") exited " + when);
  }
}

}  // namespace rumor
