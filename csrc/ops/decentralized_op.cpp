#include "ops/decentralized_op.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <span>

#include "net/channel.h"

namespace rumor::ops {

namespace {

// Elements per block of the weighted sum: every pass over a block stays in L1/L2, so mixing
// with k peers reads each input once from memory instead of k + 1 times.
constexpr size_t kBlock = 4096;

void require_float(DType dtype, const char* what) {
  if (dtype != DType::F32 && dtype != DType::F64)
    throw Error(
        ErrorKind::kInvalidArgument,
        std::string(what) + ": weights must be float32 or float64, got " + std::string(dtype_name(dtype)));
}

template <typename T>
void weighted_sum(const T* in, T* out, size_t count, T self_w, const std::vector<const T*>& peers,
                  const std::vector<T>& peer_w) {
  for (size_t b = 0; b < count; b += kBlock) {
    const size_t e = std::min(count, b + kBlock);
    for (size_t i = b; i < e; ++i) out[i] = self_w * in[i];
    for (size_t k = 0; k < peers.size(); ++k) {
      const T* p = peers[k];
      const T w = peer_w[k];
      for (size_t i = b; i < e; ++i) out[i] += w * p[i];
    }
  }
}

template <typename T>
void combine(const void* in, void* out, size_t count, const MixPlan& plan, const std::byte* scratch) {
  std::vector<const T*> peers;
  std::vector<T> w;
  for (size_t k = 0; k < plan.srcs.size(); ++k) {
    peers.push_back(reinterpret_cast<const T*>(scratch + k * count * sizeof(T)));
    w.push_back(static_cast<T>(plan.srcs[k].second));
  }
  weighted_sum(static_cast<const T*>(in), static_cast<T*>(out), count, static_cast<T>(plan.self_weight),
               peers, w);
}

// x += w * (sum of the neighbours' copies) - w * k * xh, in one pass.
template <typename T>
void mix_toward_replicas(T* x, const T* self, const T* left, const T* right, size_t count, int k) {
  const T w = T(1) / static_cast<T>(k + 1);
  if (k == 1) {
    for (size_t i = 0; i < count; ++i) x[i] += w * (left[i] - self[i]);
  } else {
    for (size_t i = 0; i < count; ++i) x[i] += w * (left[i] + right[i] - T(2) * self[i]);
  }
}

template <typename T>
void subtract(const T* a, const T* b, T* out, size_t count) {
  for (size_t i = 0; i < count; ++i) out[i] = a[i] - b[i];
}

}  // namespace

void check_plan(const MixPlan& plan, uint32_t rank, uint32_t size, const char* what) {
  auto fail = [&](const std::string& msg) {
    throw Error(ErrorKind::kInvalidArgument, std::string(what) + " (rank " + std::to_string(rank) + " of " +
                                                 std::to_string(size) + "): " + msg);
  };
  if (!std::isfinite(plan.self_weight)) fail("self weight is not finite");
  std::vector<bool> seen_src(size, false), seen_dst(size, false);
  for (const auto& [r, w] : plan.srcs) {
    if (r >= size) fail("source rank " + std::to_string(r) + " is outside the group");
    if (r == rank) fail("a rank cannot be its own source");
    if (seen_src[r]) fail("source rank " + std::to_string(r) + " is listed twice");
    if (!std::isfinite(w)) fail("the weight of source rank " + std::to_string(r) + " is not finite");
    seen_src[r] = true;
  }
  for (uint32_t r : plan.dsts) {
    if (r >= size) fail("destination rank " + std::to_string(r) + " is outside the group");
    if (r == rank) fail("a rank cannot be its own destination");
    if (seen_dst[r]) fail("destination rank " + std::to_string(r) + " is listed twice");
    seen_dst[r] = true;
  }
}

void neighbor_mix(Communicator& comm, const void* in, void* out, size_t count, DType dtype,
                  const MixPlan& plan, std::vector<std::byte>& scratch) {
  // Every rank opens the op, even one with no peers this step: op tags count operations per
  // communicator and must advance alike on every rank.
  net::OpInfo op = comm.begin_op("decentralized weight mix", Opcode::kSendRecv);
  comm.run_guarded(op, [&] {
    check_plan(plan, comm.rank(), comm.size(), "decentralized weight mix");
    require_float(dtype, "decentralized weight mix");
    const size_t bytes = count * dtype_size(dtype);
    if (scratch.size() < plan.srcs.size() * bytes) scratch.resize(plan.srcs.size() * bytes);
    std::vector<net::Transfer> ts;
    ts.reserve(plan.srcs.size() + plan.dsts.size());
    for (uint32_t d : plan.dsts) ts.push_back(net::make_send(d, in, bytes));
    for (size_t k = 0; k < plan.srcs.size(); ++k)
      ts.push_back(net::make_recv(plan.srcs[k].first, scratch.data() + k * bytes, bytes));
    if (!ts.empty() && bytes > 0) comm.exchange(ts, op);
    if (dtype == DType::F32)
      combine<float>(in, out, count, plan, scratch.data());
    else
      combine<double>(in, out, count, plan, scratch.data());
  });
}

// ---- WeightMixOp ----------------------------------------------------------------------------

WeightMixOp::WeightMixOp(uintptr_t weights, uintptr_t out, size_t count, DType dtype, bool hierarchical)
    : weights_(reinterpret_cast<std::byte*>(weights)),
      out_(reinterpret_cast<std::byte*>(out)),
      count_(count),
      dtype_(dtype),
      hierarchical_(hierarchical) {
  require_float(dtype, "WeightMixOp");
  if (weights == 0 || out == 0) throw Error(ErrorKind::kInvalidArgument, "WeightMixOp: null buffer");
  const size_t bytes = count * dtype_size(dtype);
  if (weights < out + bytes && out < weights + bytes)
    throw Error(ErrorKind::kInvalidArgument, "WeightMixOp: the output buffer overlaps the weights");
}

void WeightMixOp::mix(Communicator& comm, const MixPlan& plan) {
  const size_t bytes = count_ * dtype_size(dtype_);
  if (plan.average_all) {
    std::memcpy(out_, weights_, bytes);
    comm.allreduce(out_, count_, dtype_, ReduceOp::AVG,
                   hierarchical_ ? AllreduceAlgo::kHierarchical : AllreduceAlgo::kAuto);
    return;
  }
  if (!hierarchical_) {
    neighbor_mix(comm, weights_, out_, count_, dtype_, plan, scratch_);
    return;
  }
  Communicator& local = comm.local_comm();
  Communicator* leaders = comm.leaders_comm();
  std::memcpy(out_, weights_, bytes);
  if (local.size() > 1) local.allreduce(out_, count_, dtype_, ReduceOp::AVG);
  if (leaders != nullptr) neighbor_mix(*leaders, out_, out_, count_, dtype_, plan, scratch_);
  if (local.size() > 1) local.broadcast(out_, count_, dtype_, 0);
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
    recv_left_.resize(send_.size());
    if (ring(comm)->size() > 2) recv_right_.resize(send_.size());
  }
}

