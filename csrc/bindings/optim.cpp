// rumor.optim's fused kernels and the per-bucket optimizer step of overlap_optimizer. Tensors
// arrive as addresses (python/rumor/optim/_kernels.py checks dtype, layout and sizes first).
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <memory>
#include <string>
#include <tuple>
#include <vector>

#include "bindings/common.h"
#include "comm/arena.h"
#include "engine/bucket_engine.h"
#include "optim/optim_kernels.h"
#include "optim/shared_step_op.h"
#include "optim/step_op.h"

namespace rumor::bindings {

namespace {

const optim::KernelSet* pick(const std::string& isa) {
  if (isa.empty()) return &optim::active_kernels();
  const optim::KernelSet* set = nullptr;
  if (isa == "generic")
    set = optim::kernel_set(optim::Isa::kGeneric);
  else if (isa == "avx2")
    set = optim::kernel_set(optim::Isa::kAvx2);
  else
    throw Error(ErrorKind::kInvalidArgument, "unknown optimizer kernel set '" + isa + "'");
  if (set == nullptr)
    throw Error(ErrorKind::kInvalidArgument,
                "optimizer kernel set '" + isa + "' is not available on this CPU");
  return set;
}

float* fptr(uintptr_t p) { return reinterpret_cast<float*>(p); }

// Runs a Python callable (the fallback optimizer update of one bucket) on the engine's step
// thread, holding the GIL only while it runs.
class PythonBucketOp final : public BucketOp {
 public:
  explicit PythonBucketOp(py::function fn) : fn_(std::make_unique<py::function>(std::move(fn))) {}
  ~PythonBucketOp() override {
    // The last reference may go on a thread without the GIL.
    if (Py_IsInitialized()) {
      py::gil_scoped_acquire gil;
      fn_.reset();
    }
  }
  PythonBucketOp(const PythonBucketOp&) = delete;
  PythonBucketOp& operator=(const PythonBucketOp&) = delete;
  void run(Communicator&, void*, size_t, DType) override {
    py::gil_scoped_acquire gil;
    (*fn_)();
  }
  std::string name() const override { return "python optimizer step"; }

