#include "optim/shared_step_op.h"

#include <algorithm>
#include <cstring>

#include "core/stream_copy.h"

namespace rumor::optim {

SharedStepAllreduceOp::SharedStepAllreduceOp(std::shared_ptr<SharedArena> arena, ReduceOp op)
    : arena_(std::move(arena)), op_(op) {
  if (arena_ == nullptr) throw Error(ErrorKind::kInvalidArgument, "shared optimizer step: no arena");
}

void SharedStepAllreduceOp::set_segments(std::vector<StepSegment> segments) {
  check_segments(segments);
  for (const auto& s : segments)
    if (s.count > 0 && !arena_->contains(s.param, s.count * sizeof(float)))
      throw Error(ErrorKind::kInvalidArgument,
                  "shared optimizer step: a segment's parameters are not inside this rank's arena");
  std::lock_guard lk(mu_);
  segments_ = std::move(segments);
}

void SharedStepAllreduceOp::run(Communicator&, void* data, size_t count, DType dtype) {
  std::lock_guard lk(mu_);
  if (dtype != DType::F32)
    throw Error(ErrorKind::kInvalidArgument,
                "shared optimizer step: a float32 bucket expected, got " + std::string(dtype_name(dtype)));
  auto* bucket = static_cast<float*>(data);
  for (const auto& s : segments_)
    if (s.count > 0 && (s.grad < bucket || s.grad + s.count > bucket + count))
      throw Error(ErrorKind::kInvalidArgument,
                  "shared optimizer step: a segment's gradient is not a slice of its bucket");
  for (auto& s : segments_)
    if (s.kind == StepSegment::Kind::kAdam) *s.step += 1.0f;
  const uint32_t me = arena_->comm().rank(), n = arena_->comm().size();
  arena_->allreduce(data, count, dtype, op_, [&](size_t first, size_t len) {
    for (auto& s : segments_) {
      const auto at = static_cast<size_t>(s.grad - bucket);
      const size_t lo = std::max(first, at), hi = std::min(first + len, at + s.count);
      if (lo >= hi) continue;
      const size_t k = lo - at, m = hi - lo;
      if (s.kind == StepSegment::Kind::kAdam && s.first) {
        std::fill_n(s.state0 + k, m, 0.0f);
        std::fill_n(s.state1 + k, m, 0.0f);
        if (s.adam.amsgrad) std::fill_n(s.state2 + k, m, 0.0f);
      }
      step_range(s, k, m);
      const auto offset = static_cast<size_t>(reinterpret_cast<std::byte*>(s.param + k) - arena_->data());
      for (uint32_t q = 0; q < n; ++q)
        if (q != me) copy_streaming(arena_->data_of(q) + offset, s.param + k, m * sizeof(float));
    }
  });
  for (auto& s : segments_) s.first = false;
}

}  // namespace rumor::optim
