// Built only when LibTorch has CUDA (see fsdp/CMakeLists.txt). Runs only where a GPU exists.
#include "fsdp/internal/cuda_backend.h"

#include <c10/cuda/CUDACachingAllocator.h>
#include <c10/cuda/CUDAFunctions.h>
#include <torch/csrc/distributed/c10d/PrefixStore.hpp>
#include <torch/csrc/distributed/c10d/ProcessGroupNCCL.hpp>

#include <cstdlib>

namespace fsdp::detail {

bool maybe_add_nccl_backend(c10d::ProcessGroup& pg, const c10::intrusive_ptr<c10d::Store>& store, const LaunchEnv& env,
                            std::chrono::milliseconds timeout) {
  if (c10::cuda::device_count() == 0) return false;
  const int device = env.local_rank % c10::cuda::device_count();
  c10::cuda::set_device(static_cast<c10::DeviceIndex>(device));
  // On a timeout the watchdog aborts the communicators and marks the collective failed, without
  // ending the process from its thread (2: CleanUpOnly; PyTorch's default tears the process
  // down): the library reports it at its next wait with the usual message (Comm::wait_on_stream).
  // A value the user set is kept.
  setenv("TORCH_NCCL_ASYNC_ERROR_HANDLING", "2", /*overwrite=*/0);
  auto opts = c10d::ProcessGroupNCCL::Options::create();
  opts->timeout = timeout;
  auto nccl = c10::make_intrusive<c10d::ProcessGroupNCCL>(c10::make_intrusive<c10d::PrefixStore>("nccl", store),
                                                          env.rank, env.world_size, opts);
  pg.setBackend(c10::DeviceType::CUDA, c10d::ProcessGroup::BackendType::NCCL, nccl);
  return true;
}

CudaMemory cuda_memory(int device) {
  if (c10::cuda::device_count() == 0) return {};
  auto stats = c10::cuda::CUDACachingAllocator::getDeviceStats(static_cast<c10::DeviceIndex>(device));
  const auto& s = stats.allocated_bytes[static_cast<size_t>(c10::CachingAllocator::StatType::AGGREGATE)];
  return {s.current, s.peak};
}

void cuda_reset_peak(int device) {
  if (c10::cuda::device_count() == 0) return;
  c10::cuda::CUDACachingAllocator::resetPeakStats(static_cast<c10::DeviceIndex>(device));
}

}  // namespace fsdp::detail
