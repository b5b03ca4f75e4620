// CUDA kernels of the codecs and the host functions of cuda/codec_cuda.h.
//
// Chunked codecs run one warp per chunk (codec_ops.cuh explains why that reproduces the CPU's
// chunk sums bit for bit): a block of 256 threads takes 8 chunks, and the grid strides over the
// rest. Lanes read consecutive elements, so loads are coalesced; each chunk is read twice (reduce,
// then quantize), the second time mostly from L2. The reductions cannot be split further without
// changing the CPU's summation order, so a chunk is never spread over more than a warp: with the
// default 1024-element chunks any large tensor still fills the GPU. The casts are one element per
// thread and grid stride; decodes read several codes before they write (codec_ops.cuh).
#include <cuda_runtime.h>

#include <cstring>
#include <string>

#include "compress/elem.h"
#include "compress/kernels.h"
#include "cuda/codec_cuda.h"
#include "cuda/codec_ops.cuh"

namespace rumor::cuda {

namespace {

using namespace detail;
using compress::Kind;

constexpr unsigned kThreads = 256;
constexpr unsigned kWarpsPerBlock = kThreads / kWarp;
// Enough blocks to fill any current GPU several times over; larger inputs are strided over.
constexpr size_t kMaxBlocks = size_t{1} << 16;
constexpr size_t kHeaderBytes = sizeof(Header);
constexpr unsigned kFullMask = 0xffffffffu;

// ---------------------------------------------------------------------------------------------
// Device side.

// Calls f(chunk, lane) for each chunk this warp owns. The loop bounds depend only on the warp,
// so all 32 lanes take every iteration together and may shuffle inside f.
template <class F>
__device__ __forceinline__ void for_each_chunk(size_t count, uint32_t chunk, F&& f) {
  const size_t chunks = (count + chunk - 1) / chunk;
  const unsigned lane = threadIdx.x % kWarp;
  const size_t stride = static_cast<size_t>(gridDim.x) * kWarpsPerBlock;
  for (size_t ci = static_cast<size_t>(blockIdx.x) * kWarpsPerBlock + threadIdx.x / kWarp; ci < chunks;
       ci += stride) {
    const size_t begin = ci * chunk;
    f(Chunk{ci, begin, count - begin < chunk ? count - begin : chunk}, lane);
  }
}

// The xor butterfly of codec_ops.cuh: adjacent lanes first, the full sum in every lane.
__device__ __forceinline__ float warp_sum(float v) {
  for (unsigned off = 1; off < kWarp; off <<= 1) v = fadd(v, __shfl_xor_sync(kFullMask, v, off));
  return v;
}
__device__ __forceinline__ double warp_sum(double v) {
  for (unsigned off = 1; off < kWarp; off <<= 1) v = dadd(v, __shfl_xor_sync(kFullMask, v, off));
  return v;
}
__device__ __forceinline__ MinMax warp_join(MinMax r) {
  for (unsigned off = 1; off < kWarp; off <<= 1)
    r = minmax_join(r, MinMax{__shfl_xor_sync(kFullMask, r.lo, off), __shfl_xor_sync(kFullMask, r.hi, off)});
  return r;
}

// Every encode kernel also writes the header, so an encoding is one launch. One thread with
// constant indices: indexing the parameter by thread would copy it to local memory in every
// thread.
__device__ __forceinline__ void write_header(const Header& h, std::byte* out) {
  if (blockIdx.x != 0 || threadIdx.x != 0) return;
#pragma unroll
  for (unsigned k = 0; k < kHeaderBytes; ++k) out[k] = static_cast<std::byte>(h.bytes[k]);
}

// One chunk of each chunked codec: the lanes' partial results, joined across the warp, then
// each lane's share of the codes.
template <DType D>
__device__ __forceinline__ void encode_chunk(const MinMaxEncode<D>& op, Chunk c, unsigned lane) {
  op.quantize(c, lane, warp_join(op.lane_range(c, lane)));
}
template <DType D>
__device__ __forceinline__ void encode_chunk(const QsgdEncode<D>& op, Chunk c, unsigned lane) {
  // Every lane holds the same sum, so the fallback branch is taken by the whole warp or none.
  const float fsum = warp_sum(op.lane_sumsq_f32(c, lane));
  const float norm = sumsq_f32_ok(fsum) ? fsqrt(fsum) : narrow(dsqrt(warp_sum(op.lane_sumsq_f64(c, lane))));
  op.quantize(c, lane, norm);
}
template <DType D>
__device__ __forceinline__ void encode_chunk(const SignEncode<D>& op, Chunk c, unsigned lane) {
  op.pack(c, lane, warp_sum(op.lane_abs_sum(c, lane)));
}

// MinMaxEncode, QsgdEncode or SignEncode.
template <class Op>
__global__ void __launch_bounds__(kThreads)
    chunk_encode_kernel(Op op, size_t count, uint32_t chunk, Header h, std::byte* out) {
  write_header(h, out);
  for_each_chunk(count, chunk, [&](Chunk c, unsigned lane) { encode_chunk(op, c, lane); });
}

template <DType D, bool Bf>
__global__ void __launch_bounds__(kThreads)
    cast_encode_kernel(const void* in, std::byte* codes, size_t count, Header h, std::byte* out) {
  write_header(h, out);
  const size_t stride = static_cast<size_t>(gridDim.x) * blockDim.x;
  for (size_t i = static_cast<size_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < count; i += stride)
    cast_encode_one<D, Bf>(in, codes, i);
}

// MinMaxDecode, QsgdDecode or SignDecode.
template <class Op>
__global__ void __launch_bounds__(kThreads) chunk_decode_kernel(Op op, size_t count, uint32_t chunk) {
  for_each_chunk(count, chunk, [&](Chunk c, unsigned lane) { op.run(c, lane); });
}

template <DType D, bool Acc, bool Bf>
__global__ void __launch_bounds__(kThreads)
    cast_decode_kernel(const std::byte* codes, void* out, size_t count) {
  cast_decode_thread<D, Acc, Bf>(codes, out, count,
                                 static_cast<size_t>(blockIdx.x) * blockDim.x + threadIdx.x,
                                 static_cast<size_t>(gridDim.x) * blockDim.x);
}

// ---------------------------------------------------------------------------------------------
// Host side.

// Blocks for one warp per chunk / one thread per element; at least one, which writes the header.
unsigned chunk_grid(size_t chunks) {
  const size_t b = (chunks + kWarpsPerBlock - 1) / kWarpsPerBlock;
  return static_cast<unsigned>(b == 0 ? 1 : b < kMaxBlocks ? b : kMaxBlocks);
}
unsigned element_grid(size_t count) {
  const size_t b = (count + kThreads - 1) / kThreads;
  return static_cast<unsigned>(b == 0 ? 1 : b < kMaxBlocks ? b : kMaxBlocks);
}

// A thread per group of eight where cast_decode_thread takes them so, else per element.
template <DType D>
unsigned cast_decode_grid(const std::byte* codes, const void* out, size_t count) {
  return element_grid(detail::cast_decode_by8<D>(codes, out) ? (count + 7) / 8 : count);
}

[[noreturn]] void fail(const std::string& who, const std::string& what) {
  throw Error(ErrorKind::kInvalidArgument, who + ": " + what);
}

void check_cuda(cudaError_t e, const std::string& who, const char* what) {
  if (e == cudaSuccess) return;
  cudaGetLastError();  // clear it unless it is sticky
  throw Error(ErrorKind::kSystem,
              who + ": " + what + " failed: " + cudaGetErrorName(e) + " (" + cudaGetErrorString(e) + ")");
}

// As the CPU codec's check, so both paths reject the same dtypes with the same words.
void check_dtype(const std::string& who, DType dtype) {
  if (dtype != DType::F32 && dtype != DType::F16 && dtype != DType::BF16 && dtype != DType::F64)
    fail(who, "unsupported dtype " + std::string(dtype_name(dtype)) +
                  "; expected float32, float16, bfloat16 or float64");
}

// The device a pointer lives on; it must be device (or managed) memory.
int device_of(const void* p, const std::string& who, const char* what) {
  cudaPointerAttributes a{};
  const cudaError_t e = cudaPointerGetAttributes(&a, p);
  if (e != cudaSuccess) {
    cudaGetLastError();
    fail(who, std::string(what) + " is not CUDA memory (" + cudaGetErrorString(e) + ")");
  }
  if (a.type != cudaMemoryTypeDevice && a.type != cudaMemoryTypeManaged)
    fail(who, std::string(what) + " is host memory; the CUDA codecs take device memory");
  return a.device;
}

// Where the buffers live: one GPU for both. Element buffers must be aligned to their dtype.
int common_device(const std::string& who, const void* encoded, const void* elements, size_t count,
                  DType dtype, const char* encoded_what, const char* elements_what) {
  if (cuda_device_count() == 0) fail(who, "no CUDA device is available to this process");
  const int dev = device_of(encoded, who, encoded_what);
  if (count == 0) return dev;
  if (reinterpret_cast<uintptr_t>(elements) % dtype_size(dtype) != 0)
    fail(who, std::string(elements_what) + " is not aligned to its " + std::string(dtype_name(dtype)) +
                  " elements");
  const int other = device_of(elements, who, elements_what);
  if (other != dev)
    fail(who, std::string(encoded_what) + " is on CUDA device " + std::to_string(dev) + " but " +
                  elements_what + " on device " + std::to_string(other));
  return dev;
}

// Makes `dev` current for the kernels and restores the caller's device afterwards.
class DeviceGuard {
 public:
  DeviceGuard(int dev, const std::string& who) {
    check_cuda(cudaGetDevice(&prev_), who, "cudaGetDevice");
    if (prev_ == dev) {
      prev_ = -1;
    } else {
      check_cuda(cudaSetDevice(dev), who, "cudaSetDevice");
    }
  }
  ~DeviceGuard() {
    if (prev_ >= 0) cudaSetDevice(prev_);
  }
  DeviceGuard(const DeviceGuard&) = delete;
  DeviceGuard& operator=(const DeviceGuard&) = delete;