void LowPrecisionMixOp::prepare(Communicator& comm) {
  drop_copies_if_idle(comm);
  Communicator* r = ring(comm);
  Communicator* local = hierarchical_ ? &comm.local_comm() : nullptr;
  if (local != nullptr && local->size() > 1) local->allreduce(weights_, count_, dtype_, ReduceOp::AVG);
  if (r != nullptr && count_ > 0) {
    const int k = r->size() == 2 ? 1 : 2;
    std::vector<std::byte> diff(count_ * dtype_size(dtype_));
    if (dtype_ == DType::F32) {
      auto* x = reinterpret_cast<float*>(weights_);
      auto* s = reinterpret_cast<const float*>(self_.data());
      mix_toward_replicas(x, s, reinterpret_cast<const float*>(left_.data()),
                          reinterpret_cast<const float*>(right_.data()), count_, k);
      subtract(x, s, reinterpret_cast<float*>(diff.data()), count_);
    } else {
      auto* x = reinterpret_cast<double*>(weights_);
      auto* s = reinterpret_cast<const double*>(self_.data());
      mix_toward_replicas(x, s, reinterpret_cast<const double*>(left_.data()),
                          reinterpret_cast<const double*>(right_.data()), count_, k);
      subtract(x, s, reinterpret_cast<double*>(diff.data()), count_);
    }
    codec_->encode(diff.data(), count_, dtype_, send_.data(), send_.size());
    codec_->decode(send_.data(), send_.size(), self_.data(), count_, dtype_, /*accumulate=*/true);
  }
  if (local != nullptr && local->size() > 1) local->broadcast(weights_, count_, dtype_, 0);
}

void LowPrecisionMixOp::exchange(Communicator& comm) {
  drop_copies_if_idle(comm);
  Communicator* r = ring(comm);
  if (r == nullptr || count_ == 0) return;
  net::OpInfo op = r->begin_op("low-precision decentralized exchange", Opcode::kSendRecv);
  r->run_guarded(op, [&] {
    const uint32_t n = r->size(), me = r->rank();
    const uint32_t left = (me + n - 1) % n, right = (me + 1) % n;
    std::vector<net::Transfer> ts;
    ts.push_back(net::make_send(left, send_.data(), send_.size()));
    ts.push_back(net::make_recv(left, recv_left_.data(), recv_left_.size()));
    if (n > 2) {
      ts.push_back(net::make_send(right, send_.data(), send_.size()));
      ts.push_back(net::make_recv(right, recv_right_.data(), recv_right_.size()));
    }
    r->exchange(ts, op);
    codec_->decode(recv_left_.data(), recv_left_.size(), left_.data(), count_, dtype_, /*accumulate=*/true);
    if (n > 2)
      codec_->decode(recv_right_.data(), recv_right_.size(), right_.data(), count_, dtype_,
                     /*accumulate=*/true);
  });
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