 private:
  std::unique_ptr<py::function> fn_;
};

// (kind 0 = SGD / 1 = Adam, param, grad, count, state0, state1, state2, step, first, lr,
//  momentum | beta1, dampening | beta2, eps, weight_decay, nesterov | decoupled, amsgrad, maximize)
using SegmentTuple = std::tuple<int, uintptr_t, uintptr_t, size_t, uintptr_t, uintptr_t, uintptr_t, uintptr_t,
                                bool, double, double, double, double, double, bool, bool, bool>;

optim::StepSegment to_segment(const SegmentTuple& t) {
  const auto& [kind, param, grad, count, s0, s1, s2, step, first, lr, a, b, eps, wd, flag, ams, maximize] = t;
  optim::StepSegment s;
  if (kind != 0 && kind != 1)
    throw Error(ErrorKind::kInvalidArgument, "optimizer step: unknown segment kind");
  s.kind = kind == 0 ? optim::StepSegment::Kind::kSgd : optim::StepSegment::Kind::kAdam;
  s.param = fptr(param);
  s.grad = fptr(grad);
  s.count = count;
  s.state0 = fptr(s0);
  s.state1 = fptr(s1);
  s.state2 = fptr(s2);
  s.step = fptr(step);
  s.first = first;
  s.sgd = optim::SgdHyper{lr, a, b, wd, flag, maximize};
  s.adam = optim::AdamHyper{lr, a, b, eps, wd, flag, ams, maximize};
  return s;
}

std::vector<optim::StepSegment> to_segments(const std::vector<SegmentTuple>& segs) {
  std::vector<optim::StepSegment> v;
  v.reserve(segs.size());
  for (const auto& t : segs) v.push_back(to_segment(t));
  return v;
}

}  // namespace

void bind_optim(py::module_& m) {
  m.def(
      "optim_isa", [] { return std::string(optim::active_kernels().isa); },
      "Which kernel set the fused optimizer uses on this CPU ('avx2' or 'generic').");
  m.def(
      "sgd_step",
      [](uintptr_t param, uintptr_t grad, uintptr_t buf, size_t count, double lr, double momentum,
         double dampening, double weight_decay, bool nesterov, bool maximize, bool first,
         const std::string& isa, unsigned threads) {
        const optim::KernelSet* set = pick(isa);
        py::gil_scoped_release nogil;
        optim::sgd_step(fptr(param), fptr(grad), fptr(buf), count,
                        optim::SgdHyper{lr, momentum, dampening, weight_decay, nesterov, maximize}, first,
                        set, threads);
      },
      py::arg("param"), py::arg("grad"), py::arg("momentum_buffer"), py::arg("count"), py::arg("lr"),
      py::arg("momentum"), py::arg("dampening"), py::arg("weight_decay"), py::arg("nesterov"),
      py::arg("maximize"), py::arg("first"), py::arg("isa") = "", py::arg("threads") = 1,
      "One SGD step over flat float32 buffers, as torch.optim.SGD.");
  m.def(
      "adam_step",
      [](uintptr_t param, uintptr_t grad, uintptr_t exp_avg, uintptr_t exp_avg_sq, uintptr_t max_exp_avg_sq,
         size_t count, double lr, double beta1, double beta2, double eps, double weight_decay, bool decoupled,
         bool amsgrad, bool maximize, double step, const std::string& isa, unsigned threads) {
        const optim::KernelSet* set = pick(isa);
        py::gil_scoped_release nogil;
        optim::adam_step(fptr(param), fptr(grad), fptr(exp_avg), fptr(exp_avg_sq), fptr(max_exp_avg_sq),
                         count,
                         optim::AdamHyper{lr, beta1, beta2, eps, weight_decay, decoupled, amsgrad, maximize},
                         step, set, threads);
      },
      py::arg("param"), py::arg("grad"), py::arg("exp_avg"), py::arg("exp_avg_sq"), py::arg("max_exp_avg_sq"),
      py::arg("count"), py::arg("lr"), py::arg("beta1"), py::arg("beta2"), py::arg("eps"),
      py::arg("weight_decay"), py::arg("decoupled_weight_decay"), py::arg("amsgrad"), py::arg("maximize"),
      py::arg("step"), py::arg("isa") = "", py::arg("threads") = 1,
      "One Adam (AdamW with decoupled_weight_decay) step over flat float32 buffers.");

  py::class_<optim::OptimizerStepOp, BucketOp, std::shared_ptr<optim::OptimizerStepOp>>(m, "OptimizerStepOp")
      .def(py::init<>())
      .def(
          "set_segments",
          [](optim::OptimizerStepOp& op, const std::vector<SegmentTuple>& segs) {
            op.set_segments(to_segments(segs));
          },
          "[(kind, param, grad, count, state0, state1, state2, step, first, lr, momentum|beta1, "
          "dampening|beta2, eps, weight_decay, nesterov|decoupled, amsgrad, maximize)]")
      .def("set_clip_norm", &optim::OptimizerStepOp::set_clip_norm, py::arg("max_norm"),
           "Per-bucket gradient clipping before the update (0 = off).");
  py::class_<optim::SharedStepAllreduceOp, BucketOp, std::shared_ptr<optim::SharedStepAllreduceOp>>(
      m, "SharedStepAllreduceOp")
      .def(py::init([](std::shared_ptr<SharedArena> arena, int op) {
             return std::make_shared<optim::SharedStepAllreduceOp>(std::move(arena), to_op(op));
           }),
           py::arg("arena"), py::arg("op"))
      .def(
          "set_segments",
          [](optim::SharedStepAllreduceOp& op, const std::vector<SegmentTuple>& segs) {
            op.set_segments(to_segments(segs));
          },
          "As OptimizerStepOp.set_segments; parameters inside this rank's arena, state shared.");
  m.def(
      "python_bucket_op",
      [](py::function fn) -> std::shared_ptr<BucketOp> {
        return std::make_shared<PythonBucketOp>(std::move(fn));
      },
      "Bucket op calling fn() (with the GIL) on the engine's step thread.");
  auto engine =
      py::reinterpret_borrow<py::class_<BucketEngine, std::shared_ptr<BucketEngine>>>(m.attr("BucketEngine"));
  engine.def("set_after", &BucketEngine::set_after, py::arg("ops"),
             "One op (or None) per bucket, run after that bucket's op on the engine's step thread.");
}

}  // namespace rumor::bindings
