// The CUDA-only pieces (NCCL backend, caching-allocator statistics), compiled where LibTorch has
// CUDA; elsewhere they report "no CUDA".
#pragma once

#include "fsdp/process_group.h"

#include <torch/csrc/distributed/c10d/Store.hpp>

#include <cstdint>

namespace fsdp::detail {

/// Adds an NCCL backend for CUDA tensors to `pg` if CUDA and a GPU are present; binds this process
/// to GPU `env.local_rank`. Returns whether it did.
bool maybe_add_nccl_backend(c10d::ProcessGroup& pg, const c10::intrusive_ptr<c10d::Store>& store, const LaunchEnv& env,
                            std::chrono::milliseconds timeout);

struct CudaMemory {
  int64_t current = 0;
  int64_t peak = 0;
};
/// The caching allocator's allocated bytes on `device` (zeros without CUDA).
CudaMemory cuda_memory(int device);
void cuda_reset_peak(int device);

}  // namespace fsdp::detail
