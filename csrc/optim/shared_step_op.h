// overlap_optimizer with shared buckets (every rank of the group on one host): a bucket's
// allreduce and its optimizer update as one op, the update done once per host instead of once
// per rank.
//
// Each rank's parameters of the bucket lie in its own arena, laid out like the bucket; the
// optimizer state lies once, in the arena of the group's rank 0, and every rank's
// optimizer.state views it. SharedArena::allreduce gives each chunk of the bucket one owner (the
// rank that claims it); once the chunk is averaged the owner updates the state and its own
// parameters over the chunk and copies the new values into every peer's parameters: the same
// work on whichever rank it falls, since every rank's parameters hold the same values. On 4 ranks sharing 2
// cores the ranks each updating the whole bucket was the tail of the step after backward.
//
// Why writing peers' parameters is safe: a chunk is reduced only after every rank marked the
// bucket ready, i.e. after its backward produced every gradient of the bucket, which autograd
// does after the last use of those parameters in that backward. Why sharing the state is safe:
// only the optimizer touches it, and each element has one owner; the allreduce's closing
// barrier publishes the update before any rank's step() returns.
#pragma once

#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "comm/arena.h"
#include "engine/bucket_engine.h"
#include "optim/step_op.h"

namespace rumor::optim {

class SharedStepAllreduceOp final : public BucketOp {
 public:
  SharedStepAllreduceOp(std::shared_ptr<SharedArena> arena, ReduceOp op);
  // As OptimizerStepOp's, and: each segment's parameters inside this rank's arena, its gradient a
  // slice of the bucket, its state (shared) where the owner of each element may write it. The
  // step counters stay each rank's own: every rank counts every segment's step. For Adam,
  // `first` means the state was just created: the owner zeroes its chunk of it before the first
  // update (no rank may write the shared state outside the op).
  void set_segments(std::vector<StepSegment> segments);
  void run(Communicator& comm, void* data, size_t count, DType dtype) override;
  std::string name() const override { return "allreduce + optimizer step (shared buckets)"; }

 private:
  std::shared_ptr<SharedArena> arena_;
  ReduceOp op_;
  std::mutex mu_;
  std::vector<StepSegment> segments_;
};

}  // namespace rumor::optim
