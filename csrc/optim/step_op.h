// The optimizer update of one gradient bucket, run by the bucket engine once the bucket's
// communication finished (DistributedDataParallel(overlap_optimizer=True)). The bucket holds one
// or more segments (runs of parameters of one optimizer param group, laid out alike in the
// parameter, gradient and state buffers). Python refreshes the segments before every backward:
// hyper-parameters may change between steps (lr schedulers) and state buffers may be replaced
// (load_state_dict).
#pragma once

#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "engine/bucket_engine.h"
#include "optim/optim_kernels.h"

namespace rumor::optim {

struct StepSegment {
  enum class Kind { kSgd, kAdam };
  Kind kind = Kind::kSgd;
  float* param = nullptr;
  float* grad = nullptr;  // a slice of the bucket: per-bucket clipping scales it in place
  size_t count = 0;
  // SGD: state0 = momentum buffer (null without momentum). Adam: exp_avg, exp_avg_sq and, with
  // amsgrad, max_exp_avg_sq.
  float* state0 = nullptr;
  float* state1 = nullptr;
  float* state2 = nullptr;
  // Adam: torch's float32 `step` tensor of the segment, incremented before the update as torch
  // does. SGD: unused.
  float* step = nullptr;
  bool first = false;  // SGD: the momentum buffer holds nothing yet
  SgdHyper sgd;
  AdamHyper adam;
};

// Throws kInvalidArgument for a segment without its buffers (what every step op refuses).
void check_segments(const std::vector<StepSegment>& segments);
// The update of elements [first, first + count) of one segment, in place.
void step_range(StepSegment& s, size_t first, size_t count);

class OptimizerStepOp final : public BucketOp {
 public:
  OptimizerStepOp() = default;
  void set_segments(std::vector<StepSegment> segments);
  // Per-bucket clipping (0 = off): before the update, the bucket's gradients are scaled by
  // min(1, max_norm / (norm + 1e-6)), norm being the L2 norm over all its segments, as
  // torch.nn.utils.clip_grad_norm_ would over the bucket's parameters. The gradients are the
  // averaged ones, equal on every rank, so every rank clips alike without communicating.
  void set_clip_norm(double max_norm);
  void run(Communicator& comm, void* data, size_t count, DType dtype) override;
  std::string name() const override { return "optimizer step"; }

 private:
  std::mutex mu_;
  std::vector<StepSegment> segments_;
  double clip_norm_ = 0;
};

}  // namespace rumor::optim
