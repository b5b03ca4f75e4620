// Gradient codecs for Python (python/rumor/compression.py). Buffers cross as addresses and
// lengths; the Python side checks devices, dtypes and contiguity, the codecs check every size.
#include "bindings/common.h"
#include "compress/codec.h"

namespace rumor::bindings {

void bind_compression(py::module_& m) {
  using compress::Codec;
  py::enum_<compress::Kind>(m, "CodecKind")
      .value("MinMaxU8", compress::Kind::kMinMaxU8)
      .value("QSGD", compress::Kind::kQSGD)
      .value("Sign", compress::Kind::kSign)
      .value("F16", compress::Kind::kF16)
      .value("BF16", compress::Kind::kBF16);

  py::class_<Codec>(m, "Codec")
      .def_property_readonly("name", &Codec::name)
      .def_property_readonly("kind", &Codec::kind)
      .def("encoded_bytes", &Codec::encoded_bytes, py::arg("count"))
      .def(
          "encode",
          [](const Codec& c, uintptr_t in, size_t count, int dtype, uintptr_t out, size_t out_bytes,
             uint64_t seed) {
            DType dt = to_dtype(dtype);
            py::gil_scoped_release nogil;
            c.encode(ptr(in), count, dt, static_cast<std::byte*>(ptr(out)), out_bytes, seed);
          },
          py::arg("src"), py::arg("count"), py::arg("dtype"), py::arg("dst"), py::arg("dst_bytes"),
          py::arg("seed") = 0, "Encodes count elements at src into dst (exactly encoded_bytes(count) bytes).")
      .def(
          "decode",
          [](const Codec& c, uintptr_t in, size_t in_bytes, uintptr_t out, size_t count, int dtype,
             bool acc) {
            DType dt = to_dtype(dtype);
            py::gil_scoped_release nogil;
            c.decode(static_cast<const std::byte*>(ptr(in)), in_bytes, ptr(out), count, dt, acc);
          },
          py::arg("src"), py::arg("src_bytes"), py::arg("dst"), py::arg("count"), py::arg("dtype"),
          py::arg("accumulate") = false,
          "Decodes an encoding into count elements at dst (or adds into them).");

  m.def(
      "make_codec",
      [](compress::Kind kind, uint32_t chunk, uint32_t levels) {
        return compress::make_codec(compress::CodecParams{kind, chunk, levels});
      },
      py::arg("kind"), py::arg("chunk") = 0, py::arg("levels") = 16);
  m.def("codec_isa", &compress::codec_isa, "Kernel set the codecs use: 'avx2' or 'generic'.");
}

}  // namespace rumor::bindings
