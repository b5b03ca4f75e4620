// Compressed collectives and their bucket ops (ByteGrad, QSGD, LowPrecision, 1-bit Adam).
#include <pybind11/stl.h>

#include <memory>
#include <span>
#include <vector>

#include "bindings/common.h"
#include "ops/compressed_allreduce.h"
#include "ops/onebit_allreduce.h"

namespace rumor::bindings {

namespace {

compress::CodecParams codec_params(int kind, uint32_t chunk, uint32_t levels) {
  if (kind < static_cast<int>(compress::Kind::kMinMaxU8) || kind > static_cast<int>(compress::Kind::kBF16))
    throw Error(ErrorKind::kInvalidArgument, "unknown codec kind " + std::to_string(kind));
  return compress::CodecParams{static_cast<compress::Kind>(kind), chunk, levels};
}

float* floats(uintptr_t p) { return reinterpret_cast<float*>(p); }

}  // namespace

void bind_compressed_ops(py::module_& m) {
  using ops::CompressedAllreduce;
  using ops::OneBitAllreduce;
  using ops::OneBitMomentumBucketOp;

  m.def(
      "compressed_allreduce_op",
      [](int kind, uint32_t chunk, uint32_t levels, bool average, bool hierarchical,
         uint64_t seed) -> std::shared_ptr<BucketOp> {
        return std::make_shared<ops::CompressedAllreduceBucketOp>(codec_params(kind, chunk, levels), average,
                                                                  hierarchical, seed);
      },
      py::arg("kind"), py::arg("chunk") = 0, py::arg("levels") = 16, py::arg("average") = true,
      py::arg("hierarchical") = false, py::arg("seed") = 0,
      "Bucket op: compressed allreduce (reduce-scatter + allgather of codec encodings) of the bucket.");

  m.def(
      "compressed_allreduce",
      [](std::shared_ptr<Communicator> c, uintptr_t buf, size_t count, int dtype, int kind, uint32_t chunk,
         uint32_t levels, bool average, bool hierarchical, uint64_t seed, uint64_t step, bool nonblocking) {
        DType dt = to_dtype(dtype);
        auto impl = std::make_shared<CompressedAllreduce>(codec_params(kind, chunk, levels), average,
                                                          hierarchical, seed);
        // The task holds the communicator by address, as every op on its queue does: a queued
        // op keeps no owner, so ~Communicator (which drains the queue) never runs on its own worker.
        Communicator* comm = c.get();
        return dispatch(*c, nonblocking, [comm, impl, buf, count, dt, step] {
          impl->set_calls(step);  // seeds as in the op's call number `step`
          impl->run(*comm, ptr(buf), count, dt);
        });
      },
      py::arg("comm"), py::arg("buf"), py::arg("count"), py::arg("dtype"), py::arg("kind"),
      py::arg("chunk") = 0, py::arg("levels") = 16, py::arg("average") = true,
      py::arg("hierarchical") = false, py::arg("seed") = 0, py::arg("step") = 0,
      py::arg("nonblocking") = false,
      "In-place compressed allreduce of count elements at buf (one call of a fresh op, numbered step).");

  m.def(
      "compressed_blocks",
      [](size_t count, uint32_t size, int kind, uint32_t chunk) {
        return ops::split_blocks(count, size, ops::block_align(codec_params(kind, chunk, 16)));
      },
      py::arg("count"), py::arg("size"), py::arg("kind"), py::arg("chunk") = 0,
      "Elements per rank's block in a compressed allreduce of count elements.");

  m.def(
      "compressed_seed",
      [](uint64_t base, uint64_t step, uint32_t rank, uint32_t block, uint32_t phase) {
        return ops::encode_seed(base, step, rank, block, phase);
      },
      py::arg("base"), py::arg("step"), py::arg("rank"), py::arg("block"), py::arg("phase"),
      "The codec seed a compressed allreduce uses (phase 0: a rank's contribution, 1: the reduced block).");

  py::class_<OneBitMomentumBucketOp, BucketOp, std::shared_ptr<OneBitMomentumBucketOp>>(m, "OneBitMomentumOp")
      .def_property("compressing", &OneBitMomentumBucketOp::compressing,
                    &OneBitMomentumBucketOp::set_compressing)
      .def(
          "set_preconditioner",
          [](OneBitMomentumBucketOp& op, uintptr_t inv_denom) {
            op.set_preconditioner(inv_denom != 0 ? floats(inv_denom) : nullptr);
          },
          py::arg("inv_denom"),
          "Address of count float32 values 1/denominator (0: none); the op then keeps the preconditioned "
          "momentum. Set between iterations only.");

  m.def(
      "onebit_momentum_op",
      [](uintptr_t momentum, uintptr_t worker_error, uintptr_t server_error, size_t count, float beta1,
         uint32_t chunk, std::shared_ptr<BucketOp> warmup, bool hierarchical) {
        return std::make_shared<OneBitMomentumBucketOp>(floats(momentum), floats(worker_error),
                                                        floats(server_error), count, beta1, chunk,
                                                        std::move(warmup), hierarchical);
      },
      py::arg("momentum"), py::arg("worker_error"), py::arg("server_error"), py::arg("count"),
      py::arg("beta1"), py::arg("chunk") = 0, py::arg("warmup") = nullptr, py::arg("hierarchical") = false,
      "Bucket op of 1-bit Adam over float32 buffers of count elements owned by the caller: full-precision "
      "gradient average while not compressing (the warmup op, or an AVG allreduce); else momentum update "
      "from the local gradient and 1-bit allreduce of the momentum with error feedback (hierarchical: "
      "averaged at full precision inside each host, 1-bit among the host leaders).");

  m.def(
      "onebit_allreduce",
      [](std::shared_ptr<Communicator> c, uintptr_t buf, size_t count, uintptr_t worker_error,
         uintptr_t server_error, uint32_t chunk) {
        auto impl = std::make_shared<OneBitAllreduce>(chunk);
        dispatch(*c, false, [c, impl, buf, count, worker_error, server_error] {
          impl->run(*c, floats(buf), count, std::span<float>(floats(worker_error), worker_error ? count : 0),
                    std::span<float>(floats(server_error), server_error ? count : 0));
        });
      },
      py::arg("comm"), py::arg("buf"), py::arg("count"), py::arg("worker_error"), py::arg("server_error"),
      py::arg("chunk") = 0,
      "In-place 1-bit average of count float32 elements with error feedback through the given buffers.");
}

}  // namespace rumor::bindings
