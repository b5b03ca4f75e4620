// The Python extension. It sees tensors only as (address, element count, dtype code): no torch
// header is included, so one build serves every torch 2.x. Every call that communicates
// releases the GIL.
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <chrono>
#include <cstring>
#include <functional>
#include <memory>
#include <optional>
#include <stdexcept>
#include <string>
#include <vector>

#include "bindings/common.h"
#include "comm/communicator.h"
#include "comm/context.h"
#include "core/reduce.h"
#include "engine/bucket_engine.h"
#include "net/dial.h"
#include "net/handshake.h"
#include "net/socket.h"
#include "net/tls.h"

namespace py = pybind11;
using namespace rumor;

using namespace rumor::bindings;

namespace {

// A rank's arena as a Python buffer: torch.frombuffer over it keeps the arena mapped.
struct ArenaRankView {
  std::shared_ptr<SharedArena> arena;
  std::byte* data;
};

// 32 bytes, or None for the key derived from the token (an unauthenticated job).
std::optional<net::Key> to_key(const py::object& key) {
  if (key.is_none()) return std::nullopt;
  if (!py::isinstance<py::bytes>(key))
    throw Error(ErrorKind::kInvalidArgument,
                "connection key must be bytes (" + std::to_string(net::kKeyBytes) + ") or None, got " +
                    std::string(py::str(py::type::handle_of(key).attr("__name__"))));
  std::string s = key.cast<py::bytes>();
  if (s.size() != net::kKeyBytes)
    throw Error(ErrorKind::kInvalidArgument, "connection key must be " + std::to_string(net::kKeyBytes) +
                                                 " bytes, got " + std::to_string(s.size()));
  net::Key k{};
  std::memcpy(k.data(), s.data(), k.size());
  return k;
}

bool probe_connect(const std::string& address, const py::bytes& token, uint32_t rank, uint64_t comm_id,
                   uint32_t stream, const py::object& key, double timeout_s) {
  net::Token t = to_token(token);
  std::optional<net::Key> k = to_key(key);
  const net::Key use = k ? *k : net::unauthenticated_key(t);
  py::gil_scoped_release nogil;
  Deadline dl = Deadline::after(timeout_s);
  net::DialRequest req{rank, comm_id, stream, std::nullopt};
  while (true) {
    net::Fd fd = net::connect_tcp(net::HostPort::parse(address), dl, "probe");
    try {
      if (net::client_handshake(fd.get(), use, req, dl, "probe") == net::DialOutcome::kAccepted) return true;
    } catch (const Error&) {
      return false;  // refused, whatever the step
    }
    if (dl.expired()) return false;  // busy until the end
  }
}

}  // namespace

