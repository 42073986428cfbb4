// Built when LibTorch has no CUDA: there is no NCCL backend and no CUDA memory to report.
#include "fsdp/internal/cuda_backend.h"

namespace fsdp::detail {

bool maybe_add_nccl_backend(c10d::ProcessGroup&, const c10::intrusive_ptr<c10d::Store>&, const LaunchEnv&,
                            std::chrono::milliseconds) {
  return false;
}
CudaMemory cuda_memory(int) {
  return {};
}
void cuda_reset_peak(int) {}

}  // namespace fsdp::detail
