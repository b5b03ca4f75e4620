#include "core/reduce.h"

#include <string>

#include "core/cpu.h"

namespace rumor {

namespace generic {
void reduce_into(void* dst, const void* src, size_t n, DType t, ReduceOp op);
void reduce_many(void* dst, const void* const* srcs, size_t k, size_t n, DType t, ReduceOp op);
void finish_average(void* buf, size_t n, DType t, size_t divisor);
}  // namespace generic
#ifdef RUMOR_AVX2_KERNELS
namespace avx2 {
void reduce_into(void* dst, const void* src, size_t n, DType t, ReduceOp op);
void reduce_many(void* dst, const void* const* srcs, size_t k, size_t n, DType t, ReduceOp op);
void finish_average(void* buf, size_t n, DType t, size_t divisor);
}  // namespace avx2
#endif

bool cpu_has_avx2() {
#ifdef RUMOR_AVX2_KERNELS
  static const bool yes =
      __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") && __builtin_cpu_supports("f16c");
  return yes;
#else
  return false;
#endif
}

void reduce_into(void* dst, const void* src, size_t count, DType dtype, ReduceOp op) {
  if (count == 0) return;
#ifdef RUMOR_AVX2_KERNELS
  if (cpu_has_avx2()) return avx2::reduce_into(dst, src, count, dtype, op);
#endif
  generic::reduce_into(dst, src, count, dtype, op);
}

void reduce_many(void* dst, const void* const* srcs, size_t k, size_t count, DType dtype, ReduceOp op) {
  if (count == 0) return;
  if (k == 0 || srcs == nullptr)
    throw Error(ErrorKind::kInvalidArgument, "reduce_many: expected at least one source for " +
                                                 std::to_string(count) + " " +
                                                 std::string(dtype_name(dtype)) + " elements, got none");
#ifdef RUMOR_AVX2_KERNELS
  if (cpu_has_avx2()) return avx2::reduce_many(dst, srcs, k, count, dtype, op);
#endif
  generic::reduce_many(dst, srcs, k, count, dtype, op);
}

void finish_average(void* buf, size_t count, DType dtype, size_t divisor) {
  if (count == 0 || divisor <= 1) return;
#ifdef RUMOR_AVX2_KERNELS
  if (cpu_has_avx2()) return avx2::finish_average(buf, count, dtype, divisor);
#endif
  generic::finish_average(buf, count, dtype, divisor);
}

const char* reduce_isa() { return cpu_has_avx2() ? "avx2" : "generic"; }

}  // namespace rumor
