// Which GPU a rank's NCCL backend binds to, and why a rank has none. NCCL cannot run two ranks of
// one communicator on one GPU: it refuses with "Duplicate GPU detected", deep inside the first
// CUDA collective. So a local rank without a device of its own (more ranks on a host than it has
// GPUs) gets no NCCL backend at start-up, and the first CUDA collective says why and what to do
// (Comm::backend) instead of NCCL. CPU tensors are unaffected: Gloo serves them on every rank, so
// a CPU job may still start more ranks than the host has GPUs. Internal to the library.
#pragma once

#include "fsdp/export.h"
#include "fsdp/process_group.h"

#include <string>

namespace fsdp::detail {

/// Why local rank `env.local_rank` of a host with `device_count` CUDA devices may not bind NCCL to
/// one of them ("" when it has its own: `local_rank < device_count`, or no device at all, or its
/// rank was given in InitOptions, where the launcher did not say the local rank).
FSDP_TESTING_API std::string nccl_device_refusal(const LaunchEnv& env, int device_count);

/// The reason this process was given no NCCL backend at start-up ("" when it has one, or none was
/// wanted), for the error of its first CUDA collective. Set by maybe_add_nccl_backend
/// (fsdp/internal/cuda_backend.h) each time fsdp::init_process_group or new_subgroup adds one.
FSDP_TESTING_API std::string& nccl_absent_reason();

}  // namespace fsdp::detail
