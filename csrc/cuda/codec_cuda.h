// The codecs of compress/codec.h on CUDA device memory. An encoding made here is byte for byte
// the one the CPU codec makes of the same values (same header, chunk scales, codes and, for
// QSGD, the same random draws for the same seed), so GPU and CPU ranks can exchange encodings
// and either side can decode the other's.
//
// Plain C++ on purpose: no CUDA header, so the bindings and tests include it with any compiler.
// Streams cross as void* (a cudaStream_t; nullptr is the legacy default stream). The functions
// are defined only in builds with RUMOR_WITH_CUDA (nvcc found at configure time).
#pragma once

#include <cstddef>
#include <cstdint>

#include "compress/codec.h"
#include "core/types.h"

namespace rumor::cuda {

// CUDA devices this process can use: 0, never an exception, when the driver or the GPU is
// missing (the CUDA runtime is linked statically, so the extension loads without a driver).
int cuda_device_count() noexcept;

// codec.encode on the device: reads count elements of `in` (float32, float16, bfloat16 or
// float64) and writes exactly codec.encoded_bytes(count) bytes at `out`. Both must be device
// memory of the same GPU; `out` may have any alignment, `in` must be aligned to its dtype. The
// work is queued on `stream` (which must belong to that GPU) and the call returns without
// waiting for it. Bad arguments throw Error(kInvalidArgument) naming the codec and
// "encode (CUDA)"; a failed CUDA call throws Error(kSystem) with CUDA's message.
void encode(const compress::Codec& codec, const void* in, size_t count, DType dtype, std::byte* out,
            size_t out_bytes, uint64_t seed, void* stream);

// codec.decode on the device: writes (or with accumulate, adds into) count elements at `out`.
// The 32-byte header is validated exactly as the CPU decoder does; reading it costs a 32-byte
// copy to the host and so a synchronization with `stream` (the call waits for the work already
// queued there, e.g. the kernel that wrote the encoding). The decode kernel itself is queued
// without waiting.
void decode(const compress::Codec& codec, const std::byte* in, size_t in_bytes, void* out, size_t count,
            DType dtype, bool accumulate, void* stream);

}  // namespace rumor::cuda
