#include "bindings/common.h"

namespace rumor::bindings {

void bind_compressed_ops(py::module_& m) { (void)m; }

}  // namespace rumor::bindings
