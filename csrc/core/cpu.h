// What this CPU can run: picks between the baseline and the AVX2 copies of the kernels.
#pragma once

#include <cstdlib>
#include <string_view>

namespace rumor {

// True when the AVX2 kernel copies are compiled in and this CPU has AVX2, FMA and F16C
// (evaluated once; the answer cannot change while the process runs).
bool cpu_has_avx2();

// The kernel set a feature area runs: `avx2` where it is compiled in (non-null) and this CPU
// runs it, else `generic`; the environment variable `env` set to "generic" forces the baseline
// (to compare or to rule the AVX2 copy out). Callers keep the answer in a function-local static:
// the environment is read once and the CPU cannot change.
template <typename Set>
const Set* choose_kernels(const Set* generic, const Set* avx2, const char* env) {
  const char* v = std::getenv(env);
  if (v != nullptr && std::string_view(v) == "generic") return generic;
  return avx2 != nullptr && cpu_has_avx2() ? avx2 : generic;
}

}  // namespace rumor
