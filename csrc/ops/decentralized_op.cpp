#include "ops/decentralized_op.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <span>

#include "comm/neighbor.h"

namespace rumor::ops {

namespace {

void require_float(DType dtype, const char* what) {
  if (dtype != DType::F32 && dtype != DType::F64)
    throw Error(
        ErrorKind::kInvalidArgument,
        std::string(what) + ": weights must be float32 or float64, got " + std::string(dtype_name(dtype)));
}

std::vector<NeighborEdge> edges(const MixPlan& plan) {
  std::vector<NeighborEdge> e;
  for (const auto& [r, w] : plan.srcs) e.push_back(NeighborEdge{r, w});
  return e;
}

std::vector<NeighborEdge> unit_edges(const std::vector<uint32_t>& ranks) {
  std::vector<NeighborEdge> e;
  for (uint32_t r : ranks) e.push_back(NeighborEdge{r, 1.0});
  return e;
}

// x += w * (sum of the neighbours' copies) - w * k * xh, and diff = x - xh, in one pass over
// memory (the buffers are model-sized; every extra pass costs as much as the arithmetic).
template <typename T>
void mix_toward_replicas(T* x, const T* self, const T* left, const T* right, T* diff, size_t count, int k) {
  const T w = T(1) / static_cast<T>(k + 1);
  if (k == 1) {
    for (size_t i = 0; i < count; ++i) {
      x[i] += w * (left[i] - self[i]);
      diff[i] = x[i] - self[i];
    }
  } else {
    for (size_t i = 0; i < count; ++i) {
      x[i] += w * (left[i] + right[i] - T(2) * self[i]);
      diff[i] = x[i] - self[i];
    }
  }
}

}  // namespace

// ---- WeightMixOp ----------------------------------------------------------------------------

WeightMixOp::WeightMixOp(uintptr_t weights, uintptr_t out, size_t count, DType dtype, bool hierarchical,
                         std::shared_ptr<SharedArena> arena)
    : weights_(reinterpret_cast<std::byte*>(weights)),
      out_(reinterpret_cast<std::byte*>(out)),
      count_(count),
      dtype_(dtype),
      hierarchical_(hierarchical),
      arena_(std::move(arena)) {
  if (dtype != DType::F32 && dtype != DType::F64 && dtype != DType::F16 && dtype != DType::BF16)
    throw Error(ErrorKind::kInvalidArgument,
                "WeightMixOp: weights must be a floating-point type, got " + std::string(dtype_name(dtype)));
  if (weights == 0 || out == 0) throw Error(ErrorKind::kInvalidArgument, "WeightMixOp: null buffer");
  const size_t bytes = count * dtype_size(dtype);
  if (weights < out + bytes && out < weights + bytes)
    throw Error(ErrorKind::kInvalidArgument, "WeightMixOp: the output buffer overlaps the weights");
  if (arena_ && (!arena_->contains(weights_, bytes) || !arena_->contains(out_, bytes)))
    throw Error(ErrorKind::kInvalidArgument,
                "WeightMixOp: the weights or the output are not inside the arena");
}

void WeightMixOp::mix(Communicator& comm, const MixPlan& plan) {
  // What hierarchical_neighbor_allreduce reduces a single host's schedule to: the host's average.
  const bool host_average =
      plan.average_all || (hierarchical_ && comm.local_comm().size() == comm.size() &&
                           plan.self_weight == 1.0 && plan.srcs.empty() && plan.dsts.empty());
  if (arena_ && host_average && &arena_->comm() == &comm) {
    arena_->allreduce_into(weights_, out_, count_, dtype_, ReduceOp::AVG);
    return;
  }
  if (plan.average_all) {
    comm.allreduce_into(weights_, out_, count_, dtype_, ReduceOp::AVG,
                        hierarchical_ ? AllreduceAlgo::kHierarchical : AllreduceAlgo::kAuto);
    return;
  }
  // Every rank derives its lists from the same schedule or matrix, so the collective topology
  // check (an alltoall per step) is left off; a mismatch would still fail, by frame check or
  // deadline, rather than mix wrong data.
  const auto srcs = edges(plan);
  const auto dsts = unit_edges(plan.dsts);
  if (hierarchical_)
    hierarchical_neighbor_allreduce(comm, weights_, out_, count_, dtype_, plan.self_weight, srcs, dsts, false,
                                    scratch_.get());
  else
    neighbor_allreduce(comm, weights_, out_, count_, dtype_, plan.self_weight, srcs, dsts, false,
                       scratch_.get());
}

// ---- LowPrecisionMixOp ----------------------------------------------------------------------

LowPrecisionMixOp::LowPrecisionMixOp(uintptr_t weights, size_t count, DType dtype, bool hierarchical,
                                     uint32_t chunk)
    : weights_(reinterpret_cast<std::byte*>(weights)),
      count_(count),
      dtype_(dtype),
      hierarchical_(hierarchical) {
  require_float(dtype, "LowPrecisionMixOp");
  if (weights == 0) throw Error(ErrorKind::kInvalidArgument, "LowPrecisionMixOp: null weight buffer");
  compress::CodecParams p;
  p.kind = compress::Kind::kMinMaxU8;
  p.chunk = chunk;
  codec_ = compress::make_codec(p);
  const size_t bytes = count * dtype_size(dtype);
  self_.assign(weights_, weights_ + bytes);
}

Communicator* LowPrecisionMixOp::ring(Communicator& comm) {
  Communicator* r = hierarchical_ ? comm.leaders_comm() : &comm;
  return (r != nullptr && r->size() > 1) ? r : nullptr;
}

void LowPrecisionMixOp::drop_copies_if_idle(Communicator& comm) {
  if (ring(comm) == nullptr) {
    // This rank never mixes (a non-leader, or a ring of one): its copies would only cost memory.
    std::vector<std::byte>().swap(self_);
    return;
  }
  if (left_.empty() && !self_.empty()) {
    left_ = self_;
    if (ring(comm)->size() > 2) right_ = self_;
    send_.resize(codec_->encoded_bytes(count_));
    recv_.resize(send_.size() * (ring(comm)->size() > 2 ? 2 : 1));
  }
}

void LowPrecisionMixOp::prepare(Communicator& comm) {
  drop_copies_if_idle(comm);
  Communicator* r = ring(comm);
  Communicator* local = hierarchical_ ? &comm.local_comm() : nullptr;
  if (local != nullptr && local->size() > 1) local->allreduce(weights_, count_, dtype_, ReduceOp::AVG);
  if (r != nullptr && count_ > 0) {
    const int k = r->size() == 2 ? 1 : 2;
    diff_.resize(count_ * dtype_size(dtype_));
    if (dtype_ == DType::F32) {
      auto* x = reinterpret_cast<float*>(weights_);
      auto* s = reinterpret_cast<const float*>(self_.data());
      mix_toward_replicas(x, s, reinterpret_cast<const float*>(left_.data()),
                          reinterpret_cast<const float*>(right_.data()),
                          reinterpret_cast<float*>(diff_.data()), count_, k);
    } else {
      auto* x = reinterpret_cast<double*>(weights_);
      auto* s = reinterpret_cast<const double*>(self_.data());
      mix_toward_replicas(x, s, reinterpret_cast<const double*>(left_.data()),
                          reinterpret_cast<const double*>(right_.data()),
                          reinterpret_cast<double*>(diff_.data()), count_, k);
    }
    codec_->encode(diff_.data(), count_, dtype_, send_.data(), send_.size());
    codec_->decode(send_.data(), send_.size(), self_.data(), count_, dtype_, /*accumulate=*/true);
  }
  if (local != nullptr && local->size() > 1) local->broadcast(weights_, count_, dtype_, 0);
}

void LowPrecisionMixOp::exchange(Communicator& comm) {
  drop_copies_if_idle(comm);
  Communicator* r = ring(comm);
  if (r == nullptr || count_ == 0) return;
  const uint32_t n = r->size(), me = r->rank();
  const uint32_t left = (me + n - 1) % n, right = (me + 1) % n;
  // On a ring of two the left and the right neighbour are the same rank: one message each way.
  std::vector<uint32_t> peers{left};
  if (n > 2) peers.push_back(right);
  const std::vector<size_t> sizes(peers.size(), send_.size());
  neighbor_allgather(*r, send_.data(), send_.size(), peers, sizes, peers, recv_.data(), false);
  codec_->decode(recv_.data(), send_.size(), left_.data(), count_, dtype_, /*accumulate=*/true);
  if (n > 2) codec_->decode(recv_.data() + send_.size(), send_.size(), right_.data(), count_, dtype_, true);
}

std::vector<double> LowPrecisionMixOp::copy_state(int which) const {
  const std::vector<std::byte>* src = which == 0   ? &self_
                                      : which == 1 ? &left_
                                      : which == 2 ? &right_
                                                   : nullptr;
  if (src == nullptr) throw Error(ErrorKind::kInvalidArgument, "copy_state: which must be 0, 1 or 2");
  std::vector<double> out(src->size() / dtype_size(dtype_));
  for (size_t i = 0; i < out.size(); ++i) {
    if (dtype_ == DType::F32) {
      float v;
      std::memcpy(&v, src->data() + i * sizeof(float), sizeof v);
      out[i] = v;
    } else {
      std::memcpy(&out[i], src->data() + i * sizeof(double), sizeof(double));
    }
  }
  return out;
}

}  // namespace rumor::ops
