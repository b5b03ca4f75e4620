#define RUMOR_KERNEL_NS generic
#define RUMOR_KERNEL_NAME "generic"
#include "compress/powersgd_impl.h"
