// programs/flops.h's device_name where the build has CUDA: the device's own name.
#include "programs/flops.h"

#include <ATen/cuda/CUDAContext.h>

namespace fsdp::programs {

std::string device_name(const c10::Device& device) {
  if (!device.is_cuda()) return c10::DeviceTypeName(device.type(), /*lower_case=*/true);
  return at::cuda::getDeviceProperties(device.has_index() ? device.index() : at::cuda::current_device())->name;
}

}  // namespace fsdp::programs
