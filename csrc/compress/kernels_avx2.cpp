// Built with -mavx2 -mfma -mf16c (see CMakeLists.txt); only called when the CPU has them.
#define RUMOR_KERNEL_NS avx2
#include "compress/kernels_impl.h"

namespace rumor::compress::avx2 {

extern const KernelSet kKernels;
const KernelSet kKernels = {
    "avx2",      minmax_encode,      minmax_decode,      qsgd_encode,       qsgd_decode,       sign_encode,
    sign_decode, cast_encode<false>, cast_decode<false>, cast_encode<true>, cast_decode<true>,
};

}  // namespace rumor::compress::avx2
