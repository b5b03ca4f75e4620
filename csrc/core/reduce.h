// Elementwise reductions used by every reducing collective.
#pragma once

#include <cstddef>

#include "core/types.h"

namespace rumor {

// dst[i] = dst[i] (op) src[i] for `count` elements. AVG accumulates as SUM; the caller divides
// once at the end (finish_average) so that intermediate hops do not compound rounding.
void reduce_into(void* dst, const void* src, size_t count, DType dtype, ReduceOp op);

// dst[i] = srcs[0][i] (op) srcs[1][i] (op) ... (op) srcs[k-1][i], folded left in that order, for
// `count` elements: each source is read once and dst written once, instead of the k-1 passes over
// dst of a reduce_into chain. The fold order makes float32/float64/integer results bit-identical
// to that chain (and the same on every rank that lists its sources in the same order). float16
// and bfloat16 accumulate in float32 over all k sources and round once at the end (nearest even,
// NaN kept quiet, as core/half.h), where the chain rounds at every hop. dst may be one of the
// sources (the same pointer); a partial overlap is not allowed. AVG accumulates as SUM, as above.
// Throws Error(kInvalidArgument) when k == 0 and count > 0.
void reduce_many(void* dst, const void* const* srcs, size_t k, size_t count, DType dtype, ReduceOp op);

// buf[i] /= divisor. Integer types use truncating division, like C++ and torch's div(rounding_mode="trunc").
void finish_average(void* buf, size_t count, DType dtype, size_t divisor);

// Which kernel set reduce_into dispatches to on this CPU ("avx2" or "generic").
const char* reduce_isa();

}  // namespace rumor
