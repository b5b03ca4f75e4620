// Built with -mavx2 -mfma -mf16c (see CMakeLists.txt); only called when the CPU has them.
#define RUMOR_KERNEL_NS avx2
#define RUMOR_KERNEL_NAME "avx2"
#include "compress/powersgd_impl.h"