PYBIND11_MODULE(_C, m) {
  m.doc() = "rumor's C++ communication core";

  py::register_exception_translator([](std::exception_ptr p) {
    try {
      if (p) std::rethrow_exception(p);
    } catch (const Error& e) {
      static const char* names[] = {"_InvalidArgument", "CommTimeoutError", "PeerError",
                                    "ProtocolError",    "AbortedError",     "RumorError"};
      py::object errors = py::module_::import("rumor.errors");
      py::object cls = errors.attr(names[static_cast<int>(e.kind())]);
      PyErr_SetString(cls.ptr(), e.what());
    }
  });

  m.def("reduce_isa", &reduce_isa);
  m.def("protocol_version", [] { return net::kProtocolVersion; });
  m.def("probe_connect", &probe_connect, py::arg("address"), py::arg("token"), py::arg("rank"),
        py::arg("comm_id") = 0, py::arg("stream") = 0, py::arg("key") = py::none(), py::arg("timeout") = 10.0,
        "Connects and runs the dialing side of the handshake under `key` (None: the key derived from "
        "`token`); True if the listener accepted the stream, False if it or this side refused.");
  m.def(
      "reduce_into",
      [](uintptr_t dst, uintptr_t src, size_t count, int dtype, int op) {
        py::gil_scoped_release nogil;
        reduce_into(ptr(dst), ptr(src), count, to_dtype(dtype), to_op(op));
      },
      "dst[i] = dst[i] op src[i] (AVG accumulates as SUM).");
  m.def(
      "reduce_many",
      [](uintptr_t dst, const std::vector<uintptr_t>& srcs, size_t count, int dtype, int op) {
        std::vector<const void*> p(srcs.size());
        for (size_t j = 0; j < srcs.size(); ++j) p[j] = ptr(srcs[j]);
        py::gil_scoped_release nogil;
        reduce_many(ptr(dst), p.data(), p.size(), count, to_dtype(dtype), to_op(op));
      },
      "dst[i] = srcs[0][i] op srcs[1][i] op ... in one pass (core/reduce.h; float16/bfloat16 "
      "summed in float32 and rounded once). Raw addresses, as reduce_into: used by "
      "benchmarks/reduce_kernels.py.");
  m.def(
      "copy_bytes",
      [](uintptr_t dst, uintptr_t src, size_t bytes) {
        // libc's copy streams large buffers past the cache (no read of the destination first),
        // which makes moving a fresh gradient into its bucket about 1.5x faster than Tensor.copy_.
        py::gil_scoped_release nogil;
        std::memmove(ptr(dst), ptr(src), bytes);
      },
      "Copies bytes from src to dst (the ranges may overlap).");

  py::class_<Options>(m, "Options")
      .def(py::init<>())
      .def_readwrite("timeout", &Options::timeout_s)
      .def_readwrite("streams", &Options::streams)
      .def_readwrite("stripe_min", &Options::stripe_min)
      .def_readwrite("stripe_steal", &Options::stripe_steal)
      .def_readwrite("stripe_adapt", &Options::stripe_adapt)
      .def_readwrite("link_rate", &Options::link_rate)
      .def_readwrite("shm", &Options::shm)
      .def_readwrite("shm_ring_bytes", &Options::shm_ring_bytes)
      .def_readwrite("small_allreduce_bytes", &Options::small_allreduce_bytes)
      .def_readwrite("large_broadcast_bytes", &Options::large_broadcast_bytes)
      .def_readwrite("spin_us", &Options::spin_us)
      .def_readwrite("host_direct", &Options::host_direct)
      .def_readwrite("host_direct_min_bytes", &Options::host_direct_min_bytes)
      .def_readwrite("huge_pages", &Options::huge_pages)
      .def_readwrite("two_rank_path", &Options::two_rank_path)
      .def_readwrite("site_overlap", &Options::site_overlap)
      .def_readwrite("adaptive_deadline", &Options::adaptive_deadline)
      .def_readwrite("deadline_floor", &Options::deadline_floor_s)
      .def_readwrite("flight_records", &Options::flight_records)
      .def_readwrite("tls_cert_pem", &Options::tls_cert_pem)
      .def_readwrite("tls_key_pem", &Options::tls_key_pem)
      .def_readwrite("tls_ca_pem", &Options::tls_ca_pem)
      .def_readwrite("tls_peer_name", &Options::tls_peer_name);

  // The PKI helpers of net/tls.h, for tests and for a launcher that makes a job's certificates.
  // Valid from 5 minutes ago (clocks of a job's hosts differ a little) for valid_s seconds.
  auto validity = [](double valid_s) {
    const auto now = std::chrono::system_clock::now();
    return std::pair{now - std::chrono::minutes(5), now + std::chrono::duration_cast<std::chrono::seconds>(
                                                              std::chrono::duration<double>(valid_s))};
  };
  m.def(
      "tls_make_ca",
      [validity](const std::string& cn, double valid_s, const std::optional<py::bytes>& private_scalar) {
        const auto [from, to] = validity(valid_s);
        if (!private_scalar) {
          auto c = net::make_ca(cn, from, to);
          return py::make_tuple(py::bytes(c.cert_pem), py::bytes(c.key_pem));
        }
        const std::string d(*private_scalar);
        auto c = net::make_ca(cn, from, to, std::span(reinterpret_cast<const uint8_t*>(d.data()), d.size()));
        return py::make_tuple(py::bytes(c.cert_pem), py::bytes(c.key_pem));
      },
      py::arg("common_name"), py::arg("valid_s") = 86400.0, py::arg("private_scalar") = py::none(),
      "A self-signed EC P-256 CA: (cert_pem, key_pem) as bytes. private_scalar: its key as 32 big-endian "
      "bytes "
      "in [1, n-1] (the same scalar gives the same public key on every host); None: a random key.");
  m.def(
      "tls_issue_certificate",
      [validity](const py::bytes& ca_cert, const py::bytes& ca_key, const std::string& cn,
                 const std::vector<std::string>& sans, double valid_s) {
        const auto [from, to] = validity(valid_s);
        auto c = net::issue_certificate({std::string(ca_cert), std::string(ca_key)}, cn, sans, from, to);
        return py::make_tuple(py::bytes(c.cert_pem), py::bytes(c.key_pem));
      },
      py::arg("ca_cert"), py::arg("ca_key"), py::arg("common_name"), py::arg("sans"),
      py::arg("valid_s") = 86400.0,
      "A leaf certificate signed by the CA (serverAuth and clientAuth; a subjectAltName per entry of sans): "
      "(cert_pem, key_pem) as bytes.");

  py::class_<Work, std::shared_ptr<Work>>(m, "Work")
      .def("done", &Work::done)
      .def(
          "wait",
          [](const Work& w, double timeout_s) {
            py::gil_scoped_release nogil;
            w.wait(Deadline::after(timeout_s));
          },
          py::arg("timeout"));

  py::class_<Context, std::shared_ptr<Context>>(m, "Context")
      .def(py::init([](uint32_t rank, uint32_t size, const py::bytes& token, const Options& opts, int port,
                       const py::object& key, const std::string& bind) {
             return std::make_shared<Context>(rank, size, to_token(token), opts, port, to_key(key), bind);
           }),
           py::arg("rank"), py::arg("size"), py::arg("token"), py::arg("options"), py::arg("port") = 0,
           py::arg("key") = py::none(), py::arg("bind") = "",
           "token: the job's 16-byte public session id; key: the 32-byte connection key every TCP stream "
           "proves (None: derived from the token, unauthenticated); bind: the listen address ('' = all).")
      .def_property_readonly("rank", &Context::rank)
      .def_property_readonly("size", &Context::size)
      .def_property_readonly("port", &Context::port)
      .def_property_readonly("rejected_connections", &Context::rejected_connections)
      .def_property_readonly("pending_connections", &Context::pending_connections)
      .def_property_readonly(
          "tls", [](const Context& c) { return c.options().tls(); },
          "True when the TCP channels of this context run TLS 1.3 (RUMOR_TLS_*).")
      .def("set_sites", &Context::set_sites, py::arg("site_ids"),
           "Every rank's site (RUMOR_SITE): hierarchical collectives group ranks by site, not host.")
      .def_property_readonly("sites", &Context::site_ids, "Every rank's site; empty when none are set.")
      .def("set_peers", &Context::set_peers, py::arg("addresses"), py::arg("host_ids"),
           py::arg("owner_tags") = std::vector<std::string>{}, py::call_guard<py::gil_scoped_release>())
      .def_property_readonly("shm_tag", &Context::shm_tag)
      .def("seal", &Context::seal)
      .def("abort", &Context::abort, py::arg("why"))
      .def("set_timeout", &Context::set_timeout, py::arg("seconds"))
      .def_property_readonly("timeout", &Context::timeout_s);

  using C = Communicator;
  py::class_<C, std::shared_ptr<C>>(m, "Communicator")
      .def(py::init<std::shared_ptr<Context>, uint64_t, std::string, std::vector<uint32_t>>())
      .def_property_readonly("rank", &C::rank)
      .def_property_readonly("size", &C::size)
      .def_property_readonly("world_ranks", &C::world_ranks)
      .def_property_readonly("name", &C::name)
      .def_property_readonly("aborted", &C::aborted)
      .def_property_readonly("all_local", &C::all_local)
      .def_property_readonly("uses_shm", &C::uses_shm)
      .def(
          "allgather_checks_blocks",
          [](const C& c, const std::vector<size_t>& counts, int dtype) {
            return c.allgather_checks_blocks(counts, to_dtype(dtype));
          },
          py::arg("counts"), py::arg("dtype"))
      .def("allreduce",
           [](C& c, uintptr_t buf, size_t count, int dtype, int op, int algo, bool nb) {
             DType dt = to_dtype(dtype);
             ReduceOp o = to_op(op);
             auto a = static_cast<AllreduceAlgo>(algo);
             return dispatch(c, nb, [&c, buf, count, dt, o, a] { c.allreduce(ptr(buf), count, dt, o, a); });
           })
      .def("allreduce_into",
           [](C& c, uintptr_t in, uintptr_t out, size_t count, int dtype, int op, int algo, bool nb) {
             DType dt = to_dtype(dtype);
             ReduceOp o = to_op(op);
             auto a = static_cast<AllreduceAlgo>(algo);
             return dispatch(c, nb, [&c, in, out, count, dt, o, a] {
               c.allreduce_into(ptr(in), ptr(out), count, dt, o, a);
             });
           })
      .def("reduce_scatter",
           [](C& c, uintptr_t in, uintptr_t out, std::vector<size_t> counts, int dtype, int op, bool nb) {
             DType dt = to_dtype(dtype);
             ReduceOp o = to_op(op);
             return dispatch(c, nb, [&c, in, out, counts = std::move(counts), dt, o] {
               c.reduce_scatter(ptr(in), ptr(out), counts, dt, o);
             });
           })
      .def(
          "allgather",
          [](C& c, uintptr_t buf, std::vector<size_t> counts, int dtype, bool nb, uintptr_t own) {
            DType dt = to_dtype(dtype);
            if (own != 0 && !nb) {
              // Blocking: the core reads the caller's block where it is (one host's direct path)
              // or copies it into place.
              return dispatch(c, false, [&c, buf, counts = std::move(counts), dt, own] {
                c.allgather(ptr(buf), counts, dt, ptr(own));
              });
            }
            if (own != 0) {
              // The caller's own block, copied here rather than by a tensor slice and copy_ in
              // Python: those cost more than a small allgather when ranks share cores. Copied now:
              // the caller may reuse it once this returns.
              if (counts.size() != c.size())
                throw std::invalid_argument("allgather: counts must hold one block per rank (" +
                                            std::to_string(c.size()) + "), got " +
                                            std::to_string(counts.size()));
              size_t off = 0;
              for (uint32_t q = 0; q < c.rank(); ++q) off += counts[q];
              const size_t es = dtype_size(dt);
              std::byte* dst = static_cast<std::byte*>(ptr(buf)) + off * es;
              const auto* src = reinterpret_cast<const std::byte*>(own);
              if (src != dst) std::memmove(dst, src, counts[c.rank()] * es);
            }
            return dispatch(c, nb,
                            [&c, buf, counts = std::move(counts), dt] { c.allgather(ptr(buf), counts, dt); });
          },
          py::arg("buf"), py::arg("counts"), py::arg("dtype"), py::arg("nb"), py::arg("own") = 0,
          "buf gets size() blocks of counts[q] elements; own (an address, 0: none) is this rank's block "
          "(left untouched), else buf holds it in place.")
      .def("broadcast",
           [](C& c, uintptr_t buf, size_t count, int dtype, uint32_t root, bool nb) {
             DType dt = to_dtype(dtype);
             return dispatch(c, nb, [&c, buf, count, dt, root] { c.broadcast(ptr(buf), count, dt, root); });
           })
      .def("reduce",
           [](C& c, uintptr_t buf, size_t count, int dtype, int op, uint32_t root, bool nb) {
             DType dt = to_dtype(dtype);
             ReduceOp o = to_op(op);
             return dispatch(c, nb,
                             [&c, buf, count, dt, o, root] { c.reduce(ptr(buf), count, dt, o, root); });
           })
      .def("alltoall",
           [](C& c, uintptr_t in, std::vector<size_t> sc, uintptr_t out, std::vector<size_t> rc, int dtype,
              bool nb) {
             DType dt = to_dtype(dtype);
             return dispatch(c, nb, [&c, in, sc = std::move(sc), out, rc = std::move(rc), dt] {
               c.alltoall(ptr(in), sc, ptr(out), rc, dt);
             });
           })
      .def("barrier", [](C& c, bool nb) { return dispatch(c, nb, [&c] { c.barrier(); }); })
      .def("peer_rtts", &C::peer_rtts, py::call_guard<py::gil_scoped_release>(),
           "Connects to every member; each one's round trip in seconds (TCP_INFO; 0: self, shared memory).")
      .def(
          "link_rtts",
          [](C& c) {
            // On the worker, after the operations queued ahead: they are the ones that open channels.
            std::vector<double> rtt;
            dispatch(c, false, [&c, &rtt] { rtt = c.link_rtts(); });
            return rtt;
          },
          "Each member's round trip in seconds over a channel already open (TCP_INFO); 0: none, self, "
          "shared memory.")
      .def("send",
           [](C& c, uintptr_t buf, size_t bytes, uint32_t dst, bool nb) {
             return dispatch(c, nb, [&c, buf, bytes, dst] { c.send(ptr(buf), bytes, dst); });
           })
      .def("recv",
           [](C& c, uintptr_t buf, size_t bytes, uint32_t src, bool nb) {
             return dispatch(c, nb, [&c, buf, bytes, src] { c.recv(ptr(buf), bytes, src); });
           })
      .def("abort", &C::abort);

  py::class_<BucketOp, std::shared_ptr<BucketOp>>(m, "BucketOp")
      .def_property_readonly("name", &BucketOp::name);
  m.def(
      "allreduce_op",
      [](int op, int algo) -> std::shared_ptr<BucketOp> {
        return std::make_shared<AllreduceBucketOp>(to_op(op), static_cast<AllreduceAlgo>(algo));
      },
      py::arg("op"), py::arg("algo"), "Bucket op: in-place allreduce of the flat bucket.");

  py::class_<ArenaRankView>(m, "ArenaRankView", py::buffer_protocol()).def_buffer([](ArenaRankView& v) {
    return py::buffer_info(v.data, 1, py::format_descriptor<uint8_t>::format(), 1,
                           {static_cast<py::ssize_t>(v.arena->size())}, {1});
  });
  py::class_<SharedArena, std::shared_ptr<SharedArena>>(m, "SharedArena", py::buffer_protocol())
      .def(py::init<std::shared_ptr<Communicator>, size_t>(), py::arg("comm"), py::arg("bytes"))
      .def_property_readonly("size", &SharedArena::size)
      .def_buffer([](SharedArena& a) {
        return py::buffer_info(a.data(), 1, py::format_descriptor<uint8_t>::format(), 1,
                               {static_cast<py::ssize_t>(a.size())}, {1});
      })
      .def(
          "rank_view",
          [](std::shared_ptr<SharedArena> a, uint32_t rank) { return ArenaRankView{a, a->data_of(rank)}; },
          py::arg("rank"),
          "A writable buffer over the arena of communicator rank `rank`, as mapped here (keeps the arena "
          "alive).")
      .def(
          "allreduce_op",
          [](std::shared_ptr<SharedArena> a, int op) -> std::shared_ptr<BucketOp> {
            return std::make_shared<ArenaAllreduceBucketOp>(std::move(a), to_op(op));
          },
          "Bucket op: allreduce of a bucket inside this arena, reading peers in place.")
      .def(
          "allreduce",
          [](const std::shared_ptr<SharedArena>& a, uintptr_t buf, size_t count, int dtype, int op) {
            DType dt = to_dtype(dtype);
            ReduceOp o = to_op(op);
            dispatch(a->comm(), false, [a, buf, count, dt, o] { a->allreduce(ptr(buf), count, dt, o); });
          },
          py::arg("address"), py::arg("count"), py::arg("dtype"), py::arg("op"),
          "Blocking in-place allreduce of a buffer inside this arena, on the arena's communicator.")
      .def(
          "average_into_deltas",
          [](const std::shared_ptr<SharedArena>& a, uintptr_t x, uintptr_t delta, size_t count, int dtype,
             std::vector<uint8_t> role) {
            DType dt = to_dtype(dtype);
            dispatch(a->comm(), false, [a, x, delta, count, dt, role = std::move(role)] {
              a->average_into_deltas(ptr(x), ptr(delta), count, dt, role);
            });
          },
          py::arg("x"), py::arg("delta"), py::arg("count"), py::arg("dtype"), py::arg("role"),
          "Blocking: every contributing rank's delta <- mean of the contributions - its weights x "
          "(role per rank: 0 none, 1 x, 2 x + delta; both buffers inside the arena).");

  py::class_<BucketEngine, std::shared_ptr<BucketEngine>>(m, "BucketEngine")
      .def(py::init<std::shared_ptr<Communicator>>())
      .def(
          "set_buckets",
          [](BucketEngine& e,
             const std::vector<std::tuple<uintptr_t, size_t, int, uint32_t, std::shared_ptr<BucketOp>>>&
                 specs) {
            std::vector<BucketSpec> v;
            for (const auto& [data, count, dtype, slots, op] : specs)
              v.push_back(BucketSpec{data, count, to_dtype(dtype), slots, op, nullptr});
            e.set_buckets(std::move(v));
          },
          "[(address, count, dtype code, parameters, op)]")
      .def_property_readonly("num_buckets", &BucketEngine::num_buckets)
      .def("mark_ready", &BucketEngine::mark_ready)
      .def("launch_all", &BucketEngine::launch_all, py::call_guard<py::gil_scoped_release>())
      .def("incomplete", &BucketEngine::incomplete)
      .def("idle", &BucketEngine::idle)
      .def(
          "last_timings",
          [](const BucketEngine& e) {
            std::vector<std::tuple<uint32_t, size_t, double, double, double>> out;
            for (const auto& t : e.last_timings())
              out.emplace_back(t.bucket, t.count, t.launched, t.started, t.ended);
            return out;
          },
          "[(bucket, elements, launched, started, ended)] of the last completed iteration, in "
          "time.monotonic() seconds")
      .def(
          "finish",
          [](BucketEngine& e, double timeout_s) {
            py::gil_scoped_release nogil;
            e.finish(Deadline::after(timeout_s));
          },
          py::arg("timeout"));

  bind_compression(m);
  bind_cuda(m);
  bind_compressed_ops(m);
  bind_neighbor(m);
  bind_decentralized_ops(m);
  bind_window(m);
  bind_optim(m);
  bind_trace(m);
  bind_powersgd(m);
  bind_nccl(m);
}
