// Helpers shared by the binding files (module.cpp and one file per feature area).
#pragma once

#include <pybind11/pybind11.h>

#include <cstring>
#include <functional>
#include <memory>
#include <string>

#include "comm/communicator.h"
#include "core/types.h"
#include "net/handshake.h"

namespace rumor::bindings {

namespace py = pybind11;

inline void* ptr(uintptr_t p) { return reinterpret_cast<void*>(p); }

inline DType to_dtype(int code) {
  if (code < 0 || code >= kNumDTypes)
    throw Error(ErrorKind::kInvalidArgument, "unknown dtype code " + std::to_string(code));
  return static_cast<DType>(code);
}

inline ReduceOp to_op(int code) {
  if (code < 0 || code > static_cast<int>(ReduceOp::PROD))
    throw Error(ErrorKind::kInvalidArgument, "unknown reduce op code " + std::to_string(code));
  return static_cast<ReduceOp>(code);
}

inline net::Token to_token(const py::bytes& b) {
  std::string s = b;
  if (s.size() != net::kTokenBytes)
    throw Error(ErrorKind::kInvalidArgument,
                "job token must be " + std::to_string(net::kTokenBytes) + " bytes");
  net::Token t{};
  std::memcpy(t.data(), s.data(), t.size());
  return t;
}

// Runs fn on the communicator's queue: returns a Work if nonblocking, else waits for it.
inline std::shared_ptr<Work> dispatch(Communicator& c, bool nonblocking, std::function<void()> fn) {
  py::gil_scoped_release nogil;
  if (nonblocking) return c.worker().submit(std::move(fn));
  // Ops queued ahead each have their own deadline; this wait only needs to outlast them.
  c.worker().run(std::move(fn), Deadline::after(c.timeout_s() * 64));
  return nullptr;
}

// One function per feature area, each in its own file, called by PYBIND11_MODULE.
void bind_compression(py::module_& m);
void bind_cuda(py::module_& m);
void bind_compressed_ops(py::module_& m);
void bind_neighbor(py::module_& m);
void bind_decentralized_ops(py::module_& m);
void bind_window(py::module_& m);
void bind_optim(py::module_& m);
void bind_trace(py::module_& m);
void bind_powersgd(py::module_& m);
void bind_nccl(py::module_& m);

}  // namespace rumor::bindings
