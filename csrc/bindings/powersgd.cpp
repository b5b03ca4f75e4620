// PowerSGD's bucket op and, for tests, its kernels on raw buffers.
#include "ops/powersgd.h"

#include <pybind11/stl.h>

#include <memory>
#include <tuple>
#include <vector>

#include "bindings/common.h"
#include "compress/powersgd_kernels.h"

namespace rumor::bindings {

namespace {

float* floats(uintptr_t p) { return reinterpret_cast<float*>(p); }

const compress::powersgd::KernelSet& kernels(const std::string& isa) {
  using compress::powersgd::Isa;
  if (isa.empty()) return compress::powersgd::active_kernels();
  const auto* set = compress::powersgd::kernel_set(isa == "generic" ? Isa::kGeneric : Isa::kAvx2);
  if (set == nullptr || (isa != "generic" && isa != "avx2"))
    throw Error(ErrorKind::kInvalidArgument, "PowerSGD kernels: no kernel set '" + isa + "' on this CPU");
  return *set;
}

}  // namespace

void bind_powersgd(py::module_& m) {
  using ops::PowerSgdBucketOp;

  py::class_<PowerSgdBucketOp, BucketOp, std::shared_ptr<PowerSgdBucketOp>>(m, "PowerSGDOp")
      .def_property("compressing", &PowerSgdBucketOp::compressing, &PowerSgdBucketOp::set_compressing)
      .def_property_readonly("first_count", &PowerSgdBucketOp::first_count)
      .def_property_readonly("second_count", &PowerSgdBucketOp::second_count);

  m.def(
      "powersgd_op",
      [](const std::vector<std::tuple<size_t, size_t, size_t, uint32_t, size_t, size_t>>& matrices,
         const std::vector<std::pair<size_t, size_t>>& uncompressed, size_t count, uintptr_t p,
         size_t p_count, uintptr_t q, size_t q_count, uintptr_t error, double epsilon, int wire,
         std::shared_ptr<BucketOp> warmup) {
        ops::PowerSgdConfig cfg;
        for (const auto& [off, n, mm, k, po, qo] : matrices) cfg.matrices.push_back({off, n, mm, k, po, qo});
        for (const auto& [off, len] : uncompressed) cfg.uncompressed.push_back({off, len});
        cfg.epsilon = epsilon;
        cfg.wire = to_dtype(wire);
        return std::make_shared<PowerSgdBucketOp>(std::move(cfg), count, floats(p), p_count, floats(q),
                                                  q_count, error != 0 ? floats(error) : nullptr,
                                                  std::move(warmup));
      },
      py::arg("matrices"), py::arg("uncompressed"), py::arg("count"), py::arg("p"), py::arg("p_count"),
      py::arg("q"), py::arg("q_count"), py::arg("error"), py::arg("epsilon") = 0.0, py::arg("wire") = 0,
      py::arg("warmup") = nullptr,
      "Bucket op of PowerSGD over a float32 bucket of count elements. matrices: (offset, n, m, rank, "
      "P offset, Q offset) each; uncompressed: (offset, count) runs averaged as they are. p, q, error: "
      "addresses of float32 buffers owned by the caller (error 0: no error feedback).");

  m.def(
      "powersgd_kernel",
      [](const std::string& which, const std::string& isa, uintptr_t a, uintptr_t b, size_t n, size_t mm,
         uintptr_t x, uint32_t k, uintptr_t out) {
        const auto& kern = kernels(isa);
        py::gil_scoped_release nogil;
        if (which == "project")
          kern.project(floats(a), b != 0 ? floats(b) : nullptr, n, mm, floats(x), k, floats(out));
        else if (which == "back_project")
          kern.back_project(floats(a), n, mm, floats(x), k, floats(out));
        else if (which == "reconstruct")
          kern.reconstruct(floats(a), n, k, floats(x), mm, floats(out), b != 0 ? floats(b) : nullptr);
        else
          throw Error(ErrorKind::kInvalidArgument, "PowerSGD kernels: unknown kernel '" + which + "'");
      },
      py::arg("which"), py::arg("isa"), py::arg("a"), py::arg("b"), py::arg("n"), py::arg("m"), py::arg("x"),
      py::arg("k"), py::arg("out"),
      "Runs one PowerSGD kernel on raw float32 buffers (for tests; see compress/powersgd_kernels.h).");

  m.def(
      "powersgd_orthogonalize",
      [](uintptr_t x, size_t n, uint32_t k, double epsilon) {
        std::vector<double> scratch(n * k);
        compress::powersgd::orthogonalize(floats(x), n, k, epsilon, scratch.data());
      },
      py::arg("x"), py::arg("n"), py::arg("k"), py::arg("epsilon") = 0.0,
      "Gram-Schmidt on the k columns of an n x k row-major float32 matrix, in place (in double).");
}

}  // namespace rumor::bindings
