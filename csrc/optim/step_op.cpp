#include "optim/step_op.h"

#include <cmath>

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

void OptimizerStepOp::set_clip_norm(double max_norm) {
  if (!(max_norm >= 0) || !std::isfinite(max_norm))
    throw Error(ErrorKind::kInvalidArgument, "optimizer step: the clipping norm must be finite and >= 0");
  std::lock_guard lk(mu_);
  clip_norm_ = max_norm;
}

void OptimizerStepOp::run(Communicator&, void*, size_t, DType) {
  std::lock_guard lk(mu_);
  if (clip_norm_ > 0) {
    double sumsq = 0;
    for (const auto& s : segments_)
      for (size_t i = 0; i < s.count; ++i) sumsq += static_cast<double>(s.grad[i]) * s.grad[i];
    // torch computes the coefficient as a float32 tensor and multiplies only by its clamp to 1.
    const auto coef = static_cast<float>(clip_norm_ / (std::sqrt(sumsq) + 1e-6));
    if (coef < 1.0f)
      for (auto& s : segments_)
        for (size_t i = 0; i < s.count; ++i) s.grad[i] *= coef;
  }
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
