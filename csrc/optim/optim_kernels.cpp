#include "optim/optim_kernels.h"

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <string>
#include <string_view>
#include <thread>
#include <vector>

#include "core/isa_dispatch.h"
#include "core/types.h"

namespace rumor::optim {

namespace generic {
extern const KernelSet kKernels;
}
namespace avx2 {
extern const KernelSet kKernels;
}

constexpr IsaDispatch<KernelSet> kDispatch{&generic::kKernels, RUMOR_AVX2_SET(avx2::kKernels),
                                           "RUMOR_OPTIM_ISA"};

const KernelSet* kernel_set(Isa isa) { return kDispatch.set(isa); }

const KernelSet& active_kernels() { return active_set<kDispatch>(); }

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

// Runs fn(begin, count) over [0, n) in up to `threads` slices, the last on the calling thread.
// Slices start on 64-byte boundaries and below kMinSlice elements are not worth a thread.
template <typename Fn>
void in_slices(size_t n, unsigned threads, Fn fn) {
  constexpr size_t kMinSlice = size_t{1} << 18, kAlign = 16;
  const size_t parts = std::max<size_t>(1, std::min<size_t>(threads, n / kMinSlice));
  if (parts <= 1) {
    fn(size_t{0}, n);
    return;
  }
  const size_t per = (n / parts + kAlign - 1) / kAlign * kAlign;
  std::vector<std::jthread> helpers;
  helpers.reserve(parts - 1);
  size_t begin = 0;
  for (size_t k = 0; k + 1 < parts && begin + per < n; ++k, begin += per)
    helpers.emplace_back([&fn, begin, per] { fn(begin, per); });
  fn(begin, n - begin);
}  // the helpers join as they go out of scope

}  // namespace

void sgd_step(float* param, const float* grad, float* momentum_buf, size_t n, const SgdHyper& h, bool first,
              const KernelSet* set, unsigned threads) {
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
  const KernelSet& k = set != nullptr ? *set : active_kernels();
  in_slices(n, threads, [&](size_t b, size_t c) {
    k.sgd(param + b, grad + b, momentum_buf != nullptr ? momentum_buf + b : nullptr, c, h, first);
  });
}

void adam_step(float* param, const float* grad, float* exp_avg, float* exp_avg_sq, float* max_exp_avg_sq,
               size_t n, const AdamHyper& h, double step, const KernelSet* set, unsigned threads) {
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
  const KernelSet& k = set != nullptr ? *set : active_kernels();
  float* vmax = h.amsgrad ? max_exp_avg_sq : nullptr;
  in_slices(n, threads, [&](size_t b, size_t c) {
    k.adam(param + b, grad + b, exp_avg + b, exp_avg_sq + b, vmax != nullptr ? vmax + b : nullptr, c, h,
           step);
  });
}

}  // namespace rumor::optim
