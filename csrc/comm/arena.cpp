#include "comm/arena.h"

#include <algorithm>
#include <cstring>

#include "core/reduce.h"

namespace rumor {

namespace {
// Partial sums of this size stay in L2 while each peer's slice streams past them.
constexpr size_t kChunkBytes = 64 * 1024;

std::string arena_name(const Communicator& c, uint64_t id, uint32_t rank) {
  return c.shm_prefix() + "-a" + std::to_string(id) + "-" + std::to_string(c.world_ranks().at(rank));
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

}  // namespace rumor
