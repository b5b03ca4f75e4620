// Kernel bodies for optim_kernels.h, compiled once per instruction set (optim_generic.cpp and
// optim_avx2.cpp). Plain loops over __restrict pointers that the compiler vectorizes for the
// unit's target.
#pragma once

#include <cmath>
#include <cstddef>

#include "optim/optim_kernels.h"

#ifndef RUMOR_KERNEL_NS
#error "define RUMOR_KERNEL_NS before including optim_impl.h"
#endif

namespace rumor::optim::RUMOR_KERNEL_NS {

namespace {

// a * b + c. torch's vectorized CPU kernels for add(alpha=), lerp and friends use fused
// multiply-adds where the CPU has them; the AVX2 set does the same, the baseline cannot.
#ifdef __FMA__
inline float madd(float a, float b, float c) { return __builtin_fmaf(a, b, c); }
#else
inline float madd(float a, float b, float c) { return a * b + c; }
#endif

// The optimizer sources are built with -fno-math-errno (CMakeLists.txt): a sqrt that may set
// errno is a branch, and a loop with a branch does not vectorize (Adam ran 4x slower that way).
inline float root(float x) { return __builtin_sqrtf(x); }

template <bool Maximize, bool Decay, bool Momentum, bool Nesterov>
void sgd_loop(float* __restrict p, const float* __restrict g, float* __restrict buf, size_t n,
              const SgdHyper& h, bool first) {
  const float wd = static_cast<float>(h.weight_decay);
  const float mom = static_cast<float>(h.momentum);
  const float keep = static_cast<float>(1.0 - h.dampening);
  const float neg_lr = static_cast<float>(-h.lr);
  for (size_t i = 0; i < n; ++i) {
    float d = Maximize ? -g[i] : g[i];
    if constexpr (Decay) d = madd(p[i], wd, d);
    if constexpr (Momentum) {
      const float b = first ? d : madd(d, keep, buf[i] * mom);
      buf[i] = b;
      d = Nesterov ? madd(b, mom, d) : b;
    }
    p[i] = madd(d, neg_lr, p[i]);
  }
}

void sgd(float* p, const float* g, float* buf, size_t n, const SgdHyper& h, bool first) {
  const bool decay = h.weight_decay != 0, momentum = h.momentum != 0, nesterov = momentum && h.nesterov;
#define RUMOR_SGD(MAX, DEC)                                                         \
  do {                                                                              \
    if (!momentum) return sgd_loop<MAX, DEC, false, false>(p, g, buf, n, h, first); \
    if (nesterov) return sgd_loop<MAX, DEC, true, true>(p, g, buf, n, h, first);    \
    return sgd_loop<MAX, DEC, true, false>(p, g, buf, n, h, first);                 \
  } while (0)
  if (h.maximize) {
    if (decay) RUMOR_SGD(true, true);
    RUMOR_SGD(true, false);
  }
  if (decay) RUMOR_SGD(false, true);
  RUMOR_SGD(false, false);
#undef RUMOR_SGD
}

// Scalars of one Adam step, derived as torch derives them (in double, then used as float).
struct AdamCoef {
  float wd, shrink, w1, w1_rest, beta2, c2, bc2_sqrt, eps, neg_step_size;
  bool small_weight;
};

AdamCoef adam_coef(const AdamHyper& h, double step) {
  AdamCoef c{};
  c.wd = static_cast<float>(h.weight_decay);
  c.shrink = static_cast<float>(1.0 - h.lr * h.weight_decay);
  const float w1 = static_cast<float>(1.0 - h.beta1);
  c.w1 = w1;
  c.w1_rest = 1.0f - w1;  // lerp's complementary weight, computed in the weight's type
  c.small_weight = std::fabs(w1) < 0.5f;
  c.beta2 = static_cast<float>(h.beta2);
  c.c2 = static_cast<float>(1.0 - h.beta2);
  const double bc1 = 1.0 - std::pow(h.beta1, step);
  const double bc2 = 1.0 - std::pow(h.beta2, step);
  c.bc2_sqrt = static_cast<float>(std::sqrt(bc2));
  c.eps = static_cast<float>(h.eps);
  c.neg_step_size = static_cast<float>(-(h.lr / bc1));
  return c;
}

template <bool Maximize, bool L2, bool Decoupled, bool Ams>
void adam_loop(float* __restrict p, const float* __restrict g, float* __restrict m, float* __restrict v,
               float* __restrict vmax, size_t n, const AdamCoef& c) {
  for (size_t i = 0; i < n; ++i) {
    float d = Maximize ? -g[i] : g[i];
    float x = p[i];
    if constexpr (Decoupled) x = x * c.shrink;
    if constexpr (L2) d = madd(x, c.wd, d);
    // exp_avg.lerp_(grad, 1 - beta1)
    const float diff = d - m[i];
    const float mi = c.small_weight ? madd(c.w1, diff, m[i]) : madd(-diff, c.w1_rest, d);
    m[i] = mi;
    // exp_avg_sq.mul_(beta2).addcmul_(grad, grad, value=1 - beta2)
    float vi = v[i] * c.beta2;
    vi = madd(c.c2 * d, d, vi);
    v[i] = vi;
    if constexpr (Ams) {
      const float mx = vmax[i] < vi ? vi : vmax[i];
      vmax[i] = mx;
      vi = mx;
    }
    const float denom = root(vi) / c.bc2_sqrt + c.eps;
    p[i] = madd(c.neg_step_size, mi / denom, x);
  }
}

void adam(float* p, const float* g, float* m, float* v, float* vmax, size_t n, const AdamHyper& h,
          double step) {
  const AdamCoef c = adam_coef(h, step);
  const bool decay = h.weight_decay != 0;
  const bool l2 = decay && !h.decoupled_weight_decay, decoupled = decay && h.decoupled_weight_decay;
#define RUMOR_ADAM(MAX, AMS)                                                        \
  do {                                                                              \
    if (l2) return adam_loop<MAX, true, false, AMS>(p, g, m, v, vmax, n, c);        \
    if (decoupled) return adam_loop<MAX, false, true, AMS>(p, g, m, v, vmax, n, c); \
    return adam_loop<MAX, false, false, AMS>(p, g, m, v, vmax, n, c);               \
  } while (0)
  if (h.maximize) {
    if (h.amsgrad) RUMOR_ADAM(true, true);
    RUMOR_ADAM(true, false);
  }
  if (h.amsgrad) RUMOR_ADAM(false, true);
  RUMOR_ADAM(false, false);
#undef RUMOR_ADAM
}

}  // namespace

extern const KernelSet kKernels;
const KernelSet kKernels = {RUMOR_KERNEL_NAME, &sgd, &adam};

}  // namespace rumor::optim::RUMOR_KERNEL_NS