 private:
  int prev_ = -1;
};

compress::EncodingHeader fields(const Header& h) {
  compress::EncodingHeader f;
  std::memcpy(&f, h.bytes, sizeof(f));
  return f;
}

// The header of codec's encoding of count elements. The CPU codec writes it (an encoding of no
// elements is just its header), so the magic, version, chunk and levels cannot drift from the
// CPU's; only the count is patched in.
Header header_of(const compress::Codec& codec, size_t count) {
  Header h;
  codec.encode(nullptr, 0, DType::F32, reinterpret_cast<std::byte*>(h.bytes), kHeaderBytes, 0);
  const uint64_t n = count;
  std::memcpy(h.bytes + 16, &n, 8);
  return h;
}

void launch_encode(Kind kind, const Header& h, const void* in, size_t count, DType dtype, std::byte* out,
                   uint64_t seed, cudaStream_t s) {
  const compress::EncodingHeader f = fields(h);
  std::byte* body = out + kHeaderBytes;
  const size_t chunks = f.chunk == 0 ? 0 : (count + f.chunk - 1) / f.chunk;
  compress::detail::by_float_dtype(dtype, [&]<DType D>() {
    switch (kind) {
      case Kind::kMinMaxU8:
        chunk_encode_kernel<<<chunk_grid(chunks), kThreads, 0, s>>>(
            MinMaxEncode<D>{in, body, body + 8 * chunks}, count, f.chunk, h, out);
        break;
      case Kind::kQSGD:
        chunk_encode_kernel<<<chunk_grid(chunks), kThreads, 0, s>>>(
            QsgdEncode<D>{in, body, body + 4 * chunks, f.levels, compress::qsgd_key(seed)}, count, f.chunk, h,
            out);
        break;
      case Kind::kSign:
        chunk_encode_kernel<<<chunk_grid(chunks), kThreads, 0, s>>>(
            SignEncode<D>{in, body, body + 4 * chunks}, count, f.chunk, h, out);
        break;
      case Kind::kF16:
        cast_encode_kernel<D, false><<<element_grid(count), kThreads, 0, s>>>(in, body, count, h, out);
        break;
      case Kind::kBF16:
        cast_encode_kernel<D, true><<<element_grid(count), kThreads, 0, s>>>(in, body, count, h, out);
        break;
    }
  });
}

template <bool Acc>
void launch_decode(Kind kind, const Header& h, const std::byte* in, void* out, size_t count, DType dtype,
                   cudaStream_t s) {
  if (count == 0) return;
  const compress::EncodingHeader f = fields(h);
  const std::byte* body = in + kHeaderBytes;
  const size_t chunks = f.chunk == 0 ? 0 : (count + f.chunk - 1) / f.chunk;
  compress::detail::by_float_dtype(dtype, [&]<DType D>() {
    switch (kind) {
      case Kind::kMinMaxU8:
        chunk_decode_kernel<<<chunk_grid(chunks), kThreads, 0, s>>>(
            MinMaxDecode<D, Acc>{body, body + 8 * chunks, out}, count, f.chunk);
        break;
      case Kind::kQSGD:
        chunk_decode_kernel<<<chunk_grid(chunks), kThreads, 0, s>>>(
            QsgdDecode<D, Acc>{body, body + 4 * chunks, out, f.levels}, count, f.chunk);
        break;
      case Kind::kSign:
        chunk_decode_kernel<<<chunk_grid(chunks), kThreads, 0, s>>>(
            SignDecode<D, Acc>{body, body + 4 * chunks, out}, count, f.chunk);
        break;
      case Kind::kF16:
        cast_decode_kernel<D, Acc, false>
            <<<cast_decode_grid<D>(body, out, count), kThreads, 0, s>>>(body, out, count);
        break;
      case Kind::kBF16:
        cast_decode_kernel<D, Acc, true>
            <<<cast_decode_grid<D>(body, out, count), kThreads, 0, s>>>(body, out, count);
        break;
    }
  });
}

}  // namespace

int cuda_device_count() noexcept {
  int n = 0;
  if (cudaGetDeviceCount(&n) != cudaSuccess) {
    cudaGetLastError();  // no driver or no device: not an error for the caller
    return 0;
  }
  return n;
}

void encode(const compress::Codec& codec, const void* in, size_t count, DType dtype, std::byte* out,
            size_t out_bytes, uint64_t seed, void* stream) {
  const std::string who = codec.name() + " encode (CUDA)";
  check_dtype(who, dtype);
  const size_t want = codec.encoded_bytes(count);
  if (out_bytes != want)
    fail(who, "output buffer is " + std::to_string(out_bytes) + " bytes, the encoding of " +
                  std::to_string(count) + " elements takes " + std::to_string(want));
  if (out == nullptr || (count > 0 && in == nullptr)) fail(who, "null buffer");
  const DeviceGuard guard(common_device(who, out, in, count, dtype, "output", "input"), who);
  launch_encode(codec.kind(), header_of(codec, count), in, count, dtype, out, seed,
                static_cast<cudaStream_t>(stream));
  check_cuda(cudaGetLastError(), who, "kernel launch");
}

void decode(const compress::Codec& codec, const std::byte* in, size_t in_bytes, void* out, size_t count,
            DType dtype, bool accumulate, void* stream) {
  const std::string who = codec.name() + " decode (CUDA)";
  check_dtype(who, dtype);
  if (in_bytes < kHeaderBytes)
    fail(who, "buffer of " + std::to_string(in_bytes) + " bytes is shorter than the " +
                  std::to_string(kHeaderBytes) + "-byte header");
  if (in == nullptr || (count > 0 && out == nullptr)) fail(who, "null buffer");
  const DeviceGuard guard(common_device(who, in, out, count, dtype, "input", "output"), who);
  const auto s = static_cast<cudaStream_t>(stream);
  Header got;
  check_cuda(cudaMemcpyAsync(got.bytes, in, kHeaderBytes, cudaMemcpyDeviceToHost, s), who,
             "reading the header");
  check_cuda(cudaStreamSynchronize(s), who, "waiting for the header");
  codec.check_encoding(reinterpret_cast<const std::byte*>(got.bytes), in_bytes, count, who);
  const Header want = header_of(codec, count);
  if (accumulate) {
    launch_decode<true>(codec.kind(), want, in, out, count, dtype, s);
  } else {
    launch_decode<false>(codec.kind(), want, in, out, count, dtype, s);
  }
  check_cuda(cudaGetLastError(), who, "kernel launch");
}

}  // namespace rumor::cuda
