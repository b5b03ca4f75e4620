#include "optim/step_op.h"

#include <cmath>

namespace rumor::optim {

void check_segments(const std::vector<StepSegment>& segments) {
  for (const auto& s : segments) {
    if (s.count > 0 && (s.param == nullptr || s.grad == nullptr))
      throw Error(ErrorKind::kInvalidArgument,
                  "optimizer step: a segment has no parameter or gradient buffer");
    if (s.kind == StepSegment::Kind::kAdam && s.count > 0 &&
        (s.step == nullptr || s.state0 == nullptr || s.state1 == nullptr ||
         (s.adam.amsgrad && s.state2 == nullptr)))
      throw Error(ErrorKind::kInvalidArgument,
                  "optimizer step: an Adam segment lacks its step counter or state");
    if (s.kind == StepSegment::Kind::kSgd && s.count > 0 && s.sgd.momentum != 0 && s.state0 == nullptr)
      throw Error(ErrorKind::kInvalidArgument, "optimizer step: an SGD segment with momentum has no buffer");
  }
}

void step_range(StepSegment& s, size_t first, size_t count) {
  auto at = [first](float* p) { return p == nullptr ? nullptr : p + first; };
  if (s.kind == StepSegment::Kind::kSgd) {
    sgd_step(s.param + first, s.grad + first, at(s.state0), count, s.sgd, s.first);
    return;
  }
  adam_step(s.param + first, s.grad + first, at(s.state0), at(s.state1),
            s.adam.amsgrad ? at(s.state2) : nullptr, count, s.adam, static_cast<double>(*s.step));
}

void OptimizerStepOp::set_segments(std::vector<StepSegment> segments) {
  check_segments(segments);
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
    if (s.kind == StepSegment::Kind::kAdam) *s.step += 1.0f;
    step_range(s, 0, s.count);
    s.first = false;
  }
}

}  // namespace rumor::optim
