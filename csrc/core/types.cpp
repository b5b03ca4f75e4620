#include "core/types.h"

#include <algorithm>

namespace rumor {

std::string_view dtype_name(DType t) {
  switch (t) {
    case DType::F32:
      return "float32";
    case DType::F16:
      return "float16";
    case DType::BF16:
      return "bfloat16";
    case DType::F64:
      return "float64";
    case DType::I32:
      return "int32";
    case DType::I64:
      return "int64";
    case DType::U8:
      return "uint8";
    case DType::I8:
      return "int8";
    case DType::I16:
      return "int16";
  }
  return "unknown";
}

std::string_view op_name(ReduceOp op) {
  switch (op) {
    case ReduceOp::SUM:
      return "SUM";
    case ReduceOp::AVG:
      return "AVG";
    case ReduceOp::MIN:
      return "MIN";
    case ReduceOp::MAX:
      return "MAX";
    case ReduceOp::PROD:
      return "PROD";
  }
  return "unknown";
}

int Deadline::ms_left(int cap_ms) const {
  if (cancelled()) return 0;
  auto left = std::chrono::duration_cast<std::chrono::milliseconds>(at_ - Clock::now()).count();
  return static_cast<int>(std::clamp<long long>(left, 0, cap_ms));
}

}  // namespace rumor
