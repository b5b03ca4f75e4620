#define RUMOR_KERNEL_NS generic
#define RUMOR_KERNEL_NAME "generic"
#include "optim/optim_impl.h"
