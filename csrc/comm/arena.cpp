#include "comm/arena.h"

#include <algorithm>
#include <cstring>
#include <string>
#include <vector>

#include "core/reduce.h"

namespace rumor {

namespace {
// Partial sums of this size stay in L2 while each peer's slice streams past them.
constexpr size_t kChunkBytes = 64 * 1024;

std::string arena_name(const Communicator& c, uint64_t id, uint32_t rank) {
  const uint32_t world = c.world_ranks().at(rank);
  return c.context().owned_name(c.shm_prefix() + "-a" + std::to_string(id) + "-" + std::to_string(world),
                                {world});
}
template <typename T>
void average_minus_own_block(const std::vector<const void*>& src, const std::vector<void*>& dst, uint32_t own,
                             size_t n, double divisor, void* scratch) {
  T* __restrict acc = static_cast<T*>(scratch);
  // Own contribution first, then the peers in rank order: the same summation order on every
  // run, as in allreduce.
  std::memcpy(acc, src[own], n * sizeof(T));
  for (size_t q = 0; q < src.size(); ++q) {
    if (q == own) continue;
    const T* __restrict s = static_cast<const T*>(src[q]);
    for (size_t i = 0; i < n; ++i) acc[i] += s[i];
  }
  const T div = static_cast<T>(divisor);
  for (size_t i = 0; i < n; ++i) acc[i] /= div;
  for (size_t q = 0; q < src.size(); ++q) {
    const T* __restrict s = static_cast<const T*>(src[q]);
    T* __restrict d = static_cast<T*>(dst[q]);
    for (size_t i = 0; i < n; ++i) d[i] = acc[i] - s[i];
  }
}
}  // namespace

SharedArena::SharedArena(std::shared_ptr<Communicator> comm, size_t bytes)
    : comm_(std::move(comm)), id_(comm_->next_arena_id()), bytes_(std::max<size_t>(bytes, 64)) {
  if (!comm_->all_local() || !comm_->uses_shm())
    throw Error(ErrorKind::kInvalidArgument,
                comm_->name() + ": shared buckets need every rank on one host and shared memory enabled");
  own_ = net::ShmSegment::create(arena_name(*comm_, id_, comm_->rank()), bytes_);
  peers_.resize(comm_->size());
  // Map every peer's arena now and drop the names once all have mapped them, so that no name
  // outlives construction. Runs through the worker to stay in order with queued operations.
  comm_->worker().run(
      [this] {
        net::OpInfo info = comm_->begin_op("shared bucket setup", Opcode::kArenaAllreduce);
        comm_->run_guarded(info, [&] {
          comm_->barrier_within(info);  // every rank has created its arena
          map_peers(info);
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
          arena_name(*comm_, id_, q), bytes_, op.deadline,
          op.where() + ": shared buckets of rank " + std::to_string(comm_->world_ranks()[q]));
}

void SharedArena::allreduce(void* buf, size_t count, DType dtype, ReduceOp op) {
  const size_t es = dtype_size(dtype);
  if (!contains(buf, count * es))
    throw Error(ErrorKind::kInvalidArgument, "shared-bucket allreduce: buffer is not inside the arena");
  net::OpInfo info = comm_->begin_op("allreduce (shared buckets)", Opcode::kArenaAllreduce);
  info.bytes = static_cast<int64_t>(count * es);
  info.algo = "shared buckets";
  const uint32_t n = comm_->size(), r = comm_->rank();
  if (n == 1 || count == 0) return;
  const size_t offset = static_cast<size_t>(static_cast<std::byte*>(buf) - data());
  comm_->run_guarded(info, [&] {
    comm_->barrier_within(info);  // everyone's gradients are in place

    std::vector<size_t> begin(n + 1, 0);
    for (uint32_t q = 0; q < n; ++q) begin[q + 1] = begin[q] + (count / n + (q < count % n ? 1 : 0));
    std::byte* mine = data() + offset + begin[r] * es;
    const size_t my_bytes = (begin[r + 1] - begin[r]) * es;
    // Peers in a fixed order, so a block sums the same way in every run. The owner then writes
    // its result into every peer's bucket while the chunk is still in cache: pushing costs one
    // write per copy where pulling later would cost a read and a write, and only the owner ever
    // touches block r of any bucket during this call, so the writes race with nothing.
    for (size_t c = 0; c < my_bytes; c += kChunkBytes) {
      const size_t len = std::min(kChunkBytes, my_bytes - c);
      for (uint32_t q = 0; q < n; ++q) {
        if (q == r) continue;
        const auto* theirs = static_cast<const std::byte*>(peers_[q].data()) + offset + begin[r] * es + c;
        reduce_into(mine + c, theirs, len / es, dtype, op);
      }
      if (op == ReduceOp::AVG) finish_average(mine + c, len / es, dtype, n);
      for (uint32_t q = 0; q < n; ++q)
        if (q != r)
          std::memcpy(static_cast<std::byte*>(peers_[q].data()) + offset + begin[r] * es + c, mine + c, len);
    }
    comm_->barrier_within(info);  // every block reduced and delivered everywhere
  });
}

void SharedArena::average_minus_own(const void* src, void* dst, size_t count, DType dtype, double divisor) {
  if (dtype != DType::F32 && dtype != DType::F64)
    throw Error(
        ErrorKind::kInvalidArgument,
        "shared-arena average: float32 or float64 buffers expected, got " + std::string(dtype_name(dtype)));
  const size_t es = dtype_size(dtype);
  if (!contains(src, count * es) || !contains(dst, count * es))
    throw Error(ErrorKind::kInvalidArgument, "shared-arena average: a buffer is not inside the arena");
  if (!(divisor > 0))
    throw Error(ErrorKind::kInvalidArgument, "shared-arena average: the divisor must be positive");
  net::OpInfo info = comm_->begin_op("average (shared arena)", Opcode::kArenaAllreduce);
  const uint32_t n = comm_->size(), r = comm_->rank();
  if (count == 0) return;
  const size_t src_off = static_cast<size_t>(static_cast<const std::byte*>(src) - data());
  const size_t dst_off = static_cast<size_t>(static_cast<std::byte*>(dst) - data());
  auto base = [&](uint32_t q) { return q == r ? data() : static_cast<std::byte*>(peers_[q].data()); };
  comm_->run_guarded(info, [&] {
    if (n > 1) comm_->barrier_within(info);  // every contribution is in place
    std::vector<size_t> begin(n + 1, 0);
    for (uint32_t q = 0; q < n; ++q) begin[q + 1] = begin[q] + (count / n + (q < count % n ? 1 : 0));
    const size_t block = begin[r] * es, my_bytes = (begin[r + 1] - begin[r]) * es;
    std::vector<std::byte> acc(kChunkBytes);
    std::vector<const void*> s(n);
    std::vector<void*> d(n);
    for (size_t c = 0; c < my_bytes; c += kChunkBytes) {
      const size_t len = std::min(kChunkBytes, my_bytes - c);
      for (uint32_t q = 0; q < n; ++q) {
        s[q] = base(q) + src_off + block + c;
        d[q] = base(q) + dst_off + block + c;
      }
      if (dtype == DType::F32)
        average_minus_own_block<float>(s, d, r, len / es, divisor, acc.data());
      else
        average_minus_own_block<double>(s, d, r, len / es, divisor, acc.data());
    }
    if (n > 1) comm_->barrier_within(info);  // every block delivered everywhere
  });
}

}  // namespace rumor
