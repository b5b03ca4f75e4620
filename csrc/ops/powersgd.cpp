#include "ops/powersgd.h"

#include <algorithm>
#include <cstring>
#include <string>

#include "compress/powersgd_kernels.h"
#include "core/half.h"

namespace rumor::ops {

namespace {

[[noreturn]] void bad(const std::string& what) {
  throw Error(ErrorKind::kInvalidArgument, "PowerSGD: " + what);
}

}  // namespace

PowerSgdBucketOp::PowerSgdBucketOp(PowerSgdConfig config, size_t count, float* p, size_t p_count, float* q,
                                   size_t q_count, float* error, std::shared_ptr<BucketOp> warmup)
    : cfg_(std::move(config)),
      count_(count),
      p_(p),
      p_count_(p_count),
      q_(q),
      q_count_(q_count),
      error_(error),
      warmup_(std::move(warmup)) {
  if (cfg_.wire != DType::F32 && cfg_.wire != DType::F16 && cfg_.wire != DType::BF16)
    bad("wire dtype must be float32, float16 or bfloat16, got " + std::string(dtype_name(cfg_.wire)));
  if (!(cfg_.epsilon >= 0)) bad("orthogonalization epsilon must be >= 0");
  if ((p_count > 0 && p == nullptr) || (q_count > 0 && q == nullptr)) bad("null P or Q buffer");
  // Every element of the bucket belongs to exactly one matrix or range: the op rewrites the
  // whole bucket, and an element it skipped would keep this rank's own gradient.
  std::vector<std::pair<size_t, size_t>> spans;
  size_t max_qt = 0, max_pk = 0;
  for (const auto& mx : cfg_.matrices) {
    if (mx.n == 0 || mx.m == 0 || mx.k == 0 || mx.k > std::min(mx.n, mx.m))
      bad("matrix " + std::to_string(mx.n) + " x " + std::to_string(mx.m) + " with rank " +
          std::to_string(mx.k) + " (expected 1 <= rank <= min(n, m))");
    if (mx.p_offset + mx.n * mx.k > p_count || mx.q_offset + mx.m * mx.k > q_count)
      bad("a matrix's P or Q block lies outside the P (" + std::to_string(p_count) + ") or Q (" +
          std::to_string(q_count) + ") buffer");
    spans.emplace_back(mx.offset, mx.n * mx.m);
    max_qt = std::max(max_qt, mx.m * mx.k);
    max_pk = std::max(max_pk, std::max(mx.n, mx.m) * mx.k);
  }
  for (const auto& r : cfg_.uncompressed) {
    spans.emplace_back(r.offset, r.count);
    unc_total_ += r.count;
  }
  std::sort(spans.begin(), spans.end());
  size_t at = 0;
  for (const auto& [off, len] : spans) {
    if (off != at)
      bad("matrices and uncompressed ranges must tile the bucket; element " + std::to_string(at) +
          (off > at ? " is in none" : " is in two"));
    at = off + len;
  }
  if (at != count_)
    bad("matrices and uncompressed ranges cover " + std::to_string(at) + " elements, the bucket has " +
        std::to_string(count_));
  send_.resize(unc_total_ + p_count_);
  qt_.resize(max_qt);
  ortho_.resize(max_pk);
  if (cfg_.wire != DType::F32) wire_.resize(std::max(send_.size(), q_count_));
}

void PowerSgdBucketOp::run(Communicator& comm, void* data, size_t count, DType dtype) {
  if (dtype != DType::F32 || count != count_)
    throw Error(ErrorKind::kInvalidArgument,
                "PowerSGD op: bucket of " + std::to_string(count) + " " + std::string(dtype_name(dtype)) +
                    " elements, but the op was built for " + std::to_string(count_) + " float32");
  if (!compressing_.load()) {
    if (warmup_)
      warmup_->run(comm, data, count, dtype);
    else
      comm.allreduce(data, count, dtype, ReduceOp::AVG);
    return;
  }
  compress(comm, static_cast<float*>(data));
}

void PowerSgdBucketOp::allreduce_sum(Communicator& comm, float* buf, size_t n) {
  if (n == 0) return;
  if (cfg_.wire == DType::F32) {
    if (comm.size() > 1) comm.allreduce(buf, n, DType::F32, ReduceOp::SUM);
    return;
  }
  // Even alone, values are rounded to the wire dtype: a job's results do not depend on its size
  // through whether that rounding happened.
  uint16_t* w = wire_.data();
  if (cfg_.wire == DType::F16) {
    for (size_t i = 0; i < n; ++i) w[i] = half::f32_to_f16(buf[i]);
  } else {
    for (size_t i = 0; i < n; ++i) w[i] = half::f32_to_bf16(buf[i]);
  }
  if (comm.size() > 1) comm.allreduce(w, n, cfg_.wire, ReduceOp::SUM);
  if (cfg_.wire == DType::F16) {
    for (size_t i = 0; i < n; ++i) buf[i] = half::f16_to_f32(w[i]);
  } else {
    for (size_t i = 0; i < n; ++i) buf[i] = half::bf16_to_f32(w[i]);
  }
}

void PowerSgdBucketOp::compress(Communicator& comm, float* g) {
  const auto& kern = compress::powersgd::active_kernels();
  const auto ranks = static_cast<float>(comm.size());  // a divisor, as torch's hook divides
  float* send = send_.data();
  float* p_sum = send + unc_total_;

  // 1. The uncompressed values and this rank's P = M Q, for one allreduce. With error feedback
  //    the matrix is M + error, formed in the error buffer (which afterwards receives
  //    M + error - P Q^T: what this step's approximation leaves out).
  size_t u = 0;
  for (const auto& r : cfg_.uncompressed) {
    std::memcpy(send + u, g + r.offset, r.count * sizeof(float));
    u += r.count;
  }
  for (const auto& mx : cfg_.matrices) {
    float* q = q_ + mx.q_offset;
    compress::powersgd::orthogonalize(q, mx.m, mx.k, cfg_.epsilon, ortho_.data());
    for (size_t j = 0; j < mx.m; ++j)
      for (uint32_t c = 0; c < mx.k; ++c) qt_[c * mx.m + j] = q[j * mx.k + c];
    float* a = error_ != nullptr ? error_ + mx.offset : g + mx.offset;
    kern.project(a, error_ != nullptr ? g + mx.offset : nullptr, mx.n, mx.m, qt_.data(), mx.k,
                 p_sum + mx.p_offset);
  }
  allreduce_sum(comm, send, unc_total_ + p_count_);

  u = 0;
  for (const auto& r : cfg_.uncompressed) {
    for (size_t i = 0; i < r.count; ++i) g[r.offset + i] = send[u + i] / ranks;
    u += r.count;
  }
  if (cfg_.matrices.empty()) return;

  // 2. Orthogonalized P (the same on every rank), then this rank's Q = M^T P, summed.
  std::memcpy(p_, p_sum, p_count_ * sizeof(float));
  for (const auto& mx : cfg_.matrices) {
    float* p = p_ + mx.p_offset;
    compress::powersgd::orthogonalize(p, mx.n, mx.k, cfg_.epsilon, ortho_.data());
    const float* a = error_ != nullptr ? error_ + mx.offset : g + mx.offset;
    kern.back_project(a, mx.n, mx.m, p, mx.k, qt_.data());
    float* q = q_ + mx.q_offset;
    for (size_t j = 0; j < mx.m; ++j)
      for (uint32_t c = 0; c < mx.k; ++c) q[j * mx.k + c] = qt_[c * mx.m + j];
  }
  allreduce_sum(comm, q_, q_count_);
  for (size_t i = 0; i < q_count_; ++i) q_[i] /= ranks;

  // 3. M <- P Q^T, and error <- (M + error) - P Q^T.
  for (const auto& mx : cfg_.matrices) {
    const float* q = q_ + mx.q_offset;
    for (size_t j = 0; j < mx.m; ++j)
      for (uint32_t c = 0; c < mx.k; ++c) qt_[c * mx.m + j] = q[j * mx.k + c];
    kern.reconstruct(p_ + mx.p_offset, mx.n, mx.k, qt_.data(), mx.m, g + mx.offset,
                     error_ != nullptr ? error_ + mx.offset : nullptr);
  }
}

}  // namespace rumor::ops
