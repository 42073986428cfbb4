// programs/flops.h's device_name in a build without CUDA: the device type alone.
#include "programs/flops.h"

namespace fsdp::programs {

std::string device_name(const c10::Device& device) {
  return c10::DeviceTypeName(device.type(), /*lower_case=*/true);
}

}  // namespace fsdp::programs
