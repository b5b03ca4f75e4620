// Allreduce with compressed messages: a reduce-scatter and an allgather whose every message is
// a codec encoding (csrc/compress/codec.h). Each rank owns one block of the buffer; peers send
// it their encoded contributions to that block, it reduces them in float32 (its own part at full
// precision), re-encodes the result once and every rank decodes every block from those bytes.
// Since all ranks decode the same bytes with the same decoder, every rank ends with bitwise
// identical results, and each value crossed the codec exactly twice.
//
// OneBitAllreduce is the same exchange with sign compression and error feedback on both sides
// (the scheme of 1-bit Adam): the worker adds what its last compression lost before compressing
// again, and so does the owner ("server") of each block.
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

namespace rumor::ops {

// Frame opcodes of the compressed collectives (beyond the communicator's own).
constexpr Opcode kCompressedAllreduceOpcode = static_cast<Opcode>(40);
constexpr Opcode kOneBitAllreduceOpcode = static_cast<Opcode>(41);

// Splits count elements into n blocks whose boundaries fall on multiples of `align` elements
// (the codec's chunk: a chunk cut in two would carry two headers and two scales). Block sizes
// differ by at most `align`; the last non-empty block takes the remainder.
std::vector<size_t> split_blocks(size_t count, uint32_t n, size_t align);

// Elements per block boundary for a codec: its chunk, or a fixed granule for codecs without one.
size_t block_align(const compress::CodecParams& params);

// The piece length the compressed allreduce of `count` elements over n ranks cuts its blocks
// into when asked for pieces of `piece_elements` (rounded to the block alignment), or 0 when it
// keeps whole blocks (pipelining off, or no block longer than one piece).
size_t pipeline_piece(const compress::CodecParams& params, size_t count, uint32_t n, size_t piece_elements);

// A seed for one encoding: distinct for every (base, step, rank, block, phase), and the same on
// every run, so stochastic rounding is reproducible.
uint64_t encode_seed(uint64_t base, uint64_t step, uint32_t rank, uint32_t block, uint32_t phase);

// The seed of piece `piece` of a pipelined block whose whole-block seed is block_seed (piece 0
// keeps it). QSGD's draws follow an element's position inside its encoding, so each piece draws
// afresh under its own seed: a pipelined QSGD allreduce is as reproducible and as random as the
// whole-block one, but its bytes differ from it. Deterministic codecs ignore seeds.
uint64_t piece_seed(uint64_t block_seed, size_t piece);

// Compressed allreduce of F32, F16, BF16 or F64 buffers. One object per bucket: it keeps its
// scratch buffers and a call counter that varies the stochastic-rounding seeds from step to step.
// Not thread-safe (a bucket's op runs on its communicator's worker thread only).
class CompressedAllreduce {
 public:
  // hierarchical: full-precision reduce inside each host, compressed allreduce among one leader
  // per host, broadcast inside the host. average: divide by the number of ranks.
  CompressedAllreduce(const compress::CodecParams& params, bool average, bool hierarchical,
                      uint64_t seed = 0);

  void run(Communicator& comm, void* buf, size_t count, DType dtype);

  const compress::Codec& codec() const { return *codec_; }
  const compress::CodecParams& params() const { return params_; }
  bool average() const { return average_; }
  bool hierarchical() const { return hierarchical_; }
  uint64_t calls() const { return calls_; }
  // Renumbers the next call (its seeds), e.g. to replay one step of a bucket's op.
  void set_calls(uint64_t calls) { calls_ = calls; }
  // Elements per piece of the pipelined schedule for large blocks (rounded to the block
  // alignment; default 2^18); 0 turns pipelining off. Every rank must use the same value.
  void set_piece_elements(size_t elements) { piece_ = elements; }

 private:
  // The reduce-scatter + allgather on comm; the owner divides its reduced block by divisor.
  void flat(Communicator& comm, std::byte* buf, size_t count, DType dtype, double divisor, uint64_t step,
            const net::OpInfo& op);
  // flat() for large buffers: each block is cut into pieces that are encoded, sent, reduced and
  // decoded one after another, so codec work overlaps the transfers of neighbouring pieces.
  void pipelined(Communicator& comm, std::byte* buf, size_t count, DType dtype, double divisor, uint64_t step,
                 const net::OpInfo& op, size_t piece);

  compress::CodecParams params_;
  std::unique_ptr<compress::Codec> codec_;
  bool average_;
  bool hierarchical_;
  uint64_t seed_;
  uint64_t calls_ = 0;
  size_t piece_ = size_t{1} << 18;
  std::vector<std::byte> send_, recv_, gathered_;
  std::vector<float> acc_;
};

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

// Bucket op: compressed allreduce of the bucket (ByteGrad, QSGD, LowPrecision).
class CompressedAllreduceBucketOp final : public BucketOp {
 public:
  CompressedAllreduceBucketOp(const compress::CodecParams& params, bool average, bool hierarchical,
                              uint64_t seed = 0)
      : impl_(params, average, hierarchical, seed) {}
  void run(Communicator& comm, void* data, size_t count, DType dtype) override {
    impl_.run(comm, data, count, dtype);
  }
  std::string name() const override;

 private:
  CompressedAllreduce impl_;
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
