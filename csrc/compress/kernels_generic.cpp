#define RUMOR_KERNEL_NS generic
#include "compress/kernels_impl.h"

namespace rumor::compress::generic {

extern const KernelSet kKernels;
const KernelSet kKernels = {
    "generic",   minmax_encode,      minmax_decode,      qsgd_encode,       qsgd_decode,       sign_encode,
    sign_decode, cast_encode<false>, cast_decode<false>, cast_encode<true>, cast_decode<true>,
};

}  // namespace rumor::compress::generic
