// Baseline x86-64 (or other architecture) build of the neighbor kernels.
#define RUMOR_KERNEL_NS neighbor_generic
#include "comm/neighbor_kernels.h"
