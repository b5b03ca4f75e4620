// rumor._C.WindowHub: the one-sided window layer (comm/window.h). Addresses and weights only;
// the Python layer (python/rumor/window.py) checks names, shapes, dtypes and neighbours.
#include "comm/window.h"

#include <pybind11/stl.h>

#include "bindings/common.h"

namespace rumor::bindings {

void bind_window(py::module_& m) {
  using W = WindowHub;
  using Weights = W::Weights;
  py::class_<WinOp, std::shared_ptr<WinOp>>(m, "WinOp")
      .def("done", &WinOp::done)
      .def_property_readonly("what", &WinOp::what);
  py::class_<W, std::shared_ptr<W>>(m, "WindowHub")
      .def(py::init<std::shared_ptr<Context>>())
      .def("create",
           [](W& h, uint64_t id, const std::string& name, uintptr_t data, size_t count, int dtype,
              bool zero_init, double timeout) {
             DType dt = to_dtype(dtype);
             py::gil_scoped_release nogil;
             h.create(id, name, ptr(data), count, dt, zero_init, Deadline::after(timeout));
           })
      .def("attach",
           [](W& h, uint64_t id, double timeout) {
             py::gil_scoped_release nogil;
             h.attach(id, Deadline::after(timeout));
           })
      .def("seal", &W::seal)
      .def("has", &W::has)
      .def("free",
           [](W& h, uint64_t id, double timeout) {
             py::gil_scoped_release nogil;
             h.free(id, Deadline::after(timeout));
           })
      .def("put",
           [](W& h, uint64_t id, uintptr_t x, const Weights& dsts, bool accumulate, bool with_p,
              bool require_mutex, double timeout) {
             py::gil_scoped_release nogil;
             return h.put(id, ptr(x), dsts, accumulate, with_p, require_mutex, Deadline::after(timeout));
           })
      .def("get",
           [](W& h, uint64_t id, const Weights& srcs, bool with_p, bool require_mutex, double timeout) {
             py::gil_scoped_release nogil;
             return h.get(id, srcs, with_p, require_mutex, Deadline::after(timeout));
           })
      .def("wait",
           [](W& h, const std::shared_ptr<WinOp>& op, double timeout) {
             py::gil_scoped_release nogil;
             h.wait(op, Deadline::after(timeout));
           })
      .def("update",
           [](W& h, uint64_t id, double self_weight, const Weights& nbrs, bool reset, bool with_p,
              uintptr_t out, bool require_mutex, double timeout) {
             py::gil_scoped_release nogil;
             h.update(id, self_weight, nbrs, reset, with_p, ptr(out), require_mutex,
                      Deadline::after(timeout));
           })
      .def("publish",
           [](W& h, uint64_t id, double timeout) {
             py::gil_scoped_release nogil;
             h.publish(id, Deadline::after(timeout));
           })
      .def("versions", &W::versions)
      .def("p", &W::p, py::call_guard<py::gil_scoped_release>())
      .def("set_p", &W::set_p, py::call_guard<py::gil_scoped_release>())
      .def("mutex_acquire",
           [](W& h, uint64_t id, std::vector<uint32_t> ranks, double timeout) {
             py::gil_scoped_release nogil;
             h.mutex_acquire(id, std::move(ranks), Deadline::after(timeout));
           })
      .def("mutex_release",
           [](W& h, uint64_t id, std::vector<uint32_t> ranks, double timeout) {
             py::gil_scoped_release nogil;
             h.mutex_release(id, std::move(ranks), Deadline::after(timeout));
           })
      .def_property_readonly("frames_applied", &W::frames_applied);
}

}  // namespace rumor::bindings
