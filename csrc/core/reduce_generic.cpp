#define RUMOR_KERNEL_NS generic
#include "core/reduce_impl.h"
