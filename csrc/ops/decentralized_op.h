// Bucket-level ops of the decentralized training algorithms (python/rumor/algorithms/
// decentralized.py and low_precision_decentralized.py). They communicate model WEIGHTS, not
// gradients: gradients stay local (LocalBucketOp), and each rank mixes its weights with those
// of a few peers. Weight buffers are flat per bucket (the parameters are views into them), so
// one bucket is one message per peer.
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "comm/arena.h"
#include "comm/neighbor.h"
#include "compress/codec.h"
#include "engine/bucket_engine.h"

namespace rumor::ops {

// For the gradient buckets of weight-communicating algorithms: gradients are not exchanged.
class LocalBucketOp final : public BucketOp {
 public:
  void run(Communicator&, void*, size_t, DType) override {}
  std::string name() const override { return "local (no communication)"; }
};

// Who a rank mixes with in one step. Peers are ranks of the communicator that does the
// exchange: the job's communicator, or the host leaders' one when hierarchical.
struct MixPlan {
  bool average_all = false;  // allreduce-average over every rank; the fields below are unused
  double self_weight = 1.0;
  std::vector<std::pair<uint32_t, double>> srcs;  // receive from, with the weight of its copy
  std::vector<uint32_t> dsts;                     // send this rank's weights to
};

// Full-precision decentralized SGD on one bucket: mixes the flat weight buffer `weights` with
// the step's peers into `out` (a buffer of the same size), leaving `weights` untouched, so the
// exchange can run while forward and backward read the parameters. The algorithm copies `out`
// into the weights before optimizer.step().
//
// hierarchical: average inside the host first (shared memory), mix among host leaders, then
// broadcast inside the host; peers in the plan are then host indices. The exchange itself is
// comm/neighbor.h's neighbor_allreduce (or its hierarchical form).
class WeightMixOp final : public BucketOp {
 public:
  // arena (may be null): the shared arena `weights` and `out` lie in, on the communicator the op
  // runs on. A mix that is an average over every rank of one host then reads the peers' weights
  // in place and writes each block's average into every rank's `out` (SharedArena::
  // allreduce_into): on 4 ranks sharing 2 cores, 100 MB of float32 weights, a round took 20-24 ms
  // of CPU time per rank against 26-28 ms through private buffers, whose cross-process copies are
  // system calls that pin every page.
  WeightMixOp(uintptr_t weights, uintptr_t out, size_t count, DType dtype, bool hierarchical,
              std::shared_ptr<SharedArena> arena = nullptr);
  // Mixes with plan's peers. Runs on the communicator's worker.
  void mix(Communicator& comm, const MixPlan& plan);
  // As a bucket op (launched when the bucket's gradients are ready) it mixes with the plan
  // set last; the gradient bucket itself is not touched.
  void run(Communicator& comm, void*, size_t, DType) override { mix(comm, plan_); }
  void set_plan(MixPlan plan) { plan_ = std::move(plan); }
  std::string name() const override { return hierarchical_ ? "weight mix (hierarchical)" : "weight mix"; }
  size_t count() const { return count_; }
  // Ops that never run at once (Decentralized's two buffer sets, used in turn) share one
  // receive buffer: one model's worth of memory instead of two.
  void share_scratch(const WeightMixOp& other) { scratch_ = other.scratch_; }

 private:
  std::byte* weights_;
  std::byte* out_;
  size_t count_;
  DType dtype_;
  bool hierarchical_;
  std::shared_ptr<SharedArena> arena_;
  MixPlan plan_;
  // The peers' weights land here. Kept between steps: a fresh buffer per step cost a zero fill
  // and the page faults of a whole model every step, on the cores that compute uses.
  std::shared_ptr<NeighborScratch> scratch_ = std::make_shared<NeighborScratch>();
};

// Low-precision decentralized SGD (difference compression with error compensation) on one
// bucket, over a ring of ranks (or of host leaders when hierarchical). The op keeps, besides
// the weights x (the parameters), this rank's tracked copy xh (what its neighbours believe x
// to be) and replicas of the left and right neighbours' tracked copies. One communicating step:
//
//   prepare (synchronous, after optimizer.step):
//     [hierarchical: x = average of x over the host]
//     x  += w * (sum over distinct neighbours j of xh_j) - w * k * xh     (w = 1 / (k + 1),
//           k = number of distinct neighbours: 2 on a ring of >= 3, 1 on a ring of 2)
//     q   = MinMaxU8(x - xh);  xh += decode(q)
//     [hierarchical: broadcast x from the host leader]
//   exchange (asynchronous, overlaps the next forward and backward):
//     send q to both neighbours; xh_left += decode(q_left); xh_right += decode(q_right)
//
// Since xh tracks x only through the compressed differences, the part of x - xh that the
// quantisation lost is sent again at the next step (error compensation).
class LowPrecisionMixOp final {
 public:
  // Every rank must hold the same weights when the op is made (the wrapper broadcast them):
  // they are the starting value of every tracked copy.
  LowPrecisionMixOp(uintptr_t weights, size_t count, DType dtype, bool hierarchical, uint32_t chunk);
  void prepare(Communicator& comm);
  void exchange(Communicator& comm);
  size_t count() const { return count_; }
  // The copies, for tests and checkpoints: 0 = this rank's xh, 1 = left, 2 = right.
  std::vector<double> copy_state(int which) const;

 private:
  // The ring this rank mixes on: nullptr where this rank takes no part (non-leaders).
  Communicator* ring(Communicator& comm);
  void drop_copies_if_idle(Communicator& comm);

  std::byte* weights_;
  size_t count_;
  DType dtype_;
  bool hierarchical_;
  std::unique_ptr<compress::Codec> codec_;
  std::vector<std::byte> self_, left_, right_;  // tracked copies, dtype_ elements each
  std::vector<std::byte> diff_;         // x - xh of the step, kept to avoid a model-sized allocation per step
  std::vector<std::byte> send_, recv_;  // q, and the neighbours' q (left, then right)
};

}  // namespace rumor::ops
