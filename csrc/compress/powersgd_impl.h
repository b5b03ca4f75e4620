// Kernel bodies for powersgd_kernels.h, compiled once per instruction set. Plain loops over
// __restrict pointers that the compiler vectorizes for the unit's target; sums are split over a
// fixed number of lanes so that they vectorize without reassociation by the compiler.
#pragma once

#include <cstddef>
#include <cstdint>

#include "compress/powersgd_kernels.h"

#ifndef RUMOR_KERNEL_NS
#error "define RUMOR_KERNEL_NS before including powersgd_impl.h"
#endif

namespace rumor::compress::powersgd::RUMOR_KERNEL_NS {

namespace {

#ifdef __FMA__
inline float madd(float a, float b, float c) { return __builtin_fmaf(a, b, c); }
#else
inline float madd(float a, float b, float c) { return a * b + c; }
#endif

constexpr size_t kLanes = 16;   // two AVX2 registers per running sum: hides the add latency
constexpr uint32_t kBlock = 4;  // columns of Q (rows of qt) handled per pass over a row of A

// out[c] = dot(row, qt row c0 + c) for c < KB.
template <uint32_t KB>
void dots(const float* __restrict row, size_t m, const float* __restrict qt, float* __restrict out) {
  float acc[KB][kLanes] = {};
  size_t j = 0;
  for (; j + kLanes <= m; j += kLanes)
    for (uint32_t c = 0; c < KB; ++c)
      for (size_t l = 0; l < kLanes; ++l) acc[c][l] = madd(row[j + l], qt[c * m + j + l], acc[c][l]);
  for (uint32_t c = 0; c < KB; ++c) {
    // Pairwise combination of the lanes: fewer roundings in sequence than a running sum.
    for (size_t w = kLanes / 2; w > 0; w /= 2)
      for (size_t l = 0; l < w; ++l) acc[c][l] += acc[c][l + w];
    float s = acc[c][0];
    for (size_t t = j; t < m; ++t) s = madd(row[t], qt[c * m + t], s);
    out[c] = s;
  }
}

void project(float* a, const float* add, size_t n, size_t m, const float* qt, uint32_t k, float* p) {
  for (size_t i = 0; i < n; ++i) {
    float* __restrict row = a + i * m;
    if (add != nullptr) {
      const float* __restrict g = add + i * m;
      for (size_t j = 0; j < m; ++j) row[j] += g[j];
    }
    float* out = p + i * k;
    uint32_t c = 0;
    for (; c + kBlock <= k; c += kBlock) dots<kBlock>(row, m, qt + c * m, out + c);
    switch (k - c) {
      case 3:
        dots<3>(row, m, qt + c * m, out + c);
        break;
      case 2:
        dots<2>(row, m, qt + c * m, out + c);
        break;
      case 1:
        dots<1>(row, m, qt + c * m, out + c);
        break;
      default:
        break;
    }
  }
}

// qt rows c < KB += coef[c] * row.
template <uint32_t KB>
void axpys(const float* __restrict row, size_t m, const float* coef, float* __restrict qt) {
  float s[KB];
  for (uint32_t c = 0; c < KB; ++c) s[c] = coef[c];
  for (size_t j = 0; j < m; ++j) {
    const float x = row[j];
    for (uint32_t c = 0; c < KB; ++c) qt[c * m + j] = madd(s[c], x, qt[c * m + j]);
  }
}

void back_project(const float* a, size_t n, size_t m, const float* p, uint32_t k, float* qt) {
  for (size_t t = 0; t < static_cast<size_t>(k) * m; ++t) qt[t] = 0.f;
  for (size_t i = 0; i < n; ++i) {
    const float* row = a + i * m;
    const float* coef = p + i * k;
    uint32_t c = 0;
    for (; c + kBlock <= k; c += kBlock) axpys<kBlock>(row, m, coef + c, qt + c * m);
    switch (k - c) {
      case 3:
        axpys<3>(row, m, coef + c, qt + c * m);
        break;
      case 2:
        axpys<2>(row, m, coef + c, qt + c * m);
        break;
      case 1:
        axpys<1>(row, m, coef + c, qt + c * m);
        break;
      default:
        break;
    }
  }
}

// One row for a rank known at compile time: one pass, the same sums in the same order as the
// general loop below (c = 0 first, then each further product added), so the same bits.
template <uint32_t K>
void reconstruct_fixed(const float* p, size_t n, const float* qt, size_t m, float* out, float* err) {
  for (size_t i = 0; i < n; ++i) {
    float s[K];
    for (uint32_t c = 0; c < K; ++c) s[c] = p[i * K + c];
    float* __restrict o = out + i * m;
    float* __restrict e = err != nullptr ? err + i * m : nullptr;
    const float* __restrict q = qt;
    for (size_t j = 0; j < m; ++j) {
      float v = s[0] * q[j];
      for (uint32_t c = 1; c < K; ++c) {
        const float prod = s[c] * q[c * m + j];
        v = v + prod;
      }
      o[j] = v;
    }
    if (e != nullptr)
      for (size_t j = 0; j < m; ++j) e[j] -= o[j];
  }
}

void reconstruct(const float* p, size_t n, uint32_t k, const float* qt, size_t m, float* out, float* err) {
  switch (k) {
    case 1:
      return reconstruct_fixed<1>(p, n, qt, m, out, err);
    case 2:
      return reconstruct_fixed<2>(p, n, qt, m, out, err);
    case 3:
      return reconstruct_fixed<3>(p, n, qt, m, out, err);
    case 4:
      return reconstruct_fixed<4>(p, n, qt, m, out, err);
    default:
      break;
  }
  for (size_t i = 0; i < n; ++i) {
    float* __restrict o = out + i * m;
    const float* pi = p + i * k;
    {
      const float s = pi[0];
      const float* __restrict q = qt;
      for (size_t j = 0; j < m; ++j) o[j] = s * q[j];
    }
    for (uint32_t c = 1; c < k; ++c) {
      const float s = pi[c];
      const float* __restrict q = qt + c * m;
      for (size_t j = 0; j < m; ++j) o[j] = o[j] + s * q[j];
    }
    if (err != nullptr) {
      float* __restrict e = err + i * m;
      for (size_t j = 0; j < m; ++j) e[j] -= o[j];
    }
  }
}

}  // namespace

extern const KernelSet kKernels;
const KernelSet kKernels = {RUMOR_KERNEL_NAME, project, back_project, reconstruct};

}  // namespace rumor::compress::powersgd::RUMOR_KERNEL_NS
