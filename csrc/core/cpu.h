// What this CPU can run: picks between the baseline and the AVX2 copies of the kernels.
#pragma once

namespace rumor {

// True when the AVX2 kernel copies are compiled in and this CPU has AVX2, FMA and F16C
// (evaluated once; the answer cannot change while the process runs).
bool cpu_has_avx2();

}  // namespace rumor
