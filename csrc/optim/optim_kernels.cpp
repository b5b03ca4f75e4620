#include "optim/optim_kernels.h"

#include <cmath>
#include <cstdlib>
#include <string>
#include <string_view>

#include "core/cpu.h"
#include "core/types.h"

namespace rumor::optim {

namespace generic {
extern const KernelSet kKernels;
}
#ifdef RUMOR_AVX2_KERNELS
namespace avx2 {
extern const KernelSet kKernels;
}
#endif

const KernelSet* kernel_set(Isa isa) {
  switch (isa) {
    case Isa::kGeneric:
      return &generic::kKernels;
    case Isa::kAvx2:
#ifdef RUMOR_AVX2_KERNELS
      if (cpu_has_avx2()) return &avx2::kKernels;
#endif
      return nullptr;
  }
  return nullptr;
}

const KernelSet& active_kernels() {
  static const KernelSet* const set =
      choose_kernels(&generic::kKernels, kernel_set(Isa::kAvx2), "RUMOR_OPTIM_ISA");
  return *set;
}

namespace {

[[noreturn]] void bad(const char* op, const std::string& what) {
  throw Error(ErrorKind::kInvalidArgument, std::string(op) + ": " + what);
}

void check_finite(const char* op, const char* name, double x, bool nonnegative) {
  if (!std::isfinite(x) || (nonnegative && x < 0))
    bad(op, std::string(name) + " must be a finite" + (nonnegative ? " non-negative" : "") + " number, got " +
                std::to_string(x));
}

void check_ptr(const char* op, const char* name, const void* p, size_t n) {
  if (n > 0 && p == nullptr) bad(op, std::string(name) + " is null");
}

}  // namespace

void sgd_step(float* param, const float* grad, float* momentum_buf, size_t n, const SgdHyper& h, bool first,
              const KernelSet* set) {
  constexpr const char* op = "optim sgd_step";
  check_finite(op, "lr", h.lr, true);
  check_finite(op, "momentum", h.momentum, true);
  check_finite(op, "dampening", h.dampening, false);
  check_finite(op, "weight_decay", h.weight_decay, true);
  if (h.nesterov && (h.momentum <= 0 || h.dampening != 0))
    bad(op, "nesterov momentum requires a momentum and zero dampening");
  check_ptr(op, "param", param, n);
  check_ptr(op, "grad", grad, n);
  if (h.momentum != 0) check_ptr(op, "momentum_buffer", momentum_buf, n);
  if (n == 0) return;
  (set != nullptr ? *set : active_kernels()).sgd(param, grad, momentum_buf, n, h, first);
}

void adam_step(float* param, const float* grad, float* exp_avg, float* exp_avg_sq, float* max_exp_avg_sq,
               size_t n, const AdamHyper& h, double step, const KernelSet* set) {
  constexpr const char* op = "optim adam_step";
  check_finite(op, "lr", h.lr, true);
  check_finite(op, "eps", h.eps, true);
  check_finite(op, "weight_decay", h.weight_decay, true);
  if (!(h.beta1 >= 0 && h.beta1 < 1) || !(h.beta2 >= 0 && h.beta2 < 1))
    bad(op,
        "betas must be in [0, 1), got (" + std::to_string(h.beta1) + ", " + std::to_string(h.beta2) + ")");
  if (!(step >= 1) || step != std::floor(step))
    bad(op, "step must be a whole number >= 1, got " + std::to_string(step));
  check_ptr(op, "param", param, n);
  check_ptr(op, "grad", grad, n);
  check_ptr(op, "exp_avg", exp_avg, n);
  check_ptr(op, "exp_avg_sq", exp_avg_sq, n);
  if (h.amsgrad) check_ptr(op, "max_exp_avg_sq", max_exp_avg_sq, n);
  if (n == 0) return;
  (set != nullptr ? *set : active_kernels())
      .adam(param, grad, exp_avg, exp_avg_sq, h.amsgrad ? max_exp_avg_sq : nullptr, n, h, step);
}

}  // namespace rumor::optim
