// What this CPU can run: the answer core/isa_dispatch.h picks kernel sets by.
#pragma once

#include <cstdint>

namespace rumor {

// The instruction sets a feature area may have a kernel set for.
enum class Isa : uint8_t { kGeneric, kAvx2 };

// True when the AVX2 kernel copies are compiled in and this CPU has AVX2, FMA and F16C
// (evaluated once; the answer cannot change while the process runs).
bool cpu_has_avx2();

}  // namespace rumor
