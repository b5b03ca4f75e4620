// AVX2/FMA/F16C build of the neighbor kernels, chosen at run time (see neighbor.cpp).
#define RUMOR_KERNEL_NS neighbor_avx2
#include "comm/neighbor_kernels.h"
