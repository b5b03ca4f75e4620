// overlap_optimizer's host-shared update (csrc/optim/shared_step_op.h): the owner of each chunk
// updates the shared state and every rank's parameters once. The result must equal, bit for bit,
// each rank updating its own copy with the averaged gradients (the update is elementwise and
// deterministic, so splitting it among owners changes nothing).
#include <gtest/gtest.h>

#include <cstring>
#include <vector>

#include "comm/arena.h"
#include "optim/shared_step_op.h"
#include "ranks.h"

namespace rumor::optim {
namespace {

float grad_of(uint32_t rank, size_t i, int step) {
  return static_cast<float>(static_cast<int>((rank * 7 + i * 3 + static_cast<size_t>(step) * 5) % 13) - 6) *
         0.01f;
}

struct Layout {
  size_t count = 100003;                  // not a multiple of the ranks, several 64 KiB chunks per owner
  size_t split = 60001;                   // two segments, the boundary inside some owner's chunk
  size_t grad = 0, param = 0, state = 0;  // byte offsets in the arena
  size_t bytes() const { return state + 3 * count * sizeof(float); }
  Layout() {
    param = (count * sizeof(float) + 63) / 64 * 64;
    state = param + (count * sizeof(float) + 63) / 64 * 64;
  }
};

std::vector<StepSegment> segments(StepSegment::Kind kind, float* grad, float* param, float* s0, float* s1,
                                  float* s2, float* steps, const Layout& l, bool first) {
  std::vector<StepSegment> v(2);
  const size_t at[2] = {0, l.split}, len[2] = {l.split, l.count - l.split};
  for (int k = 0; k < 2; ++k) {
    StepSegment& s = v[k];
    s.kind = kind;
    s.param = param + at[k];
    s.grad = grad + at[k];
    s.count = len[k];
    s.state0 = s0 + at[k];
    s.state1 = s1 + at[k];
    s.state2 = s2 + at[k];
    s.step = steps + k;
    s.first = first;
    // Different hyper-parameters per segment, as two param groups would have.
    s.sgd = SgdHyper{0.1 / (k + 1), 0.9, k == 0 ? 0.0 : 0.1, 1e-2, k == 0, false};
    s.adam = AdamHyper{1e-2 / (k + 1), 0.9, 0.999, 1e-8, 1e-2, k == 1, k == 0, false};
  }
  return v;
}

void check_kind(StepSegment::Kind kind) {
  for (uint32_t n : {1u, 2u, 3u, 4u}) {
    auto w = testing::make_world(testing::one_host(n), testing::quick_options(true));
    auto errs = testing::run_ranks_shared(w, [n, kind](std::shared_ptr<Communicator> comm, uint32_t r) {
      const Layout l;
      auto arena = std::make_shared<SharedArena>(comm, l.bytes());
      auto* grad = reinterpret_cast<float*>(arena->data() + l.grad);
      auto* param = reinterpret_cast<float*>(arena->data() + l.param);
      // The host's state: rank 0's arena, as every rank maps it.
      auto* host = reinterpret_cast<float*>(arena->data_of(0) + l.state);
      float* s0 = host;
      float* s1 = host + l.count;
      float* s2 = host + 2 * l.count;
      float steps[2] = {0, 0};
      // What this rank would do alone: its own parameters and state, updated with the averages.
      std::vector<float> ref_p(l.count), ref_s0(l.count), ref_s1(l.count), ref_s2(l.count), ref_g(l.count);
      float ref_steps[2] = {0, 0};
      for (size_t i = 0; i < l.count; ++i) param[i] = ref_p[i] = static_cast<float>(i % 17) * 0.1f - 0.8f;
      // Stale values in the shared state: a fresh (first) update must not read them.
      if (r == 0)
        for (size_t i = 0; i < 3 * l.count; ++i) host[i] = 5.0f;
      comm->barrier();
      SharedStepAllreduceOp op(arena, ReduceOp::AVG);
      for (int step = 0; step < 3; ++step) {
        for (size_t i = 0; i < l.count; ++i) grad[i] = grad_of(r, i, step);
        op.set_segments(segments(kind, grad, param, s0, s1, s2, steps, l, step == 0));
        op.run(*comm, grad, l.count, DType::F32);
        // The bucket now holds the averaged gradients on every rank: the reference uses them.
        std::memcpy(ref_g.data(), grad, l.count * sizeof(float));
        if (step == 0) {
          std::fill(ref_s0.begin(), ref_s0.end(), 0.0f);
          std::fill(ref_s1.begin(), ref_s1.end(), 0.0f);
          std::fill(ref_s2.begin(), ref_s2.end(), 0.0f);
        }
        for (auto& s : segments(kind, ref_g.data(), ref_p.data(), ref_s0.data(), ref_s1.data(), ref_s2.data(),
                                ref_steps, l, step == 0)) {
          if (kind == StepSegment::Kind::kAdam) *s.step += 1.0f;
          step_range(s, 0, s.count);
        }
        for (size_t i = 0; i < l.count; ++i) {
          ASSERT_EQ(param[i], ref_p[i]) << "n " << n << " rank " << r << " step " << step << " i " << i;
          ASSERT_EQ(s0[i], ref_s0[i]) << "n " << n << " rank " << r << " step " << step << " i " << i;
          if (kind == StepSegment::Kind::kAdam) {
            ASSERT_EQ(s1[i], ref_s1[i]) << "n " << n << " rank " << r << " step " << step << " i " << i;
            if (i < l.split) {
              ASSERT_EQ(s2[i], ref_s2[i]) << "amsgrad, i " << i;
            }
          }
        }
        ASSERT_EQ(steps[0], ref_steps[0]);
        ASSERT_EQ(steps[1], ref_steps[1]);
        // Every rank must be done reading the results before the next step's owners write them.
        comm->barrier();
      }
    });
    testing::expect_all_ok(errs);
  }
}

TEST(SharedStepOp, AdamEqualsEveryRankUpdatingAlone) { check_kind(StepSegment::Kind::kAdam); }

TEST(SharedStepOp, SgdEqualsEveryRankUpdatingAlone) { check_kind(StepSegment::Kind::kSgd); }

TEST(SharedStepOp, RejectsBadSegments) {
  auto w = testing::make_world(testing::one_host(2), testing::quick_options(true));
  auto errs = testing::run_ranks_shared(w, [](std::shared_ptr<Communicator> comm, uint32_t) {
    const Layout l;
    auto arena = std::make_shared<SharedArena>(comm, l.bytes());
    auto* grad = reinterpret_cast<float*>(arena->data() + l.grad);
    auto* param = reinterpret_cast<float*>(arena->data() + l.param);
    auto* host = reinterpret_cast<float*>(arena->data_of(0) + l.state);
    float steps[2] = {0, 0};
    SharedStepAllreduceOp op(arena, ReduceOp::AVG);
    std::vector<float> outside(l.count);
    // Parameters outside this rank's arena: the owner could not reach its peers' copies.
    EXPECT_THROW(op.set_segments(segments(StepSegment::Kind::kAdam, grad, outside.data(), host,
                                          host + l.count, host + 2 * l.count, steps, l, true)),
                 Error);
    auto missing = segments(StepSegment::Kind::kAdam, grad, param, host, nullptr, nullptr, steps, l, true);
    EXPECT_THROW(op.set_segments(missing), Error);
    // A bucket that does not hold the segments' gradients, and a non-float32 bucket.
    op.set_segments(segments(StepSegment::Kind::kAdam, grad, param, host, host + l.count, host + 2 * l.count,
                             steps, l, true));
    EXPECT_THROW(op.run(*comm, grad, l.count - 1, DType::F32), Error);
    EXPECT_THROW(op.run(*comm, grad, l.count, DType::F64), Error);
    EXPECT_EQ(steps[0], 0.0f) << "a refused run must not count a step";
  });
  testing::expect_all_ok(errs);
}

}  // namespace
}  // namespace rumor::optim
