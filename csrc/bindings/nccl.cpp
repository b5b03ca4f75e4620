// NCCL for Python (python/rumor/_nccl.py finds the library and shares the unique id). Buffers
// are device addresses and streams torch's stream handles, as integers: no torch or CUDA header.
// Every call that can wait (init, enqueue on a nonblocking communicator, wait, close) releases
// the GIL. Present in every build: the library is loaded at run time, with or without nvcc.
#include <pybind11/functional.h>
#include <pybind11/stl.h>

#include <cmath>
#include <memory>
#include <string>
#include <vector>

#include "bindings/common.h"
#include "cuda/nccl_comm.h"
#include "cuda/nccl_lib.h"

namespace rumor::bindings {

namespace {

using nccl::NcclCommunicator;
using nccl::NcclLibrary;

// A str or os.PathLike is one explicit file; any other iterable is a list of candidates.
std::vector<std::string> candidates_of(const py::handle& spec) {
  py::module_ os = py::module_::import("os");
  if (py::isinstance<py::str>(spec) || py::hasattr(spec, "__fspath__"))
    return {py::str(os.attr("fspath")(spec)).cast<std::string>()};
  if (py::isinstance<py::bytes>(spec) || !py::hasattr(spec, "__iter__"))
    throw py::type_error(
        "NcclLibrary(): expected a path (str or os.PathLike) or a list of paths and names, got " +
        std::string(py::str(py::type::of(spec).attr("__name__"))));
  std::vector<std::string> out;
  for (const py::handle& item : spec) {
    if (!py::isinstance<py::str>(item) && !py::hasattr(item, "__fspath__"))
      throw py::type_error("NcclLibrary(): every candidate must be a str or os.PathLike, got " +
                           std::string(py::str(py::type::of(item).attr("__name__"))));
    out.push_back(py::str(os.attr("fspath")(item)).cast<std::string>());
  }
  if (out.empty()) throw py::value_error("NcclLibrary(): the list of candidates is empty");
  return out;
}

size_t count_of(int64_t count, const char* what) {
  if (count < 0)
    throw py::value_error(std::string(what) + ": count must be >= 0, got " + std::to_string(count));
  return static_cast<size_t>(count);
}

double timeout_of(double seconds, const char* what) {
  if (!(seconds > 0) || !std::isfinite(seconds))
    throw py::value_error(std::string(what) + ": timeout must be positive and finite, got " +
                          std::to_string(seconds));
  return seconds;
}

std::vector<nccl::P2p> p2p_list(const std::vector<std::tuple<uintptr_t, int64_t, int>>& items,
                                const char* what) {
  std::vector<nccl::P2p> out;
  for (const auto& [buf, count, peer] : items) out.push_back(nccl::P2p{buf, count_of(count, what), peer});
  return out;
}

}  // namespace

void bind_nccl(py::module_& m) {
  py::class_<NcclLibrary, std::shared_ptr<NcclLibrary>>(
      m, "NcclLibrary",
      "An NCCL library loaded at run time: NcclLibrary(path) or NcclLibrary([path or name, ...]), "
      "the first usable candidate wins (rumor._nccl.load() chooses them).")
      .def(py::init([](const py::object& spec) {
             std::vector<std::string> c = candidates_of(spec);
             py::gil_scoped_release nogil;  // dlopen of libnccl maps ~200 MB
             return std::make_shared<NcclLibrary>(c);
           }),
           py::arg("path_or_candidates"))
      .def_property_readonly("version", &NcclLibrary::version, "\"major.minor.patch\" of the loaded NCCL")
      .def_property_readonly("version_code", &NcclLibrary::version_code,
                             "NCCL_VERSION_CODE of the loaded NCCL")
      .def_property_readonly("path", &NcclLibrary::path, "the file the dynamic loader opened")
      .def(
          "unique_id",
          [](const NcclLibrary& lib) {
            nccl::UniqueIdBytes id{};
            {
              py::gil_scoped_release nogil;
              id = lib.unique_id();
            }
            return py::bytes(reinterpret_cast<const char*>(id.data()), id.size());
          },
          "A fresh 128-byte ncclUniqueId for a new communicator (made on one rank, sent to all).")
      .def_property_readonly_static("min_version", [](const py::object&) {
        return NcclLibrary::version_string(NcclLibrary::kMinVersionCode);
      });

  using C = NcclCommunicator;
  py::class_<C, std::shared_ptr<C>>(
      m, "NcclCommunicator",
      "One rank of an NCCL communicator; see docs/gpu.md for its deadlines and aborts.")
      .def(
          py::init([](std::shared_ptr<NcclLibrary> lib, const py::bytes& uid, int nranks, int rank,
                      double timeout_s) {
            if (!lib) throw py::type_error("NcclCommunicator(): lib must be an NcclLibrary, got None");
            std::string id = uid;
            if (id.size() != nccl::abi::kUniqueIdBytes)
              throw py::value_error("NcclCommunicator(): the unique id must be " +
                                    std::to_string(nccl::abi::kUniqueIdBytes) +
                                    " bytes (NcclLibrary.unique_id()), got " + std::to_string(id.size()));
            if (nranks < 1)
              throw py::value_error("NcclCommunicator(): nranks must be >= 1, got " + std::to_string(nranks));
            if (rank < 0 || rank >= nranks)
              throw py::value_error("NcclCommunicator(): rank " + std::to_string(rank) + " is outside [0, " +
                                    std::to_string(nranks) + ")");
            timeout_of(timeout_s, "NcclCommunicator()");
            nccl::UniqueIdBytes bytes{};
            std::memcpy(bytes.data(), id.data(), bytes.size());
            py::gil_scoped_release nogil;
            // NCCL binds the communicator to this thread's current CUDA device: the caller sets it
            // (torch.cuda.device(...)) around this call.
            return std::make_shared<C>(std::move(lib), bytes, nranks, rank, nullptr,
                                       Deadline::after(timeout_s), timeout_s);
          }),
          py::arg("lib"), py::arg("unique_id"), py::arg("nranks"), py::arg("rank"), py::arg("timeout"))
      .def_property_readonly("rank", &C::rank)
      .def_property_readonly("size", &C::size)
      .def_property_readonly("aborted", &C::aborted)
      .def_property("timeout", &C::timeout_s,
                    [](C& c, double s) { c.set_timeout(timeout_of(s, "NcclCommunicator.timeout")); })
      .def(
          "allreduce",
          [](C& c, uintptr_t send, uintptr_t recv, int64_t count, int dtype, int op, uintptr_t stream) {
            size_t n = count_of(count, "allreduce");
            DType dt = to_dtype(dtype);
            ReduceOp o = to_op(op);
            py::gil_scoped_release nogil;
            c.allreduce(send, recv, n, dt, o, stream);
          },
          py::arg("send"), py::arg("recv"), py::arg("count"), py::arg("dtype"), py::arg("op"),
          py::arg("stream"))
      .def(
          "broadcast",
          [](C& c, uintptr_t send, uintptr_t recv, int64_t count, int dtype, int root, uintptr_t stream) {
            size_t n = count_of(count, "broadcast");
            DType dt = to_dtype(dtype);
            py::gil_scoped_release nogil;
            c.broadcast(send, recv, n, dt, root, stream);
          },
          py::arg("send"), py::arg("recv"), py::arg("count"), py::arg("dtype"), py::arg("root"),
          py::arg("stream"))
      .def(
          "reduce",
          [](C& c, uintptr_t send, uintptr_t recv, int64_t count, int dtype, int op, int root,
             uintptr_t stream) {
            size_t n = count_of(count, "reduce");
            DType dt = to_dtype(dtype);
            ReduceOp o = to_op(op);
            py::gil_scoped_release nogil;
            c.reduce(send, recv, n, dt, o, root, stream);
          },
          py::arg("send"), py::arg("recv"), py::arg("count"), py::arg("dtype"), py::arg("op"),
          py::arg("root"), py::arg("stream"))
      .def(
          "allgather",
          [](C& c, uintptr_t send, uintptr_t recv, int64_t send_count, int dtype, uintptr_t stream) {
            size_t n = count_of(send_count, "allgather");
            DType dt = to_dtype(dtype);
            py::gil_scoped_release nogil;
            c.allgather(send, recv, n, dt, stream);
          },
          py::arg("send"), py::arg("recv"), py::arg("send_count"), py::arg("dtype"), py::arg("stream"))
      .def(
          "reduce_scatter",
          [](C& c, uintptr_t send, uintptr_t recv, int64_t recv_count, int dtype, int op, uintptr_t stream) {
            size_t n = count_of(recv_count, "reduce_scatter");
            DType dt = to_dtype(dtype);
            ReduceOp o = to_op(op);
            py::gil_scoped_release nogil;
            c.reduce_scatter(send, recv, n, dt, o, stream);
          },
          py::arg("send"), py::arg("recv"), py::arg("recv_count"), py::arg("dtype"), py::arg("op"),
          py::arg("stream"))
      .def(
          "send",
          [](C& c, uintptr_t buf, int64_t count, int dtype, int peer, uintptr_t stream) {
            size_t n = count_of(count, "send");
            DType dt = to_dtype(dtype);
            py::gil_scoped_release nogil;
            c.send(buf, n, dt, peer, stream);
          },
          py::arg("buf"), py::arg("count"), py::arg("dtype"), py::arg("peer"), py::arg("stream"))
      .def(
          "recv",
          [](C& c, uintptr_t buf, int64_t count, int dtype, int peer, uintptr_t stream) {
            size_t n = count_of(count, "recv");
            DType dt = to_dtype(dtype);
            py::gil_scoped_release nogil;
            c.recv(buf, n, dt, peer, stream);
          },
          py::arg("buf"), py::arg("count"), py::arg("dtype"), py::arg("peer"), py::arg("stream"))
      .def(
          "exchange",
          [](C& c, const std::vector<std::tuple<uintptr_t, int64_t, int>>& sends,
             const std::vector<std::tuple<uintptr_t, int64_t, int>>& recvs, int dtype, uintptr_t stream) {
            auto s = p2p_list(sends, "exchange");
            auto r = p2p_list(recvs, "exchange");
            DType dt = to_dtype(dtype);
            py::gil_scoped_release nogil;
            c.exchange(s, r, dt, stream);
          },
          py::arg("sends"), py::arg("recvs"), py::arg("dtype"), py::arg("stream"),
          "Sends and receives [(address, count, peer)] in one NCCL group (neighbor exchange).")
      .def(
          "wait",
          [](C& c, const py::function& query, double timeout_s, const std::string& op) {
            timeout_of(timeout_s, "NcclCommunicator.wait");
            // The query (e.g. torch.cuda.Event.query) needs the GIL; it is taken per poll only.
            // Python errors become plain C++ ones here, while the GIL is held to read them.
            auto completed = [&query]() -> bool {
              py::gil_scoped_acquire gil;
              try {
                return query().cast<bool>();
              } catch (py::error_already_set& e) {
                throw std::runtime_error(e.what());
              } catch (const py::cast_error& e) {
                throw std::runtime_error(std::string("the query did not return a bool: ") + e.what());
              }
            };
            py::gil_scoped_release nogil;
            c.wait(completed, Deadline::after(timeout_s), op);
          },
          py::arg("query"), py::arg("timeout"), py::arg("op") = "nccl op",
          "Waits until query() is True (e.g. an event recorded after the op), checking NCCL's errors; "
          "aborts the communicator and raises at the deadline or on an NCCL error.")
      .def(
          "check", [](C& c, const std::string& op) { c.check(op); }, py::arg("op") = "nccl check",
          // Without the GIL: the communicator's lock may be held by a call still waiting for
          // NCCL to accept its op (a watch thread asking here must not stall every Python thread).
          py::call_guard<py::gil_scoped_release>(),
          "Raises (after aborting) if NCCL reported an asynchronous error; waits only for a call in "
          "progress on this communicator.")
      .def("abort", &C::abort, py::call_guard<py::gil_scoped_release>(),
           "Aborts the communicator (idempotent, any thread); later calls raise AbortedError.")
      .def("close", &C::close, py::call_guard<py::gil_scoped_release>(),
           "Finalizes and destroys the communicator, bounded by its timeout (aborted past it).");
}

}  // namespace rumor::bindings
