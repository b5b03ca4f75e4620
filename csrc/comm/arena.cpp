#include "comm/arena.h"

#include <algorithm>
#include <cstring>
#include <string>
#include <vector>

#if defined(__SSE2__)
#include <emmintrin.h>
#endif

#include "core/reduce.h"
#include "core/stream_copy.h"

namespace rumor {

namespace {
// Partial sums of this size stay in L2 while each peer's slice streams past them.
constexpr size_t kChunkBytes = 64 * 1024;
// What average_into_deltas keeps in cache per chunk: one chunk of every rank's weights and the sum.
constexpr size_t kScratchBytes = 192 * 1024;
// Behind the buffers of rank 0's arena: the allreduce's two chunk counters, a cache line each.
constexpr size_t kControlBytes = 128;
size_t control_offset(size_t bytes) { return (bytes + 63) / 64 * 64; }
// Every rank's segment: the buffers and the control tail (only rank 0's is used; one size for all).
size_t segment_bytes(size_t bytes) { return control_offset(bytes) + kControlBytes; }

std::string arena_name(const Communicator& c, uint64_t id, uint32_t rank) {
  const uint32_t world = c.world_ranks().at(rank);
  return c.context().owned_name(c.shm_prefix() + "-a" + std::to_string(id) + "-" + std::to_string(world),
                                {world});
}
// Element stores that bypass the cache where the target supports it: a delta is read back only
// at its rank's next forward, long after it has left the cache, so a normal store would first
// read the line in (for nothing) and then evict something useful.
template <typename T>
void difference_streaming(T* __restrict d, const T* __restrict a, const T* __restrict s, size_t n) {
  size_t i = 0;
#if defined(__SSE2__)
  constexpr size_t kLanes = 16 / sizeof(T);
  while (i < n && reinterpret_cast<uintptr_t>(d + i) % 16 != 0) {
    d[i] = a[i] - s[i];
    ++i;
  }
  for (; i + kLanes <= n; i += kLanes) {
    if constexpr (sizeof(T) == 4)
      _mm_stream_ps(reinterpret_cast<float*>(d + i),
                    _mm_sub_ps(_mm_loadu_ps(reinterpret_cast<const float*>(a + i)),
                               _mm_loadu_ps(reinterpret_cast<const float*>(s + i))));
    else
      _mm_stream_pd(reinterpret_cast<double*>(d + i),
                    _mm_sub_pd(_mm_loadu_pd(reinterpret_cast<const double*>(a + i)),
                               _mm_loadu_pd(reinterpret_cast<const double*>(s + i))));
  }
#endif
  for (; i < n; ++i) d[i] = a[i] - s[i];
}

// One chunk of the owner's block: x[q] and d[q] point at the chunk in rank q's arena, `seen`
// has room for one chunk per rank and `acc` for one.
template <typename T>
void average_into_deltas_chunk(const std::vector<const std::byte*>& x, const std::vector<std::byte*>& d,
                               const std::vector<uint8_t>& role, uint32_t own, size_t n, double divisor,
                               std::byte* seen, T* __restrict acc) {
  const size_t ranks = x.size();
  auto copy_of = [&](size_t q) { return reinterpret_cast<T*>(seen + q * n * sizeof(T)); };
  // The owner's contribution first, then the others in rank order: a fixed summation order.
  bool first = true;
  for (size_t k = 0; k < ranks; ++k) {
    const size_t q = (own + k) % ranks;
    if (role[q] == SharedArena::kSkip) continue;
    T* __restrict s = copy_of(q);
    // The single read of q's weights for this round (q's optimizer may be writing them).
    std::memcpy(s, x[q], n * sizeof(T));
    if (role[q] == SharedArena::kWeightsPlusDelta) {
      const T* __restrict old = reinterpret_cast<const T*>(d[q]);
      if (first)
        for (size_t i = 0; i < n; ++i) acc[i] = s[i] + old[i];
      else
        for (size_t i = 0; i < n; ++i) acc[i] += s[i] + old[i];
    } else if (first) {
      std::memcpy(acc, s, n * sizeof(T));
    } else {
      for (size_t i = 0; i < n; ++i) acc[i] += s[i];
    }
    first = false;
  }
  const T div = static_cast<T>(divisor);
  for (size_t i = 0; i < n; ++i) acc[i] /= div;
  for (size_t q = 0; q < ranks; ++q)
    if (role[q] != SharedArena::kSkip) difference_streaming(reinterpret_cast<T*>(d[q]), acc, copy_of(q), n);
}
}  // namespace

SharedArena::SharedArena(std::shared_ptr<Communicator> comm, size_t bytes)
    : comm_(std::move(comm)), id_(comm_->next_arena_id()), bytes_(std::max<size_t>(bytes, 64)) {
  if (!comm_->all_local() || !comm_->uses_shm())
    throw Error(ErrorKind::kInvalidArgument,
                comm_->name() + ": shared buckets need every rank on one host and shared memory enabled");
  own_ = net::ShmSegment::create(arena_name(*comm_, id_, comm_->rank()), segment_bytes(bytes_));
  peers_.resize(comm_->size());
  // Map every peer's arena now and drop the names once all have mapped them, so that no name
  // outlives construction. Runs through the worker to stay in order with queued operations.
  comm_->worker().run(
      [this] {
        net::OpInfo info = comm_->begin_op("shared bucket setup", Opcode::kArenaAllreduce);
        comm_->run_guarded(info, [&] {
          // Every page mapped into every rank now, not at first use: faulting them in one by one
          // made AsyncModelAverage's first round on mlp25m (4 ranks, 2 cores) take 1.5 s
          // against 0.15 s for the next ones, and its busy bound then held the second round
          // back for 15 s.
          own_.populate(info.where() + ": shared buckets");
          comm_->barrier_within(info);  // every rank has created its arena
          map_peers(info);
          for (const auto& peer : peers_) peer.populate(info.where() + ": shared buckets of a peer");
          comm_->barrier_within(info);  // every rank has mapped every arena
          own_.unlink_name();
        });
      },
      Deadline::after(comm_->timeout_s() * 4));
}

bool SharedArena::contains(const void* p, size_t len) const {
  auto* b = static_cast<const std::byte*>(p);
  return b >= data() && b + len <= data() + bytes_;
}

void SharedArena::map_peers(const net::OpInfo& op) {
  for (uint32_t q = 0; q < comm_->size(); ++q)
    if (q != comm_->rank())
      peers_[q] = net::ShmSegment::open(
          arena_name(*comm_, id_, q), segment_bytes(bytes_), op.deadline,
          op.where() + ": shared buckets of rank " + std::to_string(comm_->world_ranks()[q]));
}

std::byte* SharedArena::data_of(uint32_t q) const {
  if (q >= peers_.size())
    throw Error(ErrorKind::kInvalidArgument, "shared arena: no rank " + std::to_string(q) +
                                                 " in a group of " + std::to_string(peers_.size()));
  return q == comm_->rank() ? data() : static_cast<std::byte*>(peers_[q].data());
}

std::atomic_ref<uint64_t> SharedArena::claims(uint32_t slot) const {
  return std::atomic_ref<uint64_t>(
      *reinterpret_cast<uint64_t*>(data_of(0) + control_offset(bytes_) + slot * (kControlBytes / 2)));
}

void SharedArena::allreduce_into(const void* in, void* out, size_t count, DType dtype, ReduceOp op,
                                 const ChunkFn& on_reduced) {
  const size_t es = dtype_size(dtype);
  const bool in_place = in == out;
  if (!contains(in, count * es) || !contains(out, count * es))
    throw Error(ErrorKind::kInvalidArgument, "shared-bucket allreduce: buffer is not inside the arena");
  const auto* ib = static_cast<const std::byte*>(in);
  auto* ob = static_cast<std::byte*>(out);
  if (!in_place && ib < ob + count * es && ob < ib + count * es)
    throw Error(ErrorKind::kInvalidArgument, "shared-bucket allreduce: the input and the output overlap");
  net::OpInfo info = comm_->begin_op("allreduce (shared buckets)", Opcode::kArenaAllreduce);
  info.bytes = static_cast<int64_t>(count * es);
  info.algo = "shared buckets";
  const uint32_t n = comm_->size(), r = comm_->rank();
  if (count == 0) return;
  if (n == 1) {
    if (!in_place) std::memcpy(ob, ib, count * es);
    if (on_reduced) on_reduced(0, count);
    return;
  }
  const size_t in_off = static_cast<size_t>(ib - data()), out_off = static_cast<size_t>(ob - data());
  // Pieces of 64 KiB, smaller where that would leave ranks without one (a 64 KiB bucket on 4
  // ranks: four of 16 KiB, as fixed blocks split it), in whole pages so a piece holds whole
  // elements and its streaming stores stay aligned.
  const size_t total = count * es;
  const size_t piece = std::clamp<size_t>(((total + n - 1) / n + 4095) / 4096 * 4096, 4096, kChunkBytes);
  const size_t chunks = (total + piece - 1) / piece;
  // Op k claims its chunks from counter k % 2. Op k-1's claims all happened before op k's first
  // barrier, so from there rank 0 may zero that counter for op k+1, whose claims start only after
  // op k's closing barrier. (A failed op aborts the communicator: no later op runs on it.)
  const uint32_t slot = static_cast<uint32_t>(allreduces_++ & 1);
  comm_->run_guarded(info, [&] {
    comm_->barrier_within(info);  // everyone's inputs are in place
    if (r == 0) claims(slot ^ 1).store(0, std::memory_order_relaxed);
    const std::atomic_ref<uint64_t> counter = claims(slot);
    std::vector<const void*> srcs(n);
    // The chunks go to whichever rank claims them next, not to fixed blocks: with more ranks than
    // cores a rank descheduled in the middle (its comm thread behind backward's compute) no
    // longer holds back the chunks it would have owned; the ranks that run take them. Every
    // input is read once and folded in rank order (in place too, where the claimer's own input
    // is also where the sum goes), the sum written once: each element sums as HostSmall and
    // HostDirect sum it, whoever reduces it, so a layout cut elsewhere, another path or another
    // claimer gives the same bits. The claimer then writes its result into every peer's output
    // while the chunk is still in cache: pushing costs one write per copy where pulling later
    // would cost a read and a write, and only the claimer touches that chunk of any output
    // during this call, so the writes race with nothing.
    for (;;) {
      const uint64_t k = counter.fetch_add(1, std::memory_order_relaxed);
      if (k >= chunks) break;
      const size_t c = static_cast<size_t>(k) * piece, len = std::min(piece, total - c);
      std::byte* mine = data() + out_off + c;
      for (uint32_t q = 0; q < n; ++q)
        srcs[q] = in_place && q == r ? static_cast<const void*>(mine) : data_of(q) + in_off + c;
      reduce_many(mine, srcs.data(), n, len / es, dtype, op);
      if (op == ReduceOp::AVG) finish_average(mine, len / es, dtype, n);
      for (uint32_t q = 0; q < n; ++q) {
        if (q == r) continue;
        std::byte* theirs = data_of(q) + out_off + c;
        // With an update after the average (overlap_optimizer), peers read their gradients
        // only at the next zero_grad: bypass the cache. Otherwise their own update reads them
        // right away, from the cache where a normal store leaves them.
        if (on_reduced)
          copy_streaming(theirs, mine, len);
        else
          std::memcpy(theirs, mine, len);
      }
      if (on_reduced) on_reduced(c / es, len / es);
    }
    streaming_fence();
    comm_->barrier_within(info);  // every chunk reduced and delivered everywhere
  });
}

void SharedArena::average_into_deltas(const void* x, void* delta, size_t count, DType dtype,
                                      const std::vector<uint8_t>& role) {
  const char* what = "shared-arena average";
  if (dtype != DType::F32 && dtype != DType::F64)
    throw Error(
        ErrorKind::kInvalidArgument,
        std::string(what) + ": float32 or float64 buffers expected, got " + std::string(dtype_name(dtype)));
  const size_t es = dtype_size(dtype);
  if (!contains(x, count * es) || !contains(delta, count * es))
    throw Error(ErrorKind::kInvalidArgument, std::string(what) + ": a buffer is not inside the arena");
  const uint32_t n = comm_->size(), r = comm_->rank();
  if (role.size() != n)
    throw Error(ErrorKind::kInvalidArgument, std::string(what) + ": one role per rank expected (" +
                                                 std::to_string(n) + "), got " + std::to_string(role.size()));
  size_t contributors = 0;
  for (uint8_t v : role) {
    if (v > kWeightsPlusDelta)
      throw Error(ErrorKind::kInvalidArgument, std::string(what) + ": unknown role " + std::to_string(v));
    contributors += v != kSkip;
  }
  if (contributors == 0)
    throw Error(ErrorKind::kInvalidArgument, std::string(what) + ": no rank contributes");
  const auto* xb = static_cast<const std::byte*>(x);
  auto* db = static_cast<std::byte*>(delta);
  if (xb < db + count * es && db < xb + count * es)
    throw Error(ErrorKind::kInvalidArgument, std::string(what) + ": the weights and the deltas overlap");
  net::OpInfo info = comm_->begin_op("average into deltas (shared arena)", Opcode::kArenaAllreduce);
  info.bytes = static_cast<int64_t>(count * es);
  if (count == 0) return;
  const size_t x_off = static_cast<size_t>(xb - data());
  const size_t d_off = static_cast<size_t>(db - data());
  auto base = [&](uint32_t q) { return q == r ? data() : static_cast<std::byte*>(peers_[q].data()); };
  // A chunk of every rank's weights plus the sum stay in L2 while the chunk is worked on.
  const size_t chunk = std::clamp<size_t>(kScratchBytes / (n + 1) / 64 * 64, 4096, kChunkBytes);
  comm_->run_guarded(info, [&] {
    if (n > 1) comm_->barrier_within(info);  // every rank has taken its role (no apply in flight)
    std::vector<size_t> begin(n + 1, 0);
    for (uint32_t q = 0; q < n; ++q) begin[q + 1] = begin[q] + (count / n + (q < count % n ? 1 : 0));
    const size_t block = begin[r] * es, my_bytes = (begin[r + 1] - begin[r]) * es;
    std::vector<std::byte> scratch((n + 1) * chunk + 64);
    std::byte* seen = scratch.data();
    std::byte* acc = scratch.data() + n * chunk;
    std::vector<const std::byte*> xs(n);
    std::vector<std::byte*> ds(n);
    for (size_t c = 0; c < my_bytes; c += chunk) {
      const size_t len = std::min(chunk, my_bytes - c);
      for (uint32_t q = 0; q < n; ++q) {
        xs[q] = base(q) + x_off + block + c;
        ds[q] = base(q) + d_off + block + c;
      }
      if (dtype == DType::F32)
        average_into_deltas_chunk<float>(xs, ds, role, r, len / es, static_cast<double>(contributors), seen,
                                         reinterpret_cast<float*>(acc));
      else
        average_into_deltas_chunk<double>(xs, ds, role, r, len / es, static_cast<double>(contributors), seen,
                                          reinterpret_cast<double*>(acc));
    }
    streaming_fence();
    if (n > 1) comm_->barrier_within(info);  // every block delivered everywhere
  });
}

}  // namespace rumor
