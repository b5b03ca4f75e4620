#include "ops/onebit_allreduce.h"

#include <algorithm>
#include <string>

namespace rumor::ops {

OneBitAllreduce::OneBitAllreduce(uint32_t chunk)
    : codec_(compress::make_codec(compress::CodecParams{compress::Kind::kSign, chunk, 16})),
      align_(block_align(compress::CodecParams{compress::Kind::kSign, chunk, 16})) {}

void OneBitAllreduce::run(Communicator& comm, float* buf, size_t count, std::span<float> worker_error,
                          std::span<float> server_error) {
  const float* we = worker_error.empty() ? nullptr : worker_error.data();
  run_filled(comm, buf, count, worker_error, server_error,
             [this, buf, &we](size_t begin, size_t n, float* x) {
               const float* e = we != nullptr ? we : own_worker_.data();
               for (size_t i = 0; i < n; ++i) x[i] = buf[begin + i] + e[begin + i];
             });
}

void OneBitAllreduce::run_filled(Communicator& comm, float* buf, size_t count, std::span<float> worker_error,
                                 std::span<float> server_error, const Fill& fill) {
  net::OpInfo op = comm.begin_op("1-bit allreduce", kOneBitAllreduceOpcode);
  op.bytes = static_cast<int64_t>(count * sizeof(float));
  if ((!worker_error.empty() && worker_error.size() != count) ||
      (!server_error.empty() && server_error.size() != count))
    throw Error(ErrorKind::kInvalidArgument, op.where() + ": error buffers of " +
                                                 std::to_string(worker_error.size()) + " and " +
                                                 std::to_string(server_error.size()) +
                                                 " elements for a buffer of " + std::to_string(count));
  if (comm.size() == 1) return;  // a single rank's average is its input: nothing is lost
  // Owned errors belong to one buffer: a buffer of another size starts from zero error.
  if (worker_error.empty()) {
    if (own_worker_.size() != count) own_worker_.assign(count, 0.0f);
    worker_error = own_worker_;
  }
  if (server_error.empty()) {
    if (own_server_.size() != count) own_server_.assign(count, 0.0f);
    server_error = own_server_;
  }
  comm.run_guarded(op, [&] {
    const uint32_t n = comm.size(), r = comm.rank();
    const Blocks blocks(count, n, align_, *codec_);
    const auto& counts = blocks.counts;
    const auto& off = blocks.off;
    const auto& enc = blocks.enc;
    const auto& eoff = blocks.eoff;
    enc_.resize(blocks.wire_bytes());
    recv_.resize(static_cast<size_t>(n - 1) * enc[r]);
    std::byte* wire = enc_.data();
    float* we = worker_error.data();

    // Worker: compress input + carried error, keep what this compression loses. Tile by tile,
    // so the input is produced (fill), encoded and its error taken while it is in cache.
    for (uint32_t j = 0; j < n; ++j) {
      if (counts[j] == 0) continue;
      compress::SignTileEncoder tiles(*codec_, counts[j], wire + eoff[j], enc[j]);
      tile_.resize(tiles.tile());
      for (size_t t = 0; t < counts[j]; t += tiles.tile()) {
        const size_t len = std::min(tiles.tile(), counts[j] - t);
        fill(off[j] + t, len, tile_.data());
        tiles.encode_tile(t, tile_.data(), len, we + off[j] + t);
      }
    }
    scatter_to_owners(comm, op, blocks, wire, recv_.data());

    // Server: average the compressed contributions (its own included, as sent), add its carried
    // error, compress once more and keep what that loses.
    if (counts[r] > 0) {
      const size_t c = counts[r];
      acc_.resize(c);
      for (uint32_t q = 0; q < n; ++q) {
        const std::byte* src = q == r ? wire + eoff[r] : recv_.data() + peer_slot(q, r) * enc[r];
        codec_->decode(src, enc[r], acc_.data(), c, DType::F32, q != 0);
      }
      float* es = server_error.data() + off[r];
      const auto nf = static_cast<float>(n);
      for (size_t i = 0; i < c; ++i) acc_[i] = acc_[i] / nf + es[i];
      compress::SignTileEncoder tiles(*codec_, c, wire + eoff[r], enc[r]);
      for (size_t t = 0; t < c; t += tiles.tile())
        tiles.encode_tile(t, acc_.data() + t, std::min(tiles.tile(), c - t), es + t);
    }

    gather_from_owners(comm, op, blocks, wire);
    for (uint32_t j = 0; j < n; ++j)
      if (counts[j] > 0) codec_->decode(wire + eoff[j], enc[j], buf + off[j], counts[j], DType::F32, false);
  });
}

// ---- bucket op --------------------------------------------------------------------------------

OneBitMomentumBucketOp::OneBitMomentumBucketOp(float* momentum, float* worker_error, float* server_error,
                                               size_t count, float beta1, uint32_t chunk,
                                               std::shared_ptr<BucketOp> warmup, bool hierarchical)
    : momentum_(momentum),
      worker_error_(worker_error),
      server_error_(server_error),
      count_(count),
      beta1_(beta1),
      impl_(chunk),
      warmup_(std::move(warmup)),
      hierarchical_(hierarchical) {
  if (count > 0 && (momentum == nullptr || worker_error == nullptr || server_error == nullptr))
    throw Error(ErrorKind::kInvalidArgument, "1-bit momentum op: null momentum or error buffer");
  if (!(beta1 >= 0.0f && beta1 < 1.0f))
    throw Error(ErrorKind::kInvalidArgument,
                "1-bit momentum op: beta1 must be in [0, 1), got " + std::to_string(beta1));
}

void OneBitMomentumBucketOp::run(Communicator& comm, void* data, size_t count, DType dtype) {
  if (dtype != DType::F32 || count != count_)
    throw Error(ErrorKind::kInvalidArgument, "1-bit momentum op: bucket of " + std::to_string(count) + " " +
                                                 std::string(dtype_name(dtype)) +
                                                 " elements, but its momentum holds " +
                                                 std::to_string(count_) + " float32");
  if (!compressing_.load()) {
    // Warm-up: plain Adam on the averaged gradient.
    if (warmup_)
      warmup_->run(comm, data, count, dtype);
    else
      comm.allreduce(data, count, dtype, ReduceOp::AVG);
    return;
  }
  const auto* g = static_cast<const float*>(data);
  const float b = beta1_, a = 1.0f - beta1_;
  auto update_locally = [&] {
    for (size_t i = 0; i < count; ++i)
      momentum_[i] = b * momentum_[i] + a * g[i] * (inv_denom_ != nullptr ? inv_denom_[i] : 1.0f);
  };
  if (comm.size() == 1) {  // nothing to compress: the momentum is the average
    update_locally();
    return;
  }
  if (hierarchical_) {
    update_locally();
    if (comm.all_local()) {  // no host boundary to compress across
      comm.allreduce(momentum_, count, DType::F32, ReduceOp::AVG);
      return;
    }
    net::OpInfo op = comm.begin_op("1-bit momentum allreduce (hierarchical)", kOneBitAllreduceOpcode);
    comm.run_guarded(op, [&] {
      Communicator& local = comm.local_comm();
      local.reduce(momentum_, count, DType::F32, ReduceOp::SUM, 0);
      // Several hosts (checked above), so the leaders' group has at least two members.
      if (Communicator* leaders = comm.leaders_comm()) {
        // The 1-bit allreduce averages over leaders; scaling each host's sum by leaders / ranks
        // makes that the average over every rank, also for hosts of different sizes.
        const float scale = static_cast<float>(leaders->size()) / static_cast<float>(comm.size());
        const float* m = momentum_;
        const float* we = worker_error_;
        impl_.run_filled(*leaders, momentum_, count, {worker_error_, count}, {server_error_, count},
                         [=](size_t begin, size_t n, float* x) {
                           for (size_t i = begin; i < begin + n; ++i) x[i - begin] = m[i] * scale + we[i];
                         });
      }
      local.broadcast(momentum_, count, DType::F32, 0);
    });
    return;
  }
  // The momentum update and the worker's error feedback are computed tile by tile inside the
  // 1-bit allreduce (m + e_w is what the worker compresses); the momentum itself is overwritten by
  // the average afterwards, so the update is never stored.
  const float* u = momentum_;
  const float* we = worker_error_;
  const float* inv = inv_denom_;
  impl_.run_filled(comm, momentum_, count, {worker_error_, count}, {server_error_, count},
                   [=](size_t begin, size_t n, float* x) {
                     if (inv != nullptr) {
                       for (size_t i = begin; i < begin + n; ++i)
                         x[i - begin] = b * u[i] + a * g[i] * inv[i] + we[i];
                     } else {
                       for (size_t i = begin; i < begin + n; ++i) x[i - begin] = b * u[i] + a * g[i] + we[i];
                     }
                   });
}

}  // namespace rumor::ops
