// The choice between a feature area's baseline and AVX2 kernel sets (codecs, PowerSGD, optimizer
// steps), made the same way everywhere so that every RUMOR_*_ISA variable means the same thing.
// An area declares its two sets and keeps one constexpr IsaDispatch next to them:
//
//   namespace generic { extern const KernelSet kKernels; }
//   namespace avx2 { extern const KernelSet kKernels; }
//   constexpr IsaDispatch<KernelSet> kDispatch{&generic::kKernels, RUMOR_AVX2_SET(avx2::kKernels),
//                                              "RUMOR_CODEC_ISA"};
//   const KernelSet* kernel_set(Isa isa) { return kDispatch.set(isa); }
//   const KernelSet& active_kernels() { return active_set<kDispatch>(); }
#pragma once

#include <cstdlib>
#include <string_view>

#include "core/cpu.h"

namespace rumor {

// The AVX2 copy of a kernel set where this translation unit is built with one
// (RUMOR_AVX2_KERNELS), else null: a macro and not a constant, because the flag is per target and
// an inline constant that differed between translation units would break the one-definition rule.
// Without the flag the copy is only named in an unevaluated operand, so no definition is needed.
#ifdef RUMOR_AVX2_KERNELS
#define RUMOR_AVX2_SET(set) (&(set))
#else
#define RUMOR_AVX2_SET(set) (static_cast<decltype(&(set))>(nullptr))
#endif

template <typename Set>
class IsaDispatch {
 public:
  // avx2: null where that copy is not compiled in. env: the variable that, set to "generic",
  // forces the baseline (to compare, or to rule the AVX2 copy out).
  constexpr IsaDispatch(const Set* generic, const Set* avx2, const char* env)
      : generic_(generic), avx2_(avx2), env_(env) {}

  // The set for isa, or null where this build or CPU cannot run it.
  const Set* set(Isa isa) const {
    if (isa == Isa::kGeneric) return generic_;
    return avx2_ != nullptr && cpu_has_avx2() ? avx2_ : nullptr;
  }

  // The set to run now: AVX2 where available, unless the environment forces the baseline. Reads
  // the environment on every call; active_set() keeps the first answer.
  const Set* choose() const {
    const char* v = std::getenv(env_);
    if (v != nullptr && std::string_view(v) == "generic") return generic_;
    const Set* best = set(Isa::kAvx2);
    return best != nullptr ? best : generic_;
  }

 private:
  const Set* generic_;
  const Set* avx2_;
  const char* env_;
};

// The set `dispatch` chooses on the first call, for the life of the process: the environment is
// read once (so the docs can say "before the first use") and the CPU cannot change. One cached
// answer per area, since each area's dispatch object is a distinct template argument.
template <const auto& dispatch>
const auto& active_set() {
  static const auto* const chosen = dispatch.choose();
  return *chosen;
}

}  // namespace rumor
