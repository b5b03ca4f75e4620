// Small helpers that both the CPU kernels and the CUDA kernels call: with nvcc they are compiled
// for host and device, so the two sides share one definition instead of mirrored copies.
#pragma once

#if defined(__CUDACC__)
#define RUMOR_HD __host__ __device__ __forceinline__
#else
#define RUMOR_HD inline
#endif
