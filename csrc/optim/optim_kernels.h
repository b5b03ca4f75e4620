// Elementwise optimizer updates over flat fp32 buffers (rumor.optim's fused step and the update
// DistributedDataParallel(overlap_optimizer=True) runs as soon as a bucket is averaged).
//
// Each kernel takes one pass over its buffers and follows torch.optim's single-tensor update
// step by step (same operation order, the scalar coefficients derived in double and rounded to
// float where torch hands them to a float tensor op), so results agree with torch's fp32 step to
// a few ulps per step rather than merely "approximately": see tests/cpp/test_optim.cpp and
// tests/python/test_fused_optimizer.py for the tolerances asserted.
#pragma once

#include <cstddef>
#include <cstdint>

#include "core/cpu.h"

namespace rumor::optim {

// Hyper-parameters as Python floats (double); the kernel derives its float coefficients.
struct SgdHyper {
  double lr = 0, momentum = 0, dampening = 0, weight_decay = 0;
  bool nesterov = false, maximize = false;
};

struct AdamHyper {
  double lr = 0, beta1 = 0, beta2 = 0, eps = 0, weight_decay = 0;
  bool decoupled_weight_decay = false;  // AdamW
  bool amsgrad = false, maximize = false;
};

// One instruction set's kernels. The kernels trust their arguments (the callers below check).
struct KernelSet {
  const char* isa;
  // momentum_buf may be null when momentum == 0. first: the buffer holds nothing yet and is set
  // to the (decayed) gradient, as torch does on the first step.
  void (*sgd)(float* param, const float* grad, float* momentum_buf, size_t n, const SgdHyper& h, bool first);
  // step: the step count after this step's increment (1 on the first step). max_exp_avg_sq is
  // used (and may only be non-null) with amsgrad.
  void (*adam)(float* param, const float* grad, float* exp_avg, float* exp_avg_sq, float* max_exp_avg_sq,
               size_t n, const AdamHyper& h, double step);
};

using rumor::Isa;

// The kernel set for isa, or null where this build or CPU cannot run it.
const KernelSet* kernel_set(Isa isa);
// The best set this CPU runs (RUMOR_OPTIM_ISA=generic forces the baseline).
const KernelSet& active_kernels();

// Checked entry points on the active set: throw rumor::Error (kInvalidArgument) on bad arguments.
// threads > 1 splits large buffers into that many slices run at once (the update is elementwise,
// so the result does not depend on the split): the fused step called from Python uses torch's
// thread count; the per-bucket step of overlap_optimizer runs on one thread beside backward.
void sgd_step(float* param, const float* grad, float* momentum_buf, size_t n, const SgdHyper& h, bool first,
              const KernelSet* set = nullptr, unsigned threads = 1);
void adam_step(float* param, const float* grad, float* exp_avg, float* exp_avg_sq, float* max_exp_avg_sq,
               size_t n, const AdamHyper& h, double step, const KernelSet* set = nullptr,
               unsigned threads = 1);

}  // namespace rumor::optim
