// The CUDA codecs for Python (python/rumor/compression.py sends CUDA tensors here). Tensors cross
// as device addresses and torch's current stream as an integer; the extension links no torch and
// the CUDA runtime statically, so it also loads where there is no driver (0 devices).
#include "bindings/common.h"
#include "compress/codec.h"
#ifdef RUMOR_WITH_CUDA
#include "cuda/codec_cuda.h"
#endif

namespace rumor::bindings {

void bind_cuda(py::module_& m) {
#ifdef RUMOR_WITH_CUDA
  constexpr bool built = true;
#else
  constexpr bool built = false;
#endif
  m.def("cuda_built", [] { return built; }, "Whether this build has the CUDA codec kernels.");
  m.def(
      "cuda_device_count",
      [] {
#ifdef RUMOR_WITH_CUDA
        return cuda::cuda_device_count();
#else
        return 0;
#endif
      },
      "CUDA devices rumor can use: 0 without a CUDA build, a driver or a GPU (never raises).");
#ifdef RUMOR_WITH_CUDA
  using compress::Codec;
  m.def(
      "cuda_encode",
      [](const Codec& c, uintptr_t in, size_t count, int dtype, uintptr_t out, size_t out_bytes,
         uint64_t seed, uintptr_t stream) {
        DType dt = to_dtype(dtype);
        py::gil_scoped_release nogil;
        cuda::encode(c, ptr(in), count, dt, static_cast<std::byte*>(ptr(out)), out_bytes, seed, ptr(stream));
      },
      py::arg("codec"), py::arg("src"), py::arg("count"), py::arg("dtype"), py::arg("dst"),
      py::arg("dst_bytes"), py::arg("seed"), py::arg("stream"),
      "Codec.encode on device memory, queued on the CUDA stream.");
  m.def(
      "cuda_decode",
      [](const Codec& c, uintptr_t in, size_t in_bytes, uintptr_t out, size_t count, int dtype, bool acc,
         uintptr_t stream) {
        DType dt = to_dtype(dtype);
        // Releases the GIL: the header check waits for the stream.
        py::gil_scoped_release nogil;
        cuda::decode(c, static_cast<const std::byte*>(ptr(in)), in_bytes, ptr(out), count, dt, acc,
                     ptr(stream));
      },
      py::arg("codec"), py::arg("src"), py::arg("src_bytes"), py::arg("dst"), py::arg("count"),
      py::arg("dtype"), py::arg("accumulate"), py::arg("stream"),
      "Codec.decode on device memory: checks the header (a stream sync), then queues the kernel.");
#endif
}

}  // namespace rumor::bindings
