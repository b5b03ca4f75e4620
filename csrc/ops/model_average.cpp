#include "ops/model_average.h"

#include <string>

namespace rumor::ops {

namespace {

template <typename T>
void take(const T* __restrict x, T* __restrict snap, T* __restrict work, size_t n, bool retake) {
  if (retake) {
    for (size_t i = 0; i < n; ++i) {
      const T v = x[i];
      work[i] = v + (work[i] - snap[i]);
      snap[i] = v;
    }
  } else {
    for (size_t i = 0; i < n; ++i) {
      const T v = x[i];
      work[i] = v;
      snap[i] = v;
    }
  }
}

template <typename T>
void apply(T* __restrict x, const T* __restrict avg, const T* __restrict snap, size_t n) {
  for (size_t i = 0; i < n; ++i) x[i] += avg[i] - snap[i];
}

[[noreturn]] void bad_dtype(const char* op, DType dtype) {
  throw Error(ErrorKind::kInvalidArgument, std::string(op) + ": float32 or float64 buffers expected, got " +
                                               std::string(dtype_name(dtype)));
}

}  // namespace

void average_take(void* x, void* snap, void* work, size_t n, DType dtype, bool retake) {
  if (dtype == DType::F32)
    take(static_cast<const float*>(x), static_cast<float*>(snap), static_cast<float*>(work), n, retake);
  else if (dtype == DType::F64)
    take(static_cast<const double*>(x), static_cast<double*>(snap), static_cast<double*>(work), n, retake);
  else
    bad_dtype("async model average (take)", dtype);
}

void average_apply(void* x, const void* avg, const void* snap, size_t n, DType dtype) {
  if (dtype == DType::F32)
    apply(static_cast<float*>(x), static_cast<const float*>(avg), static_cast<const float*>(snap), n);
  else if (dtype == DType::F64)
    apply(static_cast<double*>(x), static_cast<const double*>(avg), static_cast<const double*>(snap), n);
  else
    bad_dtype("async model average (apply)", dtype);
}

}  // namespace rumor::ops
