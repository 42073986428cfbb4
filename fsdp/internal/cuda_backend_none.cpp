// Built when LibTorch has no CUDA: there is no NCCL backend and no CUDA memory to report.
#include "fsdp/internal/check.h"
#include "fsdp/internal/cuda_backend.h"
#include "fsdp/internal/race_delay.h"

#include <c10/util/Exception.h>

namespace fsdp::detail {

bool maybe_add_nccl_backend(c10d::ProcessGroup&, const c10::intrusive_ptr<c10d::Store>&, const LaunchEnv&,
                            std::chrono::milliseconds) {
  return false;
}
CudaMemory cuda_memory(int) {
  return {};
}
void cuda_reset_peak(int) {}
class SideStreams {};
std::shared_ptr<SideStreams> make_side_streams() {
  return nullptr;
}
bool nccl_blocking_wait() {
  return false;
}
std::unique_ptr<StreamEvent> on_side_stream(SideStreams&, const c10::Device& device, SideStream,
                                            const std::function<void()>&) {
  FSDP_CHECK(false, "fsdp: a collective on ", device, " tensors, but this build of LibTorch has no CUDA");
}

int cuda_device_count() {
  return 0;
}
int current_cuda_device() {
  return -1;
}
void set_cuda_device(int) {}
void issue_on_side_stream(SideStreams&, const c10::Device& device, SideStream, const std::function<void()>&) {
  FSDP_CHECK(false, "fsdp: a collective on ", device, " tensors, but this build of LibTorch has no CUDA");
}
std::unique_ptr<StreamEvent> complete_on_side_stream(SideStreams&, const c10::Device& device, SideStream,
                                                     const std::function<void()>&) {
  FSDP_CHECK(false, "fsdp: a collective on ", device, " tensors, but this build of LibTorch has no CUDA");
}
void on_pool_stream_for_testing(const c10::Device& device, const std::function<void()>& fn) {
  FSDP_CHECK(device.is_cpu(), "fsdp: a stream of ", device, ", but this build of LibTorch has no CUDA");
  fn();
}
void sleep_current_stream(const c10::Device&, std::chrono::microseconds) {}

std::unique_ptr<HostSync> record_host_sync(const c10::Device& device) {
  FSDP_CHECK(device.is_cpu(), "fsdp: a copy on ", device, ", but this build of LibTorch has no CUDA");
  return nullptr;
}

}  // namespace fsdp::detail
