// PowerSGD's dense products over float32 matrices, once per instruction set (powersgd_generic.cpp,
// powersgd_avx2.cpp), plus the Gram-Schmidt orthogonalization every set shares.
//
// Layouts: a gradient matrix A is n x m, row-major (a parameter's gradient viewed as
// (shape[0], numel / shape[0])). P is n x k row-major, as torch's PowerSGD state stores it. The
// kernels take Q transposed, k x m row-major ("qt"), so that every product walks A row by row
// with unit stride: each kernel reads A exactly once.
//
// Rounding: the local products (project, back_project) may fuse multiply-adds and split their
// sums over lanes, so the two sets differ in the last bits there; their results are summed over
// the ranks anyway. What every rank must compute bit for bit alike from the same reduced P and Q
// (orthogonalize, reconstruct) is pinned down: orthogonalize runs in double in one shared copy,
// and reconstruct adds the k products in a fixed order without fusing (its sources are built with
// -ffp-contract=off), so ranks on CPUs with and without AVX2 still end with identical weights.
#pragma once

#include <cstddef>
#include <cstdint>

#include "core/cpu.h"

namespace rumor::compress::powersgd {

struct KernelSet {
  const char* isa;
  // p[i * k + c] = sum_j a[i * m + j] * qt[c * m + j]. With `add` non-null, each row of a is first
  // increased by the same row of add (a += add: error feedback folds the new gradient into the
  // error buffer, which then holds the matrix that is compressed).
  void (*project)(float* a, const float* add, size_t n, size_t m, const float* qt, uint32_t k, float* p);
  // qt[c * m + j] = sum_i a[i * m + j] * p[i * k + c] (qt is overwritten).
  void (*back_project)(const float* a, size_t n, size_t m, const float* p, uint32_t k, float* qt);
  // out[i * m + j] = sum_c p[i * k + c] * qt[c * m + j], summed in order c = 0, 1, ... without
  // fused multiply-adds; with err non-null also err[i * m + j] -= that value.
  void (*reconstruct)(const float* p, size_t n, uint32_t k, const float* qt, size_t m, float* out,
                      float* err);
};

using rumor::Isa;

// The set for isa, or null where this build or CPU cannot run it.
const KernelSet* kernel_set(Isa isa);
// The best set this CPU runs (RUMOR_POWERSGD_ISA=generic forces the baseline).
const KernelSet& active_kernels();

// Modified Gram-Schmidt on the k columns of the n x k row-major matrix x, in place, computed in
// double: column c is divided by (its norm + epsilon), then its projection is removed from the
// columns after it. With epsilon == 0 a column whose norm is 0 is set to zeros (it cannot be
// normalized); torch divides by zero there and fills the matrix with NaN. scratch: n * k doubles.
void orthogonalize(float* x, size_t n, uint32_t k, double epsilon, double* scratch);

}  // namespace rumor::compress::powersgd
