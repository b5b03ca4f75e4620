// Built with -mavx2 -mfma -mf16c (see CMakeLists.txt); only called when the CPU has them.
#define RUMOR_KERNEL_NS avx2
// The half types get hand-written vector folds (core/reduce_avx2_halves.h).
#define RUMOR_REDUCE_AVX2_HALVES 1
#include "core/reduce_impl.h"
