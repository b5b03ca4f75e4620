#include "compress/powersgd_kernels.h"

#include <cmath>

#include "core/isa_dispatch.h"

namespace rumor::compress::powersgd {

namespace generic {
extern const KernelSet kKernels;
}
namespace avx2 {
extern const KernelSet kKernels;
}

constexpr IsaDispatch<KernelSet> kDispatch{&generic::kKernels, RUMOR_AVX2_SET(avx2::kKernels),
                                           "RUMOR_POWERSGD_ISA"};

const KernelSet* kernel_set(Isa isa) { return kDispatch.set(isa); }

const KernelSet& active_kernels() { return active_set<kDispatch>(); }

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
