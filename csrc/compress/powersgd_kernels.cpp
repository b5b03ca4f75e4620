#include "compress/powersgd_kernels.h"

#include <cmath>

#include "core/cpu.h"

namespace rumor::compress::powersgd {

namespace generic {
extern const KernelSet kKernels;
}
#ifdef RUMOR_AVX2_KERNELS
namespace avx2 {
extern const KernelSet kKernels;
}
#endif

const KernelSet* kernel_set(Isa isa) {
  if (isa == Isa::kGeneric) return &generic::kKernels;
#ifdef RUMOR_AVX2_KERNELS
  if (cpu_has_avx2()) return &avx2::kKernels;
#endif
  return nullptr;
}

const KernelSet& active_kernels() {
  static const KernelSet* const set =
      choose_kernels(&generic::kKernels, kernel_set(Isa::kAvx2), "RUMOR_POWERSGD_ISA");
  return *set;
}

void orthogonalize(float* x, size_t n, uint32_t k, double epsilon, double* d) {
  const size_t total = n * k;
  for (size_t t = 0; t < total; ++t) d[t] = x[t];
  for (uint32_t c = 0; c < k; ++c) {
    double ss = 0;
    for (size_t i = 0; i < n; ++i) ss += d[i * k + c] * d[i * k + c];
    const double norm = std::sqrt(ss);
    if (epsilon == 0 && norm == 0) {
      continue;  // already all zeros: nothing to normalize and nothing to project out
    }
    const double inv = 1.0 / (norm + epsilon);
    for (size_t i = 0; i < n; ++i) d[i * k + c] *= inv;
    for (uint32_t c2 = c + 1; c2 < k; ++c2) {
      double dot = 0;
      for (size_t i = 0; i < n; ++i) dot += d[i * k + c] * d[i * k + c2];
      for (size_t i = 0; i < n; ++i) d[i * k + c2] -= dot * d[i * k + c];
    }
  }
  for (size_t t = 0; t < total; ++t) x[t] = static_cast<float>(d[t]);
}

}  // namespace rumor::compress::powersgd
