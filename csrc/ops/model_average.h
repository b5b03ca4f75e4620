// The per-element passes of asynchronous model averaging (python/rumor/algorithms/
// async_model_average.py) when the averaged buffer lives in a shared arena. A round reads the
// weights once and writes both its snapshot and what it sends; the training thread later adds
// (average - snapshot) in one pass. Fusing them matters because the averaging thread shares
// memory bandwidth (and, with more ranks than cores, the CPU) with training: every pass over a
// 100 MB model that is saved is time given back to forward and backward.
#pragma once

#include <cstddef>

#include "core/types.h"

namespace rumor::ops {

// snap <- x and work <- x; with `retake` (a result not applied yet is folded into what this
// round sends) work <- x + (work - snap) using the old snap, read before it is overwritten.
// float32 and float64 only (InvalidArgument otherwise).
void average_take(void* x, void* snap, void* work, size_t n, DType dtype, bool retake);

// x <- x + (avg - snap), each element rounded once in x's dtype.
void average_apply(void* x, const void* avg, const void* snap, size_t n, DType dtype);

}  // namespace rumor::ops
