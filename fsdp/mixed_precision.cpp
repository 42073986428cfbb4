#include "fsdp/mixed_precision.h"

#include <c10/core/ScalarType.h>

#include <sstream>

namespace fsdp {

std::string to_string(const MixedPrecisionPolicy& p) {
  auto name = [](const std::optional<at::ScalarType>& t) { return t ? std::string(c10::toString(*t)) : "-"; };
  std::ostringstream os;
  os << "param_dtype=" << name(p.param_dtype()) << " reduce_dtype=" << name(p.reduce_dtype())
     << " output_dtype=" << name(p.output_dtype()) << " cast_forward_inputs=" << p.cast_forward_inputs();
  return os.str();
}

}  // namespace fsdp
