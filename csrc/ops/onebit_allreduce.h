// 1-bit allreduce: the exchange of ops/block_exchange.h with sign compression and error feedback
// on both sides (the scheme of 1-bit Adam): the worker adds what its last compression lost before
// compressing again, and so does the owner ("server") of each block.
#pragma once

#include <atomic>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>
#include <span>
#include <vector>

#include "comm/communicator.h"
#include "compress/codec.h"
#include "engine/bucket_engine.h"
#include "ops/block_exchange.h"

namespace rumor::ops {

// 1-bit (sign + per-chunk scale) allreduce of a float32 buffer with error feedback. The error
// buffers are state that must persist between calls on the same buffer: each holds, per element,
// what the last compression of that element lost. They are either owned here or lent by the
// caller (Python keeps them in the optimizer state so that they are checkpointed).
class OneBitAllreduce {
 public:
  // chunk: elements per sign-codec chunk (one scale each); 0 = the codec's default.
  explicit OneBitAllreduce(uint32_t chunk = 0);

  // Averages buf over comm's ranks, in place. worker_error and server_error (count elements
  // each, or empty to use owned buffers sized on first use) carry the error feedback; only this
  // rank's block of server_error is used.
  void run(Communicator& comm, float* buf, size_t count, std::span<float> worker_error = {},
           std::span<float> server_error = {});
  // As run(), but the worker's compressed input (input + worker error) is produced tile by tile:
  // fill(begin, n, x) writes elements [begin, begin + n) of it into x. buf only receives the
  // result. Fusing the caller's pass (e.g. a momentum update) with the encoding keeps each tile
  // in cache: one pass over memory instead of several.
  using Fill = std::function<void(size_t begin, size_t n, float* x)>;
  void run_filled(Communicator& comm, float* buf, size_t count, std::span<float> worker_error,
                  std::span<float> server_error, const Fill& fill);

  // The owned error buffers (empty until the first run that uses them).
  std::span<const float> worker_error() const { return own_worker_; }
  std::span<const float> server_error() const { return own_server_; }
  const compress::Codec& codec() const { return *codec_; }
  size_t align() const { return align_; }

 private:
  std::unique_ptr<compress::Codec> codec_;
  size_t align_;
  std::vector<float> own_worker_, own_server_;
  std::vector<std::byte> enc_, recv_, gathered_;
  std::vector<float> acc_, tile_;
};

// Bucket op of 1-bit Adam. In warm-up it averages the gradient bucket at full precision (the
// optimizer then runs plain Adam). Once compressing, it updates the bucket's momentum from the
// local gradient, m = beta1 * m + (1 - beta1) * g, and replaces m by its 1-bit average over the
// ranks with error feedback, on the comm thread while backward goes on. The momentum and error
// buffers (count float32 elements each) belong to the caller and must outlive the op.
// warmup: the op that averages the gradient during warm-up (e.g. the shared-bucket allreduce);
// null: the communicator's allreduce.
class OneBitMomentumBucketOp final : public BucketOp {
 public:
  // hierarchical: momenta are averaged at full precision inside each host and compressed only
  // among one leader per host (whose error buffers carry the feedback; the others' stay zero).
  OneBitMomentumBucketOp(float* momentum, float* worker_error, float* server_error, size_t count, float beta1,
                         uint32_t chunk, std::shared_ptr<BucketOp> warmup = nullptr,
                         bool hierarchical = false);
  void run(Communicator& comm, void* data, size_t count, DType dtype) override;
  std::string name() const override {
    return hierarchical_ ? "1-bit momentum allreduce (hierarchical)" : "1-bit momentum allreduce";
  }

  // Switched by Python between iterations (never while the bucket is in flight).
  void set_compressing(bool on) { compressing_.store(on); }
  bool compressing() const { return compressing_.load(); }
  // 1 / Adam's frozen denominator, count elements (null: none). With it the op keeps and
  // communicates the preconditioned momentum u = m / denom: u = beta1 * u + (1 - beta1) * g / denom.
  // Then compression error is measured in units of the parameter update, so an element whose
  // variance is tiny does not turn its chunk's sign scale into a huge step.
  void set_preconditioner(const float* inv_denom) { inv_denom_ = inv_denom; }

 private:
  float* momentum_;
  const float* inv_denom_ = nullptr;
  float* worker_error_;
  float* server_error_;
  size_t count_;
  float beta1_;
  std::atomic<bool> compressing_{false};
  OneBitAllreduce impl_;
  std::shared_ptr<BucketOp> warmup_;
  bool hierarchical_;
};

}  // namespace rumor::ops
