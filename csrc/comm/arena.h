// Shared-memory buffers that every rank of an all-local communicator can read directly. The
// training engine allocates its gradient buckets here, so that an allreduce of a bucket reads
// the peers' gradients in place: the ranks claim its chunks, and each chunk's claimer reduces it
// straight from everyone's buffer and writes the result into everyone's buffer. That moves about 2x the
// bucket size through memory per rank, against 6.75x for a ring through shared-memory queues (4 ranks).
#pragma once

#include <atomic>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>
#include <vector>

#include "comm/communicator.h"
#include "net/shm.h"

namespace rumor {

class SharedArena {
 public:
  // Collective over comm (same bytes on every rank, same order of creation).
  SharedArena(std::shared_ptr<Communicator> comm, size_t bytes);
  SharedArena(const SharedArena&) = delete;
  SharedArena& operator=(const SharedArena&) = delete;

  std::byte* data() const { return static_cast<std::byte*>(own_.data()); }
  size_t size() const { return bytes_; }
  Communicator& comm() const { return *comm_; }
  bool contains(const void* p, size_t len) const;

  // The arena of communicator rank q, mapped here (this rank's own for q == rank()).
  std::byte* data_of(uint32_t q) const;

  // Runs on the rank that reduced a chunk of an allreduce (whichever claimed it first), once
  // the chunk holds the result on every rank: `first` counts elements from the start of the
  // buffer. Each element is in exactly one chunk, and only its claimer touches it until the
  // allreduce returns, so work done here on it (overlap_optimizer's update) races with nothing
  // and is visible to every rank afterwards. It must therefore not depend on which rank runs it.
  using ChunkFn = std::function<void(size_t first, size_t count)>;

  // In-place allreduce of `count` elements at `data` (inside this arena) on every rank.
  void allreduce(void* data, size_t count, DType dtype, ReduceOp op, const ChunkFn& on_reduced = {}) {
    allreduce_into(data, data, count, dtype, op, on_reduced);
  }
  // The same from `in` into `out` (both inside the arena, at the same offsets on every rank; `out`
  // is `in` or does not overlap it): the ranks claim pieces of up to 64 KiB from a counter they share, and
  // a chunk's claimer reads every rank's input once and writes the result into every rank's
  // output, so no rank copies its input first. Decentralized's
  // weights on one host mix this way, from the buffer set the parameters live in into the other.
  void allreduce_into(const void* in, void* out, size_t count, DType dtype, ReduceOp op,
                      const ChunkFn& on_reduced = {});

  // What a rank brings to average_into_deltas (the same vector, one entry per rank, on every rank).
  enum Role : uint8_t {
    kSkip = 0,              // contributes nothing; its weights are not read, its delta not written
    kWeights = 1,           // contributes its weights x
    kWeightsPlusDelta = 2,  // contributes x + delta: a result it has not applied yet
  };

  // Asynchronous model averaging with the weights themselves in the arena. x and delta are
  // buffers of `count` float32/float64 elements inside the arena, at the same offsets on every
  // rank. Every contributor q (role[q] != kSkip) gets delta_q <- avg - x_q, where avg is the
  // mean of the contributions and x_q the value of q's weights that went into it: so
  // x_q + delta_q is the average however far x_q has moved since, and for kWeightsPlusDelta the
  // new delta already includes the old one. Peers may write their weights meanwhile (their
  // optimizer steps): the block owner copies each chunk of a peer's weights once into scratch
  // and computes from that copy, so a delta is always consistent with the value summed (per
  // element; the average may mix elements from before and after a peer's step).
  void average_into_deltas(const void* x, void* delta, size_t count, DType dtype,
                           const std::vector<uint8_t>& role);

 private:
  void map_peers(const net::OpInfo& op);
  // The allreduce's chunk counter `slot` (0 or 1), in rank 0's arena behind the buffers.
  std::atomic_ref<uint64_t> claims(uint32_t slot) const;

  std::shared_ptr<Communicator> comm_;
  uint64_t id_;
  size_t bytes_;
  net::ShmSegment own_;
  std::vector<net::ShmSegment> peers_;  // by communicator rank; empty for this rank
  uint64_t allreduces_ = 0;             // allreduce_into calls so far that ran the chunk loop
};

}  // namespace rumor
