// Bindings of the decentralized training ops (csrc/ops/decentralized_op.h). Python computes
// each step's peers; the weight exchange itself runs on the communicator's worker.
#include <pybind11/stl.h>

#include <tuple>
#include <vector>

#include "bindings/common.h"
#include "ops/decentralized_op.h"

namespace rumor::bindings {

namespace {

ops::MixPlan make_plan(bool average_all, double self_weight,
                       const std::vector<std::tuple<uint32_t, double>>& srcs,
                       const std::vector<uint32_t>& dsts) {
  ops::MixPlan plan;
  plan.average_all = average_all;
  plan.self_weight = self_weight;
  for (const auto& [r, w] : srcs) plan.srcs.emplace_back(r, w);
  plan.dsts = dsts;
  return plan;
}

using MixOps = std::vector<std::shared_ptr<ops::WeightMixOp>>;
using LowOps = std::vector<std::shared_ptr<ops::LowPrecisionMixOp>>;

}  // namespace

void bind_decentralized_ops(py::module_& m) {
  // A class of its own: the wrapper leaves .grad where autograd put it for these buckets
  // (python/rumor/parallel.py), saving a copy of every gradient per step.
  py::class_<ops::LocalBucketOp, BucketOp, std::shared_ptr<ops::LocalBucketOp>>(m, "LocalBucketOp");
  m.def(
      "local_op", []() -> std::shared_ptr<BucketOp> { return std::make_shared<ops::LocalBucketOp>(); },
      "Bucket op that leaves gradients local (for algorithms that communicate weights).");

  py::class_<ops::WeightMixOp, BucketOp, std::shared_ptr<ops::WeightMixOp>>(m, "WeightMixOp")
      .def(py::init([](uintptr_t weights, uintptr_t out, size_t count, int dtype, bool hierarchical,
                       std::shared_ptr<SharedArena> arena) {
             return std::make_shared<ops::WeightMixOp>(weights, out, count, to_dtype(dtype), hierarchical,
                                                       std::move(arena));
           }),
           py::arg("weights"), py::arg("out"), py::arg("count"), py::arg("dtype"), py::arg("hierarchical"),
           py::arg("arena") = nullptr,
           "Mixes a flat weight buffer with peers' copies into `out` (same size, not overlapping). With "
           "`arena` (a SharedArena holding both buffers), a whole-host average reads the peers in place.")
      .def_property_readonly("count", &ops::WeightMixOp::count)
      .def("share_scratch", &ops::WeightMixOp::share_scratch, py::arg("other"),
           "Receive into other's buffer (for ops that never run at the same time).")
      .def(
          "set_plan",
          [](ops::WeightMixOp& op, bool average_all, double self_weight,
             const std::vector<std::tuple<uint32_t, double>>& srcs, const std::vector<uint32_t>& dsts) {
            op.set_plan(make_plan(average_all, self_weight, srcs, dsts));
          },
          py::arg("average_all"), py::arg("self_weight"), py::arg("srcs"), py::arg("dsts"),
          "The plan used when the engine runs this op as a bucket op. Not while it runs.");

  m.def(
      "weight_mix",
      [](Communicator& comm, MixOps mix_ops, bool average_all, double self_weight,
         const std::vector<std::tuple<uint32_t, double>>& srcs, const std::vector<uint32_t>& dsts,
         bool nonblocking) {
        for (const auto& op : mix_ops)
          if (!op) throw Error(ErrorKind::kInvalidArgument, "weight_mix: None among the ops");
        ops::MixPlan plan = make_plan(average_all, self_weight, srcs, dsts);
        // One job for all buckets: one hand-off to the worker per step, buckets in list order.
        return dispatch(comm, nonblocking, [&comm, mix_ops = std::move(mix_ops), plan = std::move(plan)] {
          for (const auto& op : mix_ops) op->mix(comm, plan);
        });
      },
      py::arg("comm"), py::arg("ops"), py::arg("average_all"), py::arg("self_weight"), py::arg("srcs"),
      py::arg("dsts"), py::arg("nonblocking"),
      "Runs every op's weight mix with one plan: srcs = [(rank, weight)], dsts = [rank]. Returns a Work "
      "when nonblocking.");

  py::class_<ops::LowPrecisionMixOp, std::shared_ptr<ops::LowPrecisionMixOp>>(m, "LowPrecisionMixOp")
      .def(py::init([](uintptr_t weights, size_t count, int dtype, bool hierarchical, uint32_t chunk) {
             return std::make_shared<ops::LowPrecisionMixOp>(weights, count, to_dtype(dtype), hierarchical,
                                                             chunk);
           }),
           py::arg("weights"), py::arg("count"), py::arg("dtype"), py::arg("hierarchical"),
           py::arg("chunk") = 0)
      .def_property_readonly("count", &ops::LowPrecisionMixOp::count)
      .def("copy_state", &ops::LowPrecisionMixOp::copy_state, py::arg("which"),
           "0: this rank's tracked copy, 1: left neighbour's replica, 2: right neighbour's replica (empty "
           "where this rank keeps none).");

  m.def(
      "low_precision_prepare",
      [](Communicator& comm, LowOps low_ops) {
        dispatch(comm, false, [&comm, &low_ops] {
          for (const auto& op : low_ops) op->prepare(comm);
        });
      },
      py::arg("comm"), py::arg("ops"),
      "Mixes toward the replicas and compresses the step's differences (blocking).");
  m.def(
      "low_precision_exchange",
      [](Communicator& comm, LowOps low_ops, bool nonblocking) {
        return dispatch(comm, nonblocking, [&comm, low_ops = std::move(low_ops)] {
          for (const auto& op : low_ops) op->exchange(comm);
        });
      },
      py::arg("comm"), py::arg("ops"), py::arg("nonblocking"),
      "Sends the compressed differences to both ring neighbours and updates their replicas.");
}

}  // namespace rumor::bindings
