#include "optim/step_op.h"

namespace rumor::optim {

void OptimizerStepOp::set_segments(std::vector<StepSegment> segments) {
  for (const auto& s : segments) {
    if (s.count > 0 && (s.param == nullptr || s.grad == nullptr))
      throw Error(ErrorKind::kInvalidArgument,
                  "optimizer step: a segment has no parameter or gradient buffer");
    if (s.kind == StepSegment::Kind::kAdam && s.step == nullptr)
      throw Error(ErrorKind::kInvalidArgument, "optimizer step: an Adam segment has no step counter");
  }
  std::lock_guard lk(mu_);
  segments_ = std::move(segments);
}

void OptimizerStepOp::run(Communicator&, void*, size_t, DType) {
  std::lock_guard lk(mu_);
  for (auto& s : segments_) {
    if (s.kind == StepSegment::Kind::kSgd) {
      sgd_step(s.param, s.grad, s.state0, s.count, s.sgd, s.first);
      s.first = false;
    } else {
      *s.step += 1.0f;
      adam_step(s.param, s.grad, s.state0, s.state1, s.state2, s.count, s.adam, static_cast<double>(*s.step));
    }
  }
}

}  // namespace rumor::optim
