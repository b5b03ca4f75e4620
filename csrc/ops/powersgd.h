// PowerSGD (Vogels et al., 2019) as a bucket op: each gradient matrix M of a bucket is replaced by
// the rank-k approximation P Q^T that all ranks agree on, computed with two small allreduces
// instead of one of the bucket:
//   P = M Q (Q from the last step: warm start), allreduce P (sum), orthogonalize P,
//   Q = M^T P, allreduce Q (sum) / ranks, M <- P Q^T,
// with error feedback: M is first increased by what the last approximation left out, and what
// this one leaves out is kept for the next step. Tensors that compress poorly (vectors, small
// matrices) ride in the first allreduce uncompressed and are averaged. The semantics follow
// torch's PowerSGD communication hook (see docs/powersgd.md for the deliberate differences).
//
// The op runs on the communicator's worker thread while backward goes on, like every bucket op.
// Its state (error, P and Q) lives in buffers the caller owns (Python keeps them as tensors, so
// they are checkpointed) and only this op touches them while the bucket is in flight.
#pragma once

#include <atomic>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "comm/communicator.h"
#include "engine/bucket_engine.h"

namespace rumor::ops {

struct PowerSgdMatrix {
  size_t offset = 0;  // first element in the bucket; the matrix is n x m row-major there
  size_t n = 0, m = 0;
  uint32_t k = 0;                     // approximation rank, 1 <= k <= min(n, m)
  size_t p_offset = 0, q_offset = 0;  // into the P (n x k) and Q (m x k) buffers, row-major
};

struct PowerSgdRange {
  size_t offset = 0, count = 0;  // a run of the bucket averaged without compression
};

struct PowerSgdConfig {
  std::vector<PowerSgdMatrix> matrices;
  std::vector<PowerSgdRange> uncompressed;
  double epsilon = 0;       // orthogonalization: column / (norm + epsilon)
  DType wire = DType::F32;  // P, Q and the uncompressed values cross the network as F32, F16 or BF16
};

class PowerSgdBucketOp final : public BucketOp {
 public:
  // count: the bucket's elements (float32). p, q: the P and Q buffers, p_count and q_count float32
  // each, covering every matrix's block. error: count float32 elements of error feedback, or
  // null for none. All are owned by the caller and must outlive the op. warmup: what runs while
  // not compressing (e.g. the shared-bucket allreduce); null: an AVG allreduce.
  PowerSgdBucketOp(PowerSgdConfig config, size_t count, float* p, size_t p_count, float* q, size_t q_count,
                   float* error, std::shared_ptr<BucketOp> warmup = nullptr);

  void run(Communicator& comm, void* data, size_t count, DType dtype) override;
  std::string name() const override { return "PowerSGD"; }

  // Switched by Python between iterations (never while the bucket is in flight).
  void set_compressing(bool on) { compressing_.store(on); }
  bool compressing() const { return compressing_.load(); }

  // Elements one compressing call sends in each of its two allreduces.
  size_t first_count() const { return unc_total_ + p_count_; }
  size_t second_count() const { return q_count_; }

 private:
  void compress(Communicator& comm, float* g);
  // Sums n float32 values at buf over comm in the wire dtype (buf is rounded to it first).
  void allreduce_sum(Communicator& comm, float* buf, size_t n);

  PowerSgdConfig cfg_;
  size_t count_;
  float* p_;
  size_t p_count_;
  float* q_;
  size_t q_count_;
  float* error_;
  std::shared_ptr<BucketOp> warmup_;
  std::atomic<bool> compressing_{false};
  size_t unc_total_ = 0;
  // scratch, sized once
  std::vector<float> send_;  // [uncompressed values | P]
  std::vector<float> qt_;    // one matrix's Q transposed, k x m
  std::vector<double> ortho_;
  std::vector<uint16_t> wire_;
};

}  // namespace rumor::ops
