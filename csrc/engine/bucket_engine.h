// Gradient buckets for data-parallel training. Python registers flat bucket buffers (the
// parameters' .grad tensors are views into them, so communicating a bucket copies nothing) and
// calls mark_ready() from each parameter's post-accumulate-grad hook. A bucket whose last slot
// becomes ready is launched on the communicator's worker thread while backward goes on.
// Buckets launch strictly in index order on every rank, so the collective sequence matches
// across ranks even when gradients become ready in a different order.
#pragma once

#include <cstdint>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "comm/arena.h"
#include "comm/communicator.h"

namespace rumor {

// What runs on one bucket. Algorithms (Python) pick one per bucket; later algorithms add kinds.
class BucketOp {
 public:
  virtual ~BucketOp() = default;
  virtual void run(Communicator& comm, void* data, size_t count, DType dtype) = 0;
  virtual std::string name() const = 0;
};

class AllreduceBucketOp final : public BucketOp {
 public:
  AllreduceBucketOp(ReduceOp op, AllreduceAlgo algo) : op_(op), algo_(algo) {}
  void run(Communicator& comm, void* data, size_t count, DType dtype) override {
    comm.allreduce(data, count, dtype, op_, algo_);
  }
  std::string name() const override { return "allreduce"; }

 private:
  ReduceOp op_;
  AllreduceAlgo algo_;
};

// Allreduce of a bucket that lives in a SharedArena: peers read it in place.
class ArenaAllreduceBucketOp final : public BucketOp {
 public:
  ArenaAllreduceBucketOp(std::shared_ptr<SharedArena> arena, ReduceOp op)
      : arena_(std::move(arena)), op_(op) {}
  void run(Communicator&, void* data, size_t count, DType dtype) override {
    arena_->allreduce(data, count, dtype, op_);
  }
  std::string name() const override { return "allreduce (shared buckets)"; }

 private:
  std::shared_ptr<SharedArena> arena_;
  ReduceOp op_;
};

struct BucketSpec {
  uintptr_t data = 0;
  size_t count = 0;
  DType dtype = DType::F32;
  uint32_t slots = 0;  // parameters in the bucket
  std::shared_ptr<BucketOp> op;
  // Optional: runs once `op` has finished, on the engine's own step thread, so that this bucket's
  // optimizer update overlaps the next buckets' communication and the rest of backward.
  std::shared_ptr<BucketOp> after;
};

// When one bucket of an iteration became complete (and was handed to the worker), and when its
// op started and ended there. Seconds on the steady clock, which on Linux is CLOCK_MONOTONIC,
// the clock of Python's time.monotonic().
struct BucketTiming {
  uint32_t bucket = 0;
  size_t count = 0;
  double launched = 0, started = 0, ended = 0;
};

class BucketEngine {
 public:
  explicit BucketEngine(std::shared_ptr<Communicator> comm);
  ~BucketEngine();
  BucketEngine(const BucketEngine&) = delete;
  BucketEngine& operator=(const BucketEngine&) = delete;

  // Replaces all buckets. No bucket may be in flight.
  void set_buckets(std::vector<BucketSpec> buckets);
  size_t num_buckets() const { return buckets_.size(); }
  // Sets every bucket's `after` op (null for none); one per bucket. No bucket may be in flight.
  void set_after(std::vector<std::shared_ptr<BucketOp>> after);

  // One parameter of `bucket` has its gradient. Launches every bucket that is now complete and
  // has all lower-index buckets launched. A slot marked twice in one iteration is an error.
  void mark_ready(uint32_t bucket);
  // Launches the remaining buckets regardless of readiness (their unmarked slots are treated as
  // ready: the caller has filled them, e.g. zeros for unused parameters).
  void launch_all();
  // Waits for every launched bucket (rethrowing the first error) and resets readiness for the
  // next iteration. Throws if some bucket never became ready, naming it.
  void finish(const Deadline& deadline);
  // Which buckets are not yet complete (for error messages and unused-parameter handling).
  std::vector<uint32_t> incomplete() const;
  bool idle() const;
  // The timings of the last iteration that finish() completed without error, in launch order.
  std::vector<BucketTiming> last_timings() const;

 private:
  struct Bucket {
    BucketSpec spec;
    uint32_t ready = 0;
    std::shared_ptr<Work> work;
    std::shared_ptr<Work> after_work;
    // Written by the worker while the op runs; read only after finish() has waited for it.
    std::shared_ptr<BucketTiming> timing;
    double ready_at = 0;  // seconds, when its last slot was marked (timeline only)
  };
  void launch_ready_locked();
  void launch_locked(Bucket& b);

  std::shared_ptr<Communicator> comm_;
  mutable std::mutex mu_;
  std::vector<Bucket> buckets_;
  size_t next_launch_ = 0;
  uint64_t launches_ = 0;  // ids of the buckets' async spans in the timeline
  std::vector<BucketTiming> last_timings_;
  // Runs the buckets' `after` ops in launch order (its thread starts on first use). Declared last:
  // destroyed (joined) first, before the buckets it reads.
  Worker steps_;
};

}  // namespace rumor
