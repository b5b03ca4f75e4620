// Neighbor exchange over graph topologies (comm/neighbor.h) for python/rumor/neighbor/ops.py.
// Ranks here are communicator ranks; Python maps global ranks onto them.
#include "comm/neighbor.h"

#include <pybind11/stl.h>

#include <memory>
#include <utility>
#include <vector>

#include "bindings/common.h"

namespace rumor::bindings {

namespace {

using Edges = std::vector<std::pair<uint32_t, double>>;

std::vector<NeighborEdge> to_edges(const Edges& e) {
  std::vector<NeighborEdge> v;
  v.reserve(e.size());
  for (const auto& [r, w] : e) v.push_back({r, w});
  return v;
}

using WeightedOp = void (*)(Communicator&, const void*, void*, size_t, DType, double,
                            std::span<const NeighborEdge>, std::span<const NeighborEdge>, bool,
                            NeighborScratch*);

// The binding of a weighted neighbor op (flat or hierarchical): same arguments, same dispatch.
template <WeightedOp Op>
std::shared_ptr<Work> run_weighted(Communicator& c, uintptr_t in, uintptr_t out, size_t count, int dtype,
                                   double self_weight, const Edges& srcs, const Edges& dsts, bool topo_check,
                                   bool nb, std::shared_ptr<NeighborScratch> scratch) {
  DType dt = to_dtype(dtype);
  // The scratch is captured by value: it lives until the operation has finished.
  return dispatch(c, nb,
                  [&c, in, out, count, dt, self_weight, s = to_edges(srcs), d = to_edges(dsts), topo_check,
                   scratch = std::move(scratch)] {
                    Op(c, ptr(in), ptr(out), count, dt, self_weight, s, d, topo_check, scratch.get());
                  });
}

}  // namespace

void bind_neighbor(py::module_& m) {
  using C = Communicator;
  using Scratch = std::shared_ptr<NeighborScratch>;
  py::class_<NeighborScratch, Scratch>(m, "NeighborScratch",
                                       "Receive/scale buffers reused by the neighbor ops of one communicator "
                                       "(whose operations run one at a time).")
      .def(py::init<>())
      .def_property_readonly("bytes", [](const NeighborScratch& s) {
        size_t b = s.recv.capacity();
        for (const auto& v : s.scaled) b += v.capacity();
        return b;
      });
  m.def(
      "neighbor_allreduce", &run_weighted<&neighbor_allreduce>, py::arg("comm"), py::arg("input"),
      py::arg("output"), py::arg("count"), py::arg("dtype"), py::arg("self_weight"), py::arg("srcs"),
      py::arg("dsts"), py::arg("topo_check"), py::arg("nonblocking"), py::arg("scratch") = nullptr,
      "out = self_weight*in + sum of w*received over srcs [(rank, weight)]; sends in*w to dsts [(rank, w)].");
  m.def(
      "neighbor_allgather",
      [](C& c, uintptr_t in, size_t bytes, std::vector<uint32_t> srcs, std::vector<size_t> recv_bytes,
         std::vector<uint32_t> dsts, uintptr_t out, bool topo_check, bool nb) {
        return dispatch(
            c, nb,
            [&c, in, bytes, s = std::move(srcs), rb = std::move(recv_bytes), d = std::move(dsts), out,
             topo_check] { neighbor_allgather(c, ptr(in), bytes, s, rb, d, ptr(out), topo_check); });
      },
      py::arg("comm"), py::arg("input"), py::arg("bytes"), py::arg("srcs"), py::arg("recv_bytes"),
      py::arg("dsts"), py::arg("output"), py::arg("topo_check"), py::arg("nonblocking"),
      "Sends bytes of input to every dst; receives recv_bytes[k] from srcs[k] into output, in srcs order.");
  m.def(
      "neighbor_exchange_words",
      [](C& c, std::vector<uint64_t> words, std::vector<uint32_t> srcs, std::vector<uint32_t> dsts,
         bool topo_check) {
        std::vector<uint64_t> got;
        dispatch(c, false, [&] { got = neighbor_exchange_words(c, words, srcs, dsts, topo_check); });
        return got;
      },
      py::arg("comm"), py::arg("words"), py::arg("srcs"), py::arg("dsts"), py::arg("topo_check"),
      "Sends the u64 words to every dst; returns what each src sent (blocking).");
  m.def("hierarchical_neighbor_allreduce", &run_weighted<&hierarchical_neighbor_allreduce>, py::arg("comm"),
        py::arg("input"), py::arg("output"), py::arg("count"), py::arg("dtype"), py::arg("self_weight"),
        py::arg("machine_srcs"), py::arg("machine_dsts"), py::arg("topo_check"), py::arg("nonblocking"),
        py::arg("scratch") = nullptr,
        "Host average, neighbor_allreduce among host leaders over machine ranks, host broadcast.");
  m.def(
      "check_topology",
      [](C& c, std::vector<uint32_t> srcs, std::vector<uint32_t> dsts) {
        dispatch(c, false, [&] { check_topology(c, srcs, dsts, "topology check"); });
      },
      py::arg("comm"), py::arg("srcs"), py::arg("dsts"),
      "Collective: raises ValueError on every rank if some rank's sends do not match its receivers' lists.");
}

}  // namespace rumor::bindings
