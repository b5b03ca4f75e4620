#include "bindings/common.h"

namespace rumor::bindings {

void bind_decentralized(py::module_& m) { (void)m; }

}  // namespace rumor::bindings
