// Elementwise reductions used by every reducing collective.
#pragma once

#include <cstddef>

#include "core/types.h"

namespace rumor {

// dst[i] = dst[i] (op) src[i] for `count` elements. AVG accumulates as SUM; the caller divides
// once at the end (finish_average) so that intermediate hops do not compound rounding.
void reduce_into(void* dst, const void* src, size_t count, DType dtype, ReduceOp op);

// buf[i] /= divisor. Integer types use truncating division, like C++ and torch's div(rounding_mode="trunc").
void finish_average(void* buf, size_t count, DType dtype, size_t divisor);

// Which kernel set reduce_into dispatches to on this CPU ("avx2" or "generic").
const char* reduce_isa();

}  // namespace rumor
