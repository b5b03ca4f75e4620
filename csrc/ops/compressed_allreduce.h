// Allreduce with compressed messages: a reduce-scatter and an allgather whose every message is
// a codec encoding (csrc/compress/codec.h). Each rank owns one block of the buffer; peers send
// it their encoded contributions to that block, it reduces them in float32 (its own part at full
// precision), re-encodes the result once and every rank decodes every block from those bytes.
// Since all ranks decode the same bytes with the same decoder, every rank ends with bitwise
// identical results, and each value crossed the codec exactly twice.
// The 1-bit allreduce of 1-bit Adam shares the exchange (ops/block_exchange.h) and lives in
// ops/onebit_allreduce.h.
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <vector>

#include "comm/communicator.h"
#include "compress/codec.h"
#include "engine/bucket_engine.h"
#include "ops/block_exchange.h"

namespace rumor::ops {

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

}  // namespace rumor::ops
